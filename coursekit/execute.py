"""Re-execute notebooks in place so their stored outputs are fresh (``make nb NB=...``).

Outputs are produced the way nbval will check them: a fresh kernel whose environment is
:func:`kernel_env` — ``COURSE_GPU=auto`` with every GPU hidden
(``CUDA_VISIBLE_DEVICES=""``), so every cell but the GPU cells gives the same output on
any machine; one BLAS/OpenMP thread; ``PYTHONHASHSEED=0``; the Hugging Face Hub
offline — and the notebook's own folder as working directory. The environment is
handed to the kernel; the calling process's ``os.environ`` is never changed. Widget
state is dropped from the metadata so the HTML book never pulls the widget manager
from a CDN.

GPU cells (tag ``gpu``) store a result either way:

* without a CUDA device, ``COURSE_GPU=auto`` runs them on the CPU at small size, and
  their output starts with the label ``coursekit.gpu.CPU_LABEL`` (the HTML book shows
  the run, labelled, never a skip line);
* with one (``gpu="auto"`` finds it, ``gpu="on"`` requires it), the notebook's setup
  cells and GPU cells run once more in a second kernel that sees the GPU
  (``COURSE_GPU=on``), and their outputs replace the GPU cells' outputs. A chapter's
  GPU cells are self-contained (setup imports and library code only), so that second
  kernel needs nothing else; a lab's GPU cell runs the student's own functions, so the
  cells it needs are tagged ``gpu-setup`` and run there too, in order.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat


# : What every stored output is made with, and what nbval checks against (see module
# docstring).
REFERENCE_ENV = {
    "COURSE_GPU": "auto",
    "CUDA_VISIBLE_DEVICES": "",
    "PYTHONHASHSEED": "0",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    # Nothing is downloaded at run time (models are built from configs), so the Hub
    # is never asked: peft's save_pretrained otherwise looks the base model's
    # config.json up online, which with no network cost 23 s per call with the
    # huggingface_hub of the floor versions (its retries) and 0.07 s with today's.
    "HF_HUB_OFFLINE": "1",
}


def kernel_env(overrides: dict | None = None, base: dict | None = None) -> dict:
    """The full environment for a notebook kernel: ``base`` (default: this process's
    environment), then :data:`REFERENCE_ENV`, then ``overrides`` (e.g. ``{"COURSE_GPU":
    "cpu"}``, or another CPU kernel path: ``{"ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE"}``).

    A caller's own ``COURSE_GPU`` is deliberately not inherited: stored outputs are the
    ``auto``-without-GPU form. Pass it in ``overrides`` to run GPU cells.
    """
    env = dict(os.environ if base is None else base)
    env.update(REFERENCE_ENV)
    for k, v in (overrides or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = str(v)
    return env


def clean_metadata(nb: nbformat.NotebookNode) -> None:
    """Drop widget state and execution timing noise from a notebook, in place."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                data.pop("application/vnd.jupyter.widget-view+json", None)


GPU_CHOICES = ("auto", "on", "off")
SETUP_TAGS = {"setup", "colab-setup"}
# Cells a lab's GPU cell needs (the student's functions, the plan): run by the GPU pass.
GPU_SETUP_TAG = "gpu-setup"


def _tags(cell) -> set:
    return set(cell.get("metadata", {}).get("tags", []))


def gpu_cell_indices(nb: nbformat.NotebookNode) -> list[int]:
    """Indices of the code cells tagged ``gpu``."""
    return [
        i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "gpu" in _tags(c)
    ]


def cuda_visible(python: str | None = None) -> bool:
    """True when a kernel started from ``python`` (default: this interpreter, the one
    the ``python3`` kernel of the course's venv runs) would see a CUDA device. Without
    an NVIDIA driver on the machine it answers False at once, without importing
    torch."""
    if not (shutil.which("nvidia-smi") or Path("/dev/nvidia0").exists()):
        return False
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        r = subprocess.run([python or sys.executable, "-c", code], timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def _run(nb, path: Path, timeout: int, env: dict) -> None:
    from coursekit.nbclient import NotebookClient

    NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.resolve())}},
    ).execute(env=env)


def run_gpu_cells_on_cuda(
    nb: nbformat.NotebookNode, path: Path, timeout: int, env: dict | None = None
) -> int:
    """Run ``nb``'s setup and GPU cells in a kernel that sees the GPU
    (``COURSE_GPU=on``) and store their outputs in ``nb``'s GPU cells. Returns how
    many GPU cells were replaced."""
    keep = [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and (SETUP_TAGS | {GPU_SETUP_TAG, "gpu"}) & _tags(c)
    ]
    gpu_ix = gpu_cell_indices(nb)
    if not gpu_ix:
        return 0
    sub = nbformat.v4.new_notebook(
        cells=[nbformat.from_dict(dict(nb.cells[i])) for i in keep],
        metadata=nb.metadata,
    )
    overrides = dict(env or {})
    overrides.update(
        COURSE_GPU="on", CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES")
    )
    _run(sub, path, timeout, kernel_env(overrides))
    for i, c in zip(keep, sub.cells):
        if i in gpu_ix:
            nb.cells[i].outputs = c.outputs
    return len(gpu_ix)


def execute_notebook(
    path: str | Path,
    timeout: int = 600,
    env: dict | None = None,
    write: bool = True,
    gpu: str = "auto",
) -> float:
    """Execute ``path`` in a fresh kernel; write outputs back when ``write``. Returns
    seconds.

    ``env`` overrides entries of :func:`kernel_env` for this kernel only. ``gpu``:
    ``"auto"`` stores the GPU cells' real GPU output when a CUDA device is visible (else
    their labelled CPU small-size run), ``"on"`` requires the device, ``"off"`` always
    stores the CPU run (see the module docstring)."""
    if gpu not in GPU_CHOICES:
        raise ValueError(f"gpu must be one of {'|'.join(GPU_CHOICES)}, got {gpu!r}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"notebook not found: {path}")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # malformed JSON or not a notebook
        raise ValueError(f"{path} is not a readable notebook: {e}") from e
    has_gpu_cells = bool(gpu_cell_indices(nb))
    on_cuda = has_gpu_cells and gpu != "off" and cuda_visible()
    if gpu == "on" and has_gpu_cells and not on_cuda:
        raise ValueError(
            f"{path}: gpu='on' (--gpu on) but no CUDA device is visible to the "
            f"kernel's python ({sys.executable}): install a CUDA build of torch there, "
            "or use "
            "--gpu auto to store the GPU cells' CPU small-size run"
        )
    t0 = time.perf_counter()
    main_env = dict(env or {})
    if on_cuda:  # the GPU cells run on CUDA below: skip their CPU run here
        main_env.setdefault("COURSE_GPU", "off")
    _run(nb, path, timeout, kernel_env(main_env))
    if on_cuda:
        run_gpu_cells_on_cuda(nb, path, timeout, env)
    dt = time.perf_counter() - t0
    clean_metadata(nb)
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    if write:
        nbformat.write(nb, path)
    return dt
