"""Gradient accumulation and activation checkpointing: helpers to check and to measure
them.

* :func:`grads`, :func:`max_abs_diff` — snapshot and compare ``.grad`` of a model.
* :class:`Stack` — a tiny residual MLP/attention-free stack of ``n_layers`` blocks whose
  forward can checkpoint segments of ``segment`` consecutive layers
  (``torch.utils.checkpoint``).
* :class:`SavedTensorBytes` — bytes autograd keeps for backward (saved-tensor hooks),
  deduplicated by storage, parameters excluded: the activation memory, exactly.
* :class:`PeakLiveBytes` — peak bytes of tensors alive during a region (the
  :class:`trainmem.measuring.tracker.MemoryTracker` dispatch mode watching every op's
  outputs; freed storages are subtracted by weak-reference callbacks).
* :func:`measure_step` — one forward+backward of a :class:`Stack` under both meters,
  plus time.

All byte counts are bytes (not MiB/GiB); shapes are stated in each docstring.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..measuring.tracker import MemoryTracker


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of every parameter's ``.grad`` (None → zeros), keyed by parameter
    name."""
    return {
        n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
        for n, p in model.named_parameters()
    }


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute element difference between two :func:`grads` snapshots (same
    keys)."""
    if a.keys() != b.keys():
        raise ValueError("a and b must have the same parameter names")
    return max(float((a[k] - b[k]).abs().max()) for k in a)


# --------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + W2·gelu(W1·LN(x))``; x: (batch, seq, d)."""

    def __init__(self, d: int, mult: int = 4):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, mult * d)
        self.down = nn.Linear(mult * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Stack(nn.Module):
    """``n_layers`` :class:`Block` s with two ways to place checkpoints (both 0 = off,
    the default).

    * ``segment=k``: layers ``[0..k), [k..2k), …`` each run inside one ``checkpoint(...,
      use_reentrant=False)``: only the segment inputs (batch, seq, d) are kept, and
      every layer is recomputed once in backward (whatever ``k`` is).
    * ``every=n``: only layers ``0, n, 2n, …`` are checkpointed (one layer each), the
      others keep their activations — what ``transformers``' ``every_n_layers`` does:
      less recompute, more memory.
    """

    def __init__(
        self,
        n_layers: int = 8,
        d: int = 64,
        mult: int = 4,
        segment: int = 0,
        every: int = 0,
        seed: int = 0,
    ):
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be ≥ 1, got {n_layers}")
        torch.manual_seed(seed)
        self.layers = nn.ModuleList(Block(d, mult) for _ in range(n_layers))
        self._segment = self._every = 0
        self.segment = segment
        self.every = every

    @property
    def segment(self) -> int:
        return self._segment

    @segment.setter
    def segment(self, k: int) -> None:
        if k < 0 or k > len(self.layers):
            raise ValueError(
                f"segment must be 0 (off) or 1..n_layers={len(self.layers)}, got {k}"
            )
        if k and self._every:
            raise ValueError("segment and every are exclusive: set one of them to 0")
        self._segment = int(k)

    @property
    def every(self) -> int:
        return self._every

    @every.setter
    def every(self, e: int) -> None:
        if e < 0 or e > len(self.layers):
            raise ValueError(
                f"every must be 0 (off) or 1..n_layers={len(self.layers)}, got {e}"
            )
        if e and self._segment:
            raise ValueError("segment and every are exclusive: set one of them to 0")
        self._every = int(e)

    def _run(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for layer in self.layers[start:stop]:
            x = layer(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, k, e = len(self.layers), self.segment, self.every
        if (k == 0 and e == 0) or not torch.is_grad_enabled():
            return self._run(x, 0, n)
        if e:
            for i, layer in enumerate(self.layers):
                x = (
                    checkpoint(layer, x, use_reentrant=False)
                    if i % e == 0
                    else layer(x)
                )
            return x
        for start in range(0, n, k):
            x = checkpoint(self._run, x, start, min(start + k, n), use_reentrant=False)
        return x


# --------------------------------------------------------------------------------------
class SavedTensorBytes:
    """Context manager: bytes of tensors autograd saves for backward inside the ``with``
    block.

    Each storage counts once (views share storage); parameters are excluded (they exist
    anyway). With non-reentrant checkpointing, tensors saved inside a checkpointed
    segment are handled by the checkpoint's own hooks and are not kept — only the
    segment inputs reach these hooks. ``.bytes`` is the total (int, bytes); ``.count``
    the number of distinct storages.
    """

    def __init__(self, exclude: nn.Module | None = None):
        self._exclude = (
            {p.untyped_storage().data_ptr() for p in exclude.parameters()}
            if exclude
            else set()
        )
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, nn.Parameter):
            return t
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self._exclude and key != 0:
            self._seen[key] = st.nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def count(self) -> int:
        return len(self._seen)

    def __enter__(self) -> "SavedTensorBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class PeakLiveBytes(MemoryTracker):
    """Context manager: current and peak bytes of storages created by ops inside the
    block.

    A :class:`trainmem.measuring.tracker.MemoryTracker` with nothing registered by hand:
    every op output's storage counts once, from its creation until it is freed (a
    weak-reference callback on the storage subtracts it); ``meta`` tensors are ignored.
    Tensors that existed before the block (parameters, inputs) are not counted until an
    op returns a view of them. ``.peak`` and ``.current`` are ints in bytes.
    """

    skip_meta = True
    keep_records = False


@dataclass
class StepMeasurement:
    """One forward+backward: ``saved_bytes`` (kept for backward after the forward,
    bytes), ``peak_bytes`` (peak of tensors alive during forward+backward, bytes),
    ``flops`` (matmul FLOPs of forward+backward, recomputation included, from
    ``torch.utils.flop_counter``), ``seconds``."""

    segment: int
    every: int
    saved_bytes: int
    peak_bytes: int
    flops: int
    seconds: float


def measure_step(
    model: Stack, x: torch.Tensor, segment: int = 0, every: int = 0, repeats: int = 3
) -> StepMeasurement:
    """Measure one training step of a :class:`Stack` with the given checkpoint
    placement.

    ``x``: (batch, seq, d); the loss is ``out.square().mean()``. Memory and FLOPs are
    measured once (they are deterministic); ``seconds`` is the median of ``repeats``
    plain, uninstrumented runs (``repeats=0`` skips timing and returns ``nan``).
    """
    from torch.utils.flop_counter import FlopCounterMode

    if repeats < 0:
        raise ValueError(f"repeats must be ≥ 0, got {repeats}")
    model.segment = model.every = 0
    model.segment, model.every = segment, every
    model.zero_grad(set_to_none=True)
    with SavedTensorBytes(exclude=model) as saved:
        out = model(x)
    out.square().mean().backward()
    del out
    model.zero_grad(set_to_none=True)
    with PeakLiveBytes() as live:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    with FlopCounterMode(display=False) as fc:
        model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        model(x).square().mean().backward()
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    times.sort()
    return StepMeasurement(
        segment,
        every,
        saved.bytes,
        live.peak,
        int(fc.get_total_flops()),
        times[len(times) // 2] if times else float("nan"),
    )
