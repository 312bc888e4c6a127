"""The grader (issue 7): robustness cases, tamper-proofing, cache, and every lab's solution/stub.

Robustness submissions are generated here (not stored as .ipynb under tests/, where the nbval run
would collect them) against a tiny synthetic lab ``lab99`` whose hidden tests are written to a temp
folder, so each kernel does almost nothing and the whole module stays fast. All robustness cases are
graded in ONE run with ``jobs=2``, so each row also proves that no case disturbed another student.
"""
from __future__ import annotations

import csv
import json
import shutil
import textwrap
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from coursekit.grading import grade

ROOT = Path(__file__).resolve().parents[1]

HIDDEN = '''
from coursekit.grading import Question

NOTEBOOK = "lab99_toy.ipynb"

def _add_inputs(rng):
    return [[rng.randint(-10**6, 10**6), rng.randint(-10**6, 10**6)] for _ in range(20)]

def _add_check(inputs, result):
    want = [a + b for a, b in inputs]
    if result == want:
        return 1.0, "correct"
    return 0.0, "wrong"

def _mean_inputs(rng):
    return [[rng.uniform(-5, 5) for _ in range(rng.randint(1, 9))] for _ in range(10)]

def _mean_check(inputs, result):
    want = [sum(xs) / len(xs) for xs in inputs]
    ok = [isinstance(g, float) and abs(g - w) < 1e-9 for g, w in zip(result, want)] if isinstance(result, list) else []
    return sum(ok) / len(want), f"{sum(ok)} of {len(want)} correct"

QUESTIONS = [
    Question("add", points=2, make_inputs=_add_inputs, check=_add_check,
             probe="RESULT = [add(a, b) for a, b in INPUTS]"),
    Question("mean", points=3, make_inputs=_mean_inputs, check=_mean_check,
             probe="RESULT = [float(mean(xs)) for xs in INPUTS]"),
]
'''

ADD = "def add(a, b):\n    return a + b"
MEAN = "def mean(xs):\n    return sum(xs) / len(xs)"
CHECK = "assert add(1, 2) == 3 and mean([1, 2]) == 1.5\nprint('✓')"
STUB_ADD = "def add(a, b):\n    # TODO\n    raise NotImplementedError"
STUB_MEAN = "def mean(xs):\n    # TODO\n    raise NotImplementedError"


def nb(*sources: str) -> str:
    n = new_notebook()
    n.cells = [new_code_cell(s) for s in sources]
    return nbformat.writes(n)


def tamper_out(out: Path) -> str:
    """A cell that knows OUT_DIR (the worst case) and writes into it."""
    return textwrap.dedent(f'''
        import json, pathlib
        out = pathlib.Path({str(out)!r})
        (out / "grades.csv").write_text("student,add,mean,total,status\\nmallory,2,3,5,ok\\n")
        (out / "feedback").mkdir(exist_ok=True)
        (out / "feedback" / "good.html").write_text("hacked")
        (out / "feedback" / "zz_fake.html").write_text("fake")
        (out / "evil.txt").write_text("evil")
        (out / ".grade_cache.json").write_text(json.dumps({{"mallory": {{"key": "x", "record": {{}}}}}}))
    ''')


TAMPER_BUILTINS = textwrap.dedent(r'''
    import builtins, json, re, sys
    # 1. fake every result the harness might print, using the nonce read from the next cell's source
    def _hook(info):
        for m in set(re.findall(r"@@[0-9a-f]{32}@@", info.raw_cell or "")):
            sys.stdout.write(m + '{"ok": true, "value": [3, 3, 3]}' + m)
    get_ipython().events.register("pre_run_cell", _hook)
    # 2. break the tools a harness would use
    def _exec(code, ns=None, *args):       # the harness's exec never runs the hidden test
        if isinstance(ns, dict):
            ns["RESULT"] = [3, 3, 3]
    builtins.exec = _exec
    builtins.print = lambda *a, **k: None
    AssertionError = type("AssertionError", (Exception,), {})
''')

# case -> (files written to the submissions folder, expected (add, mean, total, status))
CASES = {
    "good": (nb("import math", ADD, MEAN, CHECK), (2, 3, 5, "ok")),
    "malformed_json": ('{"cells": [ {"cell_type": "code", ', (0, 0, 0, "invalid")),
    "not_a_notebook": (b"\x89PNG\r\n\x1a\n\x00\x00binary", (0, 0, 0, "invalid")),
    "json_not_notebook": ('{"hello": [1, 2, 3]}', (0, 0, 0, "invalid")),
    "empty_notebook": (nb(), (0, 0, 0, "ok")),
    "infinite_loop_cell": (nb(ADD, MEAN, "while True:\n    pass"), (2, 3, 5, "timeout")),
    "loop_ignores_interrupt": (nb(ADD, MEAN, "while True:\n    try:\n        while True:\n            pass\n"
                                  "    except KeyboardInterrupt:\n        pass"), (0, 0, 0, "timeout")),
    "kernel_exit": (nb(ADD, MEAN, "import os\nos._exit(1)"), (0, 0, 0, "kernel_died")),
    "huge_output": (nb(ADD, MEAN, "import sys\nfor _ in range(50):\n    sys.stdout.write('x' * 2**20)"), (2, 3, 5, "ok")),
    "memory_bomb": (nb(ADD, MEAN, "blocks = []\nwhile True:\n    blocks.append(bytes(256 * 2**20))"), (2, 3, 5, "ok")),
    "input_call": (nb(ADD, "name = input('your name: ')", MEAN), (2, 3, 5, "ok")),
    "deleted_cell": (nb(ADD, CHECK), (2, 0, 2, "ok")),
    "reordered_cells": (nb(CHECK, MEAN, ADD), (2, 3, 5, "ok")),
    "renamed_function": (nb(ADD, MEAN.replace("def mean", "def average"), CHECK), (2, 0, 2, "ok")),
    "right_but_slow": (nb(ADD, "import time\n" + MEAN.replace("    return", "    time.sleep(10)\n    return")),
                       (2, 0, 2, "timeout")),
    "infinite_loop_in_function": (nb(ADD, "def mean(xs):\n    while True:\n        pass"), (2, 0, 2, "timeout")),
    "tamper_builtins": (nb(STUB_ADD, STUB_MEAN, TAMPER_BUILTINS), (0, 0, 0, "ok")),
    "tamper_json": (nb(STUB_ADD, STUB_MEAN, "import json\njson.dumps = lambda *a, **k: '{\"ok\": true, \"value\": 1}'"),
                    (0, 0, 0, "kernel_died")),
    "untouched_stubs": (nb(STUB_ADD, STUB_MEAN, CHECK), (0, 0, 0, "ok")),
}
SETTINGS = dict(cell_timeout=4, notebook_timeout=30, probe_timeout=2, memory_mb=1536)


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("grading")
    tests_dir, subs, out = base / "hidden", base / "subs", base / "out"
    for d in (tests_dir, subs):
        d.mkdir()
    (tests_dir / "lab99.py").write_text(HIDDEN)
    for name, (content, _) in CASES.items():
        p = subs / f"{name}.ipynb"
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    (subs / "tamper_outdir.ipynb").write_text(nb(STUB_ADD, STUB_MEAN, tamper_out(out)))
    pidfile = base / "orphan.pid"   # a process that leaves the kernel's process group (new session)
    (subs / "orphan_process.ipynb").write_text(nb(ADD, MEAN, (
        "import subprocess, pathlib\n"
        "p = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
        f"pathlib.Path({str(pidfile)!r}).write_text(str(p.pid))")))
    logs: list[str] = []
    records = grade("lab99", subs, out, jobs=2, tests_dir=tests_dir, log=logs.append, **SETTINGS)
    rows = {r["student"]: r for r in csv.DictReader((out / "grades.csv").open())}
    return dict(records={r["student"]: r for r in records}, rows=rows, out=out, subs=subs,
                tests_dir=tests_dir, logs=logs, pidfile=pidfile)


@pytest.mark.parametrize("case", sorted(CASES))
def test_robustness_case(graded, case):
    add, mean, total, status = CASES[case][1]
    row = graded["rows"][case]
    assert (float(row["add"]), float(row["mean"]), float(row["total"]), row["status"]) == (add, mean, total, status), \
        graded["records"][case]
    assert (graded["out"] / "feedback" / f"{case}.html").exists()


def test_tamper_outdir_changes_nothing(graded):
    out, rows = graded["out"], graded["rows"]
    assert rows["tamper_outdir"]["total"] == "0" and rows["tamper_outdir"]["status"] == "ok"
    assert "mallory" not in rows and rows["good"]["total"] == "5"
    assert sorted(rows) == sorted([*CASES, "tamper_outdir", "orphan_process", "MAX"])
    assert "hacked" not in (out / "feedback" / "good.html").read_text()
    assert not (out / "evil.txt").exists() and not (out / "feedback" / "zz_fake.html").exists()
    assert "mallory" not in json.loads((out / ".grade_cache.json").read_text())


def test_escaped_processes_are_killed(graded):
    """A child that left the kernel's process group (setsid) is found by the run's token and killed."""
    assert graded["rows"]["orphan_process"]["total"] == "5"
    pid = int(graded["pidfile"].read_text())
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return
    assert "zombie" in state or "(dead)" in state, state


def test_csv_and_feedback_content(graded):
    out = graded["out"]
    header = (out / "grades.csv").read_text().splitlines()[0]
    assert header == "student,add,mean,total,status"
    assert graded["rows"]["MAX"]["total"] == "5"
    page = (out / "feedback" / "renamed_function.html").read_text()
    assert "NameError" in page and "average" not in page.split("<h2>Hidden tests")[0]
    assert "time limit" in (out / "feedback" / "right_but_slow.html").read_text()


def test_rerun_grades_only_changed(graded):
    subs, out = graded["subs"], graded["out"]
    logs: list[str] = []
    grade("lab99", subs, out, jobs=2, tests_dir=graded["tests_dir"], log=logs.append, **SETTINGS)
    assert "0 to grade" in logs[0], logs
    (subs / "deleted_cell.ipynb").write_text(nb(ADD, MEAN))   # the student fixed it
    shutil.copy(subs / "good.ipynb", subs / "newcomer.ipynb")
    logs.clear()
    records = {r["student"]: r for r in grade("lab99", subs, out, jobs=2, tests_dir=graded["tests_dir"],
                                               log=logs.append, **SETTINGS)}
    assert "2 to grade" in logs[0], logs
    assert records["deleted_cell"]["status"] == "ok" and sum(records["deleted_cell"]["scores"].values()) == 5
    assert sum(records["newcomer"]["scores"].values()) == 5
    assert records["kernel_exit"]["status"] == "kernel_died"      # cached rows unchanged


LAB_IDS = sorted(p.stem.split("_")[0] for p in (ROOT / "solutions").glob("lab*.ipynb")
                 if (ROOT / "tests" / "grading" / f"{p.stem.split('_')[0]}.py").exists())


@pytest.mark.parametrize("lab", LAB_IDS)
def test_solution_full_marks_untouched_lab_zero(lab, tmp_path):
    """Grading the reference solution gives full marks; the untouched generated lab gives 0 with status ok."""
    sol = next((ROOT / "solutions").glob(f"{lab}_*.ipynb"))
    subs = tmp_path / "subs"
    subs.mkdir()
    shutil.copy(sol, subs / "solution.ipynb")
    shutil.copy(ROOT / "labs" / sol.name, subs / "untouched_lab.ipynb")
    records = {r["student"]: r for r in grade(lab, subs, tmp_path / "out", jobs=2, log=None)}
    from coursekit.grading import load_tests

    full = load_tests(lab, ROOT / "tests" / "grading").max_points
    s, u = records["solution"], records["untouched_lab"]
    assert (s["status"], sum(s["scores"].values())) == ("ok", full), s["messages"]
    assert (u["status"], sum(u["scores"].values())) == ("ok", 0), u["messages"]
    rows = list(csv.reader((tmp_path / "out" / "grades.csv").open()))
    assert rows[1][0] == "solution" and float(rows[1][-2]) == full and rows[2][-1] == "ok"
