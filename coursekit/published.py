"""The published real-GPU rows of ``benchmarks/published_gpu.py`` for the book's cells.

The benchmark lives in the repository checkout (``benchmarks/``), not in the installed
packages; :func:`published_results` loads it from there, so a chapter shows the same
rows, estimates and errors as ``benchmarks/results/published_gpu.md``."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "published_gpu.py"


def _module():
    if not SCRIPT.exists():
        raise FileNotFoundError(
            f"{SCRIPT} not found: the published rows need the repository checkout "
            "(git clone), not only the installed packages"
        )
    spec = importlib.util.spec_from_file_location("published_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def published_results() -> tuple[dict, list[dict], list[dict]]:
    """``(data, rows, results)``: the JSON (sources and rows) and, per row, the
    benchmark's comparison (``id``, ``kind``, ``published``, ``estimate``, ``error``
    or, for documented out-of-memory runs, ``ok``)."""
    mod = _module()
    data = json.loads(Path(mod.DATA).read_text(encoding="utf-8"))
    return data, data["rows"], mod.compare(data["rows"])


def row_estimate(row: dict):
    """The estimator's :class:`~trainmem.estimate.MemoryEstimate` of one row, with the
    options the benchmark derives from its conditions."""
    from trainmem.estimate import estimate

    return estimate(row["model"], **_module().row_options(row))
