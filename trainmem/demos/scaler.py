"""A readable dynamic loss scaler: the rules ``torch.amp.GradScaler`` follows, written
out.

Why it exists: FP16 gradients smaller than about 6e-8 (the smallest subnormal, 2**-24)
become 0. Multiplying the loss by a large ``scale`` multiplies every gradient by the
same factor (the chain rule is linear), lifting small gradients into FP16's range; the
optimizer must then see the gradients divided by ``scale`` again ("unscale").

The dynamic rule (same defaults as ``torch.amp.GradScaler``):

* start at ``init_scale`` (2**16 = 65536);
* after each backward pass, check the unscaled gradients for inf/NaN;
* inf/NaN found → **skip** the optimizer step, ``scale *= backoff_factor`` (0.5), reset
  the counter;
* otherwise take the step; after ``growth_interval`` (2000) consecutive clean steps,
  ``scale *= growth_factor`` (2.0) and reset the counter.

So the scale settles just below the largest value that does not overflow: it is probed
upward every ``growth_interval`` steps and backed off whenever it overflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch

from ..formats import FP16_MAX


def loss_scale_demo(steps: int, tokens_per_batch: int) -> dict:
    """GradScaler settings that make a short fp16 run show both back-off and growth.

    The gradient of the mean cross-entropy w.r.t. one logit is at most 1/N (N tokens per
    batch), so the scaled gradient entering the fp16 ``lm_head`` backward overflows once
    ``S / N > 65504``. Starting 4x above that guarantees overflows (back-off, step
    skipped) in the first steps; a growth interval of a sixth of the run then lets the
    scale grow and overflow again several times. (The default ``growth_interval=2000``
    shows nothing in a 60-step demo.)
    """
    if steps < 6 or tokens_per_batch < 1:
        raise ValueError(
            "loss_scale_demo needs steps >= 6 and tokens_per_batch >= 1, "
            f"got {steps}, {tokens_per_batch}"
        )
    init = 2.0 ** (math.ceil(math.log2(FP16_MAX * tokens_per_batch)) + 2)
    return {"init_scale": init, "growth_interval": max(2, steps // 6)}


def scale_events(scales: list[float]) -> dict[str, int]:
    """Count growths (scale went up) and back-offs (went down) in a per-step list of
    scales."""
    ups = sum(b > a for a, b in zip(scales, scales[1:]))
    downs = sum(b < a for a, b in zip(scales, scales[1:]))
    return {"growth": ups, "backoff": downs}


@dataclass
class ScalerEvent:
    """One optimizer step as the scaler saw it.

    ``scale_used`` is the scale the loss was multiplied by; ``scale_next`` the scale for
    the next step; ``stepped`` False means the optimizer step was skipped because of
    inf/NaN gradients.
    """

    step: int
    found_inf: bool
    scale_used: float
    stepped: bool
    scale_next: float
    growth_tracker: int


@dataclass
class DynamicLossScaler:
    """Dynamic loss scaling, step by step (no fused kernels, no per-device bookkeeping).

    Parameters mirror ``torch.amp.GradScaler``: ``init_scale`` (> 0), ``growth_factor``
    (> 1), ``backoff_factor`` (in (0, 1)), ``growth_interval`` (≥ 1 clean steps before
    growing).
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    scale: float = field(init=False)
    growth_tracker: int = field(init=False, default=0)
    history: list[ScalerEvent] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"backoff_factor must be in (0, 1), got {self.backoff_factor}"
            )
        if (
            int(self.growth_interval) != self.growth_interval
            or self.growth_interval < 1
        ):
            raise ValueError(
                f"growth_interval must be an integer ≥ 1, got {self.growth_interval}"
            )
        self.scale = float(self.init_scale)

    # -- the three calls of a training step --------------------------------------------
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (backward of this gives gradients multiplied by
        ``scale``)."""
        return loss * self.scale

    def unscale_(self, params: Iterable[torch.nn.Parameter]) -> bool:
        """Divide every ``.grad`` by ``scale`` in place; return True if any is
        inf/NaN."""
        found_inf = False
        inv = 1.0 / self.scale
        for p in params:
            if p.grad is None:
                continue
            p.grad.mul_(inv)
            if not torch.isfinite(p.grad).all():
                found_inf = True
        return found_inf

    def update(self, found_inf: bool) -> ScalerEvent:
        """Apply the growth/backoff rule after one step; record and return the event."""
        used = self.scale
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0
        ev = ScalerEvent(
            len(self.history),
            bool(found_inf),
            used,
            not found_inf,
            self.scale,
            self.growth_tracker,
        )
        self.history.append(ev)
        return ev

    def step(self, optimizer: torch.optim.Optimizer) -> ScalerEvent:
        """Unscale the optimizer's gradients, step only if all are finite, then update
        the scale."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        found_inf = self.unscale_(params)
        if not found_inf:
            optimizer.step()
        return self.update(found_inf)


def trace_scale(
    found_inf: Sequence[bool],
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> list[ScalerEvent]:
    """The scaler's events for a given sequence of overflow flags (one per step)."""
    s = DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
    for f in found_inf:
        s.update(bool(f))
    return s.history


def simulate_overflow(
    max_grad: float,
    steps: int,
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    limit: float = FP16_MAX,
) -> list[ScalerEvent]:
    """Run the scaler against a toy model whose largest gradient is ``max_grad``
    (unscaled).

    A step overflows when ``max_grad * scale > limit`` (FP16's largest finite value by
    default), which is what makes the scaled FP16 gradient inf. Returns one event per
    step.
    """
    if not max_grad > 0:
        raise ValueError(f"max_grad must be > 0, got {max_grad}")
    s = DynamicLossScaler(init_scale, growth_factor, backoff_factor, growth_interval)
    for _ in range(steps):
        s.update(max_grad * s.scale > limit)
    return s.history


def equilibrium_scale(max_grad: float, limit: float = FP16_MAX) -> float:
    """The largest power of two ``s`` with ``max_grad * s <= limit`` (where the scale
    hovers)."""
    if not max_grad > 0:
        raise ValueError(f"max_grad must be > 0, got {max_grad}")
    return 2.0 ** math.floor(math.log2(limit / max_grad))
