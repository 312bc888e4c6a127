"""Wall time of each stage of ``make test``, printed at the end.

As a pytest plugin (``-p tests.stages``) it sorts every test into a stage by its node
id, and appends, per stage, the number of tests, the summed test time (setup + call +
teardown, across all workers) and the wall-clock span from the first test's start to
the last one's end to the JSON-lines file named by ``COURSE_STAGE_LOG``; per test file
it appends the same (a ``file`` record, with the xdist worker that ran it), so the
slowest files and each worker's load can be read after a run. The Makefile adds its own
steps (kernel probe, floor pass) with ``python -m tests.stages add``, and
``python -m tests.stages show`` prints the table and the slowest files.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# First match wins: (stage, node-id prefix or file name).
STAGES = (
    ("nbval: chapters", ("book/",)),
    ("nbval: solutions", ("solutions/",)),
    ("grader and sandbox", ("tests/test_grader.py", "tests/test_sandbox")),
    ("labs", ("tests/test_labs.py", "tests/test_hints.py")),
    ("book build and browser", ("tests/test_site.py",)),
    ("calculator (browser)", ("tests/test_calculator.py",)),
    ("floor versions", ("tests/test_floor.py",)),
)
OTHER = "unit tests"
# nbval runs GPU cells at CPU size in place (tests/nbval_plugin.py, which marks them
# with a user property): their own row, cut out of their notebook's stage
GPU_CELLS = "GPU cells (in nbval, COURSE_GPU=cpu)"


def stage_of(nodeid: str, properties=()) -> str:
    from tests.nbval_plugin import GPU_IGNORE_REASON, IGNORE_REASON

    # (xdist sends a worker's user properties as lists)
    if any(tuple(p) == (IGNORE_REASON, GPU_IGNORE_REASON) for p in properties or ()):
        return GPU_CELLS
    for stage, prefixes in STAGES:
        if nodeid.startswith(prefixes):
            return stage
    return OTHER


class _Recorder:
    def __init__(self, log: Path):
        self.log = log
        self.rows: dict[str, dict] = {}
        self.files: dict[str, dict] = {}

    @staticmethod
    def _fold(row: dict, report) -> None:
        if report.when == "call":
            row["tests"] += 1
        row["busy"] += report.duration
        start = getattr(report, "start", None)
        stop = getattr(report, "stop", None)
        if start is not None and stop is not None:
            row["start"] = min(row["start"], start)
            row["stop"] = max(row["stop"], stop)

    def pytest_runtest_logreport(self, report):
        new = {"tests": 0, "busy": 0.0, "start": float("inf"), "stop": 0.0}
        stage = stage_of(report.nodeid, getattr(report, "user_properties", ()))
        self._fold(self.rows.setdefault(stage, dict(new)), report)
        file = self.files.setdefault(report.nodeid.split("::")[0], dict(new))
        gateway = getattr(getattr(report, "node", None), "gateway", None)
        file["worker"] = getattr(gateway, "id", "main")  # "main" without xdist
        self._fold(file, report)

    def pytest_sessionfinish(self, session):
        with self.log.open("a") as f:
            for stage, row in self.rows.items():
                if not row["tests"]:
                    continue  # only skipped here (the floor tests outside make floor)
                span = max(0.0, row["stop"] - row["start"])
                rec = {"stage": stage, "tests": row["tests"], "busy": row["busy"]}
                f.write(json.dumps({**rec, "wall": span}) + "\n")
            for name, row in self.files.items():
                if not row["tests"] or row["start"] == float("inf"):
                    continue
                rec = {k: row[k] for k in ("tests", "busy", "start", "stop", "worker")}
                f.write(json.dumps({"file": name, **rec}) + "\n")


def pytest_configure(config):
    log = os.environ.get("COURSE_STAGE_LOG")
    # Only the controlling process records (xdist workers send it their reports).
    if log and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_Recorder(Path(log)), "course-stage-recorder")


def _add(log: Path, stage: str, seconds: float) -> None:
    with log.open("a") as f:
        f.write(json.dumps({"stage": stage, "wall": seconds, "busy": seconds}) + "\n")


def show(log: Path, top: int = 12) -> str:
    rows: dict[str, dict] = {}
    files: list[dict] = []
    for line in log.read_text().splitlines():
        rec = json.loads(line)
        if "file" in rec:
            files.append(rec)
            continue
        row = rows.setdefault(rec["stage"], {"tests": 0, "busy": 0.0, "wall": 0.0})
        row["tests"] += rec.get("tests", 0)
        row["busy"] += rec["busy"]
        row["wall"] += rec["wall"]
    out = [
        "| stage | tests | wall (s) | test time, all workers (s) |",
        "|---|---:|---:|---:|",
    ]
    for stage, row in rows.items():
        tests = row["tests"] or ""
        out.append(f"| {stage} | {tests} | {row['wall']:.0f} | {row['busy']:.0f} |")
    if files:
        t0 = min(r["start"] for r in files)
        out += [
            "",
            f"slowest {min(top, len(files))} test files (seconds from the first test's "
            "start, main pass):",
            "| file | worker | tests | start | end | test time (s) |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for r in sorted(files, key=lambda r: -r["busy"])[:top]:
            out.append(
                f"| {r['file']} | {r['worker']} | {r['tests']} | {r['start'] - t0:.0f} "
                f"| {r['stop'] - t0:.0f} | {r['busy']:.0f} |"
            )
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "show":
        print(show(Path(argv[1])))
        return 0
    if len(argv) == 4 and argv[0] == "add":
        _add(Path(argv[1]), argv[2], float(argv[3]))
        return 0
    if len(argv) >= 3 and argv[0] == "since":
        # since LOG STAGE START_EPOCH: add a stage that began at START_EPOCH
        _add(Path(argv[1]), argv[2], time.time() - float(argv[3]))
        return 0
    print(
        "usage: python -m tests.stages show LOG | add LOG STAGE SECONDS | "
        "since LOG STAGE START_EPOCH",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
