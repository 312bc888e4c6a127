"""Finding the submissions in a folder, Colab's download names included.

``<student>.ipynb`` files and ``<student>/`` folders. In a folder, the notebook named
like the lab is graded; Colab's names for copies and repeated downloads ("Copy of
X.ipynb", "X 的副本.ipynb", "X (1).ipynb") count as that name, and among several the
newest file (modification time) wins.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

COPY_PREFIX = re.compile(r"^(?:(?:Copy of|副本 -)\s+)+", re.I)
COPY_SUFFIX = re.compile(r"(?:\s*(?:\(\d+\)|的副本))+$")


@dataclass
class Submission:
    """One student's submission: the notebook to grade, or why there is none."""

    student: str
    path: Path | None
    problem: str = ""
    note: str = ""  # which file was picked, when there was a choice


def safe_name(name: str) -> str:
    """A student name usable as a file name (letters, digits, ``._-``; anything else →
    ``_``)."""
    s = re.sub(r"[^\w.-]", "_", name).strip(".") or "_"
    return s[:100]


def colab_base(filename: str) -> str:
    """The notebook name behind Colab's copy/download names: "Copy of lab01_x (2).ipynb"
    → "lab01_x.ipynb"."""
    stem = filename[:-6] if filename.endswith(".ipynb") else filename
    stem = COPY_SUFFIX.sub("", COPY_PREFIX.sub("", stem.strip())).strip()
    return stem + ".ipynb"


def _newest(paths: list[Path]) -> Path:
    return max(paths, key=lambda p: (p.stat().st_mtime, p.name))


def pick_notebook(folder: Path, notebook_name: str, student: str) -> Submission:
    nbs = sorted(
        x for x in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in x.parts
    )
    if not nbs:
        return Submission(student, None, "提交的文件夹里没有 .ipynb 文件")
    matching = [x for x in nbs if notebook_name and colab_base(x.name) == notebook_name]
    if len(matching) == 1 or (not matching and len(nbs) == 1):
        return Submission(student, (matching or nbs)[0])
    if matching:
        pick = _newest(matching)
        others = "、".join(x.name for x in matching if x != pick)
        return Submission(
            student,
            pick,
            note=f"文件夹里有 {len(matching)} 个该实验的 notebook，"
            f"评的是最新的 {pick.name}（未评：{others}）",
        )
    names = "、".join(x.name for x in nbs[:6])
    return Submission(
        student,
        None,
        f"文件夹里有多个 notebook（{names}），没有一个名为 "
        f"{notebook_name or '实验的文件名'}（或它的 Colab 副本名）",
    )


def discover(submissions: str | Path, notebook_name: str = "") -> list[Submission]:
    """Every ``<student>.ipynb`` and ``<student>/`` folder of ``submissions``, sorted by
    student."""
    root = Path(submissions)
    if not root.is_dir():
        raise FileNotFoundError(f"submissions folder not found: {root}")
    found: dict[str, Submission] = {}
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_file() and p.suffix == ".ipynb":
            found[safe_name(p.stem)] = Submission(safe_name(p.stem), p)
        elif p.is_dir():
            found[safe_name(p.name)] = pick_notebook(
                p, notebook_name, safe_name(p.name)
            )
    return [found[s] for s in sorted(found)]
