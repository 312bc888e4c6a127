"""Code in the book and the lab solutions fits the page: ruff's formatter at 88 columns
and ruff's checks (configured in pyproject.toml), and no authoring plumbing left for
`coursekit tidy` to move.

Fix everything at once with (CONTRIBUTING.md)::

    .venv/bin/python -m coursekit tidy && .venv/bin/ruff check --fix book solutions \
        && .venv/bin/ruff format book solutions
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.notebooks import ROOT

PATHS = ["book", "solutions"]


def _ruff() -> str:
    exe = Path(sys.executable).parent / "ruff"
    if exe.exists():
        return str(exe)
    found = shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed (it is in the [dev] extras: make venv)")
    return found


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_ruff(), *args, *PATHS], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_ruff_format():
    r = _run("format", "--check")
    assert r.returncode == 0, (
        "notebooks not formatted (run `ruff format book solutions`):\n"
        + r.stdout[-3000:]
        + r.stderr[-2000:]
    )


def test_ruff_check():
    r = _run("check", "--output-format", "concise")
    assert r.returncode == 0, (
        "ruff check failed:\n" + r.stdout[-4000:] + r.stderr[-2000:]
    )


def test_plumbing_tidied():
    """`python -m coursekit tidy` has nothing left to do in book/ and solutions/."""
    from coursekit.tidy import tidy_paths

    reports = tidy_paths([ROOT / p for p in PATHS], check=True)
    pending = [line for r in reports for line in r.changes]
    assert not pending, (
        f"{len(pending)} change(s) pending (run `python -m coursekit tidy`):\n"
        + "\n".join(pending[:20])
    )


LIBRARY = ["trainmem", "coursekit", "tests", "benchmarks", "_ext"]


def test_ruff_format_library():
    """The Python packages, tests and benchmarks are ruff-formatted like the book."""
    r = subprocess.run(
        [_ruff(), "format", "--check", *LIBRARY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (
        "library not formatted (run `ruff format trainmem coursekit tests benchmarks"
        " _ext`):\n" + r.stdout[-3000:] + r.stderr[-2000:]
    )


def test_ruff_check_library():
    """The Python packages: pyflakes (unused or undefined names, redefinitions) and
    pycodestyle, line length included: docstrings, comments and strings fit 88
    columns as the book's code does."""
    r = subprocess.run(
        [_ruff(), "check", "--output-format", "concise", *LIBRARY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, (
        "ruff check failed:\n" + r.stdout[-4000:] + r.stderr[-2000:]
    )
