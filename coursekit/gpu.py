"""The GPU flag, device choice, and the decisions GPU cells make by capability.

One environment variable, ``COURSE_GPU``, decides what a GPU cell does:

=========  ===========================================================================
value      behaviour
=========  ===========================================================================
``auto``   (default) run on CUDA when a device is present; otherwise run on the CPU
           at the cell's smallest sizes, under the label :data:`CPU_LABEL`.
``cpu``    run the GPU cell on the CPU at its smallest sizes (same label).
``0/off``  skip (print :data:`OFF_LINE`).
``1/on``   run on CUDA; raise :class:`GPUUnavailableError` when there is no device.
=========  ===========================================================================

A GPU cell in a notebook looks like::

    # 类型：【Skeleton】需要 GPU
    @gpu_cell
    def fp16_loop(device, small):
        ...                      # real code; `small` is True when running on CPU

``gpu_cell`` calls the function at once with ``device`` (a ``torch.device``) and
``small`` (bool) and returns its result. Before the cell's own output it prints one
label line saying where the output comes from: a CPU small-size run (with what a GPU
run would add: ``@gpu_cell(on_gpu="…")`` says it for one cell) or the named GPU. So a
book executed on a machine without CUDA still shows every GPU section's result, and
says that it is the small CPU run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, TypeVar, overload

from trainmem.gpus import SM80 as SM80

ENV_VAR = "COURSE_GPU"
ALLOWED = ("auto", "cpu", "on", "off", "1", "0")
# : First line of a GPU cell's output when it ran on the CPU at small size (``auto``
# without CUDA, or ``cpu``); ``{on_gpu}`` says what the GPU run adds.
CPU_LABEL = "以下为 CPU 小规模运行的输出；在 GPU 上运行会{on_gpu}"
ON_GPU_DEFAULT = "用完整规模，并测出 CUDA 上真实的显存与耗时。"
# : First line of a GPU cell's output when it ran on a CUDA device.
GPU_LABEL = "以下为在 GPU（{name}）上运行的输出。"
# : Every label starts with one of these (the book styles that line as a note).
LABEL_PREFIXES = ("以下为 CPU 小规模运行的输出", "以下为在 GPU（")
# : How every skip line starts (``OFF_LINE``; the book never shows one: tests look for
# this prefix on the built pages).
SKIP_PREFIX = "[COURSE_GPU] 跳过 GPU 单元"
OFF_LINE = (
    "[COURSE_GPU] 跳过 GPU 单元：COURSE_GPU=off。设置 COURSE_GPU=cpu 或 auto 可运行它。"
)

T = TypeVar("T")


class GPUFlagError(ValueError):
    """``COURSE_GPU`` holds a value outside :data:`ALLOWED`."""


class GPUUnavailableError(RuntimeError):
    """``COURSE_GPU=on`` but no CUDA device is usable."""


def gpu_mode(value: str | None = None) -> str:
    """Normalised mode: one of ``"auto"``, ``"cpu"``, ``"on"``, ``"off"``.

    ``value`` defaults to the ``COURSE_GPU`` environment variable (unset or empty →
    ``auto``). Raises :class:`GPUFlagError` naming the allowed values for anything else.
    """
    raw = os.environ.get(ENV_VAR, "") if value is None else value
    v = raw.strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v == "cpu":
        return "cpu"
    if v in ("1", "on", "true", "yes"):
        return "on"
    if v in ("0", "off", "false", "no"):
        return "off"
    raise GPUFlagError(
        f"{ENV_VAR} must be one of auto|cpu|on|off (or 1/0), got {raw!r}"
    )


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device (tests monkeypatch this)."""
    import torch

    return bool(torch.cuda.is_available()) and torch.cuda.device_count() > 0


@dataclass(frozen=True)
class DeviceChoice:
    """What a GPU cell should do: ``run`` it on ``device``; ``small`` asks for tiny
    sizes."""

    mode: str
    run: bool
    device: str | None  # "cuda" / "cpu" / None when skipped
    small: bool
    message: str | None  # the line printed when skipped


def choose_device(value: str | None = None) -> DeviceChoice:
    """Decide, from the flag and the hardware, where a GPU cell runs.

    >>> choose_device("cpu")
    DeviceChoice(mode='cpu', run=True, device='cpu', small=True, message=None)
    """
    mode = gpu_mode(value)
    if mode == "off":
        return DeviceChoice(mode, False, None, False, OFF_LINE)
    if mode == "cpu":
        return DeviceChoice(mode, True, "cpu", True, None)
    has_cuda = cuda_available()
    if mode == "on":
        if not has_cuda:
            raise GPUUnavailableError(
                f"{ENV_VAR}=on but no CUDA device is available "
                f"(torch.cuda.is_available() "
                "is False). Use a GPU runtime (Colab: 代码执行程序 → 更改运行时类型 → "
                "GPU), "
                f"or set {ENV_VAR}=cpu to run this cell on the CPU at small size."
            )
        return DeviceChoice(mode, True, "cuda", False, None)
    if has_cuda:
        return DeviceChoice(mode, True, "cuda", False, None)
    return DeviceChoice(mode, True, "cpu", True, None)


def run_label(choice: DeviceChoice, on_gpu: str | None = None) -> str | None:
    """The label line printed before a GPU cell's output (None when it is skipped)."""
    if not choice.run:
        return None
    if choice.device == "cuda":
        import torch

        return GPU_LABEL.format(name=torch.cuda.get_device_name(0))
    text = (on_gpu or ON_GPU_DEFAULT).strip()
    if not text.endswith(("。", "！", "？", ".")):
        text += "。"
    return CPU_LABEL.format(on_gpu=text)


@overload
def gpu_cell(fn: Callable[..., T]) -> T | None: ...
@overload
def gpu_cell(*, on_gpu: str) -> Callable[[Callable[..., T]], T | None]: ...
def gpu_cell(fn=None, *, on_gpu=None):
    """Run ``fn(device, small)`` now according to ``COURSE_GPU``; return its result or
    None (``COURSE_GPU=off``).

    Used as a decorator on a notebook cell's function, so the cell's code is real code
    that a student can run on Colab, and CI can run with ``COURSE_GPU=cpu``. The output
    starts with one label line (:data:`CPU_LABEL` or :data:`GPU_LABEL`).
    ``@gpu_cell(on_gpu="…")`` says, for a CPU run, what the GPU run would add (Chinese,
    completing "在 GPU 上运行会…").
    """
    if fn is None:
        if on_gpu is not None and not (isinstance(on_gpu, str) and on_gpu.strip()):
            raise TypeError(
                f"gpu_cell(on_gpu=...) takes a non-empty string, got {on_gpu!r}"
            )
        return lambda f: gpu_cell(f, on_gpu=on_gpu)
    if not callable(fn):
        raise TypeError(
            f"gpu_cell decorates a function fn(device, small), got {fn!r}; "
            'write @gpu_cell or @gpu_cell(on_gpu="…")'
        )
    import torch

    choice = choose_device()
    if not choice.run:
        print(choice.message)
        return None
    print(run_label(choice, on_gpu), flush=True)
    return fn(torch.device(choice.device), choice.small)


def compute_capability(device: int = 0) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, or None when there is none."""
    if not cuda_available():
        return None
    import torch

    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def bf16_supported(
    device: str | None = None, capability: tuple[int, int] | None = None
) -> bool:
    """True when bfloat16 runs natively on ``device``.

    CPU: True (torch implements bf16 on CPU). CUDA: compute capability ≥ 8.0 (Ampere+).
    ``torch.cuda.is_bf16_supported()`` alone is not trusted: a T4 (sm_75) reports True
    through emulation, which is slow and gives no Tensor Core speed-up.
    """
    if capability is None:
        if device is None or str(device).startswith("cpu"):
            return True
        capability = compute_capability()
        if capability is None:
            return False
    return tuple(capability) >= SM80


def amp_dtype(device: str, capability: tuple[int, int] | None = None):
    """The autocast dtype a course cell should use: bf16 where native, else fp16 (with a
    scaler)."""
    import torch

    return torch.bfloat16 if bf16_supported(device, capability) else torch.float16


def describe() -> str:
    """One line about the flag and the device, printed by setup and by labs."""
    mode = gpu_mode()
    if cuda_available():
        import torch

        name = torch.cuda.get_device_name(0)
        cap = compute_capability()
        free, total = torch.cuda.mem_get_info()
        return (
            f"{ENV_VAR}={mode}; CUDA: {name} (sm_{cap[0]}{cap[1]}), bf16 native: "
            f"{bf16_supported('cuda')}, TF32: {tf32_available(cap)}, "
            f"memory {free / 2**30:.2f} of {total / 2**30:.2f} GiB free"
        )
    if mode in ("cpu", "auto"):
        cells = "run on CPU at small size"
    else:
        cells = "are skipped" if mode != "on" else "will fail"
    return f"{ENV_VAR}={mode}; CUDA: none (GPU cells {cells})"


# --------------------------------------------------------------------------------------
# Decisions the GPU cells make. Each is a plain function of the compute capability (and,
# where it matters, of the free memory), so tests fake sm_75 (T4), sm_80 (A100) and
# sm_90 (H100/H200) on a CPU-only machine. ``capability=None`` on CUDA reads the real
# device.
# --------------------------------------------------------------------------------------


def _cap(
    device_type: str, capability: tuple[int, int] | None
) -> tuple[int, int] | None:
    if device_type != "cuda":
        return None
    return tuple(capability) if capability is not None else compute_capability()


def tf32_available(capability: tuple[int, int] | None) -> bool:
    """TF32 Tensor Core matmuls exist from sm_80 (Ampere) on; below, the TF32 setting is
    a no-op."""
    return capability is not None and tuple(capability) >= SM80


@dataclass(frozen=True)
class AmpPlan:
    """How a training cell runs mixed precision on a device."""

    dtype: object  # torch.bfloat16 or torch.float16
    use_scaler: bool  # fp16 needs a GradScaler; bf16 has fp32's exponent range
    precision: (
        str  # the matching trainmem.estimate ``precision``: "bf16-amp" / "fp16-amp"
    )
    reason: str


def amp_plan(device_type: str, capability: tuple[int, int] | None = None) -> AmpPlan:
    """bf16 autocast where it is native (CPU, sm_80+); fp16 autocast + GradScaler below
    sm_80.

    >>> amp_plan("cuda", (7, 5)).precision
    'fp16-amp'
    """
    import torch

    cap = _cap(device_type, capability)
    if device_type != "cuda":
        return AmpPlan(torch.bfloat16, False, "bf16-amp", "CPU: bf16 autocast")
    if bf16_supported("cuda", cap):
        return AmpPlan(
            torch.bfloat16, False, "bf16-amp", f"sm_{cap[0]}{cap[1]}: native bf16"
        )
    where = f"sm_{cap[0]}{cap[1]}" if cap else "this GPU"
    return AmpPlan(
        torch.float16,
        True,
        "fp16-amp",
        f"{where} < sm_80: no native bf16, fp16 + GradScaler",
    )


@dataclass(frozen=True)
class MatmulRow:
    """One row of chapter 1's matmul table: run with ``precision``/``dtype``, or report
    ``note``."""

    label: str
    precision: str  # torch.set_float32_matmul_precision
    dtype: object
    absent: bool  # True: the format does not exist on this device; the row is not timed
    note: str


def matmul_rows(
    device_type: str, capability: tuple[int, int] | None = None
) -> list[MatmulRow]:
    """The fp32 / tf32 / bf16 / fp16 rows for ``device_type``, TF32 marked absent below
    sm_80."""
    import torch

    cap = _cap(device_type, capability)
    rows = [MatmulRow("fp32 (ieee)", "highest", torch.float32, False, "")]
    if device_type != "cuda":
        tf32_absent = "absent on CPU (the setting changes nothing)"
    elif not tf32_available(cap):
        where = f"sm_{cap[0]}{cap[1]}" if cap else "this GPU"
        tf32_absent = f"absent on {where} (needs sm_80+): the setting runs plain FP32"
    else:
        tf32_absent = ""
    rows.append(
        MatmulRow("tf32", "high", torch.float32, bool(tf32_absent), tf32_absent)
    )
    native = device_type != "cuda" or bf16_supported("cuda", cap)
    bf16_note = "" if native else "emulated: no bf16 Tensor Cores"
    rows.append(MatmulRow("bf16", "highest", torch.bfloat16, False, bf16_note))
    rows.append(MatmulRow("fp16", "highest", torch.float16, False, ""))
    return rows


# the chapters' domain logic lives in trainmem; the device decides the precision here
# (standard-library modules only at import time; torch ones inside the functions)
from trainmem.estimate import EstimateCheckPlan as EstimateCheckPlan  # noqa: E402
from trainmem.estimate import fit_batch as fit_batch  # noqa: E402
from trainmem.formats import FP16_MAX as FP16_MAX  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from trainmem.demos.quant import QLoRAPlan


def loss_scale_demo(steps: int, tokens_per_batch: int) -> dict:
    """:func:`trainmem.demos.scaler.loss_scale_demo` (chapter 2's GradScaler
    settings)."""
    from trainmem.demos.scaler import loss_scale_demo as demo

    return demo(steps, tokens_per_batch)


def scale_events(scales: list[float]) -> dict[str, int]:
    """:func:`trainmem.demos.scaler.scale_events` (growths and back-offs of a run)."""
    from trainmem.demos.scaler import scale_events as events

    return events(scales)


def free_memory(device_type: str) -> int | None:
    """Free bytes on the current CUDA device (``torch.cuda.mem_get_info``); None on
    CPU."""
    if device_type != "cuda":
        return None
    import torch

    return int(torch.cuda.mem_get_info()[0])


def estimate_check_plan(
    cfg,
    device_type: str,
    capability: tuple[int, int] | None = None,
    free_bytes: int | None = None,
    want_batch: int = 4,
    seq: int = 512,
) -> EstimateCheckPlan:
    """Precision from the capability (fp16-amp below sm_80, where SDPA's
    memory-efficient kernel runs and the estimate's ``attn="sdpa"`` holds), then
    :func:`trainmem.estimate.estimate_check_plan` (batch scaled to ``free_bytes``)."""
    from trainmem.estimate import estimate_check_plan as plan_for

    precision = amp_plan(device_type, capability).precision
    return plan_for(cfg, precision, free_bytes, want_batch, seq)


SDPA_OPS = {  # aten op seen by a TorchDispatchMode -> the SDPA backend that ran
    "aten._scaled_dot_product_flash_attention_for_cpu": "flash (CPU kernel)",
    "aten._scaled_dot_product_flash_attention": "flash",
    "aten._scaled_dot_product_efficient_attention": "memory-efficient",
    "aten._scaled_dot_product_cudnn_attention": "cuDNN",
    "aten._scaled_dot_product_fused_attention_overrideable": "fused (other device)",
}


def sdpa_dtype(device_type: str, capability: tuple[int, int] | None = None):
    """fp16 below sm_80 (bf16 there is accepted only by the math backend), bf16 from
    sm_80, fp32 on CPU."""
    import torch

    if device_type != "cuda":
        return torch.float32
    return (
        torch.bfloat16
        if bf16_supported("cuda", _cap(device_type, capability))
        else torch.float16
    )


def sdpa_eligible(
    capability: tuple[int, int], dtype, heads: int = 8, head_dim: int = 64
) -> list[str]:
    """SDPA CUDA backends whose checks accept a causal, unmasked call in ``dtype``
    on ``capability`` (``heads`` query and key/value heads of ``head_dim``), as the
    installed torch checks them (:func:`trainmem.sdpa.check`): flash from sm_80 in
    fp16/bf16; memory-efficient from sm_50, bf16 only from sm_80
    (``less_than_sm80_mem_efficient_dtypes``); math always."""
    import torch

    from trainmem import sdpa
    from trainmem.versions import parse_versions

    names = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
    call = sdpa.Call(names[dtype], heads, heads, head_dim)
    version = parse_versions(f"torch={torch.__version__}")["torch"]
    shown = {"flash": "flash", "efficient": "memory-efficient"}
    out = [
        shown[b]
        for b in ("flash", "efficient")
        if sdpa.check(b, call, "cuda", tuple(capability), version) is None
    ]
    return out + ["math"]


def sdpa_backend_from_ops(op_names) -> str:
    """The SDPA backend named by the aten ops a call dispatched (``"math"``: no fused
    kernel ran, the call decomposed into ``bmm``/``softmax``, materialising the scores).
    """
    for name in op_names:
        if name in SDPA_OPS:
            return SDPA_OPS[name]
    return "math"


def sdpa_backend_ran(fn) -> str:
    """Run ``fn()`` (a ``scaled_dot_product_attention`` call) and return the backend
    that ran.

    A ``TorchDispatchMode`` records the aten ops the call dispatched to: SDPA's backend
    choice happens before that, so the fused kernel's op (or the math backend's ``bmm``)
    is what is seen.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with _Record() as rec:
        fn()
    return sdpa_backend_from_ops(rec.ops)


#: Memory a GPU reports to torch (``torch.cuda.mem_get_info()[1] / 2**30``, the "total
#: capacity" of its out-of-memory message), not the marketing number: a "16GB" T4
#: exposes about 14.6 GiB. One definition with its sources:
#: :data:`trainmem.reference.CAPACITIES`.
def _reported_gib() -> dict[str, float]:
    import re

    from trainmem.reference import CAPACITIES

    def label(key, gb):  # "A100-80GB" -> "A100 80GB", "RTX4090" -> "RTX 4090 24GB"
        name = re.sub(r"-\d+GB$", "", key).replace("RTX", "RTX ")
        return f"{name} {gb}GB"

    return {
        label(k, c.marketing_gb): round(c.torch_total_bytes / 2**30, 2)
        for k, c in CAPACITIES.items()
    }


REPORTED_GIB = _reported_gib()


def usable_capacities(include_current: bool = True) -> dict[str, float]:
    """``{GPU: GiB}`` for the GPU picker: :data:`REPORTED_GIB`, plus this machine's GPU
    (its real ``total_memory``) first when CUDA is present and ``include_current``."""
    caps = {}
    if include_current and cuda_available():
        import torch

        props = torch.cuda.get_device_properties(0)
        caps[f"this GPU ({props.name})"] = round(props.total_memory / 2**30, 2)
    caps.update(REPORTED_GIB)
    return caps


def qlora_plan(
    device_type: str, capability: tuple[int, int] | None = None
) -> QLoRAPlan:
    """NF4 + double quantization; compute in bf16 (fp16 below sm_80); paged 8-bit
    AdamW (:func:`trainmem.demos.quant.qlora_plan`)."""
    from trainmem.demos.quant import qlora_plan as plan_for

    return plan_for(amp_plan(device_type, capability).dtype)
