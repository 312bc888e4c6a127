"""Colab support for labs: the Open-in-Colab badge and the setup cell.

The repository URL and branch are read from ``_config.yml`` (``repository.url`` /
``repository.branch``) — the one place they are set. Nothing here runs on Colab itself:
the setup cell is plain source text inserted into each generated lab by
:mod:`coursekit.labs`.
"""

from __future__ import annotations

import json

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
    """Where the course lives on GitHub: ``url`` (https://github.com/<org>/<repo>) and
    ``branch``."""

    url: str
    branch: str

    @property
    def slug(self) -> str:
        """``<org>/<repo>`` part of the URL."""
        u = self.url.rstrip("/")
        if u.endswith(".git"):
            u = u[:-4]
        prefix = "https://github.com/"
        if not u.startswith(prefix) or u[len(prefix) :].count("/") != 1:
            raise ValueError(
                f"repository.url must look like https://github.com/<org>/<repo>, got "
                f"{self.url!r}"
            )
        return u[len(prefix) :]


def read_repository(config: str | Path = "_config.yml") -> Repository:
    """Read ``repository.url`` and ``repository.branch`` (default ``main``) from the
    book config."""
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
    """URL that opens ``notebook`` (a path inside the repository, e.g.
    ``labs/lab01_x.ipynb``) in Colab."""
    return f"https://colab.research.google.com/github/{repo.slug}/blob/{repo.branch}/{notebook}"


def badge_markdown(repo: Repository, notebook: str) -> str:
    """Markdown source of the badge cell (raw HTML, so the book renders it without
    fetching at build)."""
    url = colab_url(repo, notebook)
    return (
        f'<a href="{url}" target="_blank" rel="noopener">'
        f'<img src="{COLAB_BADGE_SVG}" alt="Open In Colab"/></a>\n\n'
        "在 Colab 中打开本实验：代码执行程序 → 更改运行时类型 → **GPU**（徽章打开的 "
        "notebook 已请求 GPU 运行时）。"
        "先运行下面的环境设置单元。"
    )


# Lowest versions the course declares (pyproject.toml) and tests (`make floor`); the
# setup cell upgrades an older Colab image to them, with torch pinned so pip can never
# replace it.
COLAB_FLOOR = {"transformers": "4.57.1", "peft": "0.17.1"}

SETUP_TEMPLATE = """\
# 环境设置（Colab）：只安装 Colab 缺少的包——本课程的 trainmem/coursekit（--no-deps）与
# peft，把过旧的 transformers/peft 升到课程测试过的最低版本，有 GPU 时再装 bitsandbytes
# （QLoRA）；每次安装都钉住已装的 torch，绝不重装 torch 或 Jupyter 相关包。在 Colab 之外
# （本地、评分器）这个单元什么也不安装。
import importlib.util
import importlib.metadata
import re
import subprocess
import sys

REPO_URL = "{url}"
BRANCH = "{branch}"
FLOOR = {floor}
if "google.colab" in sys.modules:
    import torch  # the preinstalled torch: every install below pins it

    _torch_pin = f"torch=={{torch.__version__.split('+')[0]}}"

    def _pip(*args):
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", *args], check=True
        )

    def _older(pkg):
        try:
            have = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return False
        num = lambda v: tuple(int(x) for x in re.findall(r"\\d+", v)[:3])
        return num(have) < num(FLOOR[pkg])

    if (
        importlib.util.find_spec("coursekit") is None
        or importlib.util.find_spec("trainmem") is None
    ):
        _pip("--no-deps", f"git+{{REPO_URL}}@{{BRANCH}}")
    if importlib.util.find_spec("peft") is None:
        _pip("peft", _torch_pin)
    stale = [f"{{p}}>={{v}}" for p, v in FLOOR.items() if _older(p)]
    if stale:
        _pip(*stale, _torch_pin)
    if torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes") is None:
        _pip("bitsandbytes", _torch_pin)
    importlib.invalidate_caches()
try:
    from coursekit.gpu import describe

    print(describe())
except ImportError:
    print(
        "找不到 coursekit：请在仓库根目录运行 pip install -e .（或 pip install "
        f"--no-deps git+{{REPO_URL}}@{{BRANCH}}）"
    )
"""


def setup_cell_source(repo: Repository) -> str:
    """Source of the Colab setup cell (safe everywhere; installs only on Colab, only
    what is missing).

    The same text opens every lab (inserted by :mod:`coursekit.labs`) and every chapter
    in ``book/`` (its first code cell, tagged :data:`SETUP_TAG`);
    ``tests/test_colab_setup.py`` checks both against this template.
    """
    return SETUP_TEMPLATE.format(
        url=repo.url, branch=repo.branch, floor=json.dumps(COLAB_FLOOR)
    ).rstrip("\n")


SETUP_TAG = "colab-setup"


def read_notebook(name: str) -> dict:
    """The JSON of the notebook ``name`` (e.g. ``"10_summary.ipynb"``) from inside that
    notebook.

    On Colab the notebook is not a file on the runtime's disk: it is asked from the
    front end (``google.colab._message``). Elsewhere it is looked up in the kernel's
    working directory, then in ``book/`` of the repository this package was installed
    from (an editable install), so a cell that reads its own notebook works whatever the
    current directory is.
    """
    import json
    import sys

    if "google.colab" in sys.modules:
        from google.colab import _message  # type: ignore[import-not-found]

        reply = _message.blocking_request("get_ipynb", timeout_sec=30)
        if not reply or "ipynb" not in reply:
            raise RuntimeError(
                f"Colab did not return the notebook {name!r}; save it and rerun the "
                f"cell"
            )
        return reply["ipynb"]
    candidates = [
        Path.cwd() / name,
        Path(__file__).resolve().parents[1] / "book" / name,
    ]
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
    where = " or ".join(str(c.parent) for c in candidates)
    raise FileNotFoundError(f"notebook {name!r} not found in {where}")
