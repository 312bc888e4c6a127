"""``make nb`` (coursekit.execute): what a GPU cell stores, with and without a GPU.

Without CUDA a GPU cell stores its labelled CPU small-size run; with CUDA the setup and
GPU cells run again in a kernel that sees the GPU and their outputs replace the GPU
cells' outputs. The second case is exercised with the kernel faked (no GPU here).
"""

import nbformat
import pytest

from coursekit import execute
from coursekit.gpu import CPU_LABEL, ON_GPU_DEFAULT, SKIP_PREFIX

SETUP = "from coursekit import gpu_cell\nprint('setup ran')"
GPU = (
    "# 类型：【Skeleton】需要 GPU\n@gpu_cell\ndef f(device, small):\n"
    "    print(device.type, small)"
)


def _notebook(path, with_gpu=True):
    cells = [
        nbformat.v4.new_code_cell(SETUP, metadata={"tags": ["setup"]}),
        nbformat.v4.new_code_cell("print(1 + 1)"),
    ]
    if with_gpu:
        cells.append(nbformat.v4.new_code_cell(GPU, metadata={"tags": ["gpu"]}))
    nb = nbformat.v4.new_notebook(cells=cells)
    nbformat.write(nb, path)
    return path


def _stream(cell):
    return "".join(o.get("text", "") for o in cell.outputs if "text" in o)


def test_without_cuda_a_gpu_cell_stores_its_labelled_cpu_run(tmp_path, monkeypatch):
    monkeypatch.setattr(execute, "cuda_visible", lambda python=None: False)
    path = _notebook(tmp_path / "nb.ipynb")
    execute.execute_notebook(path, timeout=120)
    nb = nbformat.read(path, as_version=4)
    assert _stream(nb.cells[1]) == "2\n"
    text = _stream(nb.cells[2])
    assert text == CPU_LABEL.format(on_gpu=ON_GPU_DEFAULT) + "\ncpu True\n"
    assert SKIP_PREFIX not in text


def test_with_cuda_the_gpu_cells_store_the_gpu_run(tmp_path, monkeypatch):
    """Main pass: GPU cells off (their GPU run replaces them); second pass: the setup
    and GPU cells only, COURSE_GPU=on and the GPU visible."""
    runs = []

    def fake_run(nb, path, timeout, env):
        runs.append(([c.source for c in nb.cells], env))
        for c in nb.cells:
            gpu_run = env["COURSE_GPU"] == "on"
            out = "GPU OUT" if gpu_run and "gpu_cell\n" in c.source else "cpu out"
            c.outputs = [nbformat.v4.new_output("stream", name="stdout", text=out)]

    monkeypatch.setattr(execute, "cuda_visible", lambda python=None: True)
    monkeypatch.setattr(execute, "_run", fake_run)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    path = _notebook(tmp_path / "nb.ipynb")
    execute.execute_notebook(path)
    (main_src, main_env), (gpu_src, gpu_env) = runs
    assert main_env["COURSE_GPU"] == "off" and main_env["CUDA_VISIBLE_DEVICES"] == ""
    assert gpu_src == [SETUP, GPU]
    assert gpu_env["COURSE_GPU"] == "on" and gpu_env["CUDA_VISIBLE_DEVICES"] == "0"
    nb = nbformat.read(path, as_version=4)
    assert [_stream(c) for c in nb.cells] == ["cpu out", "cpu out", "GPU OUT"]


def test_gpu_on_without_cuda_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(execute, "cuda_visible", lambda python=None: False)
    path = _notebook(tmp_path / "nb.ipynb")
    with pytest.raises(ValueError, match="no CUDA device is visible.*--gpu auto"):
        execute.execute_notebook(path, gpu="on")


def test_unknown_gpu_choice_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="gpu must be one of auto|on|off"):
        execute.execute_notebook(_notebook(tmp_path / "nb.ipynb"), gpu="maybe")


def test_a_notebook_without_gpu_cells_never_looks_for_cuda(tmp_path, monkeypatch):
    def boom(python=None):
        raise AssertionError("cuda_visible called")

    monkeypatch.setattr(execute, "cuda_visible", boom)
    monkeypatch.setattr(execute, "_run", lambda nb, path, timeout, env: None)
    execute.execute_notebook(_notebook(tmp_path / "nb.ipynb", with_gpu=False))


def test_cuda_visible_is_false_without_a_driver(monkeypatch):
    monkeypatch.setattr(execute.shutil, "which", lambda name: None)
    monkeypatch.setattr(execute.Path, "exists", lambda self: False)
    assert execute.cuda_visible() is False
