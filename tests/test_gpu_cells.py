"""GPU cells (DESIGN.md §4–5): visibly labelled, and run once with COURSE_GPU=cpu.

The stored outputs (checked by nbval) come from COURSE_GPU=auto on a machine without CUDA, where a
GPU cell prints one skip line. Here every notebook's ``setup`` cell plus its ``gpu`` cells run in a
fresh kernel with COURSE_GPU=cpu, so the real GPU code is executed at its smallest size.
"""
import nbformat
import pytest

from coursekit.execute import kernel_env
from coursekit.gpu import OFF_LINE, SKIP_LINE
from tests.notebooks import all_notebooks, tags

LABEL = "【Skeleton】需要 GPU"


def _gpu_notebooks():
    out = []
    for p in all_notebooks():
        nb = nbformat.read(p, as_version=4)
        if any("gpu" in tags(c) for c in nb.cells):
            out.append(p)
    return out


@pytest.mark.parametrize("path", all_notebooks(), ids=lambda p: p.name)
def test_gpu_cells_are_labelled_and_tagged(path):
    nb = nbformat.read(path, as_version=4)
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        uses = "@gpu_cell" in c.source
        tagged = "gpu" in tags(c)
        assert uses == tagged, f"{path.name} cell {i}: '@gpu_cell' and the 'gpu' tag must go together"
        if tagged:
            assert LABEL in c.source.splitlines()[0], f"{path.name} cell {i}: first line must carry {LABEL}"


@pytest.mark.parametrize("path", _gpu_notebooks(), ids=lambda p: p.name)
def test_gpu_cells_run_on_cpu(path, tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    keep = [c for c in nb.cells if c.cell_type == "code" and ({"setup", "gpu"} & set(tags(c)))]
    assert any("setup" in tags(c) for c in keep), f"{path.name}: no cell tagged 'setup'"
    sub = nbformat.v4.new_notebook(cells=keep, metadata=nb.metadata)
    NotebookClient(sub, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute(
        env=kernel_env({"COURSE_GPU": "cpu"}))   # the kernel's environment, not ours
    for c in sub.cells:
        if "gpu" not in tags(c):
            continue
        text = "".join(o.get("text", "") for o in c.outputs if o.get("output_type") == "stream")
        assert SKIP_LINE not in text and OFF_LINE not in text, f"{path.name}: a GPU cell was skipped under COURSE_GPU=cpu"
