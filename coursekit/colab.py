"""Colab support for labs: the Open-in-Colab badge and the setup cell (DESIGN.md §1, §7).

The repository URL and branch are read from ``_config.yml`` (``repository.url`` / ``repository.branch``)
— the one place they are set. Nothing here runs on Colab itself: the setup cell is plain source
text inserted into each generated lab by :mod:`coursekit.labs`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

COLAB_BADGE_SVG = "https://colab.research.google.com/assets/colab-badge.svg"

# Colab notebook metadata: open on a GPU runtime (T4 is the free tier's GPU).
COLAB_METADATA = {
    "accelerator": "GPU",
    "colab": {"gpuType": "T4", "provenance": [], "toc_visible": True},
}


@dataclass(frozen=True)
class Repository:
    """Where the course lives on GitHub: ``url`` (https://github.com/<org>/<repo>) and ``branch``."""

    url: str
    branch: str

    @property
    def slug(self) -> str:
        """``<org>/<repo>`` part of the URL."""
        u = self.url.rstrip("/")
        if u.endswith(".git"):
            u = u[:-4]
        prefix = "https://github.com/"
        if not u.startswith(prefix) or u[len(prefix):].count("/") != 1:
            raise ValueError(f"repository.url must look like https://github.com/<org>/<repo>, got {self.url!r}")
        return u[len(prefix):]


def read_repository(config: str | Path = "_config.yml") -> Repository:
    """Read ``repository.url`` and ``repository.branch`` (default ``main``) from the book config."""
    import yaml

    path = Path(config)
    if not path.exists():
        raise FileNotFoundError(f"book config not found: {path}")
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    repo = data.get("repository") or {}
    url = repo.get("url")
    if not url:
        raise ValueError(f"{path}: repository.url is not set")
    return Repository(url=str(url), branch=str(repo.get("branch") or "main"))


def colab_url(repo: Repository, notebook: str) -> str:
    """URL that opens ``notebook`` (a path inside the repository, e.g. ``labs/lab01_x.ipynb``) in Colab."""
    return f"https://colab.research.google.com/github/{repo.slug}/blob/{repo.branch}/{notebook}"


def badge_markdown(repo: Repository, notebook: str) -> str:
    """Markdown source of the badge cell (raw HTML, so the book renders it without fetching at build)."""
    url = colab_url(repo, notebook)
    return (
        f'<a href="{url}" target="_blank" rel="noopener">'
        f'<img src="{COLAB_BADGE_SVG}" alt="Open In Colab"/></a>\n\n'
        "在 Colab 中打开本实验：代码执行程序 → 更改运行时类型 → **GPU**（徽章打开的 notebook 已请求 GPU 运行时）。"
        "先运行下面的环境设置单元。"
    )


SETUP_TEMPLATE = '''\
# 环境设置（Colab）：只安装 Colab 缺少的包——本课程的 trainmem/coursekit（--no-deps）与 peft；
# 绝不重装 torch 或 Jupyter 相关包。在 Colab 之外（本地、评分器）这个单元什么也不安装。
import importlib.util, subprocess, sys

REPO_URL = "{url}"
BRANCH = "{branch}"
if "google.colab" in sys.modules:
    def _pip(*args):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True)
    if importlib.util.find_spec("coursekit") is None or importlib.util.find_spec("trainmem") is None:
        _pip("--no-deps", f"git+{{REPO_URL}}@{{BRANCH}}")
    if importlib.util.find_spec("peft") is None:
        import torch  # pin the preinstalled torch so pip can never replace it
        _pip("peft", f"torch=={{torch.__version__.split('+')[0]}}")
    importlib.invalidate_caches()
try:
    from coursekit.gpu import describe
    print(describe())
except ImportError:
    print(f"找不到 coursekit：请在仓库根目录运行 pip install -e .（或 pip install --no-deps git+{{REPO_URL}}@{{BRANCH}}）")
'''


def setup_cell_source(repo: Repository) -> str:
    """Source of the Colab setup cell (safe everywhere; installs only on Colab, only what is missing)."""
    return SETUP_TEMPLATE.format(url=repo.url, branch=repo.branch).rstrip("\n")
