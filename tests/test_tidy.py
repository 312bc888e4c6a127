"""`python -m coursekit tidy`: plumbing moves off the page, the code that runs does not
change."""

from __future__ import annotations

import ast
import copy
import re
import subprocess
import sys

import nbformat
import pytest

from coursekit.tidy import REMOVE, tidy_notebook, visible_source
from tests.notebooks import ROOT


def glue_out(name, text):
    return nbformat.v4.new_output(
        "display_data",
        data={"application/papermill.record/text/plain": text},
        metadata={
            "scrapbook": {"name": name, "mime_prefix": "application/papermill.record/"}
        },
    )


def stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def nb_of(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def code(src, outputs=(), tags=None):
    c = nbformat.v4.new_code_cell(src)
    c.outputs = list(outputs)
    if tags:
        c.metadata["tags"] = list(tags)
    return c


def test_trailing_glue_moves_with_its_outputs():
    nb = nb_of(
        code(
            'x = 2\nprint(x)\nglue("a", x)\nglue("b", x * 2, fmt=".1f")',
            [stream("2\n"), glue_out("a", "2"), glue_out("b", "4.0")],
        )
    )
    report = tidy_notebook(nb)
    assert [c.source for c in nb.cells] == [
        "x = 2\nprint(x)",
        'glue("a", x)\nglue("b", x * 2, fmt=".1f")',
    ]
    main, moved = nb.cells
    assert main.outputs == [stream("2\n")]
    assert [o.metadata["scrapbook"]["name"] for o in moved.outputs] == ["a", "b"]
    assert moved.metadata["tags"] == [REMOVE]
    assert "tags" not in main.metadata
    assert len(report.changes) == 1


def test_expression_left_last_is_not_displayed():
    """Before the move `md_table(rows)` was not the last line, so Jupyter did not
    display it."""
    nb = nb_of(code('rows = [1]\nmd_table(rows)  # a table\nglue("n", len(rows))'))
    tidy_notebook(nb)
    assert nb.cells[0].source == "rows = [1]\nmd_table(rows);  # a table"


def test_leading_glue_moves_before_and_comments_stay():
    nb = nb_of(
        code(
            '# the table\nglue("a", 1)\nglue("b", 2)\nrows = f()\nrows',
            [glue_out("a", "1"), glue_out("b", "2"), stream("x")],
        )
    )
    tidy_notebook(nb)
    assert [c.source for c in nb.cells] == [
        'glue("a", 1)\nglue("b", 2)',
        "# the table\nrows = f()\nrows",
    ]
    assert nb.cells[0].metadata["tags"] == [REMOVE] and len(nb.cells[0].outputs) == 2
    assert nb.cells[1].outputs == [stream("x")]


def test_glue_only_cell_is_tagged_not_split():
    nb = nb_of(
        code('glue("a", 1); glue("b", 2)\nfor k in d:\n    pass'),
        code('glue("a", 1); glue("b", 2)'),
    )
    tidy_notebook(nb)
    assert [c.source for c in nb.cells] == [
        'glue("a", 1); glue("b", 2)',
        "for k in d:\n    pass",
        'glue("a", 1); glue("b", 2)',
    ]
    assert nb.cells[0].metadata["tags"] == [REMOVE] and nb.cells[2].metadata[
        "tags"
    ] == [REMOVE]
    # a loop is not a glue call: it stays in view
    assert "tags" not in nb.cells[1].metadata


def test_glue_in_the_middle_is_left_and_reported():
    nb = nb_of(code('a = 1\nglue("a", a)\nb = 2'))
    before = copy.deepcopy(nb)
    report = tidy_notebook(nb)
    assert nb == before and not report.changes and report.left


def test_displayed_glue_and_gpu_cells_are_not_touched():
    nb = nb_of(
        code('x = 1\nglue("fig", x, display=True)'),
        code(
            '# type\n@gpu_cell\ndef f(device, small):\n    pass\nglue("g", 1)',
            tags=["gpu"],
        ),
    )
    before = copy.deepcopy(nb)
    tidy_notebook(nb)
    assert nb == before


def test_computed_keys_next_to_other_glue_are_left():
    nb = nb_of(code('glue(f"k_{i}", 1)\nx = 1\nglue("a", x)\nglue("b", x)'))
    before = copy.deepcopy(nb)
    report = tidy_notebook(nb)
    assert nb == before and "computed key" in report.left[0]


def test_nbval_comment_becomes_a_tag_and_setup_is_collapsed():
    nb = nb_of(
        code(
            "from coursekit import setup\nsetup()",
            tags=["setup", "nbval-ignore-output"],
        ),
        code("# nbval-ignore-output：耗时随机器变化\nt = time()"),
    )
    tidy_notebook(nb)
    assert nb.cells[0].metadata["tags"] == ["setup", "nbval-ignore-output", "hide-cell"]
    assert nb.cells[0].metadata["mystnb"]["code_prompt_show"].startswith("显示准备代码")
    assert nb.cells[1].source == "t = time()"
    assert nb.cells[1].metadata["tags"] == ["nbval-ignore-output"]
    assert nb.cells[1].metadata["nbval_ignore_reason"] == "耗时随机器变化"


def _program(nb) -> str:
    """The code the notebook runs, as an AST dump (comments and a trailing `;` do not
    count)."""
    srcs = []
    for c in nb.cells:
        if c.cell_type == "code":
            srcs.append(re.sub(r"^\s*[%!].*$", "pass", c.source, flags=re.M))
    return ast.dump(ast.parse("\n".join(srcs)))


def _glue_outputs(nb):
    return sorted(
        o.metadata["scrapbook"]["name"]
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if "scrapbook" in o.get("metadata", {})
    )


NOTEBOOKS = sorted((ROOT / "book").glob("*.ipynb")) + sorted(
    (ROOT / "solutions").glob("*.ipynb")
)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_real_notebooks_run_the_same_code_after_tidy(path):
    """On every notebook of the course (in memory): same statements in the same order,
    every glued output kept, glue calls no longer shown, and a second run changes
    nothing."""
    nb = nbformat.read(path, as_version=4)
    program, glued = _program(nb), _glue_outputs(nb)
    tidy_notebook(nb, path)
    assert _program(nb) == program
    assert _glue_outputs(nb) == glued
    for c in nb.cells:  # each glued output sits in the cell whose code makes it
        for o in c.get("outputs", []):
            name = o.get("metadata", {}).get("scrapbook", {}).get("name")
            if name and re.search(r"glue\(\s*f?['\"]", c.source):
                assert "glue(" in c.source, (
                    f"{name} output moved away from its glue call"
                )
    again = copy.deepcopy(nb)
    assert not tidy_notebook(again, path).changes and again == nb
    nbformat.validate(nb)


def test_visible_source_hides_only_plumbing():
    src = (
        '# nbval-ignore-output: timing\nx = 1\nglue("a", x); glue("b", 2)\n'
        "for k, v in d.items():\n    glue(k, v)\n"
        'for n in runs:\n    print(n)\n    glue(f"x_{n}", n)\n'
        'if x:\n    glue("c", 3)\nelse:\n    foo()\n'
        'y = 2; glue("d", y)\nglue("e",\n     5)\npaper'
    )
    assert visible_source(src) == (
        "x = 1\nfor n in runs:\n    print(n)\n"
        'if x:\n    glue("c", 3)\nelse:\n    foo()\n'
        'y = 2; glue("d", y)\npaper'
    )
    # not Python
    assert visible_source("%time f()\nglue('a', 1)") == "%time f()\nglue('a', 1)"
    # the source material's cell-type line is the badge's job, not the code's
    gpu = "# 类型：【Skeleton】需要 GPU\n@gpu_cell\ndef f(device, small):\n    pass"
    assert visible_source(gpu) == "@gpu_cell\ndef f(device, small):\n    pass"
    assert (
        visible_source("x = 1  # 类型：【Skeleton】") == "x = 1  # 类型：【Skeleton】"
    )


def _cli(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "coursekit", "tidy", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_check_then_tidy_then_clean(tmp_path):
    # an untidied cell: computation and its glue call together (book/ itself is already
    # tidy)
    nb = nb_of(
        code(
            "x = 2 ** -11\nprint(x)\nglue('x', x)",
            [stream("0.00048828125\n"), glue_out("x", "0.00048828125")],
        )
    )
    nbformat.write(nb, tmp_path / "ch.ipynb")
    first = _cli("--check", "ch.ipynb", cwd=tmp_path)
    assert first.returncode == 1 and "would change 1 of 1" in first.stdout
    assert _cli("ch.ipynb", cwd=tmp_path).returncode == 0
    again = _cli("--check", "ch.ipynb", cwd=tmp_path)
    assert again.returncode == 0 and "would change 0 of 1" in again.stdout
    bad = _cli("nothere.ipynb", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0
    assert "nothere.ipynb" in bad.stderr


def test_moved_glue_of_an_uncompared_cell_stays_uncompared():
    """A timing cell's glued value varies by machine: nbval must not start comparing
    it."""
    nb = nb_of(
        code(
            "# nbval-ignore-output: wall-clock time\nt = run()\nprint(t)\nglue('t', t)",
            [stream("1.2\n"), glue_out("t", "1.2")],
        )
    )
    tidy_notebook(nb)
    main, moved = nb.cells
    assert moved.metadata["tags"] == [REMOVE, "nbval-ignore-output"]
    assert moved.metadata["nbval_ignore_reason"] == "wall-clock time"
    assert main.metadata["tags"] == ["nbval-ignore-output"]


# ---------------------------------------------------------------- measurement plumbing


def test_measured_wrapper_is_shown_as_its_body_dedented():
    src = (
        "x = 1\n"
        "with measured(\n"
        "    rtol=0.01\n"
        "):  # norms are fp32 sums: their last bits depend on the CPU's kernels\n"
        "    print(f'direct cast {x}')\n"
        "    if x:\n"
        "        print(2)  # kept\n"
        "y = 1"
    )
    assert visible_source(src) == (
        "x = 1\nprint(f'direct cast {x}')\nif x:\n    print(2)  # kept\ny = 1"
    )


def test_nested_and_indented_measured_wrappers():
    src = (
        "for name in names:\n"
        "    with measured(atol=1e-3):\n"
        "        with measured(rtol=0.3 if 'linear' in name else 0.02):\n"
        "            print('中文', name)\n"
        "    done = True"
    )
    assert visible_source(src) == (
        "for name in names:\n    print('中文', name)\n    done = True"
    )


def test_tolerance_arguments_of_tables_are_left_out_and_others_kept():
    assert visible_source("md_table(under, rtol=0.05, atol=0.2)") == "md_table(under)"
    assert (
        visible_source("display(md_table(rows, atol=1))") == "display(md_table(rows))"
    )
    assert visible_source("md_table(\n    rows,\n    rtol=0.05,\n)") == (
        "md_table(\n    rows,\n)"
    )
    # a lesson's own tolerance is part of the lesson
    kept = "torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)"
    assert visible_source(kept) == kept
    assert visible_source("m = measured(rtol=0.1)") == "m = measured(rtol=0.1)"


def test_tolerance_dicts_used_only_by_tolerance_calls_are_left_out():
    from coursekit.tidy import tolerance_names

    cells = [
        "tol = dict(rtol=0.02, atol=1e-3)  # losses of a training run: measured",
        "x = 3\nmd_table(rows, **tol)",
        "lesson = dict(atol=0.05)\ntorch.testing.assert_close(a, b, **lesson)",
    ]
    names = tolerance_names(cells)
    assert names == {"tol"}
    assert visible_source(cells[0], names) == ""
    assert visible_source(cells[1], names) == "x = 3\nmd_table(rows)"
    assert visible_source(cells[2], names) == cells[2]


def test_comments_about_nbval_are_left_out():
    src = (
        "# The final loss is a float: its last digits depend on the CPU's\n"
        "# kernels, so it is not compared by\n"
        "# nbval.\n"
        "assert loss < 1\n"
        "# the lesson's comment stays\n"
        "def update(\n"
        "    change=None,\n"
        "):  # same behaviour live, under nbclient and nbval\n"
        "    text = 1"
    )
    assert visible_source(src) == (
        "assert loss < 1\n# the lesson's comment stays\n"
        "def update(\n    change=None,\n):\n    text = 1"
    )
    assert visible_source("s = '# nbval'") == "s = '# nbval'"  # a string, not a comment


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_real_cells_stripped_still_parse_and_lose_every_wrapper(path):
    import ast

    from coursekit.tidy import tolerance_names

    nb = nbformat.read(path, as_version=4)
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    names = tolerance_names(sources)
    for src in sources:
        try:
            ast.parse(src)
        except SyntaxError:
            continue  # IPython magics: shown as written
        shown = visible_source(src, names)
        ast.parse(shown)
        assert "with measured(" not in shown, shown
        assert "nbval" not in shown.lower(), shown
        for line in shown.splitlines():
            if "md_table(" in line:
                assert "rtol=" not in line and "atol=" not in line, line


def test_the_measured_import_goes_with_the_last_wrapper():
    src = (
        "from coursekit import measured  # measured floats: compared within tolerance\n"
        "with measured(rtol=0.01):\n"
        "    print(1)"
    )
    assert visible_source(src) == "print(1)"
    src = "from coursekit.nb import md_table, measured\nmd_table(rows, rtol=0.1)"
    assert visible_source(src) == "from coursekit.nb import md_table\nmd_table(rows)"
    kept = "from coursekit import measured\nm = measured(rtol=0.1)"
    assert visible_source(kept) == kept
