"""How ``make test``'s main pass spreads its work over the xdist workers.

``--dist loadfile`` sends each file to one worker whole: that keeps a notebook's nbval
cells in order on one kernel and computes a module's fixtures once. But a file of
independent slow tests then runs serially on one worker while the others sit idle at
the end of the pass. With this plugin (``-p tests.schedule``, only under
``--dist loadfile``):

* the tests named in :data:`SPLIT_BY_TEST` are units of their own: each shares
  nothing with its neighbours but the worker's floor kernel, whose namespace it
  empties first (a notebook at the floor versions);
* the lab tests in :data:`SPLIT_BY_LAB` are grouped per lab: a lab's solution,
  untouched lab and known mistake are graded once per worker by the session
  fixture ``lab_runs`` and its tests stay together;
* units are queued heaviest first (:data:`HEAVY_FIRST`, from the slowest files
  ``python -m tests.stages show`` lists after a run), so that no long unit starts last.

Nothing here changes what a test checks; only where and when it runs.
"""

from __future__ import annotations

import re

SPLIT_BY_TEST = ("tests/test_floor.py::test_notebook_runs_at_floor[",)
SPLIT_BY_LAB = (
    "tests/test_grader.py::test_self_check_catches_what_the_hidden_tests_grade[",
    "tests/test_grader.py::test_solution_full_marks_untouched_lab_zero[",
)
_LAB = re.compile(r"\[(lab\d\d)\]$")

# These units go first, in this order; the rest keep collection order
# (tests/conftest.py, which also puts these files first when xdist is not used).
# The one place that says what runs first.
# From the slowest files `make test` lists at its end (tests/stages.py).
HEAVY_FIRST: tuple[str, ...] = (
    # first whatever its cost: its replays fill the estimate cache the chapters read
    "tests/test_published.py",
    "tests/test_site.py",
    "tests/test_grader.py",
    "tests/test_sandbox.py",
    "book/06_lora_in_practice.ipynb",
    "tests/test_grader.py@lab06",
    "tests/test_calculator.py",
    "book/05_lora_principles.ipynb",
    "book/11_beyond_sft.ipynb",
    # make floor's pass (its own pytest run: these rank only among themselves)
    *(
        f"tests/test_floor.py::test_notebook_runs_at_floor[{nb}]"
        for nb in (
            "book/06_lora_in_practice.ipynb",
            "book/05_lora_principles.ipynb",
            "book/09_beyond_one_gpu.ipynb",
            "book/08_attention_inference_troubleshooting.ipynb",
            "solutions/lab06_capstone_lora_finetune.ipynb",
            "book/03_training_memory.ipynb",
        )
    ),
)


def unit_of(nodeid: str) -> str:
    """The scheduling unit of a test: its file, or finer where that is safe."""
    if nodeid.startswith(SPLIT_BY_TEST):
        return nodeid
    if nodeid.startswith(SPLIT_BY_LAB):
        m = _LAB.search(nodeid)
        if m:
            return f"tests/test_grader.py@{m.group(1)}"
    return nodeid.split("::", 1)[0]


def rank(unit: str) -> int:
    """Position in :data:`HEAVY_FIRST`, or after all of them."""
    try:
        return HEAVY_FIRST.index(unit)
    except ValueError:
        return len(HEAVY_FIRST)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return unit_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            # the heaviest unit still queued goes next (min keeps collection order
            # among equals)
            if self.workqueue:
                self.workqueue.move_to_end(min(self.workqueue, key=rank), last=False)
            super()._assign_work_unit(node)

    return Scheduling(config, log)
