"""``grade()``: one grading run over a folder of submissions (the ``grade`` command
calls it); ``--shard i/n`` grades a deterministic share, :func:`merge` joins the shards.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import encodings.unicode_escape  # noqa: F401  (a codec found lazily while grading)
import jinja2  # noqa: F401  (the feedback pages': imported before any kernel runs)

from ..labs import find_root
from . import cache, cgroup, files, sandbox
from .api import load_tests
from .report import SHARD_NAME, atomic_write, total, write_outputs
from .runner import grade_one, new_record
from .scoring import prepare
from .submissions import discover

CGROUP_WARNING = (
    "WARNING: {why}; each kernel's memory and processes are sampled by a watchdog "
    "instead (tmpfs and shared memory are not counted; a busy machine can make a "
    "classmate time out); grades.csv's limits column says 'sampled'"
)


def shown(text: str) -> str:
    """A name as the terminal may print it: control characters (escape sequences,
    carriage returns) written as escapes, never sent raw."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text))


def class_seed(out: Path, seed: int | None) -> int:
    """``seed`` when given; else the class's secret: drawn (``secrets``) on the first
    run into ``out`` and kept there (``.grade_seed``), so a regrade uses the same
    hidden inputs; nothing in the repository determines it."""
    path = out / cache.SEED_NAME
    if seed is not None:
        return seed
    try:
        text = files.read_regular(path, 100).decode().strip()
        value = int(text)
        if 0 <= value < 2**63:
            return value
        raise ValueError(text)
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        raise ValueError(
            f"{path} does not hold a seed ({e}); delete it to draw a new one (every "
            "submission is then graded again) or pass --seed"
        ) from None
    value = secrets.randbelow(2**63)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{value}\n")
    return value


NO_SANDBOX_WARNING = (
    "WARNING: grading WITHOUT a sandbox (--no-sandbox): every submission runs with "
    "your user's rights and can read, change or delete your files; grades.csv and "
    "every feedback page say so"
)


class SandboxUnavailable(ValueError):
    """No sandbox can be had here and --no-sandbox was not given (one line: the fix)."""


def parse_shard(text: str | None) -> tuple[int, int] | None:
    """ "i/n" → (i, n) with 1 ≤ i ≤ n; None → None."""
    if text is None:
        return None
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like 2/8, got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard {text}: need 1 ≤ i ≤ n")
    return i, n


def shard_of(student: str, n: int) -> int:
    """The shard (1..n) a student belongs to: a hash of the name, so it does not move
    when classmates are added or removed."""
    return int(hashlib.sha256(student.encode()).hexdigest()[:12], 16) % n + 1


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every regular file under the submissions folder (relative path →
    digest); a symlink, FIFO, device or socket is named, never opened or followed."""
    return files.snapshot(root)


def changed_files(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(
        k for k in before.keys() | after.keys() if before.get(k) != after.get(k)
    )


def _check_layout(subs: Path, out: Path, tests_dir: Path, use_sandbox: bool) -> None:
    """The grader never writes into the submissions; with a sandbox, no folder the
    kernel must not see may lie inside one it sees."""
    s, o = os.path.realpath(subs), os.path.realpath(out)
    if o == s or o.startswith(s + os.sep):
        raise ValueError(f"--out {out} lies inside the submissions folder {subs}")
    if s.startswith(o + os.sep):
        raise ValueError(f"the submissions folder {subs} lies inside --out {out}")
    if use_sandbox:
        seen = sandbox.visible_paths()
        for what, path in (
            ("the hidden tests", tests_dir),
            ("the submissions folder", subs),
            ("the output folder", out),
        ):
            hit = sandbox.inside(path, seen)
            if hit:
                raise ValueError(
                    f"{what} ({path}) overlaps {hit}, which every sandboxed kernel "
                    "can read; move it elsewhere"
                )


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
    disk_mb: int = 512,
    gpu: str = "off",
    sandboxed: bool = True,
    shard: str | tuple[int, int] | None = None,
    log: Callable[[str], None] | None = print,
) -> list[dict]:
    """Grade every submission of ``lab``; write grades.csv + feedback/; return the
    records (sorted by student). ``seed`` defaults to the class's secret
    (:func:`class_seed`: drawn on the first run into ``out``, reused after).
    ``sandboxed=False`` runs the kernels without bubblewrap (a warning everywhere);
    ``shard=(i, n)`` grades only the students of shard i (see :func:`merge`).
    ``disk_mb``: the largest file a kernel may write and the size of its /tmp."""
    if sandboxed and (why := sandbox.unavailable()):
        raise SandboxUnavailable(why)
    if tests_dir is None:
        tests_dir = find_root() / "tests" / "grading"
    shard = parse_shard(shard) if isinstance(shard, str) or shard is None else shard
    _check_layout(Path(submissions), Path(out), Path(tests_dir), sandboxed)
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
        "disk_mb": int(disk_mb),
        "gpu": gpu,
        "sandbox": bool(sandboxed),
    }
    if shard is not None and seed is None:
        raise ValueError(
            "--shard needs --seed: every shard must draw the same hidden inputs "
            "(keep the number secret, e.g. a CI secret)"
        )
    if not sandboxed and log:
        log(NO_SANDBOX_WARNING)
    if sandboxed and not (why := cgroup.available()):
        settings["limits"] = f"cgroup {cgroup.parent().kind}"
    else:
        settings["limits"] = "sampled"
        if sandboxed and log:
            log(CGROUP_WARNING.format(why=why))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings["seed"] = class_seed(out, seed)
    subs = discover(submissions, tests.notebook)
    if shard is not None:
        subs = [s for s in subs if shard_of(s.student, shard[1]) == shard[0]]
    before = snapshot(Path(submissions))
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
            f"{len(subs) - len(todo)} unchanged (cached); "
            + ("secret seed of this class" if seed is None else f"seed {seed}")
            + f"; limits: {settings['limits']}"
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
                f"  {shown(sub.student):<24} {total(rec):>6g} / {tests.max_points:g}  "
                f"{rec['status']:<12} {time.perf_counter() - t0:5.1f} s"
            )
        return sub.student, rec

    try:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for student, rec in pool.map(work, todo):
                records[student] = rec
    finally:
        cgroup.cleanup_parent()
    changed = changed_files(before, snapshot(Path(submissions)))
    for f in changed:
        who = Path(f).parts[0]
        who = who[:-6] if who.endswith(".ipynb") else who
        msg = f"警告：提交的文件 {f} 在评分过程中被改动或删除（评分器从不写提交文件夹）"
        if log:
            log(f"WARNING: submission file {shown(f)} changed during the grading run")
        for rec in records.values():
            if rec["student"] == who or Path(rec.get("file") or "/").name == f:
                rec["message"] = (msg + " " + rec.get("message", "")).strip()
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
        shard_info=None
        if shard is None
        else {
            "lab": lab,
            "shard": shard[0],
            "of": shard[1],
            "seed": settings["seed"],
            "tests": tests.digest,
            "students": [s.student for s in subs],
        },
    )
    return ordered


def merge(lab: str, shard_dirs: list[str | Path], out: str | Path) -> dict:
    """Join the outputs of ``grade --shard i/n`` (one folder per shard, all n present)
    into one grades.csv, one feedback/ folder and one cache in ``out``."""
    infos = []
    for d in map(Path, shard_dirs):
        try:
            info = json.loads((d / SHARD_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise ValueError(f"{d} is not the output of grade --shard ({e})") from None
        if info.get("lab") != lab:
            raise ValueError(f"{d} holds grades of {info.get('lab')}, not {lab}")
        infos.append((d, info))
    ns = {i["of"] for _, i in infos}
    if len(ns) != 1:
        raise ValueError(f"shards of different splits: /{sorted(ns)}")
    n = ns.pop()
    got = sorted(i["shard"] for _, i in infos)
    if got != list(range(1, n + 1)):
        missing = sorted(set(range(1, n + 1)) - set(got))
        raise ValueError(
            f"need each shard 1..{n} exactly once, got {got}"
            + (f" (missing {missing})" if missing else "")
        )
    for key in ("seed", "tests"):
        if len({json.dumps(i[key]) for _, i in infos}) != 1:
            raise ValueError(f"shards were graded with different {key}s")
    headers, rows, max_row = set(), {}, None
    for d, info in infos:
        with (d / "grades.csv").open(encoding="utf-8", newline="") as f:
            table = list(csv.reader(f))
        headers.add(tuple(table[0]))
        for row in table[1:]:
            if row and row[0] == "MAX":
                max_row = row
            elif row:
                if row[0] in rows:
                    raise ValueError(f"student {row[0]} is in two shards")
                rows[row[0]] = row
        if set(info["students"]) != {r[0] for r in table[1:] if r and r[0] != "MAX"}:
            raise ValueError(f"{d}/grades.csv does not match its {SHARD_NAME}")
    if len(headers) != 1:
        raise ValueError("shards have different grades.csv columns")
    out = Path(out)
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    merged_cache: dict = {}
    for d, _ in infos:
        for page in sorted((d / "feedback").glob("*.html")):
            shutil.copyfile(page, out / "feedback" / page.name)
        merged_cache.update(cache.load(d))
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers.pop())
    for student in sorted(rows):
        w.writerow(rows[student])
    if max_row:
        w.writerow(max_row)
    atomic_write(out / "grades.csv", buf.getvalue())
    atomic_write(
        out / cache.CACHE_NAME,
        json.dumps(merged_cache, ensure_ascii=False, indent=1),
    )
    return {"students": len(rows), "shards": n}
