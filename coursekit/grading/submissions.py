"""Finding the submissions in a folder, Colab's download names included.

``<student>.ipynb`` files and ``<student>/`` folders. In a folder, the notebook named
like the lab is graded; Colab's names for copies and repeated downloads ("Copy of
X.ipynb", "X 的副本.ipynb", "X (1).ipynb") count as that name, and among several the
newest file (modification time) wins.

Only regular files count: a symlink (a git clone keeps one), FIFO, device or socket is
never followed or opened; where it stands for the notebook, that student's submission
is invalid and the feedback says what it is. Two entries whose names give the same
student (``Li Lei.ipynb`` and ``Li_Lei.ipynb``) are refused, both named.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .files import describe

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
    return max(paths, key=lambda p: (p.lstat().st_mtime, p.name))


def _walk(folder: Path) -> tuple[list[Path], list[str]]:
    """(regular .ipynb files, descriptions of the entries that are not regular files
    or folders) under ``folder``; symlinked folders are not entered."""
    nbs, odd = [], []
    for dirpath, dirs, files in os.walk(folder):  # followlinks=False
        if ".ipynb_checkpoints" in Path(dirpath).parts:
            continue
        for name in files + dirs:
            p = Path(dirpath) / name
            try:
                what = describe(p)
            except OSError:
                continue
            if what == "文件夹":
                continue
            if what:
                odd.append(f"{p.relative_to(folder)}（{what}）")
            elif name.endswith(".ipynb"):
                nbs.append(p)
    return sorted(nbs), sorted(odd)


def pick_notebook(folder: Path, notebook_name: str, student: str) -> Submission:
    nbs, odd = _walk(folder)
    skipped = "；文件夹里的非普通文件没有打开：" + "、".join(odd[:6]) if odd else ""
    bad = [o for o in odd if o.split("（")[0].endswith(".ipynb")]
    if (
        bad
        and notebook_name
        and any(colab_base(Path(o.split("（")[0]).name) == notebook_name for o in bad)
    ):
        return Submission(
            student,
            None,
            "要评的 notebook 不是普通文件："
            + "、".join(bad[:6])
            + "；评分器只评普通文件，不跟随符号链接",
        )
    if not nbs:
        return Submission(student, None, "提交的文件夹里没有 .ipynb 文件" + skipped)
    matching = [x for x in nbs if notebook_name and colab_base(x.name) == notebook_name]
    if len(matching) == 1 or (not matching and len(nbs) == 1):
        return Submission(student, (matching or nbs)[0], note=skipped.lstrip("；"))
    if matching:
        pick = _newest(matching)
        others = "、".join(x.name for x in matching if x != pick)
        return Submission(
            student,
            pick,
            note=f"文件夹里有 {len(matching)} 个该实验的 notebook，"
            f"评的是最新的 {pick.name}（未评：{others}）" + skipped,
        )
    names = "、".join(x.name for x in nbs[:6])
    return Submission(
        student,
        None,
        f"文件夹里有多个 notebook（{names}），没有一个名为 "
        f"{notebook_name or '实验的文件名'}（或它的 Colab 副本名）" + skipped,
    )


class NameCollision(ValueError):
    """Two submissions whose names give the same student."""


def discover(submissions: str | Path, notebook_name: str = "") -> list[Submission]:
    """Every ``<student>.ipynb`` and ``<student>/`` folder of ``submissions``, sorted by
    student; :class:`NameCollision` naming both entries when two give one student."""
    root = Path(submissions)
    if not root.is_dir():
        raise FileNotFoundError(f"submissions folder not found: {root}")
    found: dict[str, Submission] = {}
    origin: dict[str, str] = {}
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        st = p.lstat()
        if stat.S_ISDIR(st.st_mode):
            student = safe_name(p.name)
            sub = pick_notebook(p, notebook_name, student)
        elif p.suffix == ".ipynb":
            student = safe_name(p.stem)
            what = describe(p)
            sub = (
                Submission(
                    student,
                    None,
                    f"{p.name} 是{what}，不是普通文件：评分器只评普通文件，"
                    "不跟随符号链接",
                )
                if what
                else Submission(student, p)
            )
        elif stat.S_ISLNK(st.st_mode) and not p.suffix:  # a symlinked folder
            student = safe_name(p.name)
            sub = Submission(
                student, None, f"{p.name} 是{describe(p)}，不是文件夹：未评分"
            )
        else:
            continue
        if student in found:
            raise NameCollision(
                f"two submissions give the same student name {student!r}: "
                f"{origin[student]!r} and {p.name!r}; rename one of them "
                "(names are kept to letters, digits and ._-) and grade again"
            )
        found[student], origin[student] = sub, p.name
    return [found[s] for s in sorted(found)]
