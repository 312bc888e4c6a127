"""Hints that guide instead of answering: no TODO line and no first hint of any lab
repeats the code of its solution block (coursekit/hints.py measures it); every exercise
has its two collapsed hints right below it."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from coursekit.hints import HINTS_TAG, hint_texts, leak, split_blocks

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = sorted((ROOT / "solutions").glob("lab*.ipynb"))

# lab05's TODO before hints were rewritten: the whole forward pass in one comment
OLD_LAB05_TODO = (
    "self.base(x) + (self.dropout(x) @ self.lora_A.T @ self.lora_B.T) * self.scaling"
)
LAB05_FORWARD = (
    "        return self.base(x) + (self.dropout(x) @ self.lora_A.T @ self.lora_B.T) "
    "* self.scaling\n"
)
LAB05_VISIBLE = "    def forward(self, x):\n"


def _exercises(path: Path):
    """``(where, todo, block, visible, hints cell or None, block index, blocks in the
    cell)`` for every solution block, the hints cell being the markdown cell tagged
    ``hints`` right after the exercise's code cell."""
    nb = nbformat.read(path, as_version=4)
    out = []
    for k, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or "### BEGIN SOLUTION" not in cell.source:
            continue
        blocks, visible = split_blocks(cell.source)
        nxt = nb.cells[k + 1] if k + 1 < len(nb.cells) else None
        hints = (
            nxt
            if nxt is not None
            and nxt.cell_type == "markdown"
            and HINTS_TAG in nxt.metadata.get("tags", [])
            else None
        )
        for b, (todo, code) in enumerate(blocks):
            where = f"{path.name} cell {k} block {b}"
            out.append((where, todo, code, visible, hints, b, len(blocks)))
    return out


EXERCISES = [e for p in SOLUTIONS for e in _exercises(p)]


def test_yesterdays_lab05_todo_is_caught():
    """The check fails on the TODO lab05 shipped with (the answer as a comment) and on
    a first hint that quotes it, and passes a TODO that says what and where."""
    assert leak(OLD_LAB05_TODO, LAB05_FORWARD, LAB05_VISIBLE).exceeds("todo")
    assert leak(f"提示：`{OLD_LAB05_TODO}`", LAB05_FORWARD, LAB05_VISIBLE).exceeds(
        "hint1"
    )
    fine = "返回冻结层的输出加上低秩更新（第 5 章“公式”一节）"
    assert not leak(fine, LAB05_FORWARD, LAB05_VISIBLE).exceeds("todo")


def test_leak_counts_runs_and_unseen_names():
    code = "    loss = model(input_ids=ids, labels=labels).loss * n / total\n"
    got = leak("用 `model(input_ids=ids` 算", code, visible="def f(model, ids):")
    assert got.run == 5 and got.run_text == "model ( input_ids = ids"
    assert got.names == ("input_ids",)  # model and ids are in the signature
    assert leak("# 注释里的 n / total 不算代码", "# n / total\nx = 1").run == 0


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e[0])
def test_todo_says_what_and_where_not_how(ex):
    where, todo, code, visible = ex[:4]
    assert todo, f"{where}: the block has no '# HINT:' line (the TODO students see)"
    assert "第" in todo and "章" in todo, (
        f"{where}: the TODO should name the chapter section that explains it: {todo!r}"
    )
    got = leak(todo, code, visible)
    assert not got.exceeds("todo"), (
        f"{where}: the TODO repeats the solution (run {got.run_text!r}, names "
        f"{got.names}): {todo!r}"
    )


@pytest.mark.parametrize("ex", EXERCISES, ids=lambda e: e[0])
def test_two_collapsed_hints_below_each_exercise(ex):
    where, _, code, visible, hints, b, n = ex
    assert hints is not None, f"{where}: no markdown cell tagged 'hints' right after it"
    texts = hint_texts(hints.source)
    titles = [t for t, _ in texts]
    assert titles == ["提示 1", "提示 2"] * n, (where, titles)
    assert hints.source.count("<details>") == 2 * n == hints.source.count("</details>")
    first, second = texts[2 * b][1], texts[2 * b + 1][1]
    one = leak(first, code, visible)
    assert not one.exceeds("hint1"), (
        f"{where}: 提示 1 gives code away (run {one.run_text!r}, names {one.names})"
    )
    two = leak(second, code, visible)
    assert not two.exceeds("hint2"), (
        f"{where}: 提示 2 writes out the expression (run {two.run_text!r})"
    )
