"""The published real-GPU rows (``coursekit.published``): shipped as package data, so a
chapter's cell finds them on a pip-only install (Colab), and the committed report is
what the benchmark prints."""

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_rows_are_package_data_of_coursekit():
    """The JSON lies inside the ``coursekit`` package and pyproject's package-data
    globs include it: ``pip install git+...`` (the Colab setup cell) installs it."""
    from coursekit import published

    data = Path(str(published.DATA)).resolve()
    pkg = (ROOT / "coursekit").resolve()
    assert data.is_relative_to(pkg), data
    rel = data.relative_to(pkg).as_posix()
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    globs = cfg["tool"]["setuptools"]["package-data"].get("coursekit", [])
    assert any(fnmatch.fnmatch(rel, g) for g in globs), (rel, globs)
    # one copy of the data: no second JSON in the benchmark folder
    assert not list((ROOT / "benchmarks").rglob("published_gpu.json"))


def test_rows_load_without_the_checkout(tmp_path):
    """Imported from outside the repository (cwd elsewhere, no ``benchmarks/`` on the
    path), the module still loads every row and compares one (every row's comparison
    is checked in-process by the next test)."""
    code = (
        "from coursekit.published import published_results\n"
        "d, rows, res = published_results(['peft-lora-r32'])\n"
        "assert [r['id'] for r in res] == ['peft-lora-r32'] and res[0]['estimate']\n"
        "print(len(rows))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    from coursekit.published import load

    assert int(out.stdout) == len(load()["rows"])


def test_committed_report_is_what_the_benchmark_prints():
    """``benchmarks/results/published_gpu.md`` (read by the reader, quoted in reviews)
    is regenerated whenever a row or the estimator changes."""
    from coursekit.published import compare, load, report

    rows = load()["rows"]
    text = report(rows, compare(rows))
    committed = (ROOT / "benchmarks/results/published_gpu.md").read_text("utf-8")
    assert committed == text, "rerun: python benchmarks/published_gpu.py --out ..."


def test_a_chapter_asks_for_rows_by_id():
    """``published_results(ids)`` compares only the rows a chapter shows, and a
    misspelt id is an error naming it, not an empty table."""
    import pytest

    from coursekit.published import published_results

    _, rows, res = published_results(["peft-lora-r32"])
    assert len(rows) > 1 and [r["id"] for r in res] == ["peft-lora-r32"]
    with pytest.raises(KeyError, match="peft-lora-r33"):
        published_results(["peft-lora-r33"])
