"""Byte accounting of the replay: symbolic tensors and their reference-counted buffers.

A :class:`SimTensor` is a (shape, dtype) with a :class:`Buffer` of ``numel * itemsize``
bytes; Python's reference counting frees a buffer exactly when the last tensor (or saved
slot) using it goes away, as for real tensors, and :class:`Simulator` keeps the running
total and the peak by category.
"""

from __future__ import annotations

import math
from itertools import count

from ..dtypes import DTYPES

#: The six categories every estimate and measurement sorts its bytes into (the one
#: definition: ``trainmem.config`` and ``trainmem.measuring.tracker`` import it from
#: here).
CATEGORIES = (
    "weights",
    "gradients",
    "optimizer_states",
    "master_weights",
    "activations",
    "temporaries",
)
#: bytes per element of the dtypes a replayed tensor may have (from the one table)
ITEMSIZE = {d.name: int(d.bytes) for d in DTYPES.values() if d.bytes >= 1}


class Simulator:
    """Byte accounting and the global state of the replay (phase, autocast, grad mode,
    the checkpointed region being recorded, ZeRO's sharding factors)."""

    def __init__(self):
        self.live = 0  # bytes alive now
        self.peak = 0
        self.live_by_category = dict.fromkeys(CATEGORIES, 0)
        self.peak_by_category = dict(self.live_by_category)
        self.phase = "forward"
        self.phase_peaks: dict[str, int] = {}
        self.node_ids = count()  # creation order of autograd nodes
        self.autocast = None  # lower-precision dtype name under torch.autocast
        self.grad_enabled = True
        # peft's disable_adapter() around a forward (a reference model)
        self.adapters_off = False
        # activation offloading (an .offload.Offload while the forward's saved tensors
        # go to the host; None: they stay) and the parameters' buffers, which stay
        self.offload = None
        self.param_buffers: set[int] = set()
        # the active CheckpointRegion while recording a checkpointed region
        self.checkpoint_region = None
        self.marks: dict[str, dict] = {}
        # what sharding does to the step (a .sharded.Sharded, set by the sharding
        # plan; None: nothing sharded)
        self.sharded = None
        # autocast's casts of trainable leaves, kept until the autocast region exits
        self.autocast_cache: list = []
        # (buffer, peak, peak by category, phase peak) before the last allocation
        self.last_alloc = None
        # a list when the step's allocation events are recorded (trainmem.memory.
        # allocator replays them): ("alloc", uid, nbytes, category, phase),
        # ("free", uid), ("resize", uid, nbytes), ("category", uid, category)
        self.events: list | None = None
        self.buffer_ids = count()

    def alloc(self, nbytes: int, category: str | None = None) -> "Buffer":
        if category is None:
            category = "activations" if self.phase == "forward" else "temporaries"
        buffer = Buffer(self, int(nbytes), category)
        if self.events is not None:
            self.events.append(
                ("alloc", buffer.uid, buffer.nbytes, category, self.phase)
            )
        self.last_alloc = (
            buffer,
            self.peak,
            self.peak_by_category,
            self.phase_peaks.get(self.phase),
        )
        self.live += buffer.nbytes
        self.live_by_category[category] += buffer.nbytes
        if self.live > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.live
        if self.live > self.peak:
            self.peak = self.live
            self.peak_by_category = dict(self.live_by_category)
        return buffer

    def unalloc_last(self, buffer: "Buffer") -> None:
        """Take back the allocation of ``buffer`` (the most recent one) as if it never
        happened: the recompute of a checkpointed region stops before the kernel of its
        last node runs."""
        if self.last_alloc is None or self.last_alloc[0] is not buffer:
            return
        _, self.peak, self.peak_by_category, phase_peak = self.last_alloc
        if phase_peak is None:
            self.phase_peaks.pop(self.phase, None)
        else:
            self.phase_peaks[self.phase] = phase_peak
        self.live -= buffer.nbytes
        self.live_by_category[buffer.category] -= buffer.nbytes
        buffer.nbytes = 0
        self.last_alloc = None
        if self.events is not None:
            self.events.append(("free", buffer.uid))

    def free(self, buffer: "Buffer") -> None:
        self.live -= buffer.nbytes
        self.live_by_category[buffer.category] -= buffer.nbytes
        if self.events is not None:
            self.events.append(("free", buffer.uid))

    def recategorize(self, buffer: "Buffer", category: str) -> None:
        self.live_by_category[buffer.category] -= buffer.nbytes
        buffer.category = category
        self.live_by_category[category] += buffer.nbytes
        if self.events is not None:
            self.events.append(("category", buffer.uid, category))

    def mark(self, name: str) -> None:
        self.marks[name] = dict(self.live_by_category, total=self.live)

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_peaks.setdefault(phase, self.live)


class Buffer:
    """Storage of ``nbytes`` bytes in one category; freed when the last reference
    goes."""

    __slots__ = ("sim", "nbytes", "category", "uid", "__weakref__")

    def __init__(self, sim: Simulator, nbytes: int, category: str):
        self.sim, self.nbytes, self.category = sim, nbytes, category
        self.uid = next(sim.buffer_ids)

    def __del__(self):
        self.sim.free(self)


class SimTensor:
    """A symbolic tensor: shape, dtype, buffer, autograd edge.

    ``grad_fn`` is the node that made it (``None`` for a leaf), ``grad_accumulator`` the
    :class:`~.autograd.AccumulateGrad` of a leaf that requires grad.  ``layout`` names
    the physical layout of 4-D attention tensors: ``"bhsd"`` (contiguous), ``"bshd"`` (a
    transposed view of a ``(b, s, h*d)`` projection), ``"t"`` (``"bhsd"`` with its last
    two dims transposed) or ``"x"`` (one key/value head expanded over the heads)."""

    __slots__ = (
        "buffer",
        "shape",
        "dtype",
        "requires_grad",
        "grad_fn",
        "grad_accumulator",
        "layout",
        "__weakref__",
    )

    def __init__(
        self, buffer, shape, dtype, requires_grad=False, grad_fn=None, layout=None
    ):
        self.buffer = buffer
        self.shape = tuple(shape)
        self.dtype = dtype
        self.requires_grad = requires_grad
        self.grad_fn = grad_fn
        self.layout = layout
        self.grad_accumulator = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]

    def edge(self):
        """Where backward sends this tensor's gradient (``None``: nowhere)."""
        if not self.requires_grad:
            return None
        return self.grad_fn if self.grad_fn is not None else self.grad_accumulator


def new(sim: Simulator, shape, dtype, category=None, layout=None) -> SimTensor:
    """A newly allocated tensor (``category`` ``None``: by the current phase)."""
    nbytes = math.prod(shape) * ITEMSIZE[dtype]
    return SimTensor(sim.alloc(nbytes, category), shape, dtype, layout=layout)


def view(t: SimTensor, shape, layout=None) -> SimTensor:
    """A view: same buffer, gradient passes through unchanged (no allocation either
    way)."""
    v = SimTensor(t.buffer, shape, t.dtype, t.requires_grad, t.grad_fn, layout)
    v.grad_accumulator = t.grad_accumulator
    return v


def shrink(sim: Simulator, buffer: Buffer, factor: float) -> None:
    """Scale a buffer's size (ZeRO partitioning, quantized storage)."""
    resize(sim, buffer, int(math.ceil(buffer.nbytes * factor)))


def resize(sim: Simulator, buffer: Buffer, new_nbytes: int) -> None:
    """Set a buffer's size (a ZeRO shard of part of it)."""
    sim.live += new_nbytes - buffer.nbytes
    sim.live_by_category[buffer.category] += new_nbytes - buffer.nbytes
    buffer.nbytes = new_nbytes
    if sim.events is not None:
        sim.events.append(("resize", buffer.uid, new_nbytes))
