"""Training-memory estimator: peak bytes of one training step, term by term.

Public API (stable; chapters and labs call it)::

    from trainmem.estimate import estimate
    est = estimate("llama-7b", method="lora", precision="bf16-amp", optimizer="adamw",
                   batch=4, seq=512, lora_rank=8, lora_targets=("q_proj", "v_proj"),
                   checkpointing=True, attn="sdpa")
    est.total_bytes          # int, the peak (bytes)
    est.breakdown            # {"weights", "gradients", "optimizer_states",
                             #  "master_weights", "activations", "temporaries"}
                             # -> int bytes, at the peak; sums to total
    est.activation_bytes     # bytes held for backward at the end of the forward pass
    est.n_params, est.n_trainable
    est.to_json(); est.to_dict()
    print(est.table())       # table in GiB (2**30) and GB (10**9)

``estimate(model, method, precision, optimizer, batch, seq, lora_rank, lora_alpha,
lora_targets, lora_dtype, qlora_double_quant, checkpointing, attn, zero, gpus,
grad_accum, optimizer_impl)``:

* ``model``: a preset name (``trainmem.models.PRESETS``: llama-7b, llama2-13b,
  qwen2.5-0.5b, gpt2, tiny, ...), a path to an HF ``config.json``, or a ``transformers``
  config.
* ``method``: ``"full"`` | ``"lora"`` | ``"qlora"`` (bitsandbytes ``load_in_4bit``: the
  Linear weights inside the decoder blocks in 4-bit NF4 — 0.5 B/weight + quantization
  constants — and the embeddings, norms and ``lm_head`` in 16 bit, fp16 under
  ``fp16-amp`` and bf16 otherwise).
* ``precision``: ``"fp32"`` | ``"fp16-amp"`` | ``"bf16-amp"`` (``torch.autocast`` over
  fp32 parameters; fp16 adds loss scaling) | ``"bf16"`` (pure bf16: parameters,
  gradients and AdamW states in bf16, no master copy).
* ``optimizer``: ``"adamw"`` (torch) | ``"adamw8bit"`` (bitsandbytes) | ``"sgd"`` |
  ``"sgd-momentum"``.
* ``optimizer_impl``: torch's implementation, which decides the scratch memory of the
  step (:data:`OPTIMIZER_IMPLS`): ``"foreach"`` (default here; what
  ``torch.optim.AdamW(params)`` picks on CUDA) allocates ``sqrt(exp_avg_sq)`` for every
  parameter at once, one more copy of the states (4 B/param under AMP); ``"fused"``
  (Hugging Face Trainer's default, ``optim= "adamw_torch_fused"`` in transformers 5)
  updates in place, no scratch; ``"for-loop"`` (``foreach=False``; the plain
  constructor's choice on CPU) needs two copies of one parameter at a time (plus the
  previous parameter's ``denom``). SGD and 8-bit AdamW: no scratch.
* ``batch``, ``seq``: micro-batch size and sequence length (tokens); ``grad_accum``
  micro-batches per optimizer step (gradients then stay allocated during the next
  forward).
* ``lora_rank`` (r), ``lora_alpha``, ``lora_targets`` (module names), ``lora_dtype``
  (``None`` = peft's default: fp32 adapters), ``qlora_double_quant``.
* ``load_dtype``: the dtype the weights are loaded in, independent of autocast
  (``None``: the precision's, fp32 under ``*-amp``). ``precision="bf16-amp",
  load_dtype="bf16"`` is ``Trainer(bf16=True)`` over a bf16 checkpoint loaded by
  transformers 5's ``from_pretrained`` (``dtype="auto"``): the 16-bit base held once
  (autocast casts only fp32 tensors), a 16-bit residual stream, peft's fp32 adapters.
  :func:`estimate_from_hf` derives it (:func:`trainmem.from_hf.load_dtype`).
* ``checkpointing``: non-reentrant activation checkpointing of every decoder layer.
* ``attn``: ``"sdpa"`` (also ``"flash"``: the same memory) | ``"eager"`` (materialises
  the ``b x heads x s x s`` scores) | ``"math"`` (SDPA's math path: fp32 copies of q,
  k, v, fp32 scores and softmax). With ``gpu`` below compute capability 8.0 (T4,
  V100) bf16 ``"sdpa"`` is replayed as ``"math"``: no fused SDPA kernel takes bf16
  there, so SDPA runs its math path; ``"flash"`` there is an error.
* ``zero`` (0-3) and ``gpus``: per-GPU memory under ZeRO partitioning over ``gpus``
  data-parallel GPUs — stage >= 1 divides optimizer states and fp32 master weights by
  ``gpus``, >= 2 also gradients, 3 also weights, frozen ones included (plus the
  gathered, unsharded layer in flight, and on N > 1 the prefetched next one and the
  root unit — embeddings, final norm, ``lm_head`` —, which FSDP keeps gathered from the
  forward to the end of backward; from stage 2 on N > 1 one unit's unsharded gradient
  waits for its reduce-scatter during backward). That is FSDP (``zero_impl="fsdp"``);
  ``zero_impl="deepspeed"`` (stages 2 and 3) models DeepSpeed ZeRO instead
  (:mod:`trainmem.deepspeed`): its gradient bucket of ``reduce_bucket_size``
  elements (kept from the optimizer's creation at stage 3, for each backward at stage
  2), parameters gathered module by module (a checkpointed layer through its backward,
  plus the prefetch bucket; the embeddings for their forward, ``lm_head`` from its
  forward to its backward: no root unit) and parameters under the persistence
  threshold never partitioned; ``deepspeed_sizes`` picks DeepSpeed's defaults or the
  Trainer's ``"auto"`` values. ``zero=0`` on ``gpus`` > 1 is torch DDP: nothing is
  partitioned, and DDP's gradient buckets (a second copy of every trainable gradient,
  ``gradient_as_bucket_view=False``) live for the whole run.  The AdamW
  ``foreach`` scratch (``temporaries`` at the optimizer step) covers the local shard
  only.  This part is a model, not measured here.  Which parameter layout applies:

  - ``zero=0``: the layout of plain PyTorch, as measured — under
    ``fp16-amp``/``bf16-amp`` torch AMP (fp32 parameters that *are* the master weights,
    fp32 gradients, autocast's 16-bit weight copies kept for backward: the 18 B/param
    convention below).
  - ``zero>=1`` with ``fp16-amp``/``bf16-amp``: the ZeRO paper's / DeepSpeed's layout —
    the module is cast to the 16-bit dtype (no autocast; adapters too), so 16-bit
    parameters 2Ψ (replicated for forward/backward at stages 1-2, sharded at stage 3) +
    16-bit gradients 2Ψ (sharded from stage 2) + fp32 master weights 4Ψ and fp32 Adam m,
    v 8Ψ held by the optimizer for its shard (12Ψ/N from stage 1).  The model states
    then equal :func:`trainmem.zero.per_gpu_memory` exactly (stage 3: plus the gathered
    layers, ``2 × params of one layer`` bytes each).  Activations follow the 16-bit
    module (a 16-bit residual stream, as with ``precision="bf16"``). DeepSpeed's
    transient fp32 copy of the local gradient shard at the step is not modelled.
  - ``fp32`` and pure ``bf16``: one layout at every stage (4 + 4 + 8, resp. 2 + 2 + 4
    bytes per parameter, each term sharded as above); fp32 matches
    ``per_gpu_memory(weight_bytes=4, grad_bytes=4, k=8)``.

How the peak is computed.  Parameters, gradients and optimizer states are counted
exactly from the config.  Activations and temporaries come from
:mod:`trainmem.memory`, a symbolic replay of the step: the Llama forward written op by
op as ``transformers`` runs it, each op saving for backward what PyTorch's autograd
saves, backward in autograd's order, then the optimizer's scratch memory. It agrees with
the tensor-level measurement of :mod:`trainmem.measure` (real CPU tensors, and fake
tensors for 7B shapes) and with torch's own ``MemTracker`` to a few bytes in most
configurations; ``benchmarks/results/memory_accuracy.md`` lists a fixed grid and a
random grid of tiny Llama, Qwen2 and Mistral configurations (GQA, tied embeddings, odd
widths, every option) with the worst rows.  The ``forward`` phase peak under
checkpointing is modelled less exactly (it is rarely the step's peak).  With
``gpu="T4"`` (any preset of :data:`trainmem.gpus.GPUS`) the step's allocations are
replayed through a model of PyTorch's caching allocator (:mod:`trainmem.memory.
allocator`) and the result adds ``reserved_bytes`` (``max_memory_reserved``: rounding,
segments, fragmentation, the cuBLAS workspaces), ``device_bytes`` (plus the CUDA
context: what ``nvidia-smi`` shows, a lower bound), ``fits`` and ``headroom_bytes``;
``total_bytes`` stays the tensors' peak.

The step as the user's stack runs it: ``lora_dropout`` (peft's dropout on each adapted
module's input: a mask and a dropped copy), ``use_cache`` (``None``: as transformers
decides — the config's ``use_cache``, off under checkpointing; from transformers 4.56
the cache holds a copy of every layer's K and V), ``versions`` (the behaviours keyed on
transformers, peft, bitsandbytes and torch releases, :mod:`trainmem.versions`: the loss
forms before 4.46 / 4.46-4.48 / from 4.49, bitsandbytes' saved 4-bit inputs up to
0.43.1) and ``kbit_prepare`` (QLoRA: ``"peft"`` = ``prepare_model_for_kbit_training``,
the non-quantized weights in fp32; ``"none"`` = kept in 16 bit). Llama-family
configs (llama, mistral, qwen2) are replayed; ``gpt2`` uses the closed-form activation
estimate of Korthikanti et al. (2022) and is marked ``exact=False``.

From what a Hugging Face Trainer user has — a model config, ``TrainingArguments`` and a
peft ``LoraConfig`` — :func:`estimate_from_hf` (CLI: ``python -m trainmem hf``) derives
these options (``optim`` → optimizer and implementation, ``bf16``/``fp16`` → precision,
checkpointing, batch, accumulation, ``max_length``, LoRA rank and targets, 4-bit
quantization → QLoRA).

Bytes per parameter — the two conventions behind "16" and "18" (see
:func:`bytes_per_param`):

* **16 B/param, ZeRO paper** (Rajbhandari et al., 2020), mixed-precision Adam: fp16
  parameters 2 + fp16 gradients 2 + fp32 master weights 4 + fp32 Adam m 4 + fp32 Adam v
  4 = 16.
* **18 B/param, torch AMP / Hugging Face "model training anatomy"**: fp32 parameters 4
  (these are the master weights) + fp32 gradients 4 + Adam m, v 8 = 16, plus the
  fp16/bf16 working copies of the weights that autocast makes and autograd keeps until
  backward, 2 → 18.
* fp32 training: 4 + 4 + 8 = 16; pure bf16 (no master copy): 2 + 2 + 2 + 2 = 8.
* ``accelerate estimate-memory`` uses "4x the model size in the dtype" (16 B/param fp32,
  8 B/param half precision) and no activations: :func:`accelerate_rule_bytes`.

Units: every ``*_bytes`` value and breakdown entry is an int number of bytes;
GiB = 2**30 bytes, GB = 10**9 bytes.

The options of one step form a :class:`~trainmem.config.StepConfig`, validated once when
it is built; ``estimate(model, **options)`` builds it and calls :func:`estimate_step`,
which takes the model and a ready ``StepConfig`` (``estimate_step("llama-7b",
StepConfig(method="lora", batch=4))``)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

from .config import (
    ATTN_IMPLS,
    CATEGORIES,
    LORA_DTYPES,
    METHODS,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PRECISIONS,
    OptionError,
    Shape,
    StepConfig,
    check_choice,
    load_model_config,
    optimizer_entry,
    model_shape,
    split_targets,
    step_signature,
)
from .decisions import Decisions, decide, sdpa_falls_back_to_math
from .dtypes import GB, GiB, nf4_bytes_per_weight
from .precisions import precision as precision_entry
from .families import FAMILIES, lora_adapter_params
from .from_hf import (
    ALL_LINEAR,
    HF_OPTIMS,
    hf_field_error,
    hf_options,
    load_dtype_reason,
)
from .memory.accounting import ITEMSIZE
from .versions import parse_versions

__all__ = [
    "ATTN_IMPLS",
    "CATEGORIES",
    "LORA_DTYPES",
    "METHODS",
    "OPTIMIZER_IMPLS",
    "OPTIMIZERS",
    "PRECISIONS",
    "GB",
    "GiB",
    "MemoryEstimate",
    "OptionError",
    "Shape",
    "StepConfig",
    "accelerate_rule_bytes",
    "activation_bytes_per_layer",
    "bytes_per_param",
    "count_params",
    "estimate",
    "estimate_step",
    "format_table",
    "load_model_config",
    "lora_trainable_params",
    "model_shape",
    "split_targets",
    "ALL_LINEAR",
    "HF_OPTIMS",
    "estimate_from_hf",
    "hf_options",
]


# --------------------------------------------------------------------------------------
# parameter counts and bytes per parameter
# --------------------------------------------------------------------------------------
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


# --------------------------------------------------------------------------------------
# the estimate
# --------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    """Peak memory of one training step (all sizes in bytes, per GPU)."""

    total_bytes: int
    breakdown: dict[str, int]
    activation_bytes: int
    n_params: int
    n_trainable: int
    peak_phase: str
    phase_peaks: dict[str, int]
    exact: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    #: weights + gradients + optimizer states + master weights held per GPU when the
    #: optimizer step starts (bytes; not in ``to_dict``). Unlike ``breakdown`` (taken at
    #: the peak, which may fall in backward before every gradient exists) this is the
    #: resident model state that :func:`trainmem.zero.per_gpu_memory` counts.
    model_state_bytes: int = 0
    #: with ``gpu``: trainmem.gpus.device_report's numbers (reserved_bytes,
    #: device_bytes, fits, headroom_bytes, ...) and the step's memory timeline
    device: dict[str, Any] | None = None
    #: with ``timeline=True``: bytes by category sampled over the step's allocation
    #: events (about 200 points: ``event``, ``phase``, ``reserved`` and the categories)
    timeline: list[dict[str, Any]] | None = None

    @property
    def reserved_bytes(self) -> int | None:
        return None if self.device is None else self.device["reserved_bytes"]

    @property
    def device_bytes(self) -> int | None:
        return None if self.device is None else self.device["device_bytes"]

    @property
    def fits(self) -> bool | None:
        return None if self.device is None else self.device["fits"]

    def to_dict(self) -> dict[str, Any]:
        out = self._base_dict()
        if self.device is not None:
            out.update(self.device)
        if self.timeline is not None:
            out["timeline"] = self.timeline
        return out

    def _base_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": int(self.total_bytes),
            "breakdown": {k: int(self.breakdown[k]) for k in CATEGORIES},
            "activation_bytes": int(self.activation_bytes),
            "n_params": int(self.n_params),
            "n_trainable": int(self.n_trainable),
            "peak_phase": self.peak_phase,
            "phase_peaks": {k: int(v) for k, v in self.phase_peaks.items()},
            "exact": self.exact,
            "options": self.options,
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    def table(self) -> str:
        title = f"estimated peak (peak in {self.peak_phase})"
        extra = {"activations at end of forward": self.activation_bytes}
        if self.device is not None:
            d = self.device
            extra["reserved (max_memory_reserved)"] = d["reserved_bytes"]
            extra["+ CUDA context"] = d["context_bytes"]
            if d["nccl_bytes"]:
                comms, channels = d["nccl_communicators"], d["nccl_channels"]
                extra[f"+ NCCL ({comms} comm x {channels} channels)"] = d["nccl_bytes"]
            extra["device (nvidia-smi, lower bound)"] = d["device_bytes"]
            extra[f"{d['gpu']} memory"] = d["capacity_bytes"]
        text = format_table(
            title,
            self.breakdown,
            self.total_bytes,
            extra,
            params=(self.n_params, self.n_trainable),
        )
        if self.device is not None:
            d = self.device
            verdict = "fits" if d["fits"] else "does NOT fit"
            text += (
                f"\n{d['gpu']}: {verdict}; headroom {d['headroom_bytes'] / GiB:.2f} GiB"
            )
            text += "".join(f"\nnote: {n['message']}" for n in d.get("notes", ()))
        if "load_dtype_reason" in self.options:
            text += f"\nrecipe: {self.options['load_dtype_reason']}"
        return text


def format_table(
    title: str,
    rows: dict[str, int],
    total: int,
    extra: dict[str, int] | None = None,
    params: tuple[int, int] | None = None,
) -> str:
    """A plain-text table of byte counts in GiB (2**30) and GB (10**9)."""
    lines = [title, f"{'term':<32}{'GiB':>12}{'GB':>12}{'bytes':>18}"]
    for k in CATEGORIES:
        v = int(rows.get(k, 0))
        lines.append(f"{k:<32}{v / GiB:>12.3f}{v / GB:>12.3f}{v:>18,}")
    lines.append(
        f"{'total (peak)':<32}{total / GiB:>12.3f}{total / GB:>12.3f}{int(total):>18,}"
    )
    for k, v in (extra or {}).items():
        lines.append(f"{k:<32}{v / GiB:>12.3f}{v / GB:>12.3f}{int(v):>18,}")
    if params:
        lines.append(f"parameters: {params[0]:,} total, {params[1]:,} trainable")
    return "\n".join(lines)


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
    param_bytes = ITEMSIZE[prec.params]
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


def _options_record(shape: Shape, step: StepConfig) -> dict[str, Any]:
    """The options of an estimate as its result reports them (``.options``)."""
    names = ESTIMATE_RECORD + (("load_dtype",) if step.load_dtype else ())
    # load_dtype only when given, so records of the recipes' own stay as they were
    return step.record(names, model=shape.name, attn=step.attn_memory)


#: the options an estimate's result reports, in order (:meth:`StepConfig.record`)
ESTIMATE_RECORD = (
    "model",
    "method",
    "precision",
    "optimizer",
    "batch",
    "seq",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "lora_dtype",
    "qlora_double_quant",
    "checkpointing",
    "attn",
    "zero",
    "gpus",
    "zero_impl",
    "deepspeed_sizes",
    "grad_accum",
    "optimizer_impl",
    "checkpointing_mode",
    "lora_dropout",
    "use_cache",
    "versions",
    "kbit_prepare",
    "framework",
)


def estimate_step(
    model: Any, step: StepConfig, gpu: str | None = None, timeline: bool = False
) -> MemoryEstimate:
    """Estimate the peak memory (bytes, per GPU) of the training step ``step`` of
    ``model`` (a preset name, config .json path, config or :class:`Shape`)."""
    shape = model_shape(model)
    step.check_model(shape)
    if gpu is not None:
        from .gpus import get_gpu

        get_gpu(gpu)  # a bad name raises OptionError("gpu") before anything else
    d = decide(shape, step, gpu)
    n_params = count_params(shape)
    if d.layout is None:
        result = _gpt2_estimate(shape, d)
        exact = False
        n_trainable = result["n_trainable"]
    else:
        from .memory.step import simulate_step

        from .gpus import replay_setup

        result = simulate_step(
            shape,
            d,
            record_events=gpu is not None or timeline,
            replay_as=(
                replay_setup(gpu, d.versions, step.gpus, d.communicators)
                if gpu
                else None
            ),
        )
        exact = True
        n_trainable = _trainable(shape, step)
    phase_peaks = result["phase_peaks"]
    peak_phase = max(phase_peaks, key=lambda k: (phase_peaks[k], k))
    return MemoryEstimate(
        int(result["peak"]),
        {k: int(result["breakdown"][k]) for k in CATEGORIES},
        int(result["activations"]),
        n_params,
        n_trainable,
        peak_phase,
        phase_peaks,
        exact,
        _options_record(shape, step),
        int(result["model_states"]),
        *_device(result, d, timeline),
    )


def nccl_communicators(step: StepConfig) -> int:
    """The NCCL communicators a step's process holds on ``step.gpus`` > 1 GPUs: torch's
    FSDP/DDP run on the default group, DeepSpeed adds a clone of it for its optimizer
    (:mod:`trainmem.gpus`, "Communicators"; the sharding entry's ``communicators``)."""
    from .sharding import sharding

    return sharding(step.zero_impl).communicators


def _device(result: dict, d: Decisions, timeline: bool):
    """trainmem.gpus.device_report of the replayed step on ``d.gpu`` (None without)
    and the step's timeline (None unless asked for)."""
    step = d.options
    gpu = None if d.gpu is None else d.gpu.name
    events = result.get("events")
    if not events:
        return None, None
    if gpu is None:
        from .memory.allocator import replay

        return None, replay(events, None, 200)["timeline"]
    from .gpus import device_report

    device = device_report(
        events,
        gpu,
        d.versions,
        200 if timeline else 0,
        gpus=step.gpus,
        replays=result.get("replays"),
        communicators=d.communicators,
    )
    points = device.pop("timeline")
    device["notes"] = _gpu_notes(d)
    return device, (points if timeline else None)


def _gpu_notes(d: Decisions) -> list[dict]:
    """What the card changes besides memory, as ``{"code", "message"}`` (front ends
    word them by ``code``): bf16 on a card without bf16 units runs, but emulated
    (torch.cuda.is_bf16_supported() answers True through emulation below compute
    capability 8.0, so Trainer(bf16=True) accepts it); bf16 SDPA there runs the
    math path (:func:`trainmem.decisions.decide`); a DeepSpeed ZeRO-3 LoRA step
    with non-reentrant checkpointing, which DeepSpeed before its fix stops with a
    CheckpointError (seen on CPU with 0.16.4, ``benchmarks/deepspeed_cpu_check.py``);
    and on more than 2 NVSwitch-connected sm_90+ GPUs NCCL's NVLS buffers, which the
    estimate leaves out (:mod:`trainmem.gpus`)."""
    step, gpu = d.options, d.gpu
    notes = []
    major, minor = gpu.capability
    uses_bf16 = d.bf16_compute or step.lora_dtype == "bf16"
    if uses_bf16 and not gpu.bf16:
        notes.append(
            {
                "code": "bf16-emulated",
                "message": f"{gpu.name} (sm_{major}{minor}) has no bf16 units: torch "
                "emulates bf16 there and the step is slow; fp16-amp is the native "
                "choice",
            }
        )
    if sdpa_falls_back_to_math(step, d.precision, gpu):
        replayed = d.attention_reason is not None  # decisions._attention
        notes.append(
            {
                "code": "sdpa-math" if replayed else "sdpa-math-not-modelled",
                "message": "no fused SDPA kernel takes bf16 below sm_80, so attention "
                "runs SDPA's math path (fp32 scores and softmax): "
                + (
                    "replayed on that path"
                    if replayed
                    else "this estimate does not include it"
                ),
            }
        )
    if (
        d.sharding.checkpoint_error
        and step.zero >= 3
        and step.method in ("lora", "qlora")
        and step.checkpointing
        and step.checkpointing_mode == "non-reentrant"
    ):
        notes.append(
            {
                "code": "deepspeed-checkpoint-error",
                "message": "DeepSpeed ZeRO-3 with LoRA and non-reentrant checkpointing "
                "stops in the backward with torch's CheckpointError in DeepSpeed "
                "releases without deepspeedai/DeepSpeed#8148 (seen with 0.16.4; "
                "huggingface/transformers#47254); gradient_checkpointing_kwargs="
                "{'use_reentrant': True} runs (--checkpointing-mode reentrant)",
            }
        )
    if gpu.nvlink and gpu.capability >= (9, 0) and step.gpus > 2:
        notes.append(
            {
                "code": "nvls-not-modelled",
                "message": "NCCL's NVLS (NVLink SHARP) buffers are not in this "
                "estimate: on more than 2 NVSwitch-connected GPUs of compute "
                "capability 9.0 or newer NCCL maps channels x 2 buffers per local GPU "
                "into each GPU, for every communicator (up to gigabytes per GPU, "
                "depending on the NCCL version); NCCL_NVLS_ENABLE=0 turns them off",
            }
        )
    return notes


def estimate(
    model: Any = "llama-7b", *, gpu: str | None = None, **options: Any
) -> MemoryEstimate:
    """Estimate the peak memory (bytes, per GPU) of one training step; see the module
    docstring. ``options`` are the fields of :class:`StepConfig` (its defaults apply),
    checked when it is built; then :func:`estimate_step` runs.

    Raises :class:`OptionError` (a ``ValueError``) naming the argument and the allowed
    values for bad input.
    """
    shape = model_shape(model)
    return estimate_step(shape, StepConfig.from_options(options), gpu=gpu)


step_signature(
    estimate,
    inspect.Parameter(
        "model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="llama-7b"
    ),
    inspect.Parameter("gpu", inspect.Parameter.KEYWORD_ONLY, default=None),
)


def activation_bytes_per_layer(
    model: Any = "llama-7b",
    batch: int = 1,
    seq: int = 512,
    precision: str = "bf16-amp",
    attn: str = "sdpa",
    method: str = "full",
    lora_targets=("q_proj", "v_proj"),
    checkpointing: bool = False,
) -> int:
    """Bytes one (non-first) decoder layer holds for backward at the end of the forward
    pass.

    Computed by the replay as the difference between models with 3 and 2 layers, so it
    is exactly what autograd keeps for one more layer (e.g. fp32, SDPA, full
    fine-tuning: ``b·s·(24h + 8·q_dim + 8·kv_dim + 16·I + 8) + 4·b·heads·s`` bytes)."""
    from .memory.step import simulate_step

    shape = model_shape(model)
    if shape.family.replay is None:
        raise OptionError(
            "model",
            "activation_bytes_per_layer models the replayed families ("
            + ", ".join(f.name for f in FAMILIES.values() if f.replay)
            + f"), got {shape.arch}",
        )
    step = StepConfig(
        method=method,
        precision=precision,
        optimizer="sgd",
        batch=batch,
        seq=seq,
        lora_targets=lora_targets,
        checkpointing=checkpointing,
        attn=attn,
    )
    held = []
    for layers in (2, 3):
        deeper = dataclasses.replace(shape, layers=layers)
        held.append(simulate_step(deeper, decide(deeper, step))["activations"])
    return held[1] - held[0]


def estimate_from_hf(
    model: Any,
    training_args: Any = None,
    peft_config: Any = None,
    *,
    seq: int | None = None,
    quantization_config: Any = None,
    **overrides: Any,
) -> MemoryEstimate:
    """:func:`estimate` from a model config, ``TrainingArguments`` and a ``LoraConfig``.

    ``model``: a preset name, a ``config.json`` path or dict, or a ``transformers``
    config. The other arguments are those of :func:`hf_options`; ``overrides`` are
    passed to :func:`estimate` last (e.g. ``precision="bf16"`` for a model loaded in
    bf16, ``zero``, ``gpus``). Example::

        from transformers import AutoConfig, TrainingArguments
        from peft import LoraConfig
        est = estimate_from_hf(AutoConfig.from_pretrained(path),
                               TrainingArguments("out", bf16=True,
                               gradient_checkpointing=True,
                                                 per_device_train_batch_size=4),
                               LoraConfig(r=16, target_modules="all-linear"), seq=1024)
    """
    if isinstance(model, dict) or (
        isinstance(model, str) and (model.endswith(".json") or os.path.sep in model)
    ):
        model = load_model_config(model)  # a preset name stays a name (its exact shape)
    opts = hf_options(
        model,
        training_args,
        peft_config,
        seq=seq,
        quantization_config=quantization_config,
        versions=overrides.get("versions"),
    )
    opts.update(overrides)
    try:
        est = estimate(model, **opts)
    except OptionError as e:  # name the Hugging Face field the bad value came from
        renamed = hf_field_error(e, overrides)
        if renamed is e:
            raise
        raise renamed from None
    est.options["source"] = "hf"
    est.options["load_dtype_reason"] = load_dtype_reason(
        model, parse_versions(overrides.get("versions"))
    )
    return est


def fit_batch(free_bytes: int, need_bytes, want: int, margin: float = 0.85) -> int:
    """Largest batch ``b <= want`` whose ``need_bytes(b)`` fits in ``margin *
    free_bytes``.

    ``need_bytes`` maps a batch size to the estimated peak (bytes); ``margin`` leaves
    room for the caching allocator's rounding and fragmentation. Raises ``ValueError``
    with both sizes in GiB when not even one sample fits.
    """
    budget = margin * free_bytes
    for b in range(want, 0, -1):
        if need_bytes(b) <= budget:
            return b
    raise ValueError(
        f"batch 1 needs {need_bytes(1) / GiB:.2f} GiB; the device has "
        f"{free_bytes / GiB:.2f} GiB free ({margin:.0%} of it usable)"
    )


@dataclass(frozen=True)
class EstimateCheckPlan:
    """Chapter 3's "check the estimate on the GPU" cell: what to run."""

    precision: str
    batch: int
    seq: int
    need_bytes: int  # the estimate for that batch


def estimate_check_plan(
    cfg,
    precision: str,
    free_bytes: int | None = None,
    want_batch: int = 4,
    seq: int = 512,
) -> EstimateCheckPlan:
    """Full fine-tuning of ``cfg`` at ``precision`` (the device decides it:
    :func:`coursekit.gpu.estimate_check_plan`), the batch scaled to ``free_bytes``
    (:func:`fit_batch`), and the estimate of that step."""

    def need(b):
        return estimate(
            cfg, method="full", precision=precision, batch=b, seq=seq
        ).total_bytes

    batch = (
        want_batch if free_bytes is None else fit_batch(free_bytes, need, want_batch)
    )
    return EstimateCheckPlan(precision, batch, seq, need(batch))
