"""Parameter counts and the closed forms: bytes per parameter under each convention
(torch AMP's 18, the ZeRO paper's 16, accelerate's 4x), and the closed-form estimate of
the families the replay does not describe (GPT-2: Korthikanti et al. 2022), reading the
step's :class:`~trainmem.decisions.Decisions`. Standard library only."""

from __future__ import annotations

from typing import Any, Iterable

from .config import (
    PRECISIONS,
    OptionError,
    Shape,
    StepConfig,
    check_choice,
    model_shape,
    optimizer_entry,
)
from .decisions import Decisions
from .dtypes import nf4_bytes_per_weight
from .families import lora_adapter_params
from .memory.accounting import ITEMSIZE
from .precisions import precision as precision_entry


def count_params(model: Any) -> int:
    """Number of parameters of the base model (no adapters), exactly as ``transformers``
    builds it."""
    shape = model_shape(model)
    return shape.family.count_params(shape)


def lora_trainable_params(
    model: Any, rank: int = 8, targets: Iterable[str] = ("q_proj", "v_proj")
) -> int:
    """Trainable LoRA parameters: ``rank * (d_in + d_out)`` per targeted Linear, in
    every layer."""
    shape = model_shape(model)
    step = StepConfig(
        method="lora", precision="fp32", lora_rank=rank, lora_targets=targets
    )
    step.check_model(shape)
    linears = shape.linear_shapes()
    return shape.layers * sum(
        lora_adapter_params(*linears[t], rank) for t in step.lora_targets
    )


def _trainable(shape: Shape, step: StepConfig) -> int:
    """Trainable parameters of the step; LitGPT's ``lora_head`` adapts ``lm_head``
    once (LitGPT's fused ``LoRAQKVLinear`` holds exactly the q/k/v adapters' count:
    A ``r·n × d`` and B ``(q + k + v widths) × r``)."""
    if step.method == "full":
        return count_params(shape)
    targets = tuple(t for t in step.lora_targets if t != "lm_head")
    n = lora_trainable_params(shape, step.lora_rank, targets) if targets else 0
    if "lm_head" in step.lora_targets:
        n += lora_adapter_params(shape.hidden, shape.vocab, step.lora_rank)
    return n


def bytes_per_param(
    precision: str = "bf16-amp", optimizer: str = "adamw", convention: str = "torch-amp"
) -> float:
    """Bytes of model state per *trainable* parameter (no activations).

    ``convention``:

    * ``"torch-amp"`` — what PyTorch actually holds: fp32 parameters (master) 4 + fp32
      grads 4 + optimizer states, plus 2 for the low-precision weight copies autocast
      keeps for backward under ``fp16-amp``/``bf16-amp``: AdamW → 4 + 2 + 4 + 8 = **18**
      (Hugging Face's count); fp32 → 4 + 4 + 8 = 16; pure ``bf16`` → 2 + 2 + 4 = 8.
    * ``"zero-paper"`` — the ZeRO paper's mixed-precision Adam: fp16 params 2 + fp16
      grads 2 + fp32 master 4 + fp32 m 4 + fp32 v 4 = **16** (the transient copies are
      not counted because the fp16 parameters *are* the working copy).
    * ``"accelerate"`` — ``accelerate estimate-memory``: 4 x the dtype size (16 fp32, 8
      half).

    Optimizer states (``nominal_bytes`` of each :mod:`trainmem.optimizers` entry): AdamW
    8 (two fp32 moments; 4 in pure bf16), 8-bit AdamW ≈ 2, SGD with momentum and Lion 4
    (2 in bf16), plain SGD 0; Adafactor has no per-parameter figure."""
    check_choice("precision", precision, PRECISIONS)
    spec = optimizer_entry(optimizer)
    check_choice("convention", convention, ("torch-amp", "zero-paper", "accelerate"))
    prec = precision_entry(precision)
    if convention == "accelerate":
        return 4.0 * ITEMSIZE[prec.compute]
    p = ITEMSIZE[prec.params]
    if convention == "zero-paper" and prec.zero_half:
        half = ITEMSIZE[prec.zero_half]
        return half + half + 4 + _nominal_state_bytes(spec, 4)
    states = _nominal_state_bytes(spec, p)
    if convention == "zero-paper":
        return p + p + states
    copy = ITEMSIZE[prec.autocast] if prec.autocast else 0
    return p + copy + p + states


def _nominal_state_bytes(spec, itemsize: int) -> float:
    """State bytes per parameter of ``spec`` (an optimizer entry) for the closed forms;
    an optimizer whose states depend on each tensor's shape has none."""
    if spec.nominal_bytes is None:
        raise OptionError(
            "optimizer",
            f"optimizer {spec.name!r} keeps states whose size depends on each "
            "parameter's shape: no bytes-per-parameter figure (the Llama replay "
            "counts them)",
        )
    return spec.nominal_bytes(itemsize)


def accelerate_rule_bytes(n_params: int, precision: str) -> int:
    """``accelerate estimate-memory``'s training figure: 16 B/param (fp32) or 8 B/param
    (half / mixed precision), Adam, no activations. Implemented here for comparison
    (bytes)."""
    return int(n_params * bytes_per_param(precision, "adamw", convention="accelerate"))


def _qlora_weights(shape: Shape, step: StepConfig) -> int:
    """Bytes of a QLoRA base model in the closed form: the decoder blocks' Linear
    weights in NF4 (:func:`trainmem.dtypes.nf4_bytes_per_weight`, with or without
    double quantisation), everything else (embeddings, biases, norms) in 16 bit — the
    layout the replay holds."""
    n_linear = shape.layers * sum(i * o for i, o in shape.linear_shapes().values())
    nf4 = nf4_bytes_per_weight(step.qlora_double_quant)
    return int(n_linear * nf4) + 2 * (count_params(shape) - n_linear)


def _gpt2_estimate(shape: Shape, d: Decisions) -> dict:
    """Closed-form estimate (not replayed): model states exact, activations after
    Korthikanti et al. 2022 (34·s·b·h + 5·a·s²·b bytes per layer in 16-bit, the s² term
    only for eager)."""
    step, prec = d.options, d.precision
    method, optimizer = step.method, step.optimizer
    n_params = count_params(shape)
    param_bytes = ITEMSIZE[d.dtypes.load]  # the weights as loaded (LoRA: 16-bit)
    amp = prec.autocast is not None
    if method == "full":
        n_trainable = n_params
    else:
        n_trainable = lora_trainable_params(shape, step.lora_rank, step.lora_targets)
    lora_bytes = 4 if (step.lora_dtype in (None, "fp32")) else 2
    trainable_bytes = param_bytes if method == "full" else lora_bytes
    qlora = method == "qlora"
    weights = _qlora_weights(shape, step) if qlora else n_params * param_bytes
    master = n_trainable * 4 if amp and method == "full" else 0
    if amp and method == "full":
        weights = 2 * n_params  # low-precision working copies
    grads = n_trainable * trainable_bytes
    spec = optimizer_entry(optimizer)
    states = int(n_trainable * _nominal_state_bytes(spec, trainable_bytes))
    if d.zero_layout:  # ZeRO/DeepSpeed: 16-bit module, fp32 master + states
        weights = _qlora_weights(shape, step) if qlora else 2 * n_params
        grads, master = 2 * n_trainable, 4 * n_trainable
        states = int(n_trainable * _nominal_state_bytes(spec, 4))
    act_scale = ITEMSIZE[prec.compute] / 2.0
    batch, seq, hidden, heads = step.batch, step.seq, shape.hidden, shape.heads
    eager = d.attention == "eager"
    per_layer = 34 * seq * batch * hidden + (
        5 * heads * seq * seq * batch if eager else 0
    )
    per_layer = int(per_layer * act_scale / 2) * 2
    if step.checkpointing:
        acts = shape.layers * seq * batch * hidden * 2 * act_scale + per_layer
    else:
        acts = shape.layers * per_layer
    acts += batch * seq * shape.vocab * 4 * 2
    temps = batch * seq * shape.vocab * 4
    gpus = step.gpus
    if step.zero >= 1:
        states //= gpus
        master //= gpus
    if step.zero >= 2:
        grads //= gpus
    if step.zero >= 3:
        weights //= gpus
    breakdown = {
        "weights": int(weights),
        "gradients": int(grads),
        "optimizer_states": int(states),
        "master_weights": int(master),
        "activations": int(acts),
        "temporaries": int(temps),
    }
    return {
        "peak": sum(breakdown.values()),
        "breakdown": breakdown,
        "activations": int(acts),
        "model_states": int(weights + grads + states + master),
        "phase_peaks": {"backward": sum(breakdown.values())},
        "n_params": n_params,
        "n_trainable": n_trainable,
    }
