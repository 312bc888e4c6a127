"""``grade()``: one grading run over a folder of submissions (the ``grade`` command
calls it)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from . import cache
from .api import load_tests
from .report import total, write_outputs
from .runner import grade_one, new_record
from .scoring import prepare
from .submissions import discover


def grade(
    lab: str,
    submissions: str | Path,
    out: str | Path,
    *,
    jobs: int = 1,
    force: bool = False,
    tests_dir: str | Path | None = None,
    seed: int | None = None,
    cell_timeout: float | None = None,
    notebook_timeout: float | None = None,
    probe_timeout: float | None = None,
    memory_mb: int | None = None,
    gpu: str = "off",
    log: Callable[[str], None] | None = print,
) -> list[dict]:
    """Grade every submission of ``lab``; write grades.csv + feedback/; return the
    records (sorted by student). ``seed`` defaults to :attr:`LabTests.default_seed`."""
    if tests_dir is None:
        from ..labs import find_root

        tests_dir = find_root() / "tests" / "grading"
    tests = load_tests(lab, tests_dir)
    if jobs < 1:
        raise ValueError(f"--jobs must be ≥ 1, got {jobs}")
    if seed is not None and not 0 <= seed < 2**63:
        raise ValueError(f"--seed must be an integer in [0, 2**63), got {seed}")
    settings = {
        "cell_timeout": cell_timeout or tests.cell_timeout,
        "notebook_timeout": notebook_timeout or tests.notebook_timeout,
        "probe_timeout": probe_timeout or tests.probe_timeout,
        "memory_mb": memory_mb or tests.memory_mb,
        "gpu": gpu,
        "seed": tests.default_seed if seed is None else seed,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    subs = discover(submissions, tests.notebook)
    old = cache.load(out)
    records: dict[str, dict] = {}
    keys = {s.student: cache.key(s, tests.digest, settings) for s in subs}
    todo = []
    for s in subs:
        hit = None if force else cache.hit(old, s.student, keys[s.student])
        if hit is not None:
            records[s.student] = hit
        else:
            todo.append(s)
    if log:
        log(
            f"{lab}: {len(subs)} submissions, {len(todo)} to grade, "
            f"{len(subs) - len(todo)} unchanged (cached); seed {settings['seed']}"
        )
    prepared = prepare(tests, settings["seed"]) if todo else []

    def work(sub):
        t0 = time.perf_counter()
        try:
            rec = grade_one(sub, prepared, settings)
        except Exception as e:  # never let one submission stop the run
            rec = new_record(sub, prepared, settings["seed"])
            rec.update(status="grader_error", message=repr(e)[:3000])
        if log:
            log(
                f"  {sub.student:<24} {total(rec):>6g} / {tests.max_points:g}  "
                f"{rec['status']:<12} {time.perf_counter() - t0:5.1f} s"
            )
        return sub.student, rec

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for student, rec in pool.map(work, todo):
            records[student] = rec
    # Everything below is written from this process's memory, after every worker is
    # gone, so files a submission wrote into OUT_DIR while it ran are overwritten or
    # removed.
    ordered = [records[s.student] for s in subs]
    write_outputs(
        out,
        ordered,
        tests,
        cache.dumps(keys, records),
        cache.CACHE_NAME,
        Path(submissions).resolve(),
    )
    return ordered
