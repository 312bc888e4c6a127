"""No typed quantity in a chapter's prose: every byte count, GB/GiB figure, percentage,
ratio and parameter count a reader sees is glued from a cell (rules and exceptions in
:mod:`tests.typed_numbers`; the reasoned exceptions in ``typed_numbers_allow.txt``).

A chapter listed in ``NOT_YET_CLEAN`` is reported (xfail, with its findings) instead of
failing; once it is clean, the test fails until it is taken off the list, so the list
only shrinks.
"""

from __future__ import annotations

import pytest

from tests import typed_numbers as T
from tests.notebooks import book_notebooks

# The one place that lists chapters whose prose still has typed quantities.
NOT_YET_CLEAN: set[str] = set()


@pytest.fixture(scope="module")
def allowed():
    return T.read_allowlist()


@pytest.mark.parametrize("path", book_notebooks(), ids=lambda p: p.stem)
def test_no_typed_quantity_in_prose(path, allowed):
    found = [f for f in T.findings_in_notebook(path) if not T.is_allowed(f, allowed)]
    listing = "\n".join(str(f) for f in found)
    if path.stem in NOT_YET_CLEAN:
        if not found:
            pytest.fail(f"{path.stem} is clean: take it off NOT_YET_CLEAN")
        pytest.xfail(f"{len(found)} typed quantities (not yet clean):\n{listing}")
    assert not found, (
        f"{path.stem}: {len(found)} typed quantities in the prose; glue them from a "
        f"cell (or list a reasoned exception in {T.ALLOW_FILE.name}):\n{listing}"
    )


def test_every_allowlist_entry_is_used(allowed):
    used = set()
    for path in book_notebooks():
        for f in T.findings_in_notebook(path):
            a = T.is_allowed(f, allowed)
            if a is not None:
                used.add(a.line)
    stale = [a for a in allowed if a.line not in used]
    assert not stale, "allowlist entries that match nothing: " + "; ".join(
        f"line {a.line}: {a.chapter} | {a.snippet}" for a in stale
    )


def _numbers(markdown: str) -> list[str]:
    return [f.number for f in T.findings_in_text(markdown, "99_synthetic")]


# The three contradictions the question bank once had, typed next to glued numbers.
@pytest.mark.parametrize(
    "markdown, typed",
    [
        (  # 16 B/param x 6.74 B parameters is 107.8 GB; 135 GB was the 20 B/param peak
            ":::{admonition} Q1：为什么不可能？\n:class: dropdown\n"
            "BF16 权重与梯度、FP32 主权重、Adam m、v，"
            "每参数共 16 字节，估算 135 GB。\n:::",
            ["16 字节", "135 GB"],
        ),
        (  # 37.7 GiB is bf16 with bf16 m, v; fp32 4 + 8 bytes would be 75.3 GiB
            "| 梯度与 Adam 状态 | {glue:}`e7_full_states` GiB |\n\n"
            "省在可训练参数才有的梯度和 Adam 状态（fp32 下 4 + 8 字节/参数）。",
            ["4 字节", "8 字节"],
        ),
        (  # pure bf16 is 8 B/param against 16: it saves 8, not 4
            ":::{admonition} Q20：纯 BF16 训练有什么风险？\n:class: dropdown\n"
            "小更新被舍入掉。它省下每参数 4 字节"
            "（[第 3 章](03_training_memory.ipynb)）。\n:::",
            ["4 字节"],
        ),
    ],
    ids=["ch8-Q1 16 B = 135 GB", "ch6 fp32 4 + 8", "S-Q20 saves 4 bytes"],
)
def test_reintroduced_contradictions_are_found(markdown, typed):
    assert _numbers(markdown) == typed


def test_glued_and_exempt_numbers_are_not_findings():
    text = (
        "7B 全量微调 {glue:}`peak` GiB（第 3 章、第 4 章，图 3.1，误区 2）。\n"
        "bitsandbytes 0.43.2 起不再保存输入；torch ≥ 2.4 的 FSDP2；"
        "ZeRO-3、FP16、sm_89。\n"
        "常见说法“减少 75%”与「3–5 倍」；单张 80 GB 的卡，100 GB/s；"
        "bf16 权重 2 字节；1 GiB = 2³⁰ 字节。\n"
        "1. **先估算**：$16\\Psi$ 字节，`4,194,304`，4096×4096 的矩阵，batch 8。"
    )
    assert _numbers(text) == []


def test_typed_quantities_of_each_kind_are_found():
    text = (
        "省 12.5%，快 3 倍，快 2.5×；共 4,194,304 个参数；"
        "两份 FP32 状态 8 字节；72.3 GiB 与 80GB；训练 0 个参数。"
    )
    assert _numbers(text) == [
        "12.5%",
        "3 倍",
        "2.5×",
        "4,194,304 个参数",
        "8 字节",
        "72.3 GiB",
        "80GB",
        "0 个参数",
    ]


def test_every_term_of_a_typed_sum_is_found():
    text = (
        "fp32 下 4 + 8 字节/参数；2 + 4 + 8 B/param；{glue:}`a` + 8 字节；"
        "1.5 + 0.5 GiB；4 + 8 个 batch。"
    )
    assert _numbers(text) == [
        "4 字节",
        "8 字节",
        "2 B/param",
        "4 B/param",
        "8 B/param",
        "8 字节",
        "1.5 GiB",
        "0.5 GiB",
    ]


def test_malformed_allowlist_line_is_a_clear_error(tmp_path):
    bad = tmp_path / "allow.txt"
    bad.write_text("06 | only two fields\n", encoding="utf-8")
    with pytest.raises(ValueError, match="expected 'chapter | snippet | reason'"):
        T.read_allowlist(bad)


# The same three contradictions, reintroduced into the sentence now on the page: the
# chapter's own cell passes, the cell with the typed number put back fails. A change to
# the sentence on the page makes the `original in source` assertion fail, so these stay
# tied to the book.
ON_THE_PAGE = [
    (  # ch8-Q1: 16 B/param next to the 20 B/param peak's 135 GB
        "08_attention_inference_troubleshooting",
        "Q1：常见说法",
        "{glue:}`bpp_amp_states` 字节/参数 = {glue:}`states_amp_gb` GB",
        "{glue:}`bpp_amp_states` 字节/参数 = 135 GB",
        ["135 GB"],
    ),
    (  # ch6's table text: 37.7 GiB is pure bf16 (2 + 4), stated as fp32 4 + 8
        "06_lora_in_practice",
        "7B 上：全量微调的梯度 + 优化器状态共",
        "（纯 bf16：每参数 {glue:}`e7_state_bpp` 字节）",
        "（fp32 下 4 + 8 字节/参数）",
        ["4 字节", "8 字节"],
    ),
    (  # S-Q20 (now the pure-BF16 question): saves 8 bytes per parameter, not 4
        "10_summary",
        "纯 BF16 训练（不要主权重）有什么风险",
        "每参数省 {glue:}`q_pure_saving` 字节",
        "每参数省 4 字节",
        ["4 字节"],
    ),
]


def _page_cell(chapter: str, marker: str) -> tuple[int, str]:
    import nbformat

    nb = nbformat.read(T.ROOT / "book" / f"{chapter}.ipynb", as_version=4)
    (hit,) = [
        (i, c.source)
        for i, c in enumerate(nb.cells)
        if c.cell_type == "markdown" and marker in c.source
    ]
    return hit


@pytest.mark.parametrize(
    "chapter, marker, original, reintroduced, typed",
    ON_THE_PAGE,
    ids=["ch8-Q1 on the page", "ch6 table text on the page", "S-Q20 on the page"],
)
def test_reintroduced_contradiction_on_the_page_is_found(
    chapter, marker, original, reintroduced, typed, allowed
):
    i, source = _page_cell(chapter, marker)
    assert original in source, f"{chapter} cell {i} no longer says {original!r}"
    clean = T.findings_in_text(source, chapter, i)
    assert [f for f in clean if not T.is_allowed(f, allowed)] == []
    bad = T.findings_in_text(source.replace(original, reintroduced), chapter, i)
    assert [f.number for f in bad if not T.is_allowed(f, allowed)] == typed
