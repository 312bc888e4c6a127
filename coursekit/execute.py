"""Re-execute notebooks in place so their stored outputs are fresh (``make nb NB=...``).

Outputs are produced the way nbval will check them: a fresh kernel whose environment is
:func:`kernel_env` — ``COURSE_GPU=auto`` with every GPU hidden
(``CUDA_VISIBLE_DEVICES=""``), so GPU cells store their skip line even on a machine with
a GPU; one BLAS/OpenMP thread; ``PYTHONHASHSEED=0`` — and the notebook's own folder as
working directory. The environment is handed to the kernel; the calling process's
``os.environ`` is never changed. Widget state is dropped from the metadata so the HTML
book never pulls the widget manager from a CDN.
"""

from __future__ import annotations

import os
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


def execute_notebook(
    path: str | Path, timeout: int = 600, env: dict | None = None, write: bool = True
) -> float:
    """Execute ``path`` in a fresh kernel; write outputs back when ``write``. Returns
    seconds.

    ``env`` overrides entries of :func:`kernel_env` for this kernel only."""
    from nbclient import NotebookClient

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"notebook not found: {path}")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # malformed JSON or not a notebook
        raise ValueError(f"{path} is not a readable notebook: {e}") from e
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    t0 = time.perf_counter()
    client.execute(env=kernel_env(env))
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
