"""Reader-facing prose never cites the source documents, and no heading carries a typed
number.

The course grew from two Chinese documents that readers never see. The introduction
names them once; everywhere else a wrong claim is quoted as a common claim ("常见说法：…
/ 实际：…"), never as "种子 17.3" or "实战指南 2.5". Sphinx numbers the sections of the
numbered chapters, so a heading such as "## 1. 两种配方" would read "2.1. 1. 两种配方",
and "第 2 节" / "§4" in prose are typed numbers that go stale.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
import yaml

from tests.notebooks import ROOT

INTRO = ROOT / "book" / "intro.md"
# The one place the source documents are named (at most this many mentions of each
# word).
INTRO_ALLOWED = {"种子": 1, "实战指南": 1}

# "随机种子" (random seed), "种子数" (number of seeds) and "种子（seed…" are a different
# word.
SEED_OK = re.compile(r"随机种子|种子数|种子\s*[（(]\s*seed", re.IGNORECASE)
CITATION = re.compile(r"(?:种子|大纲|实战指南|指南|原文)\s*(?:第\s*)?\d+(?:\.\d+)*")
NUMBERED_HEADING = re.compile(
    r"^#{1,6}\s+(?:\d+(?:\.\d+)*\s*[.、．)）]|\d+(?:\.\d+)+\s)"
)
TYPED_SECTION_REF = re.compile(r"§\s*\d|第\s*\d+(?:\s*[、，,–-]\s*\d+)*\s*节")
FENCE = re.compile(r"^\s*(```|~~~)")


def markdown_of(path: Path) -> list[tuple[str, str]]:
    """(where, text) for every markdown cell of a notebook, or the whole file for
    .md."""
    if path.suffix == ".md":
        return [(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))]
    nb = nbformat.read(path, as_version=4)
    rel = path.relative_to(ROOT).as_posix()
    return [
        (f"{rel} cell {i} ({cell.get('id')})", cell.source)
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "markdown"
    ]


def prose_lines(text: str) -> list[str]:
    """Lines of a markdown text outside fenced code blocks."""
    out, in_fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(line)
    return out


def citation_problems(text: str) -> list[str]:
    """Mentions of the source documents in `text` (a whole markdown cell or file)."""
    problems = []
    for line in prose_lines(text):
        bare = SEED_OK.sub("", line)
        if "种子" in bare:
            problems.append(
                f"mentions the source documents ('种子'): {line.strip()[:90]}"
            )
        elif "实战指南" in bare:
            problems.append(
                f"mentions the source documents ('实战指南'): {line.strip()[:90]}"
            )
        for m in CITATION.finditer(bare):
            problems.append(
                f"cites a source by section number ({m.group(0)!r}): "
                f"{line.strip()[:90]}"
            )
    return problems


def numbering_problems(text: str) -> list[str]:
    """Hand-typed section numbers in headings or prose of a page that Sphinx numbers."""
    problems = []
    for line in prose_lines(text):
        if NUMBERED_HEADING.match(line):
            problems.append(f"heading with a typed number: {line.strip()[:90]}")
        for m in TYPED_SECTION_REF.finditer(line):
            problems.append(f"typed section number {m.group(0)!r}: {line.strip()[:90]}")
    return problems


def numbered_pages() -> list[Path]:
    """Pages in the parts of _toc.yml marked `numbered: true`."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    pages = []
    for part in toc.get("parts", []):
        if part.get("numbered"):
            for chapter in part.get("chapters", []):
                stem = ROOT / chapter["file"]
                matches = [
                    p
                    for p in (stem.with_suffix(".ipynb"), stem.with_suffix(".md"))
                    if p.exists()
                ]
                assert matches, (
                    f"_toc.yml names {chapter['file']}, which does not exist"
                )
                pages.extend(matches)
    return pages


def reader_pages() -> list[Path]:
    return sorted(
        [
            *(ROOT / "book").glob("*.ipynb"),
            *(ROOT / "book").glob("*.md"),
            *(ROOT / "solutions").glob("*.ipynb"),
            *(ROOT / "labs").glob("*.ipynb"),
        ]
    )


def test_checkers_catch_what_they_should():
    assert citation_problems("本章对应种子大纲 17.1")
    assert citation_problems("勘误：实战指南 2.5 的代码")
    assert citation_problems("见指南第 2 节")
    assert citation_problems("## 代码：种子里的两个训练循环")
    assert not citation_problems(
        "同一随机种子下初始化一致；种子数取 3；种子（seed）固定"
    )
    assert not citation_problems("常见说法：“7B 训练就超过单卡 80GB”")
    assert not citation_problems("```python\n# 种子 17.3\n```")
    assert numbering_problems("## 1. 两种配方")
    assert numbering_problems("### 2.3 梯度")
    assert numbering_problems("见第 2 节与 §4")
    assert numbering_problems("（本章第 2、4 节）")
    assert not numbering_problems("## 8 位优化器\n## 7B 模型的权重显存\n见第 3 章")


@pytest.mark.parametrize(
    "path", reader_pages(), ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_no_source_citations(path):
    problems = []
    for where, text in markdown_of(path):
        if path == INTRO:
            for word, allowed in INTRO_ALLOWED.items():
                n = len(re.findall(word, SEED_OK.sub("", text)))
                if n > allowed:
                    problems.append(
                        f"{where}: names the sources {n} times with {word!r} "
                        f"(at most {allowed})"
                    )
            continue
        problems += [f"{where}: {p}" for p in citation_problems(text)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "path", numbered_pages(), ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_no_typed_section_numbers(path):
    problems = [
        f"{where}: {p}"
        for where, text in markdown_of(path)
        for p in numbering_problems(text)
    ]
    assert not problems, "\n".join(problems)
