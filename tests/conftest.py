"""Shared fixtures and markers for the whole suite.

Markers (registered here, used by ``make unit`` to leave out the long parts):

* ``slow`` — end-to-end runs: the browser suite (builds the book), the grader over every
  lab, multi-process demos. ``make unit`` runs ``-m "not slow"``.
"""

from __future__ import annotations

import os

import pytest

from tests.schedule import rank

# Test modules whose every test is end-to-end (minutes, not seconds).
SLOW_MODULES = {"test_site", "test_grader", "test_fsdp_demo", "test_calculator"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: end-to-end test; `make unit` leaves it out"
    )
    config.addinivalue_line(
        "markers",
        "floor: executes a notebook in .venv-floor's kernel (make floor; make test's "
        "main pass deselects it)",
    )


# Run first: the files tests/schedule.py ranks heaviest (HEAVY_FIRST, the one place that
# says what runs first), the published benchmark first of all: it replays every
# published row, and under ``make test`` (COURSE_ESTIMATE_CACHE) the chapters that show
# rows then read them instead of waiting for the same replays. The other files follow
# by their number of tests, most first
# (what pytest-xdist's loadfile does by itself; ``make test`` passes
# ``--no-loadscope-reorder`` so that this order holds). Every file's tests, every
# notebook's cells keep their order.


def _file_order(items) -> list:
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    groups = sorted(
        files.values(),
        key=lambda g: (rank(g[0].nodeid.split("::", 1)[0]), -len(g)),
    )
    return [item for g in groups for item in g]


def _module_name(item) -> str:
    module = getattr(item, "module", None)
    return module.__name__.rsplit(".", 1)[-1] if module is not None else ""


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _module_name(item) in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
    items[:] = _file_order(items)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (and do not fight other jobs for the
    cores). torch is imported here, not with this file: a pytest process that runs
    no test (xdist's controller, a run whose tests all skip) never needs it."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Skip reasons that mean "a tool is missing on this machine". Locally that is a skip
# with the fix in the reason; under CI=true it fails, so a CI run never goes green
# without the browser, the CJK font or the sandbox tool it is meant to test with.
MISSING_TOOL_WORDS = ("not installed", "make browser-deps", "make sandbox-deps")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped:
        return
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else "")
    if any(word in reason for word in MISSING_TOOL_WORDS):
        report.outcome = "failed"
        report.longrepr = f"CI=true: a missing tool is an error, not a skip: {reason}"
