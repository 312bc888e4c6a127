"""The validation itself is tested: a worked number that no longer matches its code fails nbval."""
import subprocess
import sys

import nbformat
import pytest

from tests.notebooks import ROOT


def _notebook(stored_text: str):
    nb = nbformat.v4.new_notebook()
    code = "from coursekit import glue\nglue('bytes_per_param', 2 + 2 + 4 + 4 + 4)"
    cell = nbformat.v4.new_code_cell(code, execution_count=1)
    cell.outputs = [nbformat.v4.new_output(
        "display_data", data={"application/papermill.record/text/plain": stored_text},
        metadata={"scrapbook": {"name": "bytes_per_param", "mime_prefix": "application/papermill.record/"}})]
    nb.cells = [nbformat.v4.new_markdown_cell("每参数 {glue:}`bytes_per_param` 字节"), cell]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.mark.parametrize("stored,ok", [("16", True), ("18", False)])
def test_glued_number_is_compared(tmp_path, stored, ok):
    path = tmp_path / "worked_number.ipynb"
    nbformat.write(_notebook(stored), path)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbval", str(path),
                        "--nbval-sanitize-with", str(ROOT / "tests/nbval_sanitize.cfg"), "-p", "tests.nbval_plugin",
                        "--rootdir", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (r.returncode == 0) is ok, r.stdout[-2000:]
    if not ok:
        assert "18" in r.stdout and "16" in r.stdout
