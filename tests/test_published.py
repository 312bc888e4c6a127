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


def test_estimates_are_shared_by_code_shape_and_options(tmp_path, monkeypatch):
    """Where ``COURSE_ESTIMATE_CACHE`` names a folder (``make test``), a row's
    estimate is computed once and read back by the next process; the key is the
    estimator's code, the Shape built from the config with the transformers of the
    process that asks, and the options, so a change to any of them computes anew."""
    import functools

    import pytest

    from coursekit import published

    monkeypatch.setenv(published.SHARED_ENV, str(tmp_path))
    row = next(r for r in published.load()["rows"] if r["id"] == "peft-lora-r32")
    published._estimate_json.cache_clear()
    first = published.row_estimate(row).to_dict()
    assert len(list(tmp_path.glob("*.pickle"))) == 1

    @functools.wraps(published.estimate)  # row_options reads its signature
    def no_replay(*a, **k):
        raise AssertionError("replayed again")

    monkeypatch.setattr(published, "estimate", no_replay)
    published._estimate_json.cache_clear()
    assert published.row_estimate(row).to_dict() == first  # read back
    other = dict(row, model=dict(row["model"], num_hidden_layers=3))
    for case in ("shape", "options", "code"):
        published._estimate_json.cache_clear()
        r = other if case == "shape" else row
        if case == "code":
            monkeypatch.setattr(published, "_code_version", lambda: "edited")
        opts = published.row_options(r)
        if case == "options":
            opts["lora_rank"] = 4
        with pytest.raises(AssertionError, match="replayed again"):
            published._cached(r["model"], **opts)
    published._estimate_json.cache_clear()


def test_earlier_runs_differ_from_their_configuration_only_in_versions():
    """A row read at its own commit (``name@date``) is an earlier run of row ``name``:
    a full 40-hex commit, the same source, model, GPU, file and conditions except the
    library versions (and the loss named by the transformers release), and its own
    published value; the report names that commit next to the source."""
    import re

    from coursekit import published

    data = published.load()
    rows = {r["id"]: r for r in data["rows"]}
    earlier = [r for r in rows.values() if "@" in r["id"]]
    assert earlier
    for row in earlier:
        base = rows[row["id"].split("@")[0]]
        assert re.fullmatch(r"[0-9a-f]{40}", row["commit"]), row["id"]
        assert row["commit"] != data["sources"][row["source"]]["commit"]
        for key in ("source", "model", "gpu", "file", "devices"):
            assert row.get(key) == base.get(key), (row["id"], key)
        same = {
            k: v for k, v in row["conditions"].items() if k not in ("versions", "loss")
        }
        assert same == {
            k: v for k, v in base["conditions"].items() if k not in ("versions", "loss")
        }
        assert row["conditions"]["versions"] != base["conditions"]["versions"]
        assert row["metric"]["kind"] == base["metric"]["kind"]
    text = (ROOT / "benchmarks/results/published_gpu.md").read_text("utf-8")
    for row in earlier:
        assert f"| {row['id']} | {row['source']}@{row['commit'][:9]} |" in text
