"""What a reader sees in chapters 6-10: misconceptions titled as boxes and placed by the
template, no test or CI plumbing in the prose, no notebook magics on the page."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

BOOK = Path(__file__).resolve().parents[1] / "book"
CHAPTERS = ("06", "07", "08", "09", "10")
PLUMBING = re.compile(
    r"tests/test_|\bCI\b|nbval|pytest|COURSE_GPU|这台|没有 GPU 的机器|单元测试"
)


def _nb(prefix):
    (path,) = BOOK.glob(f"{prefix}_*.ipynb")
    return nbformat.read(path, as_version=4)


def _markdown(prefix):
    return [c.source for c in _nb(prefix).cells if c.cell_type == "markdown"]


SOLUTIONS = BOOK.parent / "solutions"


def _all_markdown(path):
    nb = nbformat.read(path, as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


@pytest.mark.parametrize(
    "path",
    sorted(BOOK.glob("0*.ipynb")) + sorted(SOLUTIONS.glob("lab*.ipynb")),
    ids=lambda p: p.stem,
)
def test_misconceptions_are_titled_boxes(path):
    """Every 误区 is a box headed "误区 N：标题" (the title apart from the text), in
    every chapter and lab; a note with a title of its own is headed by it."""
    text = _all_markdown(path)
    numbered = re.findall(
        r":::\{admonition\} 误区 \d+：[^\n]+\n:class: warning\n", text
    )
    assert len(numbered) == len(re.findall(r"误区 \d+：", text))
    assert not re.search(r":::\{warning\}\s*\**误区", text)
    assert not re.search(r":{3,}\{(note|warning)\}\n\*\*[^\n]*\*\*", text), (
        "a box whose title is its bold first words: write :::{admonition} 标题"
    )


def test_chapter9_misconceptions_come_after_the_code_before_the_questions():
    heads = [
        line
        for src in _markdown("09")
        for line in src.splitlines()
        if line.startswith("## ")
    ]
    assert heads[-3:] == ["## 误区", "## 面试问题", "## 本章小结"], heads[-4:]


@pytest.mark.parametrize("prefix", CHAPTERS)
def test_no_plumbing_in_the_prose(prefix):
    found = [m.group(0) for s in _markdown(prefix) for m in PLUMBING.finditer(s)]
    assert not found, (prefix, found)


@pytest.mark.parametrize("prefix", CHAPTERS)
def test_no_visible_magic_cell(prefix):
    for c in _nb(prefix).cells:
        tags = c.metadata.get("tags", [])
        if c.cell_type == "code" and not {"remove-input", "remove-cell"} & set(tags):
            assert not c.source.lstrip().startswith("%"), (prefix, c.id)


def test_chapter10_is_titled_for_the_book():
    title = _markdown("10")[0].splitlines()[0]
    assert title.startswith("# 全书总结"), title
