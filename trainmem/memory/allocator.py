"""A model of PyTorch's CUDA caching allocator, replaying the step's allocations.

The replay (:mod:`trainmem.memory.step`) records every allocation, free and resize of
the step in order; :func:`replay` feeds them to :class:`CachingAllocator`, which follows
the rules of ``c10/cuda/CUDACachingAllocator.cpp`` (the constants are shared with
``c10/core/AllocatorConfig.h``):

* ``round_size``: a request is rounded up to a multiple of 512 B (``kMinBlockSize``),
  at least 512 B;
* requests of at most 1 MiB (``kSmallSize``) come from the small pool, whose segments
  are 2 MiB (``kSmallBuffer``); larger ones from the large pool, whose new segment is
  20 MiB (``kLargeBuffer``) for requests under 10 MiB (``kMinLargeAlloc``) and the
  request rounded up to 2 MiB (``kRoundLarge``) otherwise (``get_allocation_size``);
* a request takes the smallest free block of its pool that is large enough (ties: the
  lowest address; ``BlockComparatorSize``), split when the rest is at least 512 B
  (small pool) or more than 1 MiB (large pool) (``should_split``); a block that is not
  split is allocated whole, which ``memory_allocated`` then counts;
* a freed block merges with free neighbours of its segment (``try_merge_blocks``);
* cached segments are never returned to the driver unless an allocation fails: then
  every fully free segment is released and the allocation retried
  (``release_cached_blocks``), and only if that fails too is it an out-of-memory error.

The step is replayed as step 2 of training, after step 1 (:mod:`trainmem.memory.step`,
``_first_step``): torch's optimizers create their states in their first ``step()``,
in blocks step 1's activations left free, so step 2's activations need segments of
their own; a ``reset_peak`` event (``torch.cuda.reset_peak_memory_stats()``) starts
step 2's peak allocated and timeline, while reserved memory carries over.

Not modelled: several streams (one stream here), ``max_split_size_mb`` and
``expandable_segments`` (``PYTORCH_CUDA_ALLOC_CONF``; the defaults are assumed),
``garbage_collection_threshold``, and CUDA graphs' private pools.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_LARGE_BUFFER = 20 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    """``round_size``: at least 512 B, a multiple of 512 B."""
    if nbytes < K_MIN_BLOCK:
        return K_MIN_BLOCK
    return K_MIN_BLOCK * ((nbytes + K_MIN_BLOCK - 1) // K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a new ``cudaMalloc`` asks for."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


# A free block's place in its pool's free list, as one integer ordered like
# ``BlockComparatorSize`` (size, then address: here segment, then offset): integers
# compare several times faster than tuples, and the replay of a large model's step
# looks blocks up millions of times. Offsets stay below 2**48 (256 TiB) and segment
# numbers below 2**24.
_SEG_SHIFT = 48
_SIZE_SHIFT = 72


class Block:
    __slots__ = ("segment", "offset", "size", "free", "prev", "next")

    def __init__(self, segment, offset, size):
        self.segment, self.offset, self.size = segment, offset, size
        self.free = True
        self.prev = self.next = None

    def key(self) -> int:
        return (self.size << _SIZE_SHIFT) | (self.segment << _SEG_SHIFT) | self.offset


class OutOfMemory(Exception):
    pass


@dataclass
class CachingAllocator:
    """One device's caching allocator (one stream). ``capacity``: the bytes
    ``cudaMalloc`` may hand out in all (``None``: unlimited)."""

    capacity: int | None = None
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    segments: int = 0
    released: bool = False  # cached segments were given back to make room
    # free lists per pool (True = small): sorted keys (Block.key) and their blocks
    _keys: dict = field(default_factory=lambda: {True: [], False: []})
    _free: dict = field(default_factory=lambda: {True: [], False: []})
    _blocks: dict = field(default_factory=dict)  # segment id -> first block
    _segment_pool: dict = field(default_factory=dict)
    _segment_size: dict = field(default_factory=dict)

    def _insert(self, small: bool, block: Block) -> None:
        keys, k = self._keys[small], block.key()
        i = bisect.bisect_left(keys, k)
        keys.insert(i, k)
        self._free[small].insert(i, block)

    def _remove(self, small: bool, block: Block) -> None:
        keys = self._keys[small]
        i = bisect.bisect_left(keys, block.key())  # keys are unique (one address)
        del keys[i]
        del self._free[small][i]

    def _new_segment(self, small: bool, nbytes: int) -> Block:
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            self._release_cached()
            if self.reserved + nbytes > self.capacity:
                raise OutOfMemory(nbytes)
        seg = self.segments
        if seg >> (_SIZE_SHIFT - _SEG_SHIFT) or nbytes >> _SEG_SHIFT:
            raise ValueError(
                f"segment {seg} of {nbytes} B: beyond what Block.key orders "
                f"(2**{_SIZE_SHIFT - _SEG_SHIFT} segments of < 2**{_SEG_SHIFT} B)"
            )
        self.segments += 1
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        block = Block(seg, 0, nbytes)
        self._blocks[seg] = block
        self._segment_pool[seg] = small
        self._segment_size[seg] = nbytes
        return block

    def _release_cached(self) -> None:
        self.released = True
        for small in (True, False):
            keys, blocks = [], []
            for key, block in zip(self._keys[small], self._free[small]):
                if block.prev is None and block.next is None:
                    self.reserved -= block.size
                    del self._blocks[block.segment]
                else:
                    keys.append(key)
                    blocks.append(block)
            self._keys[small], self._free[small] = keys, blocks

    def malloc(self, nbytes: int) -> Block | None:
        # the hot path of a large model's replay (millions of calls): round_size,
        # Block.key and _insert written out
        if nbytes <= 0:
            return None  # a 0-byte tensor has no block
        size = K_MIN_BLOCK if nbytes < K_MIN_BLOCK else ((nbytes + 511) >> 9) << 9
        small = size <= K_SMALL_SIZE
        keys = self._keys[small]
        i = bisect.bisect_left(keys, size << _SIZE_SHIFT)  # the smallest that fits
        if i < len(keys):
            del keys[i]
            block = self._free[small].pop(i)
        else:
            block = self._new_segment(small, allocation_size(size))
        remaining = block.size - size
        if remaining >= K_MIN_BLOCK if small else remaining > K_SMALL_SIZE:
            rest = Block(block.segment, block.offset + size, remaining)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            k = (remaining << _SIZE_SHIFT) | (rest.segment << _SEG_SHIFT) | rest.offset
            j = bisect.bisect_left(keys, k)
            keys.insert(j, k)
            self._free[small].insert(j, rest)
        block.free = False
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def release(self, block: Block | None) -> None:
        if block is None:
            return
        small = self._segment_pool[block.segment]
        self.allocated -= block.size
        block.free = True
        keys, free = self._keys[small], self._free[small]
        prev, nxt = block.prev, block.next
        if prev is not None and prev.free:
            i = bisect.bisect_left(keys, prev.key())  # keys are unique (one address)
            del keys[i]
            del free[i]
            prev.size += block.size
            prev.next = nxt
            if nxt is not None:
                nxt.prev = prev
            block = prev
        if nxt is not None and nxt.free:
            i = bisect.bisect_left(keys, nxt.key())
            del keys[i]
            del free[i]
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        k = block.key()
        i = bisect.bisect_left(keys, k)
        keys.insert(i, k)
        free.insert(i, block)


def _setup_at_final_size(events: list) -> list:
    """Parameters resized while the model is set up (4-bit quantization, ZeRO
    shards) are allocated at their final size: loaders quantize or shard each weight
    as it arrives, so the full-size copies never coexist on the GPU."""
    start = next(
        (i for i, ev in enumerate(events) if ev[0] == "alloc" and ev[4] != "idle"),
        len(events),
    )
    final = {ev[1]: ev[2] for ev in events[:start] if ev[0] == "resize"}
    if not final:
        return events
    out = []
    for ev in events[:start]:
        if ev[0] == "resize":
            continue
        if ev[0] == "alloc" and ev[1] in final:
            ev = (ev[0], ev[1], final[ev[1]], ev[3], ev[4])
        out.append(ev)
    return out + list(events[start:])


class Replay:
    """Recorded events (see :class:`~.accounting.Simulator`) fed, as they come, to a
    :class:`CachingAllocator` (``capacity``: its limit, ``None``: unlimited),
    following the block and category of every live tensor. ``every``: the timeline
    keeps the highest point of each stretch of that many events (0: no timeline).
    ``oom``: the index of the event whose allocation failed under ``capacity`` (the
    replay stops there), else ``None``. ``tensors``: for each live tensor, its
    block, category, bytes and where it was made: the micro-batch (``micro_batch``
    when it was fed) it was allocated in and as which allocation of it (for
    :class:`RepeatDetector`)."""

    def __init__(self, capacity: int | None = None, every: int = 0):
        self.alloc = CachingAllocator(capacity)
        # each live tensor: [block, category, bytes, (micro-batch, ordinal)]
        self.tensors: dict[int, list] = {}
        self.live: dict[str, int] = {}
        self.micro_batch = self.ordinal = 0
        self.phase = "idle"
        self.every = every
        self.timeline: list[dict] = []
        self._best = None
        self.fed = 0  # events fed so far
        self.oom: int | None = None

    def feed(self, events) -> None:
        # allocations and frees are most of a step's events: handled here, the rest
        # by _event
        if self.oom is not None:
            return
        malloc, release = self.alloc.malloc, self.alloc.release
        tensors, live, every = self.tensors, self.live, self.every
        for ev in events:
            kind = ev[0]
            try:
                if kind == "alloc":
                    _, uid, nbytes, cat, self.phase = ev
                    tensors[uid] = [
                        malloc(nbytes),
                        cat,
                        nbytes,
                        (self.micro_batch, self.ordinal),
                    ]
                    self.ordinal += 1
                    live[cat] = live.get(cat, 0) + nbytes
                elif kind == "free":
                    t = tensors.pop(ev[1], None)
                    if t is not None:
                        release(t[0])
                        live[t[1]] -= t[2]
                else:
                    self._event(ev)
            except OutOfMemory:
                self.oom = self.fed
                return
            if every:
                self._sample()
            self.fed += 1

    def _event(self, ev) -> None:
        kind, uid = ev[0], ev[1]
        t = self.tensors.get(uid)
        if kind == "resize":
            if t is not None:
                self.alloc.release(t[0])
                self.live[t[1]] += ev[2] - t[2]
                t[2] = ev[2]
                t[0] = self.alloc.malloc(ev[2])
        elif kind == "reset_peak":
            # torch.cuda.reset_peak_memory_stats() between steps: the peak allocated
            # (and the timeline) start again from what is allocated now
            self.alloc.peak_allocated = self.alloc.allocated
            self.timeline, self._best = [], None
        elif kind == "category":
            if t is not None:
                self.live[t[1]] -= t[2]
                t[1] = ev[2]
                self.live[ev[2]] = self.live.get(ev[2], 0) + t[2]

    def _sample(self) -> None:
        # each bucket of ``every`` events keeps its highest point, so the timeline
        # shows every peak (the optimizer's spike too)
        total = sum(self.live.values())
        if self._best is None or total > self._best[0]:
            point = dict(event=self.fed, phase=self.phase, reserved=self.alloc.reserved)
            self._best = (total, dict(point, **self.live))
        if self.fed % self.every == self.every - 1:
            self.timeline.append(self._best[1])
            self._best = None

    def result(self) -> dict:
        """``peak_reserved``, ``peak_allocated`` (block sizes, as
        ``max_memory_allocated`` counts them), ``oom``, ``released`` (cached segments
        were given back to make room) and ``timeline`` (dicts with ``event``,
        ``phase``, the categories and ``reserved``), after the events fed so far."""
        timeline = list(self.timeline)
        if self._best is not None and self.oom is None:
            timeline.append(self._best[1])  # the last, shorter stretch
        return {
            "peak_reserved": self.alloc.peak_reserved,
            "peak_allocated": self.alloc.peak_allocated,
            "oom": self.oom,
            "released": self.alloc.released,
            "timeline": timeline,
        }


def replay(events: list, capacity: int | None = None, timeline_points: int = 0):
    """Replay the recorded events through a :class:`CachingAllocator` (parameters at
    their final size, ``_setup_at_final_size``) and return :meth:`Replay.result`;
    ``timeline_points``: about that many samples of the live bytes by category."""
    events = _setup_at_final_size(events)
    # the timeline samples the step after the last reset_peak (a warm-up step before)
    resets = [i for i, ev in enumerate(events) if ev[0] == "reset_peak"]
    sampled = len(events) - (resets[-1] if resets else 0)
    every = max(1, sampled // timeline_points) if timeline_points else 0
    run = Replay(capacity, every)
    run.feed(events)
    return run.result()


MAX_PERIOD = 4  # the longest cycle of allocator states looked for


class RepeatDetector:
    """Follows the caching allocator through a step's micro-batches, to tell when
    the states it is left in after each micro-batch start to cycle.

    Micro-batches after the first run the same code on tensors of the same shapes, so
    they record the same events; when one ends in the same allocator state as the
    micro-batch ``p`` before it — the same segments split into the same blocks, each
    block free or holding the tensor of the same role — the states cycle with period
    ``p`` from there (a block freed in one micro-batch can alternate between two
    places), so no later micro-batch reaches a peak of ``memory_allocated`` or
    ``reserved`` not already seen, and the state after the last one is the state
    after the one a whole number of periods before it. A tensor's role is its uid if
    it was allocated before the second micro-batch (parameters, gradients, optimizer
    states), else how many micro-batches ago and as which allocation of that
    micro-batch it was made.

    ``replay``: the :class:`Replay` it drives, as :func:`replay` of the same events
    would have left it; the caller may feed it the rest of the step
    (:func:`trainmem.gpus.device_report` does, instead of replaying from the start)."""

    def __init__(self, prelude: list = (), capacity: int | None = None):
        self.replay = Replay(capacity)
        self.prelude = list(prelude)
        self.fed = 0  # the events of the step fed so far
        self.seen: list = []  # the signature after each micro-batch from the second

    def _feed(self, events, micro_batch: int) -> None:
        self.replay.micro_batch, self.replay.ordinal = micro_batch, 0
        self.replay.feed(events)

    def catch_up(self, events: list, starts: list[int]) -> None:
        """Feed the micro-batches recorded so far (``starts``: where each one's
        events begin), each as its own micro-batch, as :meth:`period` after each
        would have."""
        for j in range(1, len(starts)):
            end = starts[j + 1] if j + 1 < len(starts) else len(events)
            self.period(events, starts[: j + 1], end)

    def period(self, events: list, starts: list[int], end: int | None = None):
        """Feed the events recorded so far (up to ``end``; ``starts``: where each
        micro-batch's events begin; the last micro-batch has just ended) and return
        ``p`` when it left the allocator as the micro-batch ``p`` before it did (the
        states cycle with period ``p`` from there on; a freed block can alternate
        between two places): the set of such ``p``, empty while there is none."""
        end = len(events) if end is None else end
        j = len(starts) - 1  # the micro-batch that just ended (j >= 1)
        if self.fed == 0:  # set-up and the first micro-batch, as replay() sees them
            self._feed(self.prelude + _setup_at_final_size(events[: starts[1]]), 0)
            self.fed = starts[1]
        self._feed(events[self.fed : end], j)
        self.fed = end
        oom = self.replay.oom is not None
        now = "out of memory" if oom else self.signature(j)
        self.seen.append(now)
        return self.periods()

    def periods(self) -> set[int]:
        """Every ``p`` (up to MAX_PERIOD) with the last state equal to the state
        ``p`` micro-batches before it."""
        now = self.seen[-1]
        n = min(MAX_PERIOD, len(self.seen) - 1)
        return {p for p in range(1, n + 1) if self.seen[-1 - p] == now}

    def signature(self, j: int):
        run = self.replay
        owner = {id(t[0]): uid for uid, t in run.tensors.items() if t[0] is not None}
        segments = []
        alloc = run.alloc
        for seg in sorted(alloc._blocks):
            block, out = alloc._blocks[seg], []
            while block is not None:
                uid = owner.get(id(block))
                t = run.tensors.get(uid)
                mb, n = t[3] if t is not None else (0, 0)
                role = None if block.free else (uid if mb == 0 else (j - mb, n))
                out.append((block.size, role))
                block = block.next
            segments.append((alloc._segment_pool[seg], tuple(out)))
        return (alloc.allocated, alloc.reserved, tuple(segments))


def common_period(periods) -> int:
    """The smallest period all detectors share (0: none yet)."""
    common = None
    for p in periods:
        common = set(p) if common is None else common & set(p)
    return min(common) if common else 0
