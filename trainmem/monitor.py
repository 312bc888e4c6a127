"""Peak-memory monitoring per training step (the guide's "每30秒记录一次显存", done properly).

Sampling memory on a wall-clock timer misses the peak: the peak of a training step lasts a few
milliseconds (end of forward / start of backward). What you want is the *peak since the last
record*, logged once per step:

* CUDA: ``torch.cuda.max_memory_allocated()`` then ``torch.cuda.reset_peak_memory_stats()``.
* CPU (this course's CI machine): :class:`TensorMemoryTracker` counts the bytes of every tensor
  storage created by an operator while it is active and notices when a storage is freed, so it
  knows the live bytes and the peak at operator granularity. It is exact for tensors; it does not
  see temporaries that a kernel allocates and frees inside one operator, nor allocator rounding.

All byte counts are plain ``int`` bytes; convert with ``/ 2**20`` (MiB) or ``/ 2**30`` (GiB).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorMemoryTracker", "PeakMemoryMonitor", "StepRecord", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class TensorMemoryTracker(TorchDispatchMode):
    """Live and peak bytes of tensor storages created by operators inside the ``with`` block.

    ``baseline`` tensors (e.g. ``model.parameters()``) that existed before are added to the count,
    so ``peak_bytes`` is comparable with ``torch.cuda.max_memory_allocated`` (minus rounding).

    >>> with TensorMemoryTracker() as tr:
    ...     x = torch.zeros(1024)            # 4096 bytes
    ...     y = x * 2                        # another 4096
    >>> tr.peak_bytes
    8192
    """

    def __init__(self, baseline: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.baseline_bytes = storage_bytes(baseline)
        self.current_bytes = self.baseline_bytes
        self.peak_bytes = self.baseline_bytes

    def _sweep(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.current_bytes -= self._live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        # in-place ops and views return storages that already existed: not new memory
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        flat, _ = tree_flatten(out)
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key = st.data_ptr()
                if key not in self._live and key not in inputs and st.nbytes() > 0:
                    self._live[key] = (StorageWeakRef(st), st.nbytes())
                    self.current_bytes += st.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (like ``reset_peak_memory_stats``)."""
        self._sweep()
        self.peak_bytes = self.current_bytes


@dataclass
class StepRecord:
    """One logged step: ``peak_bytes`` since the previous record, ``live_bytes`` at its end."""

    step: int
    peak_bytes: int
    live_bytes: int


@dataclass
class PeakMemoryMonitor:
    """Log peak memory once per step, on CUDA or (via :class:`TensorMemoryTracker`) on CPU.

    Use as a context manager around the training loop and call :meth:`step` after each
    optimizer step::

        with PeakMemoryMonitor(device, baseline=model.parameters()) as mon:
            for i, batch in enumerate(loader):
                ...; optimizer.step(); optimizer.zero_grad(set_to_none=True)
                mon.step(i)
        mon.records   # [StepRecord(step=0, peak_bytes=..., live_bytes=...), ...]

    ``warn_bytes``: when a step's peak exceeds it, ``warnings`` gets that step (a budget check).
    """

    device: str | torch.device = "cpu"
    baseline: Iterable[torch.Tensor] = ()
    warn_bytes: int | None = None
    records: list[StepRecord] = field(default_factory=list)
    warnings: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.device = torch.device(self.device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device.type!r}")
        self._tracker: TensorMemoryTracker | None = None

    def __enter__(self) -> "PeakMemoryMonitor":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._tracker = TensorMemoryTracker(baseline=self.baseline)
            self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._tracker is not None:
            self._tracker.__exit__(*exc)

    def _read(self) -> tuple[int, int]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            live = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return peak, live
        assert self._tracker is not None, "use PeakMemoryMonitor as a context manager"
        self._tracker._sweep()
        peak, live = self._tracker.peak_bytes, self._tracker.current_bytes
        self._tracker.reset_peak()
        return peak, live

    def step(self, step: int) -> StepRecord:
        """Record the peak since the last call (bytes) and start a new window."""
        peak, live = self._read()
        rec = StepRecord(step, peak, live)
        self.records.append(rec)
        if self.warn_bytes is not None and peak > self.warn_bytes:
            self.warnings.append(step)
        return rec
