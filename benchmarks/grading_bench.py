"""Benchmark (not a test): grade N copies of a lab with ``--jobs J`` and print wall
times as a table.

    .venv/bin/python benchmarks/grading_bench.py # 30 copies of lab01, --jobs 2
    .venv/bin/python benchmarks/grading_bench.py --lab lab02 --copies 10 --jobs 1 2

Half the copies are the reference solution, half the untouched generated lab (so both
the full-marks and the all-NotImplementedError paths are timed). A second run over the
same folder shows the cache (nothing changed → nothing regraded). Uses the real command
line: ``python -m coursekit grade``.

The second table is the sandbox's cost: the same folder graded with the bubblewrap
sandbox and with ``--no-sandbox``, taking turns (``--rounds`` each, fastest kept), so
both see the same machine load; target: the sandbox adds at most 10 %.
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(
    lab: str, subs: Path, out: Path, jobs: int, force: bool, sandboxed: bool = True
) -> float:
    cmd = (
        [
            sys.executable,
            "-m",
            "coursekit",
            "grade",
            "--lab",
            lab,
            str(subs),
            "--out",
            str(out),
            "--jobs",
            str(jobs),
        ]
        + (["--force"] if force else [])
        + ([] if sandboxed else ["--no-sandbox"])
    )
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def ok_count(out: Path) -> int:
    return [
        r["status"]
        for r in csv.DictReader((out / "grades.csv").open())
        if r["student"] != "MAX"
    ].count("ok")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lab", default="lab01")
    ap.add_argument("--copies", type=int, default=30)
    ap.add_argument("--jobs", type=int, nargs="+", default=[2])
    ap.add_argument(
        "--rounds", type=int, default=2, help="sandboxed/unsandboxed turns each"
    )
    args = ap.parse_args()
    from coursekit.grading import sandbox

    why = sandbox.unavailable()
    sol = next((ROOT / "solutions").glob(f"{args.lab}_*.ipynb"))
    lab = ROOT / "labs" / sol.name
    rows = []
    with tempfile.TemporaryDirectory(prefix="grading-bench-") as tmp:
        subs = Path(tmp) / "subs"
        subs.mkdir()
        for i in range(args.copies):
            shutil.copy(sol if i % 2 == 0 else lab, subs / f"student{i:03d}.ipynb")
        for jobs in args.jobs:
            out = Path(tmp) / f"out{jobs}"
            wall = run(args.lab, subs, out, jobs, force=True)
            cached = run(args.lab, subs, out, jobs, force=False)
            statuses = [
                r["status"]
                for r in csv.DictReader((out / "grades.csv").open())
                if r["student"] != "MAX"
            ]
            rows.append((jobs, wall, cached, statuses.count("ok")))
        cost = []
        if why is None:
            jobs = args.jobs[0]
            best = {True: float("inf"), False: float("inf")}
            oks = {True: [], False: []}
            for r in range(args.rounds):
                for sandboxed in (False, True) if r % 2 == 0 else (True, False):
                    out = Path(tmp) / f"cost-{sandboxed}"
                    t = run(args.lab, subs, out, jobs, True, sandboxed)
                    best[sandboxed] = min(best[sandboxed], t)
                    oks[sandboxed].append(ok_count(out))
            cost = [(jobs, best[False], best[True], min(oks[False]), min(oks[True]))]
    print(
        f"grading benchmark: {args.copies} copies of {args.lab} "
        f"({args.copies - args.copies // 2} solutions + "
        f"{args.copies // 2} untouched labs); {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}"
    )
    print()
    print(
        "| jobs | submissions | wall time (s) | s / submission | submissions / min | "
        "status ok | cached re-run (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for jobs, wall, cached, ok in rows:
        print(
            f"| {jobs} | {args.copies} | {wall:.1f} | {wall / args.copies:.2f} | "
            f"{60 * args.copies / wall:.1f} | "
            f"{ok}/{args.copies} | {cached:.1f} |"
        )
    print()
    if why is not None:
        print(f"sandbox cost not measured: {why}")
        return 0
    print(
        f"sandbox cost: the same {args.copies} submissions, --jobs {args.jobs[0]}, "
        f"sandboxed and --no-sandbox taking turns, fastest of {args.rounds} each"
    )
    print()
    print(
        "| jobs | s / submission, --no-sandbox | s / submission, sandboxed | ratio | "
        "status ok (worst round), --no-sandbox / sandboxed |"
    )
    print("|---:|---:|---:|---:|---:|")
    for jobs, plain, boxed, ok_plain, ok_boxed in cost:
        print(
            f"| {jobs} | {plain / args.copies:.2f} | {boxed / args.copies:.2f} | "
            f"{boxed / plain:.3f} | {ok_plain}/{args.copies} / "
            f"{ok_boxed}/{args.copies} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
