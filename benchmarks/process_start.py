"""Benchmark (not a test): CPU time of the Python processes the grader starts per
submission, against what they cost while the packages imported their exports eagerly.

    .venv/bin/python benchmarks/process_start.py   # 5 starts of each, best kept
    .venv/bin/python benchmarks/process_start.py --repeat 10

Every graded submission starts two processes that import this package first: the
worker (``python -m coursekit.grading.worker``) and, in the sandbox, the kernel
(``python -m coursekit.grading.kernel_main``). ``coursekit`` and ``coursekit.grading``
load their exports on first use, so neither pulls in the notebook helpers
(``coursekit.gpu``, ``coursekit.nb``: torch, until trainmem.reference stopped importing
it) nor jinja2, nbformat and the lab generator (through ``coursekit.grading.core``).
The reference rows import what the packages' ``__init__`` did: measured in the same
run, in turns, so both see the same machine load. CPU time is user + system of the
child (``RUSAGE_CHILDREN``), not wall time: the machine may be shared.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys

ROWS = [
    ("grader worker", "import coursekit.grading.worker"),
    ("sandboxed kernel's entry point", "import coursekit.grading.kernel_main"),
    ("grading CLI (python -m coursekit)", "import coursekit.cli"),
]
# what ``import coursekit`` and ``import coursekit.grading`` imported before
REFERENCE = "import coursekit.gpu, coursekit.nb, coursekit.grading.core"


def cpu_of(code: str) -> float:
    """CPU seconds (user + system) of one ``python -c code``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="starts of each (best kept)")
    args = ap.parse_args(argv)
    best: dict[str, float] = {}
    for _ in range(args.repeat):  # in turns: each row sees the same load
        for name, code in ROWS:
            for key, src in ((name, code), (name + " (ref)", f"{code}; {REFERENCE}")):
                best[key] = min(best.get(key, float("inf")), cpu_of(src))
    print(f"CPU seconds per process start (best of {args.repeat}), {sys.executable}")
    print("| process | now (s) | eager package imports (s) | ratio |")
    print("|---|---:|---:|---:|")
    for name, _ in ROWS:
        now, ref = best[name], best[name + " (ref)"]
        print(f"| {name} | {now:.2f} | {ref:.2f} | {ref / now:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
