"""The version matrix's second row: chapters and solutions at the declared floor
versions.

``make floor`` builds ``.venv-floor`` (transformers, peft, numpy, IPython, ipykernel,
ipywidgets at the lower bounds of ``pyproject.toml``; the CPU torch of ``.venv``) and
runs this file there with ``COURSE_FLOOR_RUN=1``: every chapter and solution is executed
top to bottom in a fresh kernel, and any error outside a cell tagged
``raises-exception`` fails. Outputs are not compared (nbval does that in ``.venv``);
timings and library reprs legitimately differ between versions.

In the ordinary run (``.venv``) only the bookkeeping tests run.
"""

from __future__ import annotations

import json
import os
from importlib import metadata

import nbformat
import pytest

from coursekit.floor import FLOOR_PACKAGES, constraints, floor_pins, requirements
from tests.notebooks import ROOT, all_notebooks

FLOOR_RUN = os.environ.get("COURSE_FLOOR_RUN") == "1"
# Slowest first, so the two xdist workers finish together (measured: `make floor
# --durations`).
SLOW_FIRST = (
    "06_lora_in_practice",
    "05_lora_principles",
    "lab06_capstone_lora_finetune",
    "07_quantization",
    "08_attention_inference_troubleshooting",
    "03_training_memory",
)


def _heaviest_first():
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    return sorted(all_notebooks(), key=lambda p: rank.get(p.stem, len(rank)))


def _same_versions(have: dict, want: dict) -> bool:
    from packaging.version import Version

    return set(have) == set(want) and all(
        Version(have[k]) == Version(want[k]) for k in want
    )


VERSIONS_CELL = (
    "import json, sys\nfrom importlib import metadata\n"
    "versions = {p: metadata.version(p) for p in %r}\n"
    "print(json.dumps({'python': sys.executable, **versions}))"
)


def test_floor_pins_are_the_declared_lower_bounds():
    pins = floor_pins()
    assert set(pins) == set(FLOOR_PACKAGES)
    assert [p.stem for p in _heaviest_first()][: len(SLOW_FIRST)] == list(SLOW_FIRST)
    assert constraints() == [f"{k}=={v}" for k, v in pins.items()]
    # what older Colab images ship: the floor the course promises to work on
    assert pins["transformers"].startswith("4.57.") and pins["peft"].startswith("0.17.")
    assert pins["ipython"].startswith("7.34") and pins["ipykernel"].startswith("6.17")
    assert pins["ipywidgets"] == "7.7.1" and pins["numpy"] == "2.0.2"


def test_floor_requirements_are_declared_ranges():
    reqs = requirements()
    assert reqs[:2] == ["-e", str(ROOT)]
    assert all(" " not in r for r in reqs), (
        "a requirement with a space would be split by make"
    )


def test_floor_rejects_a_missing_lower_bound(tmp_path):
    bad = tmp_path / "pyproject.toml"
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    bad.write_text(text.replace('"peft>=', '"peft<1,!=', 1), encoding="utf-8")
    with pytest.raises(ValueError, match="peft"):
        floor_pins(bad)


@pytest.mark.floor
@pytest.mark.skipif(not FLOOR_RUN, reason="runs in .venv-floor (make floor)")
def test_this_interpreter_is_the_floor():
    have = {p: metadata.version(p) for p in FLOOR_PACKAGES}
    assert _same_versions(have, floor_pins()), (
        f"make floor must run at the declared lower bounds, not {have}"
    )


@pytest.mark.floor
@pytest.mark.skipif(not FLOOR_RUN, reason="runs in .venv-floor (make floor)")
@pytest.mark.parametrize(
    "path", _heaviest_first(), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_notebook_runs_at_floor(path):
    from coursekit.execute import kernel_env
    from coursekit.nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    probe = nbformat.v4.new_code_cell(VERSIONS_CELL % (FLOOR_PACKAGES,))
    nb.cells.insert(0, probe)
    env_before = dict(os.environ)
    os.environ.update(kernel_env())  # what every stored output is made with
    try:
        # errors stop the run (CellExecutionError) unless the cell is tagged
        # raises-exception
        NotebookClient(
            nb,
            timeout=600,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        ).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    seen = json.loads("".join(o.get("text", "") for o in probe.outputs))
    assert _same_versions({p: seen[p] for p in FLOOR_PACKAGES}, floor_pins()), (
        f"the kernel ({seen['python']}) runs {seen}, not the floor versions"
    )


def test_link_torch_reuses_the_cpu_torch(tmp_path):
    """The floor venv gets this interpreter's torch by symlink: pip there sees it
    installed."""
    import subprocess
    import sys

    from coursekit.floor import link_torch

    with pytest.raises(FileNotFoundError, match="no lib/python"):
        link_torch(tmp_path)
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True
    )
    links = link_torch(venv)
    names = {p.name for p in links}
    assert "torch" in names and any(
        n.startswith("torch-") and n.endswith(".dist-info") for n in names
    )
    assert all(p.is_symlink() and p.resolve().exists() for p in links)
    assert link_torch(venv) == []  # idempotent
    r = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "from importlib import metadata; print(metadata.version('torch'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout.strip() == metadata.version("torch")


def test_make_test_runs_the_floor_pass():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = text.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "$(MAKE) --no-print-directory floor" in recipe
    assert "COURSE_FLOOR_RUN=1" in text and "link-torch" in text
