"""Re-execute notebooks in place so their stored outputs are fresh (``make nb NB=...``).

Outputs are produced the way nbval will check them: a fresh kernel, ``COURSE_GPU=auto`` (on a
machine without CUDA that means GPU cells print the skip line), ``PYTHONHASHSEED=0``, the
notebook's own folder as working directory. Widget state is dropped from the metadata so the
HTML book never pulls the widget manager from a CDN.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import nbformat


def clean_metadata(nb: nbformat.NotebookNode) -> None:
    """Drop widget state and execution timing noise from a notebook, in place."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
        if cell.cell_type == "code":
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                data.pop("application/vnd.jupyter.widget-view+json", None)


def execute_notebook(path: str | Path, timeout: int = 600, env: dict | None = None,
                     write: bool = True) -> float:
    """Execute ``path`` in a fresh kernel; write outputs back when ``write``. Returns seconds."""
    from nbclient import NotebookClient

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"notebook not found: {path}")
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception as e:  # malformed JSON or not a notebook
        raise ValueError(f"{path} is not a readable notebook: {e}") from e
    old_env = dict(os.environ)
    os.environ.setdefault("COURSE_GPU", "auto")
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ.update(env or {})
    try:
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(path.parent.resolve())}})
        t0 = time.perf_counter()
        client.execute()
        dt = time.perf_counter() - t0
    finally:
        os.environ.clear()
        os.environ.update(old_env)
    clean_metadata(nb)
    nb.metadata["kernelspec"] = {"display_name": "Python 3", "language": "python", "name": "python3"}
    if write:
        nbformat.write(nb, path)
    return dt
