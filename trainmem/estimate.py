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

* ``model``: a preset name (``trainmem.families.PRESETS``: llama-7b, llama2-13b,
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
  (``None``: :meth:`trainmem.precisions.Precision.default_load` — under LoRA with
  ``*-amp`` the autocast dtype, otherwise the precision's, fp32 under ``*-amp``).
  ``method="lora", precision="bf16-amp"`` is then ``Trainer(bf16=True)`` over a bf16
  checkpoint loaded by transformers 5's ``from_pretrained`` (``dtype="auto"``): the
  16-bit base held once (autocast casts only fp32 tensors), a 16-bit residual
  stream, peft's fp32 adapters; ``load_dtype="fp32"`` is autocast over fp32 weights
  (transformers 4.x's load), their 16-bit copies kept for backward.
  :func:`estimate_from_hf` derives it (:func:`trainmem.from_hf.load_dtype`). The
  result's ``recipe`` says which recipe it replayed.
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
the tensor-level measurement of :mod:`trainmem.measuring.measure` (real CPU tensors, and
fake tensors for 7B shapes) and with torch's own ``MemTracker`` to a few bytes in most
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
import os
from dataclasses import dataclass
from typing import Any

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
    load_model_config,
    model_shape,
    split_targets,
    step_signature,
)
from .closed_form import (
    _gpt2_estimate,
    _trainable,
    accelerate_rule_bytes,
    bytes_per_param,
    count_params,
    lora_trainable_params,
)
from .decisions import Decisions, decide
from .dtypes import GB, GiB
from .families import FAMILIES
from .gpu_notes import _gpu_notes as _gpu_notes
from .result import MemoryEstimate, format_table
from .from_hf import (
    ALL_LINEAR,
    HF_OPTIMS,
    hf_field_error,
    hf_options,
    load_dtype_reason,
)
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
# the estimate (parameter counts and the closed forms: trainmem.closed_form; the result
# and its table: trainmem.result; the card's notes: trainmem.gpu_notes)
# --------------------------------------------------------------------------------------


def _options_record(shape: Shape, d: Decisions) -> dict[str, Any]:
    """The options of an estimate as its result reports them (``.options``), with
    the recipe it replayed (:func:`recipe`)."""
    step = d.options
    names = ESTIMATE_RECORD + (("load_dtype",) if step.load_dtype else ())
    # load_dtype only when given, so records of the recipes' own stay as they were
    out = step.record(names, model=shape.name, attn=step.attn_memory)
    out["recipe"] = recipe(d)
    return out


def recipe(d: Decisions) -> str:
    """The recipe a step's estimate replays, in words: the dtype the weights are
    held in (the base and the adapters under LoRA/QLoRA) and what casts them —
    ``"bf16 base + fp32 adapters, autocast bf16"`` is ``Trainer(bf16=True)`` + LoRA
    over a 16-bit checkpoint, ``"fp32 base + fp32 adapters, autocast bf16"`` the
    same over weights loaded in fp32 (16-bit copies kept for backward)."""
    t = d.dtypes
    if d.zero_layout:
        how = f"module cast to {t.module}, fp32 master copy"
    elif t.autocast:
        how = f"autocast {t.autocast}"
    else:
        how = "no autocast"
    if d.options.method == "full":
        return f"{t.base} weights, {how}"
    if d.options.method == "qlora":
        base = f"NF4 base ({t.quant_base} non-quantized weights)"
    else:
        base = f"{t.base} base"
    return f"{base} + {t.adapters} adapters, {how}"


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
        _options_record(shape, d),
        int(result["model_states"]),
        *_device(result, d, timeline),
        attention={
            "kind": d.attention,
            "sdpa_backend": d.sdpa_backend,
            "reason": d.attention_reason,
        },
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
