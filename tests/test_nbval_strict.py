"""The validation itself is tested.

* An exact worked number that no longer matches its code fails nbval (changed by one: 16 -> 17).
* A measured number declared with a tolerance passes inside it and fails outside it — for a glued
  value, a ``measured`` printout and a tolerant ``md_table``.
* Lint: every glued float in book/ and solutions/ is exact by construction (listed, with the
  reason, in ``tests/exact_glue.txt``) or carries a declared tolerance.
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
    """Run ``code`` in this process's IPython machinery and return the outputs it displays."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    captured = []
    pub = shell.display_pub

    def publish(data, metadata=None, **kw):
        captured.append(nbformat.v4.new_output("display_data", data=data, metadata=metadata or {}))

    old = pub.publish
    pub.publish = publish
    try:
        shell.run_cell(code, store_history=False)
    finally:
        pub.publish = old
    return captured


def _notebook(code: str, outputs: list):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell(code, execution_count=1)
    cell.outputs = outputs
    nb.cells = [nbformat.v4.new_markdown_cell("算例"), cell]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _nbval(tmp_path, nb) -> subprocess.CompletedProcess:
    path = tmp_path / "worked_number.ipynb"
    nbformat.write(nb, path)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", str(path),
                           "--nbval-sanitize-with", str(ROOT / "tests/nbval_sanitize.cfg"),
                           "-p", "tests.nbval_plugin", "--rootdir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)


def _glue_output(name, text, meta=None):
    md = {"scrapbook": {"name": name, "mime_prefix": "application/papermill.record/"}}
    if meta:
        md[TOL] = meta
    return nbformat.v4.new_output("display_data", data={GLUE_MIME: text}, metadata=md)


# ------------------------------------------------------------------ exact numbers

@pytest.mark.parametrize("stored,ok", [("16", True), ("17", False)])
def test_exact_glued_number_changed_by_one_fails(tmp_path, stored, ok):
    code = "from coursekit import glue\nglue('bytes_per_param', 2 + 2 + 4 + 4 + 4)"
    r = _nbval(tmp_path, _notebook(code, [_glue_output("bytes_per_param", stored)]))
    assert (r.returncode == 0) is ok, r.stdout[-2000:]
    if not ok:
        assert "17" in r.stdout and "16" in r.stdout


def test_exact_printed_float_changed_in_last_digit_fails(tmp_path):
    code = "print(f'{2**-11:.3e}')"
    stored = nbformat.v4.new_output("stream", name="stdout", text="4.884e-04\n")
    r = _nbval(tmp_path, _notebook(code, [stored]))
    assert r.returncode != 0 and "4.883e-04" in r.stdout, r.stdout[-2000:]


# ------------------------------------------------------------------ tolerant numbers

GLUE_CODE = "from coursekit import glue\nglue('loss', 3.805, fmt='.2f', rtol=0.05)"


@pytest.mark.parametrize("stored,ok", [(3.700, True),     # 2.8 % away: inside rtol=5 %
                                       (3.990, True),     # 4.6 %
                                       (3.600, False),    # 5.4 %: outside
                                       (4.100, False)])
def test_tolerant_glue_inside_passes_outside_fails(tmp_path, stored, ok):
    out = _glue_output("loss", f"{stored:.2f}", {"rtol": 0.05, "atol": 0.0, "value": stored})
    r = _nbval(tmp_path, _notebook(GLUE_CODE, [out]))
    assert (r.returncode == 0) is ok, r.stdout[-2000:]
    if not ok:
        assert "outside rtol=0.05" in r.stdout


def test_tolerant_glue_needs_a_stored_tolerance(tmp_path):
    """A stored output made before the tolerance was declared is still compared as text."""
    r = _nbval(tmp_path, _notebook(GLUE_CODE, [_glue_output("loss", "3.79")]))
    assert r.returncode != 0, r.stdout[-2000:]


MEASURED_CODE = """from coursekit import measured
with measured(rtol=0.1):
    print(f"fp32 matmul  n 512  relative error {2.9e-07:.1e}")
"""


@pytest.mark.parametrize("stored,ok", [("fp32 matmul  n 512  relative error 2.7e-07", True),
                                       ("fp32 matmul  n 512  relative error 2.4e-07", False),
                                       ("fp32 matmul  n 513  relative error 2.9e-07", False),  # integer
                                       ("fp16 matmul  n 512  relative error 2.9e-07", False)])  # words
def test_measured_printout(tmp_path, stored, ok):
    out = nbformat.v4.new_output("display_data", data={"text/plain": stored},
                                 metadata={TOL: {"rtol": 0.1, "atol": 0.0}})
    r = _nbval(tmp_path, _notebook(MEASURED_CODE, [out]))
    assert (r.returncode == 0) is ok, r.stdout[-2000:]


TABLE_CODE = """from coursekit.nb import md_table
md_table([{"steps": 300, "loss": f"{3.805:.3f}", "error": f"{0.1234:.1%}"}], atol=0.05)
"""


@pytest.mark.parametrize("loss,err,ok", [("3.805", "12.3%", True), ("3.840", "12.3%", True),
                                         ("3.900", "12.3%", False), ("3.805", "12.5%", False)])
def test_tolerant_table(tmp_path, loss, err, ok):
    md = f"| steps | loss | error |\n|---|---|---|\n| 300 | {loss} | {err} |"
    out = nbformat.v4.new_output("execute_result", data={"text/markdown": md, "text/plain": md},
                                 metadata={TOL: {"rtol": 0.0, "atol": 0.05}}, execution_count=1)
    r = _nbval(tmp_path, _notebook(TABLE_CODE, [out]))
    assert (r.returncode == 0) is ok, r.stdout[-2000:]


# ------------------------------------------------------------------ the helpers themselves

def test_text_close_rules():
    close = plugin.text_close
    assert close("loss 3.81 after 300 steps", "loss  3.79 after 300 steps", 0.01, 0) is None
    assert "integer" in close("loss 3.81 after 301 steps", "loss 3.81 after 300 steps", 0.5, 0)
    assert "text" in close("loss 3.81 (fp16)", "loss 3.81 (bf16)", 0.5, 0)
    assert close("err 2.9e-07", "err 2.4e-07", 0.1, 0) is not None
    assert close("err 2.9e-07", "err 2.4e-07", 0.25, 0) is None
    assert close("x nan", "x nan", 0, 0) is None and close("x nan", "x 1.0", 1, 1) is not None
    assert plugin._last_digit("0.027") == pytest.approx(1e-3)
    assert plugin._last_digit("2.9e-07") == pytest.approx(1e-8)
    assert plugin._last_digit("1,234.5") == pytest.approx(0.1)


def test_glue_records_tolerance_and_raw_value():
    outs = _kernel_output("from coursekit import glue\n"
                          "glue('a', 0.123456, fmt='.2f', rtol=0.1)\n"
                          "glue('b', 16)\n"
                          "glue('c', 0.5)\n")
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
    """``(notebook glob, key glob)`` pairs of tests/exact_glue.txt (``# why`` comments allowed)."""
    pairs = []
    for line in (ROOT / "tests/exact_glue.txt").read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            nb, _, keys = line.partition(":")
            pairs += [(nb.strip(), k) for k in keys.split()]
    return pairs


def glued_floats(nb) -> list[tuple[str, bool]]:
    """``(key, has_tolerance)`` for every glued value of ``nb`` that is a float (by type or text)."""
    out = []
    for cell in nb.cells:
        for o in cell.get("outputs", []) if cell.cell_type == "code" else []:
            meta = o.get("metadata") or {}
            name = (meta.get("scrapbook") or {}).get("name")
            text = (o.get("data") or {}).get(GLUE_MIME)
            if name is None or text is None:
                continue
            tol = meta.get(TOL) or {}
            is_float = tol.get("float") or "value" in tol or (
                FLOAT_TEXT.match(text.strip()) and re.search(r"[.eE%]", text))
            if is_float:
                out.append((name, "rtol" in tol or "atol" in tol))
    return out


@pytest.mark.parametrize("path", all_notebooks(), ids=lambda p: p.name)
def test_every_glued_float_is_exact_or_tolerant(path):
    nb = nbformat.read(path, as_version=4)
    rel = str(path.relative_to(ROOT))
    registry = [k for n, k in _exact_registry() if fnmatch.fnmatch(rel, n)]
    loose = [key for key, tolerant in glued_floats(nb)
             if not tolerant and not any(fnmatch.fnmatch(key, k) for k in registry)]
    assert not loose, (
        f"{rel}: glued floats with neither a tolerance nor an entry in tests/exact_glue.txt: "
        f"{', '.join(loose)}. A measured number declares glue(..., rtol=...); an exact one "
        "(derived from exact inputs only) is listed there with the reason.")


def test_exact_registry_names_existing_keys():
    """A stale entry in tests/exact_glue.txt (the key is gone or became tolerant) is reported."""
    floats = {}
    for p in all_notebooks():
        floats[str(p.relative_to(ROOT))] = dict(glued_floats(nbformat.read(p, as_version=4)))
    stale = []
    for nb_glob, key in _exact_registry():
        hits = [k for rel, keys in floats.items() if fnmatch.fnmatch(rel, nb_glob)
                for k, tolerant in keys.items() if fnmatch.fnmatch(k, key) and not tolerant]
        if not hits:
            stale.append(f"{nb_glob}: {key}")
    assert not stale, "entries in tests/exact_glue.txt that match no untoleranced glued float: " + json.dumps(stale)
