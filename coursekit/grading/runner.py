"""Running one submission: check the notebook, start the worker, collect and score its
result.

The worker (:mod:`coursekit.grading.worker`) runs in its own session with a run token in
its environment; when it ends — normally, by time limit or by error — its whole process
tree, its process group and any process still carrying the token (a child that escaped
with ``setsid``) are killed through psutil.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import nbformat
import psutil

from . import cgroup
from .files import read_regular, remove_tree
from .report import unreadable_text
from .scoring import Prepared, probe_spec, score
from .submissions import Submission
from .worker import kill_tree

# Everything the grader's own process runs is imported above, before any kernel runs:
# nothing a submission could have touched is ever imported later (the kernel cannot
# write the grader's code anyway: it sees it read-only, as another user).

STATUSES = ("ok", "timeout", "kernel_died", "memory_limit", "invalid", "grader_error")
TOKEN_ENV = "COURSEKIT_GRADE_TOKEN"
MAX_CELL_OUTPUT = 200_000
TASKS_MAX = 384  # pids.max of a submission's cgroup: processes and threads


def kill_token(token: str) -> None:
    """SIGKILL every process whose environment carries ``token`` (escapees from the
    groups)."""
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get(TOKEN_ENV) == token:
                proc.kill()
        except psutil.Error:
            continue


def read_notebook(path: Path):
    """The submission as an nbformat 4 notebook, or ValueError saying why it is not
    one."""
    nb = nbformat.reads(read_regular(path).decode("utf-8"), as_version=4)
    cells = nb.get("cells")
    if not isinstance(cells, list) or any(
        not isinstance(c, dict) or "cell_type" not in c for c in cells
    ):
        raise ValueError("no list of cells")
    for c in cells:
        if c.get("cell_type") == "code" and not isinstance(c.get("source", ""), str):
            raise ValueError("cell source is not text")
    return nb


def cell_labels(nb) -> list[str]:
    """A name per code cell that a student can find in Colab: the heading above it and
    its first line (Colab shows no cell numbers)."""
    labels, heading = [], "开头"
    for c in nb.cells:
        src = str(c.get("source", ""))
        if c.get("cell_type") == "markdown":
            for line in src.splitlines():
                if line.lstrip().startswith("#"):
                    heading = line.lstrip("# ").strip()[:60] or heading
        elif c.get("cell_type") == "code":
            first = next(
                (ln.strip() for ln in src.splitlines() if ln.strip()), "（空单元）"
            )
            labels.append(f"「{heading}」下以 {first[:60]} 开头的单元")
    return labels


def run_worker(spec: dict, token: str, hard_timeout: float, cwd: str) -> dict:
    """Run the worker on ``spec``; its whole tree is killed before this returns (and,
    unsandboxed, every process carrying the token: inside the sandbox no process can
    leave the PID namespace, which dies with the kernel)."""
    env = dict(os.environ)
    env[TOKEN_ENV] = token
    proc = psutil.Popen(
        [sys.executable, "-m", "coursekit.grading.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        cwd=cwd,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(json.dumps(spec).encode(), timeout=hard_timeout)
        return json.loads(out.decode().strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {
            "status": "timeout",
            "message": f"评分超过 {hard_timeout:g} 秒，已终止",
            "cells": [],
            "probes": {},
        }
    except Exception as e:
        return {
            "status": "grader_error",
            "cells": [],
            "probes": {},
            "message": f"评分子进程没有返回结果（{type(e).__name__}: {e}）",
        }
    finally:
        kill_tree(proc.pid)
        proc.wait()
        if not spec.get("sandbox"):
            kill_token(token)  # reads every process's environment: 0.2 s or more


def new_record(sub: Submission, prepared: list[Prepared], seed: int) -> dict[str, Any]:
    return {
        "student": sub.student,
        "file": str(sub.path) if sub.path else "",
        "status": "ok",
        "note": sub.note,
        "message": "",
        "seed": seed,
        "seconds": 0.0,
        "sandbox": True,
        "limits": "",
        "cells": [],
        "scores": {p.question.name: 0.0 for p in prepared},
        "details": {},
    }


def grade_one(sub: Submission, prepared: list[Prepared], settings: dict) -> dict:
    """Grade one submission; never raises (failures become a status)."""
    rec = new_record(sub, prepared, settings["seed"])
    rec["sandbox"] = bool(settings.get("sandbox", True))
    if sub.path is None:
        rec.update(status="invalid", message=sub.problem)
        return rec
    try:
        nb = read_notebook(sub.path)
    except Exception as e:
        rec.update(
            status="invalid",
            message=unreadable_text(e),
        )
        return rec
    probes = [probe_spec(p, settings["probe_timeout"]) for p in prepared]
    token = secrets.token_hex(16)
    # removed by descriptor, however deep the kernel nested folders in it
    work, leftover = tempfile.mkdtemp(prefix="coursekit-grade-"), ""
    rec["limits"] = settings.get("limits", "sampled")
    cg = None
    if rec["limits"].startswith("cgroup"):
        try:
            cg = cgroup.Cgroup.create(
                cgroup.parent(), int(settings["memory_mb"]) * 2**20, TASKS_MAX
            )
        except (OSError, TypeError, AttributeError) as e:
            rec["limits"] = "sampled"
            leftover = f" 没能为这份提交建立 cgroup（{e}），内存与进程数由采样监视"
    try:
        nb_path = Path(work) / "submission.ipynb"
        nb_path.write_text(nbformat.writes(nb), encoding="utf-8")
        spec = {
            "notebook": str(nb_path),
            "workdir": work,
            "cell_timeout": settings["cell_timeout"],
            "notebook_timeout": settings["notebook_timeout"],
            "memory_mb": settings["memory_mb"],
            "sandbox": bool(settings.get("sandbox", True)),
            "disk_mb": settings.get("disk_mb", 512),
            "gpu": settings["gpu"],
            "max_output": MAX_CELL_OUTPUT,
            "probes": probes,
            "labels": cell_labels(nb),
            "cgroup": cg.spec() if cg else None,
            "cgroup_procs": cg.procs if cg else [],
            "env": {
                "COURSE_GPU": settings["gpu"],
                "PYTHONHASHSEED": "0",
                "MPLBACKEND": "Agg",
                TOKEN_ENV: token,
            },
        }
        hard = settings["notebook_timeout"] + 90  # kernel start-up and shutdown on top
        result = run_worker(spec, token, hard, work)
    finally:
        if cg is not None:
            cg.remove()
        try:
            remove_tree(work)
        except OSError as e:
            leftover = f" 评分器没能删除工作目录 {work}（{e}）"
    status = result.get("status")
    rec["status"] = status if status in STATUSES else "grader_error"
    rec["message"] = (str(result.get("message", ""))[:3000] + leftover).strip()
    rec["seconds"] = result.get("seconds", 0.0)
    if result.get("machine_busy"):  # not the submission's doing: graded again next run
        rec["no_cache"] = True
    labels = cell_labels(nb)
    for c in result.get("cells", []):
        if isinstance(c, dict) and c.get("error") and len(rec["cells"]) < 200:
            i = c.get("index", 0)
            where = (
                labels[i - 1]
                if isinstance(i, int) and 0 < i <= len(labels)
                else f"单元 {i}"
            )
            rec["cells"].append(
                {
                    "where": where,
                    "error": str(c["error"]),
                    "timeout": bool(c.get("timeout")),
                }
            )
    for p in prepared:
        name = p.question.name
        probe = result.get("probes", {}).get(name) or {"ok": False, "error": "未运行"}
        detail = score(p, probe)
        rec["scores"][name] = detail["points"]
        rec["details"][name] = detail
    return rec
