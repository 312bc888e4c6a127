"""``python -m coursekit labs [--check]`` and ``python -m coursekit grade ...``
(registered by cli.py)."""

from __future__ import annotations

import argparse
import sys


def _cmd_labs(args: argparse.Namespace) -> int:
    from .labs import generate

    changed = generate(args.root, check=args.check)
    if args.check:
        if changed:
            print(
                "labs/ is out of date (run `python -m coursekit labs`):",
                file=sys.stderr,
            )
            for c in changed:
                print(f"  {c}", file=sys.stderr)
            return 1
        print("labs/ is up to date")
        return 0
    for c in changed:
        print(f"wrote {c}")
    if not changed:
        print("labs/ already up to date")
    return 0


def _cmd_grade(args: argparse.Namespace) -> int:
    from .grading import grade
    from .grading.core import merge

    if args.merge:
        if args.shard:
            raise ValueError("--merge and --shard exclude each other")
        done = merge(args.lab, args.submissions, args.out)
        print(
            f"merged {done['shards']} shards: {done['students']} students → "
            f"{args.out}/grades.csv and {args.out}/feedback/"
        )
        return 0
    if len(args.submissions) != 1:
        raise ValueError(
            "give one submissions folder (several folders only with --merge)"
        )
    records = grade(
        args.lab,
        args.submissions[0],
        args.out,
        jobs=args.jobs,
        force=args.force,
        tests_dir=args.tests,
        seed=args.seed,
        cell_timeout=args.cell_timeout,
        notebook_timeout=args.notebook_timeout,
        probe_timeout=args.probe_timeout,
        memory_mb=args.memory_mb,
        gpu=args.gpu,
        sandboxed=not args.no_sandbox,
        shard=args.shard,
    )
    print(
        f"wrote {args.out}/grades.csv and {len(records)} feedback pages in "
        f"{args.out}/feedback/"
    )
    bad = [r for r in records if r["status"] == "grader_error"]
    if bad:
        print(
            "grader errors for: " + ", ".join(r["student"] for r in bad),
            file=sys.stderr,
        )
    return 0 if not bad else 3


def register(sub) -> None:
    """Add the ``labs`` and ``grade`` sub-commands to coursekit's CLI."""
    p = sub.add_parser(
        "labs", help="generate labs/ from solutions/ (--check: fail if labs/ is stale)"
    )
    p.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 naming stale labs"
    )
    p.add_argument(
        "--root", default=None, help="repository root (default: found from the cwd)"
    )
    p.set_defaults(func=_cmd_labs)

    g = sub.add_parser(
        "grade",
        help="grade a folder of submitted lab notebooks → grades.csv + feedback/",
    )
    g.add_argument(
        "--lab",
        required=True,
        help="lab id, e.g. lab01 (hidden tests: tests/grading/lab01.py)",
    )
    g.add_argument(
        "submissions",
        nargs="+",
        help="folder of <student>.ipynb files or <student>/ folders (with --merge: "
        "the output folders of every shard)",
    )
    g.add_argument(
        "--out", required=True, help="output folder (grades.csv, feedback/, cache)"
    )
    g.add_argument(
        "--jobs", type=int, default=1, help="submissions graded in parallel (default 1)"
    )
    g.add_argument(
        "--force", action="store_true", help="regrade everything, ignoring the cache"
    )
    g.add_argument(
        "--tests", default=None, help="folder of hidden tests (default: tests/grading)"
    )
    g.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the random inputs (default: fixed by the lab and its hidden "
        "tests)",
    )
    g.add_argument(
        "--cell-timeout", type=float, default=None, help="seconds per student cell"
    )
    g.add_argument(
        "--notebook-timeout", type=float, default=None, help="seconds per submission"
    )
    g.add_argument(
        "--probe-timeout", type=float, default=None, help="seconds per hidden test"
    )
    g.add_argument(
        "--memory-mb",
        type=int,
        default=None,
        help="resident-memory cap of the kernel's process tree (MiB); over it the "
        "kernel is stopped with status memory_limit",
    )
    g.add_argument(
        "--no-sandbox",
        action="store_true",
        help="run the kernels without bubblewrap (warned on the terminal, in "
        "grades.csv and on every feedback page)",
    )
    g.add_argument(
        "--shard",
        default=None,
        metavar="I/N",
        help="grade only shard I of N (a fixed share of the students by name hash); "
        "join the N output folders with --merge",
    )
    g.add_argument(
        "--merge",
        action="store_true",
        help="join the output folders of grade --shard 1/N … N/N into --out",
    )
    g.add_argument(
        "--gpu",
        default="off",
        choices=["off", "cpu", "auto", "on"],
        help="COURSE_GPU inside the kernels (default off: GPU cells are skipped)",
    )
    g.set_defaults(func=_cmd_grade)
