"""The optimizer in a replayed step: the states it creates in step 1 (sharded under
ZeRO) and the scratch memory of its ``step()``, one rule per way torch's
implementations allocate (:data:`SCRATCH_RULES`, named by the optimizer registry
:mod:`trainmem.optimizers`)."""

from __future__ import annotations

import math

from ..optimizers import optimizer
from .accounting import ITEMSIZE, Simulator, new, shrink


def _adamw_foreach(sim: Simulator, params: list, state_dtype, part: float) -> None:
    """torch's ``_multi_tensor_adam``: ``torch.tensor(1.0)`` for the step count, then
    ``_foreach_sqrt(exp_avg_sq)``: one copy of every state at once."""
    step_one = new(sim, (), "fp32")
    tmp = [sim.alloc(n) for n in _state_sizes(params, state_dtype, part)]
    del tmp, step_one


def _adamw_for_loop(sim: Simulator, params: list, state_dtype, part: float) -> None:
    """torch's ``_single_tensor_adam``: per parameter ``denom = (exp_avg_sq.sqrt() / bc)
    .add_(eps)`` — the ``sqrt`` and the quotient coexist, and the previous parameter's
    ``denom`` is released only when the name is rebound, after the new one exists."""
    denom = None
    for n in _state_sizes(params, state_dtype, part):
        root = sim.alloc(n)
        quotient = sim.alloc(n)
        del root
        denom = quotient
        del quotient
    del denom


def _lion_for_loop(sim: Simulator, params: list, state_dtype, part: float) -> None:
    """:class:`trainmem.measuring.lion.Lion` (lion-pytorch's update), per parameter:
    ``update = exp_avg.clone().mul_(b1).add(grad, alpha=1 - b1).sign_()`` — the clone
    and the sum coexist, the clone goes, and ``update`` is released when the
    per-parameter update function returns."""
    for n in _state_sizes(params, state_dtype, part):
        clone = sim.alloc(n)
        added = sim.alloc(n)
        del clone, added


def _adafactor_for_loop(sim: Simulator, params: list, state_dtype, part: float) -> None:
    """torch's ``_single_tensor_adafactor`` (``foreach=False``), per parameter: a
    matrix allocates ``row_mean`` (rows × 1) and ``col_mean`` (1 × cols), then
    ``var_estimate = row_var @ col_var`` (a full-size tensor) and the scalar
    ``row_var.mean()`` it is divided by; a vector allocates ``grad * grad`` and
    ``variance.clone()``. ``update`` is ``var_estimate`` updated in place, and each
    loop variable keeps the previous parameter's tensor until it is rebound. The norms
    that end in ``.item()`` are 0-d tensors freed at once."""
    live: dict[str, object] = {}

    def bind(name: str, nbytes: int) -> None:
        buffer = sim.alloc(nbytes)  # the new tensor exists before the old is released
        live[name] = buffer

    for p in params:
        size = ITEMSIZE[state_dtype or p.dtype]
        shape = p.shape
        scalar = sim.alloc(size)  # param.norm(2)
        del scalar
        if len(shape) > 1:
            rows = math.prod(shape[:-1])
            cols = math.prod(shape[:-2]) * shape[-1]
            bind("row_mean", int(math.ceil(rows * size * part)))
            bind("col_mean", int(math.ceil(cols * size * part)))
            bind("var_estimate", int(math.ceil(p.numel * size * part)))
            mean = sim.alloc(size * math.prod(shape[:-2]))  # row_var.mean(dim=-2)
            del mean
        else:
            bind("grad_squared", int(math.ceil(p.numel * size * part)))
            bind("var_estimate", int(math.ceil(p.numel * size * part)))
        live["update"] = live["var_estimate"]
        scalar = sim.alloc(size)  # update.norm(2)
        del scalar
    live.clear()


#: How ``optimizer.step()`` allocates scratch memory, by the rule names the optimizer
#: registry (:mod:`trainmem.optimizers`) gives each implementation.
SCRATCH_RULES = {
    "adamw-foreach": _adamw_foreach,
    "adamw-for-loop": _adamw_for_loop,
    "lion-for-loop": _lion_for_loop,
    "adafactor-for-loop": _adafactor_for_loop,
}


def _state_sizes(params: list, state_dtype, part: float) -> list[int]:
    """Bytes of one full-size state of each parameter, in the optimizer's order."""
    return [
        int(math.ceil(p.numel * ITEMSIZE[state_dtype or p.dtype] * part))
        for p in params
    ]


def _optimizer_states(sim: Simulator, params: list, step, state_dtype) -> list:
    """The optimizer states created in step 1 (``state_dtype`` ``None``: each
    parameter's own dtype), sharded under ZeRO. Paged states (bitsandbytes' paged
    optimizers, :class:`trainmem.optimizers.State` ``paged``) live in CUDA managed
    memory, outside the caching allocator this replay models: not allocated here."""
    spec = optimizer(step.optimizer)
    states = [
        new(sim, st.shape, st.dtype, category="optimizer_states")
        for p in params
        for st in spec.states(p.shape, state_dtype or p.dtype)
        if not st.paged
    ]
    if step.zero >= 1:
        for st in states:
            shrink(sim, st.buffer, 1.0 / step.gpus)
    return states
