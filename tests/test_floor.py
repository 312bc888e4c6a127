"""The version matrix's second row: chapters and solutions at the declared floor
versions.

``.venv-floor`` holds transformers, peft, numpy, IPython, ipykernel, ipywidgets at the
lower bounds of ``pyproject.toml`` (and the CPU torch of ``.venv``). With
``COURSE_FLOOR_VENV`` naming it (``make floor``, which ``make test`` runs after its
main pass), every chapter and solution is executed top to bottom in a kernel
started from that environment (one per pytest worker, its namespace emptied before
each notebook: ``floor_kernel``), and any error outside a cell tagged
``raises-exception`` fails. A first cell prints the kernel's interpreter and
versions, checked against the floor pins.
Outputs are not compared (nbval does that on ``.venv``'s kernel); timings and library
reprs legitimately differ between versions. pytest itself runs in ``.venv``: what is
tested at the floor is what the notebooks import, not the test tools.

Without ``COURSE_FLOOR_VENV`` only the bookkeeping tests run.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

import nbformat
import pytest

from coursekit.floor import FLOOR_PACKAGES, constraints, floor_pins, requirements
from tests.notebooks import ROOT, all_notebooks

FLOOR_VENV = os.environ.get("COURSE_FLOOR_VENV", "")


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


def floor_kernel_manager(venv: str | Path, sockets: str | Path | None = None):
    """A kernel manager whose ``python3`` is the one ``venv`` installed (and no
    other: the current interpreter's own kernel is not added as a fallback).
    ``sockets``: a folder for the kernel's channels over ZMQ's ``ipc`` transport
    (Unix sockets, as the grader runs kernels); without it, TCP ports on 127.0.0.1,
    which jupyter_client picks free and the kernel binds a moment later — another
    worker's kernel can take one in between ("Address already in use", "Kernel died
    before replying to kernel_info")."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    kernels = Path(venv).resolve() / "share" / "jupyter" / "kernels"
    if not (kernels / "python3" / "kernel.json").is_file():
        raise FileNotFoundError(
            f"{kernels / 'python3'}: no kernel; build the floor environment first "
            "(make floor-venv)"
        )
    specs = KernelSpecManager(kernel_dirs=[str(kernels)], ensure_native_kernel=False)
    ipc = {}
    if sockets is not None:
        ipc = dict(transport="ipc", ip=str(Path(sockets) / "kernel"))
    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=specs, **ipc)


# The user namespace, the working folder and the few process-wide settings a notebook
# may change, put back before each notebook in a reused kernel (the modules imported
# stay: importing them again would find them in sys.modules anyway).
RESET_CELL = """\
def _floor_reset(folder, ip=get_ipython()):
    import gc, os, sys, warnings

    ns = ip.user_ns
    first = getattr(sys, "_course_floor_state", None)
    if first is None:  # the kernel's own state, before any notebook ran
        dunders = {k: v for k, v in ns.items() if k.startswith("__")}
        first = (list(warnings.filters), dict(os.environ), dunders)
        sys._course_floor_state = first
    ip.run_line_magic("reset", "-f")
    # the reset empties __main__'s namespace, module attributes included (__spec__,
    # which multiprocessing's spawn reads): the fresh kernel's are put back
    for k in [k for k in ns if k.startswith("__") and k not in first[2]]:
        del ns[k]
    ns.update(first[2])
    warnings.filters[:] = first[0]
    os.environ.clear()
    os.environ.update(first[1])
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is not None:
        plt.close("all")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
    os.chdir(folder)
    gc.collect()


_floor_reset(%r)
"""


@pytest.fixture(scope="session")
def floor_kernel(tmp_path_factory):
    """One kernel from .venv-floor per pytest worker, reused notebook after notebook
    (``get()`` returns it, started on first use or after one failed or died).

    Starting a kernel and importing torch, transformers and peft in it again for each
    of the 16 notebooks was the pass's fixed cost (about 2 s of CPU a kernel and 2-3 s
    of imports). What a fresh kernel would add here, the main pass already proves:
    nbval runs every notebook top to bottom in a kernel of its own, so a notebook
    that leans on a name another one defined fails there. This pass asks only whether
    the code runs at the floor versions; before each notebook RESET_CELL empties the
    user namespace and restores the working folder, environment, warning filters,
    torch's default dtype and grad mode, and closes open figures.
    """
    from jupyter_core.utils import run_sync

    sockets = tmp_path_factory.mktemp("floor-kernel")
    held: dict = {}

    def stop():
        km = held.pop("km", None)
        if km is not None and km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)

    def get():
        km = held.get("km")
        if km is None or not run_sync(km.is_alive)():
            stop()
            km = held["km"] = floor_kernel_manager(FLOOR_VENV, sockets=sockets)
        return km

    get.stop = stop
    yield get
    stop()


@pytest.mark.floor
@pytest.mark.skipif(not FLOOR_VENV, reason="needs COURSE_FLOOR_VENV (make floor)")
@pytest.mark.parametrize(
    "path", all_notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_notebook_runs_at_floor(path, floor_kernel):
    from coursekit.execute import kernel_env
    from coursekit.nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    probe = nbformat.v4.new_code_cell(VERSIONS_CELL % (FLOOR_PACKAGES,))
    reset = nbformat.v4.new_code_cell(RESET_CELL % str(path.parent))
    nb.cells[:0] = [probe, reset]
    # errors stop the run (CellExecutionError) unless the cell is tagged
    # raises-exception; the kernel gets the environment every stored output is made
    # with (the native kernel path)
    client = NotebookClient(
        nb,
        km=floor_kernel(),
        timeout=600,
        resources={"metadata": {"path": str(path.parent)}},
    )
    try:
        client.execute(env=kernel_env())
    except BaseException:
        floor_kernel.stop()  # the next notebook gets a fresh kernel
        raise
    finally:
        if client.kc is not None:
            client.kc.stop_channels()
    seen = json.loads("".join(o.get("text", "") for o in probe.outputs))
    floor_python = Path(FLOOR_VENV).resolve() / "bin"
    assert Path(seen["python"]).parent.resolve() == floor_python, (
        f"the kernel runs {seen['python']}, not the floor environment's interpreter"
    )
    assert _same_versions({p: seen[p] for p in FLOOR_PACKAGES}, floor_pins()), (
        f"the kernel ({seen['python']}) runs {seen}, not the floor versions"
    )


def test_floor_kernel_manager_names_a_missing_environment(tmp_path):
    with pytest.raises(FileNotFoundError, match="make floor-venv"):
        floor_kernel_manager(tmp_path)


def test_link_torch_reuses_the_cpu_torch(tmp_path):
    """The floor venv gets this interpreter's torch by symlink (metadata copied):
    pip and uv there see it installed."""
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
    for p in links:
        if p.name.endswith(".dist-info"):  # a real folder: uv skips a linked one
            assert p.is_dir() and not p.is_symlink() and (p / "RECORD").is_file()
        else:
            assert p.is_symlink() and p.resolve().exists()
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
    # make floor-venv installs with uv: it must list the linked torch as installed,
    # or it would download another one into the floor environment
    # (a skip for a missing tool fails under CI=true: tests/conftest.py)
    uv = Path(sys.executable).with_name("uv")
    if not uv.exists():
        pytest.skip(f"uv is not installed in {uv.parent}: make venv installs it")
    listed = subprocess.run(
        [
            str(uv),
            "pip",
            "list",
            "--format",
            "json",
            "--python",
            str(venv / "bin/python"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert {"name": "torch", "version": metadata.version("torch")} in json.loads(
        listed.stdout
    )


def test_make_test_runs_the_floor_pass():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = text.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert "$(MAKE) --no-print-directory floor" in recipe
    assert "COURSE_FLOOR_VENV=" in text.split("\nfloor:", 1)[1].split("\n\n", 1)[0]
    rule = [ln for ln in text.splitlines() if ln.startswith("test: $(STAMP)")]
    assert len(rule) == 1 and "$(FLOOR_STAMP)" in rule[0]
    assert "link-torch" in text


HF_DEFAULTS_SCRIPT = """
import json, warnings
warnings.filterwarnings("ignore")
import torch, transformers
from transformers import TrainingArguments
from trainmem.measuring.models import build_model, get_config
m = build_model(get_config("tiny"))
m.gradient_checkpointing_enable()
fns = {getattr(mod, "_gradient_checkpointing_func", None) for mod in m.modules()}
fns.discard(None)
optim = TrainingArguments("%s", report_to=[]).optim
from trainmem.from_hf import _sharding_options
fsdp = {
    words: _sharding_options(TrainingArguments("unused", fsdp=words, report_to=[]))
    for words in ("full_shard auto_wrap", "shard_grad_op auto_wrap")
}
print(json.dumps({
    "fsdp": fsdp,
    "transformers": transformers.__version__,
    "torch": torch.__version__.split("+")[0],
    "use_reentrant": sorted({f.keywords.get("use_reentrant") for f in fns}),
    "optim": str(getattr(optim, "value", optim)),
}))
"""


@pytest.mark.parametrize(
    "env", ["main", pytest.param("floor", marks=pytest.mark.floor)]
)
def test_hf_defaults_are_those_of_the_installed_transformers(env, tmp_path):
    """``trainmem hf`` fills the fields a TrainingArguments dict leaves out with the
    defaults of the transformers and torch named in ``versions``: the checkpointing
    form (``use_reentrant``) and ``optim``. Checked against the real thing, in both
    environments (transformers 5 in ``.venv``, 4.x at the floor):
    ``gradient_checkpointing_enable()`` and ``TrainingArguments().optim`` there; and
    the ZeRO stage read from ``TrainingArguments(fsdp=...)`` as each keeps it."""
    import subprocess

    from trainmem.versions import (
        hf_checkpointing_reentrant,
        hf_default_optim,
        parse_versions,
    )

    if env == "floor" and not FLOOR_VENV:
        pytest.skip("needs COURSE_FLOOR_VENV (make floor)")
    if env == "main":  # this process runs .venv
        seen = _run_script(HF_DEFAULTS_SCRIPT % (tmp_path / "out"))
    else:
        out = subprocess.run(
            [
                str(Path(FLOOR_VENV) / "bin/python"),
                "-c",
                HF_DEFAULTS_SCRIPT % (tmp_path / "out"),
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        seen = json.loads(out.stdout.strip().splitlines()[-1])
    versions = parse_versions(
        f"transformers={seen['transformers']},torch={seen['torch']}"
    )
    assert seen["use_reentrant"] == [hf_checkpointing_reentrant(versions)], seen
    assert seen["optim"] == hf_default_optim(versions), seen
    # TrainingArguments(fsdp=...) as each transformers keeps it (4.x: a list of
    # FSDPOption; 5.x: True and fsdp_config["reshard_after_forward"])
    assert seen["fsdp"] == {
        "full_shard auto_wrap": {"zero": 3, "zero_impl": "fsdp"},
        "shard_grad_op auto_wrap": {"zero": 2, "zero_impl": "fsdp"},
    }, seen


def _run_script(script: str) -> dict:
    """``script`` run in this process; the JSON line it prints."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        exec(compile(script, "<hf-defaults>", "exec"), {})
    return json.loads(buf.getvalue().strip().splitlines()[-1])
