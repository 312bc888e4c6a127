"""Shared fixtures and markers for the whole suite.

Markers (registered here, used by ``make unit`` to leave out the long parts):

* ``slow`` — end-to-end runs: the browser suite (builds the book), the grader over every
  lab, multi-process demos. ``make unit`` runs ``-m "not slow"``.
"""

from __future__ import annotations

import pytest
import torch

# Test modules whose every test is end-to-end (minutes, not seconds).
SLOW_MODULES = {"test_site", "test_grader", "test_fsdp_demo", "test_calculator"}


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "slow: end-to-end test; `make unit` leaves it out"
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, "module", None)
        name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
        if name in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread (and do not fight other jobs for the
    cores)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
