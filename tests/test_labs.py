"""Lab generation: solutions/ → labs/ is up to date, the stub format, Colab badge and
setup cell."""

from __future__ import annotations

import importlib.util as _iu
import random
import subprocess
import sys
import types
from pathlib import Path

import nbformat
import pytest

from coursekit.colab import read_repository, setup_cell_source
from coursekit.labs import (
    LabFormatError,
    generate,
    make_lab,
    strip_code,
    strip_markdown,
)

ROOT = Path(__file__).resolve().parents[1]
_REAL_FIND_SPEC = _iu.find_spec
LABS = sorted((ROOT / "solutions").glob("lab*.ipynb"))


def test_labs_check_passes():
    """`python -m coursekit labs --check`: labs/ is exactly what the solutions
    generate."""
    assert generate(ROOT, check=True) == []
    r = subprocess.run(
        [sys.executable, "-m", "coursekit", "labs", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


def test_check_names_stale_and_orphan_labs(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labs").mkdir()
    (tmp_path / "_config.yml").write_text((ROOT / "_config.yml").read_text())
    src = LABS[0]
    (tmp_path / "solutions" / src.name).write_bytes(src.read_bytes())
    assert generate(tmp_path, check=True) == [f"labs/{src.name}"]  # missing
    assert generate(tmp_path) == [f"labs/{src.name}"]  # written
    assert generate(tmp_path, check=True) == []
    lab = tmp_path / "labs" / src.name
    lab.write_text(lab.read_text().replace("raise NotImplementedError", "return 42", 1))
    (tmp_path / "labs" / "lab99_orphan.ipynb").write_text("{}")
    r = subprocess.run(
        [sys.executable, "-m", "coursekit", "labs", "--check", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert r.returncode == 1
    assert f"labs/{src.name}" in r.stderr and "lab99_orphan" in r.stderr


def test_strip_code_keeps_indentation_and_hint():
    src = (
        'def f(x):\n    """doc"""\n'
        "    ### BEGIN SOLUTION\n    # HINT: 用 x 的平方\n    y = x * x\n"
        "    return y\n    ### END SOLUTION\n\n"
        "### BEGIN SOLUTION\nz = 1\n### END SOLUTION\nprint(z)"
    )
    assert strip_code(src) == (
        'def f(x):\n    """doc"""\n'
        "    # TODO: 用 x 的平方\n    raise NotImplementedError\n\n"
        "# TODO: 在这里实现\nraise NotImplementedError\nprint(z)"
    )


@pytest.mark.parametrize(
    "bad",
    [
        "### BEGIN SOLUTION\nx = 1",
        "### END SOLUTION",
        "### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION",
    ],
)
def test_strip_code_rejects_broken_markers(bad):
    with pytest.raises(LabFormatError):
        strip_code(bad, "cell 3")


def test_strip_markdown():
    assert (
        strip_markdown("答：<!-- BEGIN SOLUTION -->秘密<!-- END SOLUTION -->。")
        == "答：*（在此写下你的答案）*。"
    )
    with pytest.raises(LabFormatError):
        strip_markdown("<!-- BEGIN SOLUTION --> open")


def _toy_solution():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 实验 9"),
        nbformat.v4.new_code_cell(
            "from coursekit import setup\nsetup()", metadata={"tags": ["setup"]}
        ),
        nbformat.v4.new_code_cell(
            "def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION"
        ),
        nbformat.v4.new_code_cell("print(f())", metadata={"tags": ["solution-only"]}),
    ]
    nb.cells[2].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nb.cells[2].execution_count = 3
    nb.metadata["widgets"] = {"x": 1}
    return nb


def test_make_lab_structure_and_colab_metadata():
    repo = read_repository(ROOT / "_config.yml")
    lab = make_lab(_toy_solution(), "lab09_toy.ipynb", repo)
    tags = [c.metadata.get("tags", []) for c in lab.cells]
    assert [c.cell_type for c in lab.cells] == [
        "markdown",
        "markdown",
        "code",
        "code",
        "code",
    ]
    assert (
        tags[1] == ["colab-badge"]
        and tags[2] == ["colab-setup"]
        and tags[3] == ["setup"]
    )
    url = f"https://colab.research.google.com/github/{repo.slug}/blob/{repo.branch}/labs/lab09_toy.ipynb"
    assert url in lab.cells[1].source and repo.url.startswith("https://github.com/")
    assert (
        lab.cells[4].source
        == "def f():\n    # TODO: 在这里实现\n    raise NotImplementedError"
    )
    assert all(
        c.outputs == [] and c.execution_count is None
        for c in lab.cells
        if c.cell_type == "code"
    )
    assert (
        lab.metadata["accelerator"] == "GPU"
        and lab.metadata["colab"]["gpuType"] == "T4"
    )
    assert "widgets" not in lab.metadata and lab.metadata["lab"]["id"] == "lab09"


@pytest.mark.parametrize("path", LABS, ids=lambda p: p.stem)
def test_generated_lab_has_no_solution_and_no_outputs(path):
    lab = nbformat.read(ROOT / "labs" / path.name, as_version=4)
    text = "\n".join(c.source for c in lab.cells)
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    assert "raise NotImplementedError" in text
    assert all(not c.get("outputs") for c in lab.cells if c.cell_type == "code")
    assert lab.cells[1].metadata["tags"] == ["colab-badge"]
    assert any(c.metadata.get("tags") == ["colab-setup"] for c in lab.cells)


def _run_setup_cell(monkeypatch, on_colab: bool, missing: set[str]):
    import importlib.util

    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    real_find = _REAL_FIND_SPEC
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: None if n in missing else real_find(n, *a),
    )
    if on_colab:
        monkeypatch.setitem(
            sys.modules, "google.colab", types.ModuleType("google.colab")
        )
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(
        compile(
            setup_cell_source(read_repository(ROOT / "_config.yml")), "setup", "exec"
        ),
        {},
    )
    return calls


def test_setup_cell_outside_colab_installs_nothing_and_prints_device(
    monkeypatch, capsys
):
    assert (
        _run_setup_cell(
            monkeypatch, on_colab=False, missing={"coursekit", "trainmem", "peft"}
        )
        == []
    )
    assert "COURSE_GPU=" in capsys.readouterr().out


def test_setup_cell_on_colab_installs_only_what_is_missing(monkeypatch, capsys):
    import torch

    repo = read_repository(ROOT / "_config.yml")
    calls = _run_setup_cell(monkeypatch, on_colab=True, missing={"trainmem", "peft"})
    args = [" ".join(c[3:]) for c in calls]
    assert args == [
        f"install -q --no-deps git+{repo.url}@{repo.branch}",
        f"install -q peft torch=={torch.__version__.split('+')[0]}",
    ]
    joined = " ".join(args)
    for banned in (
        "jupyter",
        "ipykernel",
        "ipywidgets",
        "notebook",
        "torch>",
        "-U",
        "--upgrade",
    ):
        assert banned not in joined
    # everything present
    assert _run_setup_cell(monkeypatch, on_colab=True, missing=set()) == []
    assert "COURSE_GPU=" in capsys.readouterr().out


def test_lab03_hidden_reference_matches_transformers():
    """The count_params reference in tests/grading/lab03.py agrees with real (meta)
    models."""
    import importlib.util as iu

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = iu.spec_from_file_location(
        "_lab03_hidden", ROOT / "tests" / "grading" / "lab03.py"
    )
    mod = iu.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = random.Random(7)
    for _ in range(3):
        cfg = mod.random_llama_cfg(rng)
        cfg.update(
            num_hidden_layers=min(cfg["num_hidden_layers"], 3),
            vocab_size=min(cfg["vocab_size"], 5000),
        )
        with torch.device("meta"):
            model = LlamaForCausalLM(LlamaConfig(**cfg))
        assert mod.ref_count_params(cfg) == sum(
            p.numel() for p in model.parameters()
        ), cfg


def test_glue_roles_are_inlined_from_the_solution():
    from coursekit.labs import inline_glue

    assert (
        inline_glue(
            "约 {glue:}`n_7b` B，{glue:text}`x` 与 {glue}`y`",
            {"n_7b": "6.74", "x": "1", "y": "2"},
        )
        == "约 6.74 B，1 与 2"
    )
    with pytest.raises(LabFormatError):
        inline_glue("{glue:}`missing`", {}, "cell 1")
    lab = nbformat.read(ROOT / "labs" / "lab03_memory_estimator.ipynb", as_version=4)
    assert not any("{glue" in c.source for c in lab.cells if c.cell_type == "markdown")
