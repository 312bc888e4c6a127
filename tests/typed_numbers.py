"""Typed quantities in the book's prose: numbers a reader takes as a result (bytes,
bytes per parameter, GB/GiB, percentages, ratios, counts) that were typed by hand
instead of glued from a cell.

A chapter's numbers are computed by its cells and shown with ``{glue:}`key```; a number
typed next to them goes stale silently (the question bank once said "16 字节，估算
135 GB" where 16 bytes x 6.74 B parameters is 107.8 GB). This module reads the markdown
cells of a notebook (admonitions and dropdowns included), removes what is not prose
(code, math, glue roles, link targets, directive options) and reports every number that
is followed by a quantity unit (every term of a sum such as "4 + 8 字节/参数" is), or is
a grouped count such as 4,194,304, unless a rule below says it is not a quantity:

- identifiers and names: a number glued to a Latin letter or underscore before it
  (FP16, sm_89, H100, Q19, E4M3), joined to a name by a hyphen (ZeRO-3, GPT-2,
  Llama-2-70B), or a model size glued to B (7B, 1.5B);
- versions: three-part numbers (0.43.2) and numbers right after a library name
  (bitsandbytes 0.44, torch ≥ 2.4);
- structure: chapter and section references (第 3 章, 第 3、4 章, 图 3.1, 误区 2) and
  list markers at the start of a line;
- shapes: ``4096×4096`` (× between two numbers);
- quotations: a claim quoted for examination (“减少 75%”, 「3–5 倍」);
- conditions: a device's capacity or bandwidth (80 GB 的卡, 100 GB/s);
- definitions: one unit defined in another (1 GiB = 2³⁰ 字节);
- format constants: one element's size right after its dtype (bf16 权重 2 字节).

Counts of devices, layers, steps or tokens are the conditions of an experiment and are
not flagged; counts of parameters (个参数) and grouped numbers (4,194,304) are.

Everything else that states a quantity is a finding, unless ``typed_numbers_allow.txt``
lists it (chapter, a snippet of the sentence that contains the number, and why it is not
a computed result). ``python -m tests.typed_numbers`` prints the report for the whole
book.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
ALLOW_FILE = Path(__file__).resolve().parent / "typed_numbers_allow.txt"

UNIT = re.compile(
    r"""\s?(?:
        %|％|倍|×(?!\s*\d)|x\b|
        字节|bytes?\b|B/param|B/参数|
        [KMGT]i?B\b|
        个参数|个可训练参数
    )""",
    re.VERBOSE,
)
# The size of one element of a named dtype is a constant of the format, not a result:
# "bf16 权重 2 字节" (the number must equal the dtype's size and follow it closely).
DTYPE_BYTES = {"fp32": 4, "tf32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}
DTYPE_BEFORE = re.compile(r"(fp32|tf32|fp16|bf16|fp8|int8)[^，,；。0-9]{0,8}$", re.I)
# A device's capacity or a link's bandwidth is a condition of the question:
# "80 GB 的卡", "24 GB 的消费级显卡", "100 GB/s".
DEVICE_AFTER = re.compile(r"\s?[KMGT]i?B\s*(?:/s|的?\s*(?:卡|显卡|消费级显卡|GPU))")
QUOTE = re.compile(r"「[^」]*」|“[^”]*”|\"[^\"\n]*\"")
NUMBER = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)*")
LIBRARIES = (
    "torch",
    "pytorch",
    "transformers",
    "peft",
    "bitsandbytes",
    "python",
    "cuda",
    "accelerate",
    "deepspeed",
    "numpy",
    "flash-attn",
    "flash_attn",
    "triton",
    "jupyter",
    "ipywidgets",
    "jupyter-book",
    "myst-nb",
    "版本",
)
AFTER_LIBRARY = re.compile(
    r"(?:" + "|".join(re.escape(n) for n in LIBRARIES) + r")\s*(?:[<>≥≤=~^]=?\s*)?v?$",
    re.IGNORECASE,
)
STRUCTURE_AFTER = re.compile(r"^(?:\s*[、，,–\-~至和与]\s*\d+(?:\.\d+)?)*\s*(?:章|节)")
STRUCTURE_BEFORE = re.compile(r"(?:第|图|表|误区|步骤|Q|问题)\s*$")
LIST_MARKER = re.compile(r"^\s*(?:[-*]\s+)?$")

# What is not prose, removed before scanning (in this order).
FENCED_CODE = re.compile(r"^(```|~~~)(?!\{).*?^\1\s*$", re.MULTILINE | re.DOTALL)
DISPLAY_MATH = re.compile(r"\$\$.*?\$\$", re.DOTALL)
INLINE_MATH = re.compile(r"(?<!\\)\$[^$\n]+?\$|\\\(.*?\\\)")
GLUE_ROLE = re.compile(r"\{glue(?::\w*)?\}`[^`]*`")
OTHER_ROLE = re.compile(r"\{\w+(?::\w+)?\}`[^`]*`")
INLINE_CODE = re.compile(r"``.*?``|`[^`\n]*`")
LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
URL = re.compile(r"https?://\S+")
HTML = re.compile(r"<!--.*?-->|<[^>\n]+>", re.DOTALL)
DIRECTIVE_OPTION = re.compile(r"^\s*:[\w-]+:.*$", re.MULTILINE)
FENCE_LINE = re.compile(r"^\s*(?::{3,}|`{3,}|~{3,})\s*(?:\{[\w:-]+\})?", re.MULTILINE)
SENTENCE_END = re.compile(r"(?<=[。！？；])|\n+")
GLUED = "⟦glue⟧"
# The other terms of a sum whose unit comes after its last term: in "4 + 8 字节/参数"
# the 4 is bytes as much as the 8 is.
SUM_TAIL = re.compile(r"(?:\s*[+＋]\s*(?:\d+(?:\.\d+)?|" + GLUED + r"))+")


@dataclass(frozen=True)
class Finding:
    chapter: str  # file name without .ipynb
    cell: int
    number: str  # the typed number with its unit, as written
    sentence: str

    def __str__(self) -> str:
        return f"{self.chapter} cell {self.cell}: {self.number!r} in: {self.sentence}"


def prose(markdown: str) -> str:
    """The prose of a markdown cell: code, math, roles, link targets and directive
    options removed; a glue role becomes the marker ⟦glue⟧."""
    text = FENCED_CODE.sub(" ", markdown)
    text = DISPLAY_MATH.sub(" ", text)
    text = GLUE_ROLE.sub(GLUED, text)
    text = OTHER_ROLE.sub(" ", text)
    text = INLINE_CODE.sub(" ", text)
    text = INLINE_MATH.sub(" ", text)
    text = LINK.sub(r"\1", text)
    text = URL.sub(" ", text)
    text = HTML.sub(" ", text)
    text = DIRECTIVE_OPTION.sub(" ", text)
    return FENCE_LINE.sub(" ", text)


# A single line break inside a paragraph is not a sentence end (prose is hard-wrapped);
# a break before a table row, list item, heading or quote, or a blank line, is.
SOFT_BREAK = re.compile(r"(?<=\S)\n(?!\s*(?:[|#>*-]|\d+[.)]\s|\n))")


def sentences(text: str) -> list[str]:
    text = SOFT_BREAK.sub(
        lambda m: "" if not text[m.start() - 1].isascii() else " ", text
    )
    return [s.strip() for s in SENTENCE_END.split(text) if s and s.strip()]


def _exempt(sentence: str, start: int, end: int) -> bool:
    before, after, token = sentence[:start], sentence[end:], sentence[start:end]
    if any(q.start() < start < q.end() for q in QUOTE.finditer(sentence)):
        return True  # a quoted claim under examination: “减少 75%”、「3–5 倍」
    if DEVICE_AFTER.match(after):
        return True  # 80 GB 的卡, 100 GB/s
    if token == "1" and re.match(r"\s?[KMGT]i?B\s*=", after):
        return True  # a unit's definition: 1 GiB = 2³⁰ 字节
    dtype = DTYPE_BEFORE.search(before)
    if (
        dtype
        and re.match(r"\s?字节(?!/)", after)
        and token == str(DTYPE_BYTES[dtype.group(1).lower()])
    ):
        return True  # bf16 权重 2 字节
    prev = before[-1:]
    if prev and prev.isascii() and (prev.isalpha() or prev == "_"):
        return True  # FP16, sm_89, H100, Q19, E4M3
    if prev == "-" and re.search(r"[A-Za-z0-9]-$", before):
        return True  # ZeRO-3, GPT-2, Llama-2-70B
    if re.match(r"B\b", after):
        return True  # model size: 7B, 70B, 1.5B
    if token.count(".") >= 2 or AFTER_LIBRARY.search(before):
        return True  # 0.43.2, bitsandbytes 0.44
    if STRUCTURE_BEFORE.search(before) or STRUCTURE_AFTER.match(after):
        return True  # 第 3 章, 图 3.1, 误区 2
    if LIST_MARKER.match(before) and re.match(r"[.)、]\s", after):
        return True  # "1. **...**" list item
    if re.match(r"\s?×\s*\d", after) or re.search(r"\d\s?×\s?$", before):
        return True  # a shape 4096×4096
    return False


def findings_in_text(markdown: str, chapter: str = "?", cell: int = 0) -> list[Finding]:
    """Typed quantities in one markdown cell's text."""
    out = []
    for sentence in sentences(prose(markdown)):
        for m in NUMBER.finditer(sentence):
            if _exempt(sentence, m.start(), m.end()):
                continue
            unit = UNIT.match(sentence, m.end())
            tail = SUM_TAIL.match(sentence, m.end())
            if unit is None and tail:
                unit = UNIT.match(sentence, tail.end())  # a term of a sum
            grouped = "," in m.group()
            if unit is None and not grouped:
                continue
            number = m.group() + (unit.group() if unit else "")
            out.append(Finding(chapter, cell, number, sentence))
    return out


def findings_in_notebook(path: Path) -> list[Finding]:
    nb = nbformat.read(path, as_version=4)
    out = []
    for i, c in enumerate(nb.cells):
        if c.cell_type == "markdown":
            out += findings_in_text(c.source, path.stem, i)
    return out


@dataclass(frozen=True)
class Allowed:
    chapter: str  # prefix such as "06"
    snippet: str
    reason: str
    line: int


def read_allowlist(path: Path = ALLOW_FILE) -> list[Allowed]:
    """``chapter | snippet of the sentence | reason`` per line; # starts a comment."""
    out = []
    for n, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = [p.strip() for p in line.split("|")]
        if len(parts) != 3 or not all(parts):
            raise ValueError(
                f"{path.name}:{n}: expected 'chapter | snippet | reason', got {raw!r}"
            )
        out.append(Allowed(*parts, line=n))
    return out


def is_allowed(f: Finding, allowed: list[Allowed]) -> Allowed | None:
    for a in allowed:
        if (
            f.chapter.startswith(a.chapter)
            and a.snippet in f.sentence
            and f.number.split()[0] in a.snippet
        ):
            return a
    return None


def report(paths: list[Path], allowed: list[Allowed]) -> dict[str, list[Finding]]:
    return {
        p.stem: [f for f in findings_in_notebook(p) if not is_allowed(f, allowed)]
        for p in paths
    }


def main() -> int:
    paths = sorted((ROOT / "book").glob("*.ipynb"))
    by_chapter = report(paths, read_allowlist())
    for chapter, found in by_chapter.items():
        print(f"{chapter}: {len(found)} typed quantities")
        for f in found:
            print(f"    cell {f.cell}: {f.number!r} in: {f.sentence}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
