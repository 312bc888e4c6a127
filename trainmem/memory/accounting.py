"""Byte accounting of the replay: symbolic tensors and their reference-counted buffers.

A :class:`T` is a (shape, dtype) with a :class:`Buf` of ``numel * itemsize`` bytes; Python's
reference counting frees a buffer exactly when the last tensor (or saved slot) using it goes away,
as for real tensors, and :class:`Sim` keeps the running total and the peak by category.
"""

from __future__ import annotations

import math
from itertools import count

CATS = (
    "weights",
    "gradients",
    "optimizer_states",
    "master_weights",
    "activations",
    "temporaries",
)
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "i64": 8, "bool": 1}


class Sim:
    """Byte accounting: current and peak live bytes, by category."""

    def __init__(self):
        self.cur = 0
        self.peak = 0
        self.by = dict.fromkeys(CATS, 0)
        self.peak_by = dict(self.by)
        self.phase = "forward"
        self.phase_peaks: dict[str, int] = {}
        self.seq = count()
        self.save = True  # False inside a checkpointed region's first forward
        self.autocast = None  # lower-precision dtype name under torch.autocast
        self.grad_enabled = True
        self.ckpt = None  # the active _CkptGroup while recording a checkpointed region
        self.marks: dict[str, dict] = {}
        self.grad_scale = 1.0  # ZeRO >= 2: the fraction of each gradient kept locally
        self.param_cast_scale = (
            1.0  # ZeRO-3: the fraction of each weight cast by autocast
        )
        self.autocast_cache: list = []  # autocast's casts of trainable leaves, kept to its exit
        self.last_alloc = (
            None  # (buffer, peak, peak_by, phase peak) before the last alloc
        )

    def alloc(self, nbytes: int, cat: str | None = None) -> "Buf":
        if cat is None:
            cat = "activations" if self.phase == "forward" else "temporaries"
        b = Buf(self, int(nbytes), cat)
        self.last_alloc = (b, self.peak, self.peak_by, self.phase_peaks.get(self.phase))
        self.cur += b.n
        self.by[cat] += b.n
        if self.cur > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.cur
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_by = dict(self.by)
        return b

    def unalloc_last(self, b: "Buf") -> None:
        """Take back the allocation of ``b`` (the most recent one) as if it never happened: the
        recompute of a checkpointed region stops before the kernel of its last node runs."""
        if self.last_alloc is None or self.last_alloc[0] is not b:
            return
        _, self.peak, self.peak_by, phase_peak = self.last_alloc
        if phase_peak is None:
            self.phase_peaks.pop(self.phase, None)
        else:
            self.phase_peaks[self.phase] = phase_peak
        self.cur -= b.n
        self.by[b.cat] -= b.n
        b.n = 0
        self.last_alloc = None

    def _free(self, b: "Buf"):
        self.cur -= b.n
        self.by[b.cat] -= b.n

    def recat(self, b: "Buf", cat: str):
        self.by[b.cat] -= b.n
        b.cat = cat
        self.by[cat] += b.n

    def mark(self, name: str):
        self.marks[name] = dict(self.by, total=self.cur)

    def set_phase(self, phase: str):
        self.phase = phase
        self.phase_peaks.setdefault(phase, self.cur)


class Buf:
    __slots__ = ("sim", "n", "cat", "info", "__weakref__")

    def __init__(self, sim, n, cat):
        self.sim, self.n, self.cat = sim, n, cat
        self.info = None

    def __del__(self):
        self.sim._free(self)


class T:
    """A symbolic tensor: shape, dtype, buffer, autograd edge. ``phys`` names the physical
    layout of 4-D attention tensors: ``"bhsd"`` (contiguous) or ``"bshd"`` (a transposed view of
    a ``(b, s, h*d)`` projection)."""

    __slots__ = ("buf", "shape", "dt", "rg", "fn", "acc", "phys", "__weakref__")

    def __init__(self, buf, shape, dt, rg=False, fn=None, phys=None):
        self.buf, self.shape, self.dt, self.rg, self.fn, self.phys = (
            buf,
            tuple(shape),
            dt,
            rg,
            fn,
            phys,
        )
        self.acc = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dt]

    def edge(self):
        if not self.rg:
            return None
        return self.fn if self.fn is not None else self.acc


def new(sim: Sim, shape, dt, cat=None, phys=None) -> T:
    n = math.prod(shape) * ITEMSIZE[dt]
    t = T(sim.alloc(n, cat), shape, dt, phys=phys)
    t.buf.info = (tuple(shape), dt)
    return t


def view(t: T, shape, phys=None) -> T:
    """A view: same buffer, gradient passes through unchanged (no allocation either way)."""
    v = T(t.buf, shape, t.dt, t.rg, t.fn, phys)
    v.acc = t.acc
    return v


def shrink(sim: Sim, buf: Buf, factor: float):
    """Scale a buffer's size (ZeRO partitioning, quantized storage)."""
    new_n = int(math.ceil(buf.n * factor))
    sim.cur += new_n - buf.n
    sim.by[buf.cat] += new_n - buf.n
    buf.n = new_n
