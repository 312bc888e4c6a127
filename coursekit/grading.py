"""The grader: ``python -m coursekit grade --lab labNN SUBMISSIONS_DIR --out OUT_DIR``.

Format of hidden tests, statuses and outputs: ``tests/grading/README.md``. In short, for every
submission a worker process (:mod:`coursekit.grade_worker`, own process group, memory cap) runs the
student's code cells and then one probe cell per question in a fresh kernel; probes hand back plain
JSON data, and :class:`Question.check` scores it HERE, in the grader's process, against the reference
with inputs drawn fresh for this run. Results go to ``OUT_DIR/grades.csv`` and
``OUT_DIR/feedback/<student>.html``; a content-hash cache skips unchanged submissions.
"""
from __future__ import annotations

import csv
import hashlib
import html
import importlib.util
import io
import json
import math
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

GRADER_VERSION = "1"


def _code_digest() -> str:
    """Hash of the grader's own code: a changed grader regrades everything."""
    h = hashlib.sha256()
    here = Path(__file__).resolve().parent
    for name in ("grading.py", "grade_worker.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]
STATUSES = ("ok", "timeout", "kernel_died", "invalid", "grader_error")
DEFAULTS = dict(CELL_TIMEOUT=30, NOTEBOOK_TIMEOUT=300, PROBE_TIMEOUT=10, MEMORY_MB=4096)
CACHE_NAME = ".grade_cache.json"
TOKEN_ENV = "COURSEKIT_GRADE_TOKEN"
NAME_RE = re.compile(r"^[a-z0-9_]+$")


@dataclass
class Question:
    """One graded question of a lab (see tests/grading/README.md §4)."""

    name: str
    points: float
    make_inputs: Callable[[random.Random], Any]
    probe: str
    check: Callable[[Any, Any], Any]
    description: str = ""
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ValueError(f"Question name must match [a-z0-9_]+, got {self.name!r}")
        if self.points <= 0:
            raise ValueError(f"Question {self.name}: points must be > 0, got {self.points}")


@dataclass
class LabTests:
    """A loaded hidden-test module."""

    lab: str
    path: Path
    notebook: str
    questions: list[Question]
    cell_timeout: float
    notebook_timeout: float
    probe_timeout: float
    memory_mb: int
    digest: str

    @property
    def max_points(self) -> float:
        return sum(q.points for q in self.questions)


def load_tests(lab: str, tests_dir: str | Path) -> LabTests:
    """Import ``tests_dir/<lab>.py`` in this process (never in a student's kernel)."""
    if not re.fullmatch(r"lab\d\d", lab):
        raise ValueError(f"--lab must look like lab01, got {lab!r}")
    path = Path(tests_dir) / f"{lab}.py"
    if not path.exists():
        raise FileNotFoundError(f"no hidden tests for {lab}: {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_hidden_tests_{lab}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    qs = list(getattr(mod, "QUESTIONS", []))
    if not qs:
        raise ValueError(f"{path}: QUESTIONS is empty")
    names = [q.name for q in qs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate question names {names}")
    g = lambda k: getattr(mod, k, DEFAULTS[k])  # noqa: E731
    return LabTests(lab=lab, path=path, notebook=getattr(mod, "NOTEBOOK", ""), questions=qs,
                    cell_timeout=g("CELL_TIMEOUT"), notebook_timeout=g("NOTEBOOK_TIMEOUT"),
                    probe_timeout=g("PROBE_TIMEOUT"), memory_mb=int(g("MEMORY_MB")),
                    digest=hashlib.sha256(path.read_bytes()).hexdigest())


def safe_name(name: str) -> str:
    """A student name usable as a file name (letters, digits, ``._-``; anything else → ``_``)."""
    s = re.sub(r"[^\w.-]", "_", name).strip(".") or "_"
    return s[:100]


def discover(submissions: str | Path, notebook_name: str = "") -> list[tuple[str, Path | None, str]]:
    """``(student, path, problem)`` for every ``<student>.ipynb`` and ``<student>/`` folder, sorted."""
    root = Path(submissions)
    if not root.is_dir():
        raise FileNotFoundError(f"submissions folder not found: {root}")
    found: dict[str, tuple[Path | None, str]] = {}
    for p in sorted(root.iterdir()):
        if p.name.startswith("."):
            continue
        if p.is_file() and p.suffix == ".ipynb":
            found[safe_name(p.stem)] = (p, "")
        elif p.is_dir():
            nbs = sorted(x for x in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in x.parts)
            pick = [x for x in nbs if x.name == notebook_name] or nbs
            if not pick:
                found[safe_name(p.name)] = (None, "no .ipynb file in the submission folder")
            elif len(pick) > 1:
                found[safe_name(p.name)] = (None, "several notebooks; rename the one to grade to " + (notebook_name or "the lab's name"))
            else:
                found[safe_name(p.name)] = (pick[0], "")
    return [(s, p, why) for s, (p, why) in sorted(found.items())]


def _score(q: Question, inputs: Any, probe: dict) -> tuple[float, str]:
    if not probe.get("ok"):
        return 0.0, str(probe.get("error") or "no result")
    try:
        verdict = q.check(inputs, probe.get("value"))
        frac, msg = (verdict if isinstance(verdict, tuple) else (verdict, ""))
        frac = float(frac)
        if not math.isfinite(frac):
            frac = 0.0
        frac = min(1.0, max(0.0, frac))
    except Exception as e:  # garbage in the student's result
        return 0.0, f"result has the wrong form: {type(e).__name__}: {e}"
    return round(q.points * frac, 2), str(msg or ("correct" if frac == 1 else "partly correct" if frac else "wrong"))


def _kill_token(token: str) -> None:
    """SIGKILL every process whose environment carries ``token`` (escapees from the process groups)."""
    needle = f"{TOKEN_ENV}={token}".encode()
    for d in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                os.kill(int(d.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def grade_one(student: str, path: Path | None, problem: str, tests: LabTests, settings: dict) -> dict:
    """Grade one submission; never raises (failures become a status)."""
    rec: dict[str, Any] = {"student": student, "file": str(path) if path else "", "status": "ok",
                           "scores": {q.name: 0.0 for q in tests.questions}, "messages": {}, "cells": [],
                           "message": "", "seed": None, "seconds": 0.0}
    if path is None:
        rec.update(status="invalid", message=problem)
        return rec
    try:
        import nbformat

        raw = path.read_bytes()
        nb = nbformat.reads(raw.decode("utf-8"), as_version=4)
        if not isinstance(nb.get("cells"), list) or any(not isinstance(c, dict) or "cell_type" not in c for c in nb.cells):
            raise ValueError("no list of cells")
        for c in nb.cells:
            if c.get("cell_type") == "code" and not isinstance(c.get("source", ""), str):
                raise ValueError("cell source is not text")
    except Exception as e:
        rec.update(status="invalid", message=f"not a readable notebook: {type(e).__name__}: {str(e)[:300]}")
        return rec

    seed = secrets.randbits(32)
    rec["seed"] = seed
    inputs, probes = {}, []
    for q in tests.questions:
        rng = random.Random(f"{seed}:{q.name}")
        inputs[q.name] = q.make_inputs(rng)
        probes.append({"name": q.name, "source": q.probe, "inputs_json": json.dumps(inputs[q.name]),
                       "timeout": q.timeout or settings["probe_timeout"]})
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="coursekit-grade-") as work:
        nb_path = Path(work) / "submission.ipynb"
        nb_path.write_text(nbformat.writes(nb), encoding="utf-8")
        spec = {"notebook": str(nb_path), "workdir": work, "cell_timeout": settings["cell_timeout"],
                "notebook_timeout": settings["notebook_timeout"], "memory_mb": settings["memory_mb"],
                "max_output": 200_000, "probes": probes,
                "env": {"COURSE_GPU": settings["gpu"], "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg",
                        TOKEN_ENV: token}}
        env = dict(os.environ)
        env[TOKEN_ENV] = token
        hard = settings["notebook_timeout"] + 90  # kernel start-up and shutdown on top
        proc = subprocess.Popen([sys.executable, "-m", "coursekit.grade_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=work, env=env,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(json.dumps(spec).encode(), timeout=hard)
            result = json.loads(out.decode().strip().splitlines()[-1])
        except subprocess.TimeoutExpired:
            result = {"status": "timeout", "message": f"grading exceeded {hard} s; killed", "cells": [], "probes": {}}
        except Exception as e:
            result = {"status": "grader_error", "message": f"worker returned no result ({type(e).__name__}: {e})",
                      "cells": [], "probes": {}}
        finally:
            for sig_target in (proc.pid,):
                try:
                    os.killpg(sig_target, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            proc.wait()
            _kill_token(token)
    status = result.get("status")
    rec["status"] = status if status in STATUSES else "grader_error"
    rec["message"] = str(result.get("message", ""))[:3000]
    rec["seconds"] = result.get("seconds", 0.0)
    rec["cells"] = [c for c in result.get("cells", []) if isinstance(c, dict) and c.get("error")][:200]
    for q in tests.questions:
        probe = result.get("probes", {}).get(q.name) or {"ok": False, "error": "not run"}
        pts, msg = _score(q, inputs[q.name], probe)
        rec["scores"][q.name] = pts
        rec["messages"][q.name] = msg[:3000]
    return rec


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_dir() and not path.is_symlink():  # a submission put a folder where a file goes
        shutil.rmtree(path, ignore_errors=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def total(rec: dict) -> float:
    return round(sum(rec["scores"].values()), 2)


def feedback_html(rec: dict, tests: LabTests) -> str:
    """One self-contained HTML page: per question points, verdict and why; cell errors; status."""
    e = html.escape
    rows = []
    for q in tests.questions:
        pts = rec["scores"].get(q.name, 0.0)
        ok = pts >= q.points
        rows.append(f"<tr class={'pass' if ok else 'fail'}><td>{e(q.name)}</td><td>{e(q.description)}</td>"
                    f"<td>{pts:g} / {q.points:g}</td><td>{'✓' if ok else '✗'}</td>"
                    f"<td><pre>{e(rec['messages'].get(q.name, ''))}</pre></td></tr>")
    cells = [c for c in rec.get("cells", []) if c.get("error")]
    cell_html = "".join(f"<li>cell {c['index']}{' (time limit)' if c.get('timeout') else ''}:"
                        f"<pre>{e(str(c['error']))}</pre></li>" for c in cells) or "<li>none</li>"
    explain = {
        "ok": "notebook ran; hidden tests ran", "timeout": "a time limit was hit; what could be graded was graded",
        "kernel_died": "the kernel died (exit, crash or memory cap); questions not yet tested score 0",
        "invalid": "not a readable notebook", "grader_error": "the grader failed on this submission — tell the instructor",
    }[rec["status"]]
    return f"""<!DOCTYPE html>
<html lang="zh-CN"><head><meta charset="utf-8"><title>{e(tests.lab)} · {e(rec['student'])}</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td,th{{border:1px solid #ccc;padding:4px;vertical-align:top}}
table{{border-collapse:collapse}}.pass td:nth-child(4){{color:green}}.fail td:nth-child(4){{color:#b00}}pre{{white-space:pre-wrap;margin:0}}</style>
</head><body>
<h1>{e(tests.lab)} — {e(rec['student'])}</h1>
<p><b>Total: {total(rec):g} / {tests.max_points:g}</b> · status <code>{e(rec['status'])}</code> ({e(explain)})</p>
<p>{e(rec.get('message') or '')}</p>
<h2>Hidden tests</h2>
<p>Inputs are drawn fresh for each grading run (seed {rec.get('seed')}).</p>
<table><tr><th>question</th><th>what</th><th>points</th><th></th><th>details</th></tr>
{''.join(rows)}</table>
<h2>Errors in your notebook's cells</h2><ul>{cell_html}</ul>
<p><small>graded by coursekit grader v{GRADER_VERSION} in {rec.get('seconds', 0)} s</small></p>
</body></html>
"""


def grades_csv(records: list[dict], tests: LabTests) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["student", *[q.name for q in tests.questions], "total", "status"])
    for rec in records:
        w.writerow([rec["student"], *[f"{rec['scores'].get(q.name, 0.0):g}" for q in tests.questions],
                    f"{total(rec):g}", rec["status"]])
    w.writerow(["MAX", *[f"{q.points:g}" for q in tests.questions], f"{tests.max_points:g}", ""])
    return buf.getvalue()


def grade(lab: str, submissions: str | Path, out: str | Path, *, jobs: int = 1, force: bool = False,
          tests_dir: str | Path | None = None, cell_timeout: float | None = None,
          notebook_timeout: float | None = None, probe_timeout: float | None = None,
          memory_mb: int | None = None, gpu: str = "off", log: Callable[[str], None] | None = print) -> list[dict]:
    """Grade every submission of ``lab``; write grades.csv + feedback/; return the records (sorted)."""
    if tests_dir is None:
        from .labs import find_root

        tests_dir = find_root() / "tests" / "grading"
    tests = load_tests(lab, tests_dir)
    if jobs < 1:
        raise ValueError(f"--jobs must be ≥ 1, got {jobs}")
    settings = {"cell_timeout": cell_timeout or tests.cell_timeout,
                "notebook_timeout": notebook_timeout or tests.notebook_timeout,
                "probe_timeout": probe_timeout or tests.probe_timeout,
                "memory_mb": memory_mb or tests.memory_mb, "gpu": gpu}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    subs = discover(submissions, tests.notebook)
    cache_path = out / CACHE_NAME
    try:
        cache = json.loads(cache_path.read_text(encoding="utf-8")) if cache_path.exists() else {}
        cache = cache if isinstance(cache, dict) else {}
    except (OSError, ValueError):
        cache = {}
    records: dict[str, dict] = {}
    todo = []
    for student, path, problem in subs:
        h = hashlib.sha256()
        h.update(f"{GRADER_VERSION}|{_code_digest()}|{tests.digest}|{json.dumps(settings, sort_keys=True)}|".encode())
        try:
            h.update(path.read_bytes() if path else problem.encode())
        except OSError as e:
            h.update(repr(e).encode())
        key = h.hexdigest()
        hit = cache.get(student)
        if not force and isinstance(hit, dict) and hit.get("key") == key and isinstance(hit.get("record"), dict):
            records[student] = hit["record"]
        else:
            todo.append((student, path, problem, key))
    if log:
        log(f"{lab}: {len(subs)} submissions, {len(todo)} to grade, {len(subs) - len(todo)} unchanged (cached)")
    keys = {}

    def work(item):
        student, path, problem, key = item
        t0 = time.perf_counter()
        try:
            rec = grade_one(student, path, problem, tests, settings)
        except Exception as e:  # never let one submission stop the run
            rec = {"student": student, "file": str(path), "status": "grader_error", "message": repr(e)[:3000],
                   "scores": {q.name: 0.0 for q in tests.questions}, "messages": {}, "cells": [], "seed": None}
        if log:
            log(f"  {student:<24} {total(rec):>6g} / {tests.max_points:g}  {rec['status']:<12} {time.perf_counter() - t0:5.1f} s")
        return student, key, rec

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for student, key, rec in pool.map(work, todo):
            records[student] = rec
            keys[student] = key
    # Everything below is written from this process's memory, after every worker is gone, so files a
    # submission wrote into OUT_DIR while it ran are overwritten or removed.
    new_cache = {s: {"key": keys.get(s) or cache[s]["key"], "record": records[s]} for s, _, _ in subs}
    ordered = [records[s] for s, _, _ in subs]
    _atomic_write(cache_path, json.dumps(new_cache, ensure_ascii=False, indent=1))
    _atomic_write(out / "grades.csv", grades_csv(ordered, tests))
    fb = out / "feedback"
    fb.mkdir(exist_ok=True)
    wanted = {f"{rec['student']}.html" for rec in ordered}
    for p in fb.iterdir():
        if p.name not in wanted:
            p.unlink() if not p.is_dir() or p.is_symlink() else shutil.rmtree(p, ignore_errors=True)
    for rec in ordered:
        _atomic_write(fb / f"{rec['student']}.html", feedback_html(rec, tests))
    for p in out.iterdir():  # stray files a submission may have dropped next to grades.csv
        if p.name not in ("grades.csv", "feedback", CACHE_NAME) and p.is_file():
            p.unlink()
    return ordered
