"""FP32 master weights for an FP16 model, and the rounding facts that make them
necessary.

The classic mixed-precision recipe (Micikevicius et al., 2018) keeps the model in FP16
for the forward and backward passes, and a separate FP32 copy of every parameter (the
*master weights*) that the optimizer updates. Each step: FP16 grads → FP32 → optimizer
step on the master copy → copy the master weights back into the FP16 model.

Functions here are plain and CPU-friendly (FP16 matmuls run on the CPU in torch ≥ 2.1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..dtypes import FLOAT_DTYPES  # noqa: E402
from ..measuring.training_setup import torch_dtype  # noqa: E402

_DTYPES = {name: torch_dtype(name) for name in FLOAT_DTYPES}


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(_DTYPES)} or a torch float dtype, "
                f"got {dtype!r}"
            )
        return _DTYPES[dtype]
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
    return dtype


def spacing(
    x: float, dtype: torch.dtype | str = torch.float16, direction: str = "up"
) -> float:
    """Distance from ``x`` (representable in ``dtype``) to its neighbour ``"up"`` or
    ``"down"``.

    Example: ``spacing(0.5, fp16, "up") == 2**-11`` and ``spacing(0.5, fp16, "down") ==
    2**-12`` (0.5 is a power of two, so the grid below it is twice as fine).
    """
    if direction not in ("up", "down"):
        raise ValueError(f"direction must be 'up' or 'down', got {direction!r}")
    dt = _dtype(dtype)
    t = torch.tensor(x, dtype=dt)
    target = torch.tensor(
        float("inf") if direction == "up" else float("-inf"), dtype=dt
    )
    return abs(float(torch.nextafter(t, target).double() - t.double()))


def update_survives(
    w: float, delta: float, dtype: torch.dtype | str = torch.float16
) -> bool:
    """True when ``w + delta`` computed and stored in ``dtype`` differs from ``w`` in
    ``dtype``."""
    dt = _dtype(dtype)
    wt = torch.tensor(w, dtype=dt)
    return bool((wt + torch.tensor(delta, dtype=dt)) != wt)


class MasterWeights:
    """FP32 master copies of a low-precision model's parameters, and the step that uses
    them.

    ``model`` holds FP16 (or BF16) parameters; ``optimizer_fn`` builds the optimizer
    over the FP32 copies (so Adam's m and v are FP32 too). ``step()``: copy grads (low
    precision → FP32, divided by ``grad_scale``), optimizer step on the FP32 copies,
    copy them back into the model.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer_fn: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer],
    ):
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        self.master = [
            torch.nn.Parameter(p.detach().float().clone()) for p in self.model_params
        ]
        self.optimizer = optimizer_fn(self.master)

    def step(self, grad_scale: float = 1.0) -> bool:
        """One update; returns False (and changes nothing) if any gradient is
        inf/NaN."""
        for mp, p in zip(self.master, self.model_params):
            mp.grad = None if p.grad is None else p.grad.float() / grad_scale
        if any(
            mp.grad is not None and not torch.isfinite(mp.grad).all()
            for mp in self.master
        ):
            return False
        self.optimizer.step()
        with torch.no_grad():
            for mp, p in zip(self.master, self.model_params):
                p.copy_(mp)  # round FP32 → model dtype for the next forward
        return True

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        for mp in self.master:
            mp.grad = None


@dataclass
class RegressionTask:
    """y = X @ w_true with small targeted steps: the FP16 weight update is below half a
    spacing.

    ``X``: (n, d) standard normal; weights start at ``w0`` (0.5 everywhere, the seed's
    example).
    """

    n: int = 64
    d: int = 8
    w0: float = 0.5
    spread: float = 0.01
    seed: int = 0

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        X = torch.randn(self.n, self.d, generator=g)
        w_true = self.w0 + self.spread * torch.randn(self.d, generator=g)
        return X, X @ w_true


def train_regression(
    mode: str, steps: int = 300, lr: float = 4e-3, task: RegressionTask | None = None
) -> list[float]:
    """FP32 loss after each SGD step of a linear model on :class:`RegressionTask`.

    ``mode``: ``"fp32"`` (reference), ``"fp16"`` (pure FP16 weights updated in place),
    or ``"fp16_master"`` (FP16 forward/backward, FP32 master weights). Returns ``steps +
    1`` losses (before the first step and after each), computed in FP32 from the weights
    the model holds.
    """
    if mode not in ("fp32", "fp16", "fp16_master"):
        raise ValueError(f"mode must be one of fp32, fp16, fp16_master, got {mode!r}")
    task = task or RegressionTask()
    X, y = task.data()
    dt = torch.float32 if mode == "fp32" else torch.float16
    w = torch.nn.Parameter(torch.full((task.d,), task.w0, dtype=dt))
    model = torch.nn.Module()
    model.w = w
    if mode == "fp16_master":
        mw = MasterWeights(model, lambda ps: torch.optim.SGD(ps, lr=lr))
    else:
        opt = torch.optim.SGD([w], lr=lr)

    def fp32_loss() -> float:
        return float(((X @ w.detach().float() - y) ** 2).mean())

    losses = [fp32_loss()]
    Xd, yd = X.to(dt), y.to(dt)
    for _ in range(steps):
        loss = ((Xd @ w - yd) ** 2).mean()
        w.grad = None
        loss.backward()
        if mode == "fp16_master":
            mw.step()
        else:
            opt.step()
        losses.append(fp32_loss())
    return losses
