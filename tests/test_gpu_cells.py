"""GPU cells: visibly labelled, stored with a result, self-contained in chapters.

The stored outputs come from ``make nb``: on a machine without CUDA a GPU cell's output
is its CPU small-size run, under the label ``coursekit.gpu.CPU_LABEL``; with a GPU, the
GPU run. nbval runs every notebook with COURSE_GPU=cpu, so each GPU cell's real code
executes at its smallest size in its place, and checks what it prints instead of
comparing it (machine-dependent timings; ``gpu_run_problem`` in tests/nbval_plugin.py).
Here: labels and tags, the stored outputs, a chapter's GPU cells needing only the setup
cell, the checks themselves, and each cell's decisions for faked GPUs.
"""

import re

import nbformat
import pytest
import torch

from coursekit import gpu
from coursekit.gpu import LABEL_PREFIXES, SKIP_PREFIX
from tests.notebooks import all_notebooks, tags

LABEL = "【Skeleton】需要 GPU"


def _gpu_notebooks():
    out = []
    for p in all_notebooks():
        nb = nbformat.read(p, as_version=4)
        if any("gpu" in tags(c) for c in nb.cells):
            out.append(p)
    return out


@pytest.mark.parametrize("path", all_notebooks(), ids=lambda p: p.name)
def test_gpu_cells_are_labelled_and_tagged(path):
    nb = nbformat.read(path, as_version=4)
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        uses = "@gpu_cell" in c.source
        tagged = "gpu" in tags(c)
        assert uses == tagged, (
            f"{path.name} cell {i}: '@gpu_cell' and the 'gpu' tag must go together"
        )
        if tagged:
            assert LABEL in c.source.splitlines()[0], (
                f"{path.name} cell {i}: first line must carry {LABEL}"
            )


@pytest.mark.parametrize("path", _gpu_notebooks(), ids=lambda p: p.name)
def test_stored_gpu_output_is_a_labelled_run(path):
    """The book shows what every GPU cell printed: a labelled CPU small-size run or a
    GPU run, never a skip line."""
    nb = nbformat.read(path, as_version=4)
    for i, c in enumerate(nb.cells):
        if "gpu" not in tags(c):
            continue
        text = "".join(
            o.get("text", "") for o in c.outputs if o.get("output_type") == "stream"
        )
        assert text.startswith(LABEL_PREFIXES) and SKIP_PREFIX not in text, (
            f"{path.name} cell {i}: the stored output is not a labelled run "
            f"({text[:60]!r}); re-execute it: "
            f"make nb NB={path.relative_to(path.parents[1])}"
        )


def _python(source: str) -> str:
    """A cell's source as IPython runs it (``%magic`` lines become Python)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def _bound(table) -> set[str]:
    return {
        s.get_name()
        for s in table.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }


def bound_names(source: str) -> set[str]:
    """The names a cell binds at the notebook's top level (imports, assignments,
    definitions)."""
    import symtable

    return _bound(symtable.symtable(_python(source), "<cell>", "exec"))


def free_names(source: str) -> set[str]:
    """The global names a cell reads (at its top level or inside its functions) that
    it does not bind itself and Python and IPython do not provide."""
    import builtins
    import symtable

    table = symtable.symtable(_python(source), "<cell>", "exec")
    used: set[str] = set()

    def walk(t, top: bool) -> None:
        used.update(
            s.get_name()
            for s in t.get_symbols()
            if s.is_referenced() and (top or s.is_global())
        )
        for child in t.get_children():
            walk(child, False)

    walk(table, True)
    return used - _bound(table) - set(dir(builtins)) - {"get_ipython", "display"}


@pytest.mark.parametrize(
    "path",
    [p for p in _gpu_notebooks() if p.parent.name == "book"],
    ids=lambda p: p.name,
)
def test_chapter_gpu_cells_need_only_the_setup_cell(path):
    """A chapter's GPU cell reads nothing but what its ``setup`` cell binds: with a
    GPU, ``make nb`` runs only the setup and GPU cells in a kernel that sees the GPU
    (coursekit.execute). nbval runs every GPU cell in place at CPU size and checks
    what it prints (tests/nbval_plugin.py); a lab's GPU cell runs the student's own
    functions and so depends on the cells before it by design."""
    nb = nbformat.read(path, as_version=4)
    setup: set[str] = set()
    for c in nb.cells:
        if c.cell_type == "code" and "setup" in tags(c):
            setup |= bound_names(c.source)
    assert setup, f"{path.name}: no cell tagged 'setup'"
    for i, c in enumerate(nb.cells):
        if "gpu" in tags(c):
            missing = sorted(free_names(c.source) - setup)
            assert not missing, (
                f"{path.name} cell {i}: the GPU cell reads {missing}, which only "
                "earlier cells define; import or define them in the setup cell or "
                "in the GPU cell itself"
            )


@pytest.mark.parametrize(
    "path",
    [p for p in _gpu_notebooks() if p.parent.name == "solutions"],
    ids=lambda p: p.name,
)
def test_lab_gpu_cells_need_only_setup_and_gpu_setup_cells(path):
    """A lab's GPU cell runs the student's functions: the cells it needs are tagged
    ``gpu-setup``, and the GPU pass of ``coursekit execute`` runs exactly the setup,
    gpu-setup and GPU cells in a fresh kernel. Every name the GPU cell (and the
    gpu-setup cells) read must be bound there."""
    from coursekit.execute import GPU_SETUP_TAG, SETUP_TAGS

    nb = nbformat.read(path, as_version=4)
    bound: set[str] = set()
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        t = set(tags(c))
        if t & (SETUP_TAGS | {GPU_SETUP_TAG, "gpu"}):
            if t & {GPU_SETUP_TAG, "gpu"}:
                missing = sorted(free_names(c.source) - bound)
                assert not missing, (
                    f"{path.name} cell {i} ({c.get('id')}): reads {missing}, which no "
                    f"setup or {GPU_SETUP_TAG} cell before it binds; tag the cell that "
                    f"defines them {GPU_SETUP_TAG!r}"
                )
            bound |= bound_names(c.source)


def test_free_names_finds_what_a_cell_borrows():
    setup = "import torch\nfrom coursekit import gpu_cell\nN = 3"
    cell = (
        "%matplotlib inline\n"
        "@gpu_cell\n"
        "def run(device, small):\n"
        "    x = torch.ones(N, device=device)\n"
        "    return helper(x) + len(plan)\n"
        "plan = [1]\n"
    )
    assert bound_names(setup) == {"torch", "gpu_cell", "N"}
    assert free_names(cell) == {"gpu_cell", "torch", "N", "helper"}
    assert free_names(cell) - bound_names(setup) == {"helper"}


def _stream_out(text: str) -> list:
    return [nbformat.v4.new_output("stream", name="stdout", text=text)]


def test_gpu_run_problem_rules():
    """What nbval checks in a GPU cell's fresh run instead of comparing it."""
    from tests.nbval_plugin import gpu_run_problem

    label = gpu.CPU_LABEL.format(on_gpu="测出真实显存。") + "\n"
    assert gpu_run_problem("x = 1", _stream_out(label + "peak 12 MiB\n")) is None
    skip = gpu_run_problem("x = 1", _stream_out(gpu.OFF_LINE + "\n"))
    assert skip and "skipped" in skip
    assert "label" in gpu_run_problem("x = 1", _stream_out("peak 12 MiB\n"))
    scaler = "def fp16_scaler_loop(device, small): ..."
    assert (
        gpu_run_problem(
            scaler, _stream_out(label + "5 back-offs (overflow), 1 growths\n")
        )
        is None
    )
    assert "backs off" in gpu_run_problem(
        scaler, _stream_out(label + "0 back-offs (overflow), 1 growths\n")
    )
    qlora = "def qlora_finetune(device, small): ..."
    good = label + "nf4 ... trainmem estimate ... 3 ms/step ... 4 ms/step\n"
    assert gpu_run_problem(qlora, _stream_out(good)) is None
    assert gpu_run_problem(qlora, _stream_out(label + "nf4 3 ms/step\n"))


# --------------------------------------------------------------------------------------
# Each GPU cell's decisions, on a CPU-only machine, with faked capabilities: T4 (sm_75),
# A100 (sm_80), H100/H200 (sm_90). The cells call these functions (checked below).
# --------------------------------------------------------------------------------------

T4, A100, H100 = (7, 5), (8, 0), (9, 0)
CAPS = [T4, A100, H100]
GiB = 2**30

# GPU cell (function name or marker) -> the decision calls it must make
CELL_DECISIONS = {
    "def matmul_precision(": ["matmul_rows("],
    "def fp16_scaler_loop(": ["loss_scale_demo(", "scale_events("],
    "def check_estimate_on_device(": ["estimate_check_plan(", "free_memory("],
    "def flash_backends(": ["sdpa_dtype(", "sdpa_backend_ran("],
    "def qlora_finetune(": [
        "qlora_plan(",
        "prepare_model_for_kbit_training(",
        "PagedAdamW8bit(",
    ],
    "GPUS = usable_capacities()": ["usable_capacities("],
}


def test_gpu_cells_use_the_tested_decisions():
    sources = [
        c.source
        for p in all_notebooks()
        for c in nbformat.read(p, as_version=4).cells
        if c.cell_type == "code"
    ]
    for marker, calls in CELL_DECISIONS.items():
        cells = [s for s in sources if marker in s]
        assert len(cells) == 1, f"expected one cell with {marker!r}, found {len(cells)}"
        for call in calls:
            assert call in cells[0], f"the cell with {marker!r} must call {call!r}"


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_amp_plan_by_capability(cap):
    plan = gpu.amp_plan("cuda", cap)
    if cap < (8, 0):
        assert (plan.dtype, plan.use_scaler, plan.precision) == (
            torch.float16,
            True,
            "fp16-amp",
        )
    else:
        assert (plan.dtype, plan.use_scaler, plan.precision) == (
            torch.bfloat16,
            False,
            "bf16-amp",
        )
    assert (
        gpu.amp_plan("cpu").dtype is torch.bfloat16
        and not gpu.amp_plan("cpu").use_scaler
    )


def test_amp_plan_reads_the_real_device_when_not_given(monkeypatch):
    monkeypatch.setattr(gpu, "compute_capability", lambda device=0: T4)
    assert gpu.amp_plan("cuda").precision == "fp16-amp"


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_tf32_row_is_absent_below_sm80(cap):
    rows = {r.label: r for r in gpu.matmul_rows("cuda", cap)}
    assert list(rows) == ["fp32 (ieee)", "tf32", "bf16", "fp16"]
    assert rows["tf32"].absent is (cap < (8, 0))
    assert gpu.tf32_available(cap) is (cap >= (8, 0))
    if cap < (8, 0):
        assert "sm_75" in rows["tf32"].note and "emulated" in rows["bf16"].note
    else:
        assert rows["tf32"].precision == "high" and rows["bf16"].note == ""
    assert rows["fp32 (ieee)"].precision == "highest"


def _simulated_scaler(plan: dict, steps: int, tokens: int) -> list[float]:
    """GradScaler's rules against the overflow point the plan assumes (S / tokens > fp16
    max)."""
    scale, good, out = plan["init_scale"], 0, []
    for _ in range(steps):
        if scale / tokens > gpu.FP16_MAX:
            scale, good = scale * 0.5, 0
        else:
            good += 1
            if good == plan["growth_interval"]:
                scale, good = scale * 2.0, 0
        out.append(scale)
    return out


@pytest.mark.parametrize("steps,tokens", [(60, 16 * 128), (8, 4 * 16), (200, 8 * 2048)])
def test_loss_scale_demo_backs_off_and_grows_within_its_steps(steps, tokens):
    plan = gpu.loss_scale_demo(steps, tokens)
    assert plan["init_scale"] / tokens > 2 * gpu.FP16_MAX  # the first steps overflow
    assert plan["growth_interval"] * 3 <= steps  # several growth attempts
    events = gpu.scale_events(
        [plan["init_scale"], *_simulated_scaler(plan, steps, tokens)]
    )
    assert events["backoff"] >= 2 and events["growth"] >= 1, events
    # the chapter's old settings: default init 2**16 and growth_interval 2000 show
    # nothing in 60 steps
    old = gpu.scale_events(
        _simulated_scaler({"init_scale": 2.0**16, "growth_interval": 2000}, 60, 2048)
    )
    assert old == {"growth": 0, "backoff": 0}


def test_loss_scale_demo_rejects_tiny_runs():
    with pytest.raises(ValueError, match="steps >= 6"):
        gpu.loss_scale_demo(3, 64)


def test_fit_batch_scales_to_free_memory():
    need = lambda b: 2 * GiB + b * GiB  # noqa: E731
    assert gpu.fit_batch(100 * GiB, need, want=4) == 4
    assert gpu.fit_batch(6 * GiB, need, want=4) == 3  # 0.85 * 6 = 5.1 GiB
    with pytest.raises(
        ValueError, match=r"batch 1 needs 3.00 GiB; the device has 2.00 GiB free"
    ):
        gpu.fit_batch(2 * GiB, need, want=4)


def test_free_memory_reads_mem_get_info(monkeypatch):
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda *a: (int(14.3 * GiB), int(14.56 * GiB))
    )
    assert gpu.free_memory("cuda") == int(14.3 * GiB)
    assert gpu.free_memory("cpu") is None


@pytest.mark.parametrize(
    "cap,free_gib",
    [(T4, 14.3), (A100, 39.0), (A100, 78.6), (H100, 78.6), (H100, 138.0)],
    ids=["T4", "A100-40", "A100-80", "H100", "H200"],
)
def test_estimate_check_plan_on_each_gpu(cap, free_gib):
    from trainmem.measuring.models import get_config

    cfg = get_config("qwen2.5-0.5b")
    plan = gpu.estimate_check_plan(
        cfg, "cuda", cap, free_bytes=int(free_gib * GiB), want_batch=4, seq=512
    )
    assert plan.precision == ("fp16-amp" if cap < (8, 0) else "bf16-amp")
    assert 1 <= plan.batch <= 4 and plan.need_bytes <= 0.85 * free_gib * GiB
    if free_gib > 20:
        assert plan.batch == 4
    # the T4: b4 x s512 full fine-tuning of 0.5B does not fit in ~14 GiB with margin
    else:
        assert plan.batch < 4


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_sdpa_dtype_is_one_a_fused_backend_accepts(cap):
    dtype = gpu.sdpa_dtype("cuda", cap)
    assert dtype is (torch.float16 if cap < (8, 0) else torch.bfloat16)
    eligible = gpu.sdpa_eligible(cap, dtype)
    assert "memory-efficient" in eligible and eligible[-1] == "math"
    assert ("flash" in eligible) is (cap >= (8, 0))
    # the old cell's choice on a T4
    assert gpu.sdpa_eligible(T4, torch.bfloat16) == ["math"]
    assert gpu.sdpa_dtype("cpu") is torch.float32


def test_sdpa_backend_that_ran_is_detected_on_cpu():
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 16, 8)
    assert (
        gpu.sdpa_backend_ran(
            lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True)
        )
        == "flash (CPU kernel)"
    )
    with sdpa_kernel([SDPBackend.MATH]):
        assert (
            gpu.sdpa_backend_ran(lambda: F.scaled_dot_product_attention(q, q, q))
            == "math"
        )
    assert (
        gpu.sdpa_backend_from_ops(
            ["aten.empty", "aten._scaled_dot_product_efficient_attention"]
        )
        == "memory-efficient"
    )
    assert (
        gpu.sdpa_backend_from_ops(["aten._scaled_dot_product_cudnn_attention"])
        == "cuDNN"
    )


def test_picker_capacities_are_what_devices_report(monkeypatch):
    monkeypatch.setattr(gpu, "cuda_available", lambda: False)
    caps = gpu.usable_capacities()
    assert caps == gpu.REPORTED_GIB
    for name, gib in caps.items():
        nominal = float(re.search(r"(\d+)GB", name).group(1))
        assert gib < nominal, (
            f"{name}: {gib} GiB is not less than the nominal {nominal}"
        )
    assert caps["T4 16GB"] < 15


def test_picker_puts_this_gpu_first(monkeypatch):
    class Props:
        name, total_memory = "Tesla T4", 15_835_660_288

    monkeypatch.setattr(gpu, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: Props())
    caps = gpu.usable_capacities()
    assert next(iter(caps.items())) == ("this GPU (Tesla T4)", 14.75)


@pytest.mark.parametrize("cap", CAPS, ids=lambda c: f"sm_{c[0]}{c[1]}")
def test_qlora_plan_by_capability(cap):
    plan = gpu.qlora_plan("cuda", cap)
    q = plan.quant_kwargs
    assert (
        q["load_in_4bit"]
        and q["bnb_4bit_quant_type"] == "nf4"
        and q["bnb_4bit_use_double_quant"]
    )
    assert (
        q["bnb_4bit_compute_dtype"]
        is plan.compute_dtype
        is (torch.float16 if cap < (8, 0) else torch.bfloat16)
    )
    assert plan.optimizer == "PagedAdamW8bit"


def test_describe_names_the_capability_decisions(monkeypatch):
    monkeypatch.setattr(gpu, "cuda_available", lambda: True)
    monkeypatch.setattr(gpu, "compute_capability", lambda device=0: T4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Tesla T4")
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda *a: (int(14.3 * GiB), 15_835_660_288)
    )
    monkeypatch.setenv("COURSE_GPU", "auto")
    assert gpu.describe() == (
        "COURSE_GPU=auto; CUDA: Tesla T4 (sm_75), bf16 native: False, TF32: False, "
        "memory 14.30 of 14.75 GiB free"
    )


def test_gpu_pass_runs_setup_gpu_setup_and_gpu_cells_in_order(monkeypatch, tmp_path):
    """With a GPU, make nb's second kernel gets the setup, gpu-setup and GPU cells (in
    notebook order) and nothing else; the GPU cell's output is stored back."""
    from coursekit import execute

    def code(src, *tags):
        return nbformat.v4.new_code_cell(src, metadata={"tags": list(tags)})

    nb = nbformat.v4.new_notebook(
        cells=[
            code("a = 1", "setup"),
            code("b = 2"),
            code("c = 3", "gpu-setup"),
            nbformat.v4.new_markdown_cell("text"),
            code("print(a + c)", "gpu"),
        ]
    )
    ran = []

    def fake_run(sub, path, timeout, env):
        ran.append([c.source for c in sub.cells])
        sub.cells[-1].outputs = [nbformat.v4.new_output("stream", text="4\n")]

    monkeypatch.setattr(execute, "_run", fake_run)
    assert execute.run_gpu_cells_on_cuda(nb, tmp_path / "x.ipynb", 10) == 1
    assert ran == [["a = 1", "c = 3", "print(a + c)"]]
    assert nb.cells[-1].outputs[0]["text"] == "4\n"
