"""What fits on a GPU: the largest micro-batch or sequence, and the cheapest change that
makes an out-of-memory configuration fit (CLI: ``python -m trainmem fit``).

"Fits" is :func:`trainmem.gpus.device_report`'s answer: the step's allocations,
replayed through the caching-allocator model under the card's memory less the CUDA
context, never fail. The search assumes memory grows with the micro-batch and the
sequence (it does in every option the replay models) and bisects.

The changes, in the order tried (cheapest first: what each costs besides memory):

1. ``smaller micro-batch``: halve the micro-batch and double the gradient
   accumulation until it fits — the same global batch and the same mathematics, fewer
   tokens per kernel;
2. ``8-bit AdamW``: bitsandbytes' block-wise 8-bit states (2 bytes per parameter
   instead of 8) — no extra compute; matters when the optimizer states are large;
3. ``checkpointing``: recompute each decoder layer in backward — about one more forward
   pass of compute;
4. ``QLoRA``: the frozen base in 4-bit NF4 — dequantization in every matmul and a
   quantized base model.

If no single change fits, they are combined in that order, and a change the combination
fits without is then dropped (the costliest first): 8-bit AdamW saves next to nothing
for LoRA, whose optimizer states are a few MB."""

from __future__ import annotations

import dataclasses
from typing import Any

from .config import OptionError, StepConfig


def _fits(model, step: StepConfig, gpu: str) -> tuple[bool, Any]:
    from .estimate import estimate_step

    est = estimate_step(model, step, gpu=gpu)
    if est.device is None:
        raise OptionError(
            "model", "fit needs a Llama-family model (the step replay); gpt2 is not"
        )
    return bool(est.fits), est


def _largest(model, step: StepConfig, gpu: str, field: str, cap: int) -> int:
    """The largest value of ``field`` (batch or seq) in [1, cap] that fits (0: none)."""

    def ok(n):
        return _fits(model, dataclasses.replace(step, **{field: n}), gpu)[0]

    if not ok(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, cap + 1)  # ok(lo) holds, ok(hi) fails (or hi is past the cap)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo


def max_batch(model, step: StepConfig, gpu: str, cap: int = 4096) -> int:
    return _largest(model, step, gpu, "batch", cap)


def max_seq(model, step: StepConfig, gpu: str, cap: int = 1 << 20) -> int:
    return _largest(model, step, gpu, "seq", cap)


def _changes(step: StepConfig):
    """(name, changed step) for each change that applies, in the order tried."""
    out = []
    if step.batch > 1:
        b, accum = step.batch, step.grad_accum
        while b > 1:
            b, accum = b // 2, accum * 2
            out.append(
                (
                    f"micro-batch {b} with gradient accumulation {accum}",
                    dataclasses.replace(step, batch=b, grad_accum=accum),
                    "smaller micro-batch",
                )
            )
    if step.optimizer == "adamw":
        out.append(
            ("8-bit AdamW", dataclasses.replace(step, optimizer="adamw8bit"), "8-bit")
        )
    if not step.checkpointing:
        out.append(
            (
                "activation checkpointing",
                dataclasses.replace(step, checkpointing=True),
                "checkpointing",
            )
        )
    if step.method != "qlora":
        out.append(("QLoRA", dataclasses.replace(step, method="qlora"), "QLoRA"))
    return out


def cheapest_change(model, step: StepConfig, gpu: str) -> dict[str, Any]:
    """The first change (in the module docstring's order) that makes ``step`` fit on
    ``gpu``; then combinations. ``{"fits": True}`` when it fits already."""
    ok, est = _fits(model, step, gpu)
    if ok:
        return {"fits": True, "change": None, "device_bytes": est.device_bytes}
    tried = []
    seen_kinds = set()
    for name, changed, kind in _changes(step):
        ok, est = _fits(model, changed, gpu)
        tried.append({"change": name, "fits": ok, "device_bytes": est.device_bytes})
        if ok:
            return {
                "fits": False,
                "change": name,
                "device_bytes": est.device_bytes,
                "options": _diff(step, changed),
                "tried": tried,
            }
        seen_kinds.add(kind)
    # combine: the smallest micro-batch, then each further change on top
    picked: list[tuple[str, StepConfig]] = []
    for name, changed, kind in _changes(step):
        if kind == "smaller micro-batch" and changed.batch != 1:
            continue
        picked.append((name, changed))
        ok, est = _fits(model, _combine(step, picked), gpu)
        tried.append(
            {
                "change": " + ".join(n for n, _ in picked),
                "fits": ok,
                "device_bytes": est.device_bytes,
            }
        )
        if ok:
            # drop what the combination fits without, the costliest first (the last
            # one added is needed: without it the combination did not fit)
            for item in reversed(picked[:-1]):
                rest = [p for p in picked if p is not item]
                ok_rest, est_rest = _fits(model, _combine(step, rest), gpu)
                if ok_rest:
                    picked, est = rest, est_rest
            return {
                "fits": False,
                "change": " + ".join(n for n, _ in picked),
                "device_bytes": est.device_bytes,
                "options": _diff(step, _combine(step, picked)),
                "tried": tried,
            }
    return {"fits": False, "change": None, "tried": tried}


def _combine(step: StepConfig, picked: list[tuple[str, StepConfig]]) -> StepConfig:
    """``step`` with every picked change applied."""
    out = step
    for _, changed in picked:
        out = dataclasses.replace(out, **_diff(step, changed))
    return out


def _diff(a: StepConfig, b: StepConfig) -> dict[str, Any]:
    return {
        f.name: getattr(b, f.name)
        for f in dataclasses.fields(StepConfig)
        if getattr(a, f.name) != getattr(b, f.name)
    }


def fit(model, step: StepConfig, gpu: str, vary: str = "batch") -> dict[str, Any]:
    """``{"max_batch": N}`` (or ``{"max_seq": N}`` with ``vary="seq"``) on ``gpu``,
    with the GPU's numbers at that value, and — when ``step`` itself does not fit —
    the cheapest change that makes it fit."""
    if vary not in ("batch", "seq"):
        raise OptionError("vary", f"vary must be batch or seq, got {vary!r}")
    n = max_batch(model, step, gpu) if vary == "batch" else max_seq(model, step, gpu)
    out: dict[str, Any] = {f"max_{vary}": n, "gpu": gpu}
    if n:
        _, est = _fits(model, dataclasses.replace(step, **{vary: n}), gpu)
        out.update(
            total_bytes=est.total_bytes,
            reserved_bytes=est.reserved_bytes,
            device_bytes=est.device_bytes,
            headroom_bytes=est.device["headroom_bytes"],
        )
        out["notes"] = est.device["notes"]
    change = cheapest_change(model, step, gpu)
    out["requested"] = {vary: getattr(step, vary), "fits": change["fits"]}
    if not change["fits"]:
        # (its "fits" says whether the request fits as it is: requested["fits"])
        out["cheapest_change"] = {k: v for k, v in change.items() if k != "fits"}
    return out
