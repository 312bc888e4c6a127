"""tests/schedule.py: which tests run together, and that xdist really uses it."""

import importlib
import os
import re
import subprocess
import sys

from tests import schedule
from tests.notebooks import ROOT


def test_units():
    u = schedule.unit_of
    nb = "tests/test_floor.py::test_notebook_runs_at_floor[book/06_lora.ipynb]"
    assert u(nb) == nb
    # other parametrized tests stay one unit with their file
    assert u("tests/test_gpu_cells.py::test_amp_plan_by_capability[sm_75]") == (
        "tests/test_gpu_cells.py"
    )
    full = "tests/test_grader.py::test_solution_full_marks_untouched_lab_zero[lab06]"
    check = "tests/test_grader.py::test_self_check_catches_what_the_hidden_tests_grade"
    assert u(full) == u(check + "[lab06]") == "tests/test_grader.py@lab06"
    assert u(check + "[lab03]") != u(full)
    # tests sharing the module fixture `graded` stay with their file
    assert u("tests/test_grader.py::test_robustness_case[good]") == (
        "tests/test_grader.py"
    )
    # a notebook's cells stay together
    assert u("book/03_training_memory.ipynb::Cell 7") == "book/03_training_memory.ipynb"


def test_split_names_are_real_tests():
    for prefix in schedule.SPLIT_BY_TEST + schedule.SPLIT_BY_LAB:
        path, func = re.fullmatch(r"(tests/\w+\.py)::(\w+)\[", prefix).groups()
        module = importlib.import_module(path[:-3].replace("/", "."))
        assert callable(getattr(module, func, None)), f"{prefix}: no such test"


def test_heavy_first_order():
    heavy = schedule.HEAVY_FIRST
    assert heavy and heavy[0] == "tests/test_published.py", (
        "the published rows' replay runs first: the chapters read its cache"
    )
    assert [schedule.rank(u) for u in heavy] == list(range(len(heavy)))
    assert schedule.rank("tests/test_style.py") == len(heavy)
    for unit in heavy:  # each names a unit that exists
        assert schedule.unit_of(unit.split("@")[0]) == unit or "@" in unit, unit
        file, _, rest = unit.partition("::")
        assert (ROOT / file.split("@")[0]).exists(), unit
        if "@" in file:
            assert list((ROOT / "solutions").glob(file.split("@")[1] + "_*")), unit
        if rest:
            assert (ROOT / rest.split("[")[1].rstrip("]")).exists() or list(
                ROOT.glob("*/" + rest.split("[")[1].rstrip("]"))
            ), unit


def test_xdist_spreads_a_split_file_over_workers():
    """Under --dist loadfile alone every test of tests/test_floor.py would go to one
    worker; with the plugin its notebook tests are spread (they skip here:
    COURSE_FLOOR_VENV is unset)."""
    env = {k: v for k, v in os.environ.items() if k != "COURSE_FLOOR_VENV"}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadfile"]
        + ["-p", "tests.schedule", "-v", "-p", "no:cacheprovider"]
        + ["tests/test_floor.py", "-k", "notebook_runs_at_floor"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    workers = set(
        re.findall(r"\[(gw\d)\] \[[ \d]+%\] SKIPPED tests/test_floor.py", r.stdout)
    )
    assert workers == {"gw0", "gw1"}, r.stdout[-2000:]


def test_make_test_uses_the_plugin():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    rule = text.split("\ntest: $(STAMP)", 1)[1].split("\n\n", 1)[0]
    assert "--dist loadfile" in rule and "-p tests.schedule" in rule
