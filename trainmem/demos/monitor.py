"""Peak-memory monitoring per training step (the guide's "每30秒记录一次显存", done
properly).

Sampling memory on a wall-clock timer misses the peak: the peak of a training step lasts
a few milliseconds (end of forward / start of backward). What you want is the *peak
since the last record*, logged once per step:

* CUDA: ``torch.cuda.max_memory_allocated()`` then
  ``torch.cuda.reset_peak_memory_stats()``.
* CPU (this course's CI machine): :class:`TensorMemoryTracker` (a
  :class:`trainmem.measuring.tracker.MemoryTracker`) counts the bytes of every tensor
  storage created by an operator while it is active and notices when a storage is freed,
  so it knows the live bytes and the peak at operator granularity. It is exact for
  tensors; it does not see temporaries that a kernel allocates and frees inside one
  operator, nor allocator rounding.

All byte counts are plain ``int`` bytes; convert with ``/ 2**20`` (MiB) or ``/ 2**30``
(GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.utils._pytree import tree_flatten

from ..measuring.tracker import MemoryTracker

__all__ = ["TensorMemoryTracker", "PeakMemoryMonitor", "StepRecord", "storage_bytes"]


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count
    once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


class TensorMemoryTracker(MemoryTracker):
    """Live and peak bytes of tensor storages created by operators inside the ``with``
    block.

    A :class:`trainmem.measuring.tracker.MemoryTracker` with three rules of its own:

    * an op output whose storage is one of the op's inputs (in-place ops, views) is not
      new memory; storages of size 0 and ``meta`` tensors are ignored;
    * ``baseline`` tensors (e.g. ``model.parameters()``) that existed before are added
      to the count once, as a constant, so ``peak_bytes`` is comparable with
      ``torch.cuda.max_memory_allocated`` (minus rounding);
    * frees are settled at the next operator (and by :meth:`reset_peak`), so
      ``current_bytes`` read between operators still includes storages freed since the
      last one.

    >>> with TensorMemoryTracker() as tr:
    ...     x = torch.zeros(1024)            # 4096 bytes
    ...     y = x * 2                        # another 4096
    >>> tr.peak_bytes
    8192
    """

    skip_meta = True
    keep_records = False

    def __init__(self, baseline: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._freed = 0  # bytes freed since the last settlement
        self.baseline_bytes = storage_bytes(baseline)
        self.current = self.peak = self.baseline_bytes

    @property
    def current_bytes(self) -> int:
        """Live bytes (baseline included) as of the last operator or
        :meth:`reset_peak`."""
        return self.current

    @property
    def peak_bytes(self) -> int:
        """Peak of ``current_bytes`` since entering the block or the last
        :meth:`reset_peak`."""
        return self.peak

    def _release(self, nbytes: int) -> None:
        self._freed += nbytes

    def _sweep(self) -> None:
        """Subtract the bytes of the storages freed since the last call."""
        self.current -= self._freed
        self._freed = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._sweep()
        inputs = {
            id(st)
            for st in map(self._storage, tree_flatten((args, kwargs))[0])
            if st is not None
        }
        for t in tree_flatten(out)[0]:
            st = self._storage(t)
            if st is not None and id(st) not in inputs and st.nbytes() > 0:
                self.register(t, op=func)
        return out

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (like
        ``reset_peak_memory_stats``)."""
        self._sweep()
        super().reset_peak()


@dataclass
class StepRecord:
    """One logged step: ``peak_bytes`` since the previous record, ``live_bytes`` at its
    end."""

    step: int
    peak_bytes: int
    live_bytes: int


@dataclass
class PeakMemoryMonitor:
    """Log peak memory once per step, on CUDA or (via :class:`TensorMemoryTracker`) on
    CPU.

    Use as a context manager around the training loop and call :meth:`step` after each
    optimizer step::

        with PeakMemoryMonitor(device, baseline=model.parameters()) as mon:
            for i, batch in enumerate(loader):
                ...; optimizer.step(); optimizer.zero_grad(set_to_none=True)
                mon.step(i)
        mon.records   # [StepRecord(step=0, peak_bytes=..., live_bytes=...), ...]

    ``warn_bytes``: when a step's peak exceeds it, ``warnings`` gets that step (a budget
    check).
    """

    device: str | torch.device = "cpu"
    baseline: Iterable[torch.Tensor] = ()
    warn_bytes: int | None = None
    records: list[StepRecord] = field(default_factory=list)
    warnings: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.device = torch.device(self.device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"device must be 'cpu' or 'cuda', got {self.device.type!r}"
            )
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
