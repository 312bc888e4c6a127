"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"): the
update is the sign of an interpolation of the momentum and the gradient, so it keeps one
state tensor per parameter (AdamW keeps two).

A faithful copy of the update of ``lion-pytorch`` (the reference PyTorch
implementation), so :mod:`trainmem.measuring.measure` can run the optimizer the
estimator models (:mod:`trainmem.optimizers` entry ``"lion"``) without another
dependency."""

from __future__ import annotations

import torch


def _update(p, grad, exp_avg, lr: float, wd: float, beta1: float, beta2: float):
    """One parameter's step: decoupled weight decay, the signed update, the momentum.

    ``update`` is a new tensor (the ``clone`` and the ``add`` coexist for a moment) and
    is released when this function returns."""
    p.mul_(1.0 - lr * wd)
    update = exp_avg.clone().mul_(beta1).add(grad, alpha=1.0 - beta1).sign_()
    p.add_(update, alpha=-lr)
    exp_avg.mul_(beta2).add_(grad, alpha=1.0 - beta2)


class Lion(torch.optim.Optimizer):
    """``Lion(params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0)``; state per
    parameter: ``exp_avg`` in the parameter's dtype."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not all(0.0 <= b <= 1.0 for b in betas):
            raise ValueError(f"betas must lie in [0, 1], got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                _update(
                    p,
                    p.grad,
                    state["exp_avg"],
                    group["lr"],
                    group["weight_decay"],
                    beta1,
                    beta2,
                )
        return loss
