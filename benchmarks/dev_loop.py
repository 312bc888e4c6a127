"""Speed of the maintainer's loop: a printed table, not a timed test.

    .venv/bin/python benchmarks/dev_loop.py [--skip-setup] [--skip-test] [--out
        benchmarks/results/dev_loop.md]

Measures, on this machine:
  * fresh-clone set-up: ``git clone`` + ``make venv`` (pip from the registries / local
    wheels);
  * the full test command (``make test``) in that clone;
  * the book build from stored outputs (``make book`` after ``rm -rf _build``);
  * the slowest five notebooks (each executed in a fresh kernel, outputs not written).
Targets on the 2-core machine: test command ≤ 600 s after set-up, book build ≤ 90 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def timed(cmd: list[str], cwd: Path, env: dict | None = None) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = subprocess.run(
        cmd,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - t0, r.returncode


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--skip-setup",
        action="store_true",
        help="reuse this checkout's .venv instead of a fresh clone",
    )
    ap.add_argument("--skip-test", action="store_true", help="do not time `make test`")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/dev_loop.md"))
    a = ap.parse_args()

    rows: list[tuple[str, str, str, str]] = []
    work = ROOT
    tmp = None
    if not a.skip_setup:
        tmp = tempfile.TemporaryDirectory(prefix="devloop-")
        work = Path(tmp.name) / "clone"
        dt_clone, rc = timed(
            ["git", "clone", "-q", str(ROOT), str(work)], Path(tmp.name)
        )
        dt_venv, rc2 = timed(["make", "venv"], work)
        rows.append(
            (
                "fresh-clone set-up (clone + make venv)",
                f"{dt_clone + dt_venv:.0f}",
                "—",
                "ok" if rc == rc2 == 0 else "FAILED",
            )
        )
    if not a.skip_test:
        dt, rc = timed(["make", "test"], work, {"CI": "true"})
        rows.append(
            (
                "test command (make test)",
                f"{dt:.0f}",
                "600",
                "ok"
                if rc == 0 and dt <= 600
                else ("over target" if rc == 0 else "FAILED"),
            )
        )
    subprocess.run(["rm", "-rf", str(work / "_build")])
    dt, rc = timed(["make", "book"], work)
    rows.append(
        (
            "book build from stored outputs (make book)",
            f"{dt:.0f}",
            "90",
            "ok" if rc == 0 and dt <= 90 else ("over target" if rc == 0 else "FAILED"),
        )
    )

    from coursekit.execute import execute_notebook

    nb_times = []
    for p in sorted((work / "book").glob("*.ipynb")) + sorted(
        (work / "solutions").glob("*.ipynb")
    ):
        nb_times.append((execute_notebook(p, write=False), p.relative_to(work)))
    nb_times.sort(reverse=True)

    lines = ["| step | seconds | target (s) | status |", "|---|---:|---:|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} |" for r in rows]
    lines += ["", "| slowest notebooks | seconds |", "|---|---:|"]
    lines += [f"| {p} | {t:.1f} |" for t, p in nb_times[:5]]
    lines += [
        "",
        f"all notebooks executed serially: {sum(t for t, _ in nb_times):.0f} s "
        f"({len(nb_times)} notebooks)",
    ]
    text = "\n".join(lines)
    print(text)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(
        f"# Dev-loop timings ({os.cpu_count()} cores)\n\n{text}\n", encoding="utf-8"
    )
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
