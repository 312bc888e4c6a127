"""Does a lab's TODO or hint give the solution away?

A lab exercise has three layers of help (tests/grading/README.md §2): the ``# TODO``
line the generator writes from the block's ``# HINT:`` lines (what to achieve, and which
chapter section explains it), then a markdown cell tagged ``hints`` right below the
exercise with two collapsed ``<details>`` hints — 提示 1 the idea, 提示 2 the API or the
shape. None of them may contain the code of the ``### BEGIN SOLUTION`` block.

:func:`leak` measures how much of a block's code a piece of text repeats: the longest
run of consecutive code tokens (identifiers, numbers, operators, brackets) the two
share (prose between two code fragments breaks a run), and the identifiers of the block
that the text names and the student could not already see (the code around the block:
signature, docstring, the other lines of the cell). :data:`LIMITS` says how much each
layer may repeat.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TOKEN = re.compile(
    r"[A-Za-z_][A-Za-z_0-9]*|\d+(?:\.\d+)?"  # identifiers, numbers
    r"|\*\*|//|>>|<<|->|[-+*/@%&|^~<>=!]=?|[()\[\].,:]"  # operators, brackets
)
PROSE = re.compile(r"[^\x00-\x7f]+")
HINTS_TAG = "hints"
HINT_TITLE = re.compile(r"<summary>\s*(提示\s*\d+)[^<]*</summary>")

# (longest shared run of tokens, new identifiers named) a layer may reach
LIMITS = {"todo": (3, 2), "hint1": (3, 2), "hint2": (6, 99)}


@dataclass(frozen=True)
class Leak:
    run: int  # longest run of consecutive code tokens shared with the solution
    run_text: str  # that run
    names: tuple[str, ...]  # solution identifiers named that the student cannot see

    def exceeds(self, layer: str) -> bool:
        max_run, max_names = LIMITS[layer]
        return self.run > max_run or len(self.names) > max_names


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def _code_only(code: str) -> str:
    """``code`` without comment lines and trailing comments (the ``# HINT:`` lines,
    the author's notes)."""
    out = []
    for line in code.split("\n"):
        stripped = line.strip()
        if stripped.startswith("#"):
            continue
        out.append(re.sub(r"\s+#\s.*$", "", line))
    return "\n".join(out)


def _longest_run(a: list[str], b: list[str]) -> tuple[int, str]:
    best, end = 0, 0
    prev = [0] * (len(b) + 1)
    for i in range(1, len(a) + 1):
        cur = [0] * (len(b) + 1)
        for j in range(1, len(b) + 1):
            if a[i - 1] == b[j - 1]:
                cur[j] = prev[j - 1] + 1
                if cur[j] > best:
                    best, end = cur[j], i
        prev = cur
    return best, " ".join(a[end - best : end])


def leak(text: str, solution: str, visible: str = "") -> Leak:
    """How much of ``solution`` (a block's code) ``text`` repeats; identifiers that
    occur in ``visible`` (what the student sees anyway) do not count as named."""
    code = tokens(_code_only(solution))
    said = tokens(text)
    # prose (CJK text, full-width punctuation) between two code fragments breaks a run
    run, run_text = max(
        (_longest_run(tokens(seg), code) for seg in PROSE.split(text)),
        default=(0, ""),
    )
    idents = {t for t in code if t[0].isalpha() or t[0] == "_"}
    seen = set(tokens(visible))
    names = tuple(sorted({t for t in said if t in idents and t not in seen}))
    return Leak(run, run_text, names)


def split_blocks(source: str) -> tuple[list[tuple[str, str]], str]:
    """``([(todo_text, block_code), ...], visible_code)`` of one solution code cell:
    the ``# HINT:`` text and the code of each ``### BEGIN SOLUTION`` block, and the
    cell's code outside the blocks."""
    from .labs import BEGIN, END, HINT, _join_hint

    blocks, visible, cur, pieces = [], [], None, []
    for line in source.split("\n"):
        s = line.strip()
        if s == BEGIN:
            cur, pieces = [], []
        elif s == END and cur is not None:
            blocks.append((_join_hint(pieces), "\n".join(cur)))
            cur = None
        elif cur is None:
            visible.append(line)
        elif s.startswith(HINT) and not cur:
            pieces.append(s[len(HINT) :].strip())
        else:
            cur.append(line)
    return blocks, "\n".join(visible)


def hint_texts(markdown: str) -> list[tuple[str, str]]:
    """``[("提示 1", text), ("提示 2", text), ...]`` of a ``hints`` cell, in order: each
    ``<details>`` block's title (``提示 N``, whatever follows it in the ``<summary>``
    aside) and its body. A cell below an exercise with several blocks holds two hints
    per block, in the blocks' order."""
    out = []
    for part in markdown.split("<details>")[1:]:
        m = HINT_TITLE.search(part)
        if m:
            body = part[m.end() :].split("</details>")[0]
            out.append((re.sub(r"\s+", " ", m.group(1)), body.strip()))
    return out
