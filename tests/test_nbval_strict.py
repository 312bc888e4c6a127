"""The validation itself is tested.

* An exact worked number that no longer matches its code fails nbval (changed by one: 16
  -> 17).
* A measured number declared with a tolerance passes inside it and fails outside it —
  for a glued value, a ``measured`` printout and a tolerant ``md_table``.
* Lint: every glued float in book/ and solutions/ is exact by construction (listed, with
  the reason, in ``tests/exact_glue.txt``) or carries a declared tolerance.
* The comparison helpers of ``tests/nbval_plugin.py`` on their own.
"""

import fnmatch
import json
import re
import subprocess
import sys

import nbformat
import pytest

from tests import nbval_plugin as plugin
from tests.notebooks import ROOT, all_notebooks

GLUE_MIME = "application/papermill.record/text/plain"
TOL = plugin.TOL_KEY


def _kernel_output(code: str) -> list:
    """Run ``code`` in this process's IPython machinery and return the outputs it
    displays."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    captured = []
    pub = shell.display_pub

    def publish(data, metadata=None, **kw):
        captured.append(
            nbformat.v4.new_output("display_data", data=data, metadata=metadata or {})
        )

    old = pub.publish
    pub.publish = publish
    try:
        shell.run_cell(code, store_history=False)
    finally:
        pub.publish = old
    return captured


def _glue_output(name, text, meta=None):
    md = {"scrapbook": {"name": name, "mime_prefix": "application/papermill.record/"}}
    if meta:
        md[TOL] = meta
    return nbformat.v4.new_output("display_data", data={GLUE_MIME: text}, metadata=md)


def _stream(text):
    return nbformat.v4.new_output("stream", name="stdout", text=text)


def _measured_output(text, rtol=0.0, atol=0.0):
    return nbformat.v4.new_output(
        "display_data",
        data={"text/plain": text},
        metadata={TOL: {"rtol": rtol, "atol": atol}},
    )


def _table_output(md, rtol=0.0, atol=0.0):
    return nbformat.v4.new_output(
        "execute_result",
        data={"text/markdown": md, "text/plain": md},
        metadata={TOL: {"rtol": rtol, "atol": atol}},
        execution_count=1,
    )


EXACT_CODE = "from coursekit import glue\nglue('bytes_per_param', 2 + 2 + 4 + 4 + 4)"
GLUE_CODE = "from coursekit import glue\nglue('loss', 3.805, fmt='.2f', rtol=0.05)"
MEASURED_CODE = """from coursekit import measured
with measured(rtol=0.1):
    print(f"fp32 matmul  n 512  relative error {2.9e-07:.1e}")
"""
TABLE_CODE = """from coursekit.nb import md_table
md_table([{"steps": 300, "loss": f"{3.805:.3f}", "error": f"{0.1234:.1%}"}], atol=0.05)
"""
TABLE = "| steps | loss | error |\n|---|---|---|\n| 300 | {} | {} |"


def _matmul(fmt, n, err):
    return _measured_output(f"{fmt} matmul  n {n}  relative error {err}", rtol=0.1)


def _loss(stored):
    return _glue_output(
        "loss", f"{stored:.2f}", {"rtol": 0.05, "atol": 0.0, "value": stored}
    )


# (id, code, stored outputs, passes?) — every case is one cell of one notebook,
# validated by one nbval run (each case imports what it needs, so the cells are
# independent). rtol = 10 %
CASES = [
    ("exact-int-same", EXACT_CODE, [_glue_output("bytes_per_param", "16")], True),
    ("exact-int-plus-one", EXACT_CODE, [_glue_output("bytes_per_param", "17")], False),
    (
        "exact-float-last-digit",
        "print(f'{2**-11:.3e}')",
        [_stream("4.884e-04\n")],
        False,
    ),
    ("glue-2.8%-inside", GLUE_CODE, [_loss(3.700)], True),  # rtol = 5 %
    ("glue-4.6%-inside", GLUE_CODE, [_loss(3.990)], True),
    ("glue-5.4%-outside", GLUE_CODE, [_loss(3.600)], False),
    ("glue-7.2%-outside", GLUE_CODE, [_loss(4.100)], False),
    ("glue-stored-without-tolerance", GLUE_CODE, [_glue_output("loss", "3.79")], False),
    (
        "measured-inside",
        MEASURED_CODE,
        [_matmul("fp32", 512, "2.7e-07")],
        True,
    ),
    ("measured-outside", MEASURED_CODE, [_matmul("fp32", 512, "2.4e-07")], False),
    ("measured-integer", MEASURED_CODE, [_matmul("fp32", 513, "2.9e-07")], False),
    ("measured-words", MEASURED_CODE, [_matmul("fp16", 512, "2.9e-07")], False),
    (
        "table-same",
        TABLE_CODE,
        [_table_output(TABLE.format("3.805", "12.3%"), atol=0.05)],
        True,
    ),
    (
        "table-inside",
        TABLE_CODE,
        [_table_output(TABLE.format("3.840", "12.3%"), atol=0.05)],
        True,
    ),
    (
        "table-outside",
        TABLE_CODE,
        [_table_output(TABLE.format("3.900", "12.3%"), atol=0.05)],
        False,
    ),
    (
        "table-percent-outside",
        TABLE_CODE,
        [_table_output(TABLE.format("3.805", "12.5%"), atol=0.05)],
        False,
    ),
    # GPU cells (tag "gpu", GPU_CASES): the fresh run is checked, the stored one (here
    # a GPU run) is not compared
    (
        "gpu-cpu-run",
        "from coursekit.gpu import gpu_cell\n"
        "@gpu_cell\ndef f(device, small):\n    print('peak', 3 if small else 9)",
        [_stream("以下为在 GPU（T4）上运行的输出。\npeak 9\n")],
        True,
    ),
    (
        "gpu-prints-no-label",
        "print('peak 3')",
        [_stream("以下为在 GPU（T4）上运行的输出。\npeak 9\n")],
        False,
    ),
    (
        "gpu-skipped",
        "from coursekit.gpu import OFF_LINE\nprint(OFF_LINE)",
        [_stream("以下为在 GPU（T4）上运行的输出。\npeak 9\n")],
        False,
    ),
]
GPU_CASES = {"gpu-cpu-run", "gpu-prints-no-label", "gpu-skipped"}


@pytest.fixture(scope="module")
def nbval_results(tmp_path_factory):
    """Validate one notebook holding every case; return {case id: (passed, failure
    text)}."""
    import xml.etree.ElementTree as ET

    tmp = tmp_path_factory.mktemp("nbval_cases")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    for i, (_, code, outputs, _) in enumerate(CASES):
        cell = nbformat.v4.new_code_cell(code, execution_count=i + 1)
        cell.outputs = outputs
        if CASES[i][0] in GPU_CASES:
            cell.metadata["tags"] = ["gpu"]
        nb.cells.append(cell)
    path = tmp / "cases.ipynb"
    nbformat.write(nb, path)
    junit = tmp / "junit.xml"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "--nbval",
            str(path),
            "--nbval-sanitize-with",
            str(ROOT / "tests/nbval_sanitize.cfg"),
            "-p",
            "tests.nbval_plugin",
            "--rootdir",
            str(tmp),
            f"--junitxml={junit}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert junit.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        n = int(case.get("name").rsplit(" ", 1)[-1])
        bad = case.find("failure")
        why = "" if bad is None else bad.get("message", "") + (bad.text or "")
        results[CASES[n][0]] = (bad is None, why)
    assert len(results) == len(CASES), r.stdout[-3000:]
    return results


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_nbval_case(nbval_results, case):
    name, _, _, ok = case
    passed, why = nbval_results[name]
    assert passed is ok, why[-2000:]
    if name == "exact-int-plus-one":
        assert "17" in why and "16" in why
    if name in ("glue-5.4%-outside", "glue-7.2%-outside", "measured-outside"):
        assert "outside rtol=" in why
    if name == "gpu-prints-no-label":
        assert "must start with its label" in why
    if name == "gpu-skipped":
        assert "skipped" in why


# ------------------------------------------------------------------ the helpers
# themselves


def test_text_close_rules():
    close = plugin.text_close
    assert (
        close("loss 3.81 after 300 steps", "loss  3.79 after 300 steps", 0.01, 0)
        is None
    )
    assert "integer" in close(
        "loss 3.81 after 301 steps", "loss 3.81 after 300 steps", 0.5, 0
    )
    assert "text" in close("loss 3.81 (fp16)", "loss 3.81 (bf16)", 0.5, 0)
    assert close("err 2.9e-07", "err 2.4e-07", 0.1, 0) is not None
    assert close("err 2.9e-07", "err 2.4e-07", 0.25, 0) is None
    assert (
        close("x nan", "x nan", 0, 0) is None
        and close("x nan", "x 1.0", 1, 1) is not None
    )
    assert plugin._last_digit("0.027") == pytest.approx(1e-3)
    assert plugin._last_digit("2.9e-07") == pytest.approx(1e-8)
    assert plugin._last_digit("1,234.5") == pytest.approx(0.1)


def test_glue_records_tolerance_and_raw_value():
    outs = _kernel_output(
        "from coursekit import glue\n"
        "glue('a', 0.123456, fmt='.2f', rtol=0.1)\n"
        "glue('b', 16)\n"
        "glue('c', 0.5)\n"
    )
    meta = [o.metadata.get(TOL) for o in outs]
    assert meta[0] == {"rtol": 0.1, "atol": 0.0, "value": 0.123456}
    assert outs[0].data[GLUE_MIME] == "0.12"
    assert meta[1] is None
    assert meta[2] == {"float": True}


def test_tolerance_needs_a_number():
    from coursekit.nb import measured, tolerance

    with pytest.raises(ValueError, match="rtol=... or atol="):
        tolerance()
    with pytest.raises(ValueError, match="rtol must be a number >= 0"):
        measured(rtol=-1)


# ------------------------------------------------------------------ lint

FLOAT_TEXT = re.compile(r"^[-+]?(?:\d[\d,]*)?(?:\.\d+)?(?:[eE][-+]?\d+)?%?$")


def _exact_registry() -> list[tuple[str, str]]:
    """``(notebook glob, key glob)`` pairs of tests/exact_glue.txt (``# why`` comments
    allowed)."""
    pairs = []
    for line in (
        (ROOT / "tests/exact_glue.txt").read_text(encoding="utf-8").splitlines()
    ):
        line = line.split("#", 1)[0].strip()
        if line:
            nb, _, keys = line.partition(":")
            pairs += [(nb.strip(), k) for k in keys.split()]
    return pairs


def glued_floats(nb) -> list[tuple[str, bool]]:
    """``(key, has_tolerance)`` for every compared glued value of ``nb`` that is a float
    (by type or text). Cells tagged ``nbval-ignore-output`` (timings) are not compared,
    so not linted."""
    out = []
    for cell in nb.cells:
        if "nbval-ignore-output" in cell.get("metadata", {}).get("tags", []):
            continue
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            meta = o.get("metadata") or {}
            name = (meta.get("scrapbook") or {}).get("name")
            text = (o.get("data") or {}).get(GLUE_MIME)
            if name is None or text is None:
                continue
            tol = meta.get(TOL) or {}
            is_float = (
                tol.get("float")
                or "value" in tol
                or (FLOAT_TEXT.match(text.strip()) and re.search(r"[.eE%]", text))
            )
            if is_float:
                out.append((name, "rtol" in tol or "atol" in tol))
    return out


def loose_floats(nb, rel: str) -> list[str]:
    """Glued floats of notebook ``rel`` with neither a tolerance nor an exact_glue.txt
    entry."""
    registry = [k for n, k in _exact_registry() if fnmatch.fnmatch(rel, n)]
    return [
        key
        for key, tolerant in glued_floats(nb)
        if not tolerant and not any(fnmatch.fnmatch(key, k) for k in registry)
    ]


def test_lint_catches_an_undeclared_float():
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("glue(...)")
    # listed for book/01
    cell.outputs = [
        _glue_output("new_loss", "3.81", {"float": True}),  # a float, no tolerance
        _glue_output("tol_loss", "3.81", {"rtol": 0.05, "atol": 0.0, "value": 3.81}),
        _glue_output("pct", "12.5%"),  # a float by its text
        _glue_output("count", "16"),  # an integer
        _glue_output("fp16_max", "65,504", {"float": True}),
    ]
    nb.cells = [cell]
    assert loose_floats(nb, "book/01_number_formats.ipynb") == ["new_loss", "pct"]
    cell.metadata["tags"] = ["nbval-ignore-output"]  # not compared: not linted
    assert loose_floats(nb, "book/01_number_formats.ipynb") == []


@pytest.mark.parametrize("path", all_notebooks(), ids=lambda p: p.name)
def test_every_glued_float_is_exact_or_tolerant(path):
    rel = str(path.relative_to(ROOT))
    loose = loose_floats(nbformat.read(path, as_version=4), rel)
    assert not loose, (
        f"{rel}: glued floats with neither a tolerance nor an entry in "
        f"tests/exact_glue.txt: "
        f"{', '.join(loose)}. A measured number declares glue(..., rtol=...); an exact "
        f"one "
        "(derived from exact inputs only) is listed there with the reason."
    )


def test_exact_registry_names_existing_keys():
    """A stale entry in tests/exact_glue.txt (the key is gone or became tolerant) is
    reported."""
    floats = {}
    for p in all_notebooks():
        floats[str(p.relative_to(ROOT))] = dict(
            glued_floats(nbformat.read(p, as_version=4))
        )
    stale = []
    for nb_glob, key in _exact_registry():
        hits = [
            k
            for rel, keys in floats.items()
            if fnmatch.fnmatch(rel, nb_glob)
            for k, tolerant in keys.items()
            if fnmatch.fnmatch(k, key) and not tolerant
        ]
        if not hits:
            stale.append(f"{nb_glob}: {key}")
    assert not stale, (
        "entries in tests/exact_glue.txt that match no untoleranced glued float: "
        + json.dumps(stale)
    )


# ------------------------------------------------------------------ kernel environment


def test_kernel_env_is_the_reference_plus_overrides():
    from coursekit.execute import REFERENCE_ENV, kernel_env

    env = kernel_env(
        {"ATEN_CPU_CAPABILITY": "default", "DROP_ME": None},
        base={"COURSE_GPU": "cpu", "DROP_ME": "x", "PATH": "/bin"},
    )
    # a caller's COURSE_GPU does not leak into stored outputs
    assert env["COURSE_GPU"] == "auto"
    # GPUs hidden: GPU cells store their labelled CPU small-size run
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert (
        env["ATEN_CPU_CAPABILITY"] == "default"
        and env["PATH"] == "/bin"
        and "DROP_ME" not in env
    )
    assert all(
        env[k] == v for k, v in REFERENCE_ENV.items() if k != "ATEN_CPU_CAPABILITY"
    )
    assert kernel_env({"COURSE_GPU": "cpu"}, base={})["COURSE_GPU"] == "cpu"


def test_execute_gives_the_kernel_its_environment(tmp_path):
    """The kernel sees the reference environment; this process's os.environ is
    untouched."""
    import os

    from coursekit.execute import execute_notebook

    nb = nbformat.v4.new_notebook()
    keys = [
        "COURSE_GPU",
        "CUDA_VISIBLE_DEVICES",
        "OMP_NUM_THREADS",
        "ATEN_CPU_CAPABILITY",
        "HF_HUB_OFFLINE",
    ]
    nb.cells = [
        nbformat.v4.new_code_cell(
            f"import os; print([os.environ.get(k) for k in {keys!r}])"
        )
    ]
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    path = tmp_path / "env.ipynb"
    nbformat.write(nb, path)
    before = dict(os.environ)
    execute_notebook(path, timeout=120, env={"ATEN_CPU_CAPABILITY": "default"})
    assert dict(os.environ) == before
    out = nbformat.read(path, as_version=4).cells[0].outputs[0]["text"]
    assert out.strip() == str(["auto", "", "1", "default", "1"])


def test_nbval_runs_gpu_cells_on_cpu_and_checks_them():
    """GPU cells: the nbval kernel runs them at CPU size (COURSE_GPU=cpu) and their
    fresh run reaches the check (gpu_run_problem) instead of a comparison with the
    stored output (a CPU small run with timings, or a GPU run)."""
    from types import SimpleNamespace

    from tests import nbval_plugin

    def item(tags):
        return SimpleNamespace(
            cell={"metadata": {"tags": tags}},
            options={"check": False},
            user_properties=[],
        )

    gpu, plain = item(["gpu"]), item(["nbval-ignore-output"])
    nbval_plugin.pytest_collection_modifyitems(None, None, [gpu, plain, object()])
    assert gpu.options["check"] is True and plain.options["check"] is False
    assert gpu.user_properties == [
        ("nbval_ignore_reason", nbval_plugin.GPU_IGNORE_REASON)
    ]
    config = SimpleNamespace(getoption=lambda name: [])
    assert nbval_plugin._kernel_env(config)["COURSE_GPU"] == "cpu"
    config = SimpleNamespace(getoption=lambda name: ["COURSE_GPU=off"])
    assert nbval_plugin._kernel_env(config)["COURSE_GPU"] == "off"
