"""Tensor-level memory accounting for one training step (CPU, fake tensors or CUDA
tensors).

:class:`MemoryTracker` is a ``TorchDispatchMode``: every aten op that runs while it is
active reports its outputs; each output's *untyped storage* is registered once (views
share a storage and are not counted twice) with its size in bytes, and a weak reference
tells the tracker when the storage is freed.  The tracker keeps the running total of
live bytes and remembers the event at which it peaked.  After the step, every storage
that was alive at the peak is put into one of six categories (see :data:`CATEGORIES`),
so the peak is explained tensor by tensor.

Works identically on real CPU tensors and on ``FakeTensorMode`` tensors (whose storages
have a size but no memory), which is how a 7B-shaped model is "measured" without
allocating it. Kernel-internal workspaces (e.g. inside a fused attention kernel) are
invisible at this level."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# the categories the tracker sorts into (re-exported)
from ..config import CATEGORIES as CATEGORIES


@dataclass
class StorageRecord:
    """One storage seen by the tracker: its size and the events that allocated and freed
    it."""

    nbytes: int
    alloc: int  # event number of the allocation
    # phase in which it was allocated ("pre", "forward", "backward", "optimizer", ...)
    phase: str
    free: int | None = None
    cast_of_param: bool = False
    op: object = None  # the aten op that allocated it (None: registered by hand)
    shape: tuple = ()
    dtype: object = None


class MemoryTracker(TorchDispatchMode):
    """Track live tensor storages (bytes) and the peak of their sum.

    Use ``register(t, phase)`` for tensors that exist before tracking starts
    (parameters, optimizer states, the batch), ``set_phase(name)`` to label the phases
    of the step, ``reset_peak()`` to start a new peak window; the records (``records``,
    ``peak_event``) give the breakdown afterwards
    (:func:`trainmem.measuring.measure.measure` sorts them into categories).

    Subclasses tune it with two class attributes: ``skip_meta`` (ignore ``meta``
    tensors, which have no memory) and ``keep_records`` (keep a record of every storage
    ever seen, for the breakdown). :class:`trainmem.demos.accum.PeakLiveBytes` and
    :class:`trainmem.demos.monitor.TensorMemoryTracker` are such subclasses."""

    skip_meta = False
    keep_records = True

    def __init__(self):
        super().__init__()
        self._live: dict[
            int, tuple[StorageRecord, weakref.ref]
        ] = {}  # id(storage) -> record
        self.records: list[StorageRecord] = []
        self.event = 0
        self.current = 0
        self.peak = 0
        self.peak_event = 0
        self.phase = "pre"
        self.phase_peaks: dict[str, int] = {}
        # id() of parameter storages, for autocast-cast detection
        self.param_storages: set[int] = set()

    # -- bookkeeping
    # -------------------------------------------------------------------------
    def _storage(self, t):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            return None
        if self.skip_meta and t.device.type == "meta":
            return None
        try:
            return t.untyped_storage()
        except Exception:  # pragma: no cover - tensors without storage
            return None

    def register(self, t, cast_of_param: bool = False, op=None):
        """Register the storage of tensor ``t`` (idempotent); returns its record or
        None."""
        storage = self._storage(t)
        if storage is None:
            return None
        key = id(storage)
        hit = self._live.get(key)
        if hit is not None:
            return hit[0]
        self.event += 1
        record = StorageRecord(
            int(storage.nbytes()),
            self.event,
            self.phase,
            cast_of_param=cast_of_param,
            op=op,
            shape=tuple(t.shape),
            dtype=t.dtype,
        )
        ref = weakref.ref(
            storage, lambda _r, key=key, record=record: self._on_free(key, record)
        )
        self._live[key] = (record, ref)
        if self.keep_records:
            self.records.append(record)
        self.current += record.nbytes
        if self.current > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.current
        if self.current > self.peak:
            self.peak = self.current
            self.peak_event = self.event
        return record

    def _on_free(self, key, record):
        live = self._live.get(key)
        if live is not None and live[0] is record:
            del self._live[key]
        self.event += 1
        record.free = self.event
        self._release(record.nbytes)

    def _release(self, nbytes: int) -> None:
        """Subtract ``nbytes`` (bytes) of a freed storage from the live total."""
        self.current -= nbytes

    def record_of(self, t):
        storage = self._storage(t)
        if storage is None:
            return None
        hit = self._live.get(id(storage))
        return hit[0] if hit else None

    def set_phase(self, phase: str):
        self.phase = phase
        self.phase_peaks.setdefault(phase, self.current)

    def reset_peak(self):
        self.peak = self.current
        self.peak_event = self.event
        self.phase_peaks = {}

    # -- the dispatch hook
    # --------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cast = False
        if func is torch.ops.aten._to_copy.default and self.param_storages:
            src = self._storage(args[0])
            cast = src is not None and id(src) in self.param_storages
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.register(t, cast_of_param=cast, op=func)
        return out
