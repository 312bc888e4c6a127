"""The GPU flag (DESIGN.md §4) and device choice.

One environment variable, ``COURSE_GPU``, decides what a GPU cell does:

=========  ===========================================================================
value      behaviour
=========  ===========================================================================
``auto``   (default) run on CUDA when a device is present; otherwise print
           :data:`SKIP_LINE` and skip the cell.
``cpu``    run the GPU cell on the CPU at its smallest sizes (how CI proves it works).
``0/off``  skip (print :data:`SKIP_LINE`).
``1/on``   run on CUDA; raise :class:`GPUUnavailableError` when there is no device.
=========  ===========================================================================

A GPU cell in a notebook looks like::

    # 类型：【Skeleton】需要 GPU
    @gpu_cell
    def fp16_loop(device, small):
        ...                      # real code; `small` is True when running on CPU

``gpu_cell`` calls the function at once with ``device`` (a ``torch.device``) and ``small``
(bool), or prints one fixed line and returns ``None``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, TypeVar

ENV_VAR = "COURSE_GPU"
ALLOWED = ("auto", "cpu", "on", "off", "1", "0")
SKIP_LINE = (
    "[COURSE_GPU] 跳过 GPU 单元：未检测到 CUDA 设备。"
    "设置 COURSE_GPU=cpu 可在 CPU 上以最小规模运行，COURSE_GPU=on 强制使用 GPU。"
)
OFF_LINE = "[COURSE_GPU] 跳过 GPU 单元：COURSE_GPU=off。设置 COURSE_GPU=cpu 或 auto 可运行它。"

T = TypeVar("T")


class GPUFlagError(ValueError):
    """``COURSE_GPU`` holds a value outside :data:`ALLOWED`."""


class GPUUnavailableError(RuntimeError):
    """``COURSE_GPU=on`` but no CUDA device is usable."""


def gpu_mode(value: str | None = None) -> str:
    """Normalised mode: one of ``"auto"``, ``"cpu"``, ``"on"``, ``"off"``.

    ``value`` defaults to the ``COURSE_GPU`` environment variable (unset or empty → ``auto``).
    Raises :class:`GPUFlagError` naming the allowed values for anything else.
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
    """What a GPU cell should do: ``run`` it on ``device``; ``small`` asks for tiny sizes."""

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
                f"{ENV_VAR}=on but no CUDA device is available (torch.cuda.is_available() "
                "is False). Use a GPU runtime (Colab: 代码执行程序 → 更改运行时类型 → GPU), "
                f"or set {ENV_VAR}=cpu to run this cell on the CPU at small size."
            )
        return DeviceChoice(mode, True, "cuda", False, None)
    if has_cuda:
        return DeviceChoice(mode, True, "cuda", False, None)
    return DeviceChoice(mode, False, None, False, SKIP_LINE)


def gpu_cell(fn: Callable[..., T]) -> T | None:
    """Run ``fn(device, small)`` now according to ``COURSE_GPU``; return its result or None.

    Used as a decorator on a notebook cell's function, so the cell's code is real code that a
    student can run on Colab, and CI can run with ``COURSE_GPU=cpu``.
    """
    import torch

    choice = choose_device()
    if not choice.run:
        print(choice.message)
        return None
    return fn(torch.device(choice.device), choice.small)


def compute_capability(device: int = 0) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, or None when there is none."""
    if not cuda_available():
        return None
    import torch

    return tuple(torch.cuda.get_device_capability(device))  # type: ignore[return-value]


def bf16_supported(device: str | None = None, capability: tuple[int, int] | None = None) -> bool:
    """True when bfloat16 runs natively on ``device``.

    CPU: True (torch implements bf16 on CPU). CUDA: compute capability ≥ 8.0 (Ampere+).
    ``torch.cuda.is_bf16_supported()`` alone is not trusted: a T4 (sm_75) reports True through
    emulation, which is slow and gives no Tensor Core speed-up.
    """
    if capability is None:
        if device is None or str(device).startswith("cpu"):
            return True
        capability = compute_capability()
        if capability is None:
            return False
    return tuple(capability) >= (8, 0)


def amp_dtype(device: str, capability: tuple[int, int] | None = None):
    """The autocast dtype a course cell should use: bf16 where native, else fp16 (with a scaler)."""
    import torch

    return torch.bfloat16 if bf16_supported(device, capability) else torch.float16


def describe() -> str:
    """One line about the flag and the device, printed by setup and by labs."""
    mode = gpu_mode()
    if cuda_available():
        import torch

        name = torch.cuda.get_device_name(0)
        cap = compute_capability()
        return f"{ENV_VAR}={mode}; CUDA: {name} (sm_{cap[0]}{cap[1]}), bf16 native: {bf16_supported('cuda')}"
    return f"{ENV_VAR}={mode}; CUDA: none (GPU cells {'run on CPU at small size' if mode == 'cpu' else 'are skipped' if mode != 'on' else 'will fail'})"
