"""What one training step will do, resolved once: :func:`decide` turns the options
(:class:`~trainmem.config.StepConfig`), the model (:class:`~trainmem.config.Shape`),
the GPU and the library versions into a frozen :class:`Decisions` record — the dtypes
(load, compute/autocast, trainable, gradients, optimizer states, master copy), the
attention backend, the sharding plan, the decoder layout and the loss form. The replay
(:mod:`trainmem.memory.step`), the closed forms and the notes
(:mod:`trainmem.estimate`) and the measurement (:mod:`trainmem.measuring.measure`) read
the record; none of them looks at a precision, sharding or framework name again (those
are registries: :mod:`trainmem.precisions`, :mod:`trainmem.sharding`,
:mod:`trainmem.frameworks`).

Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import OptionError, Shape, StepConfig
from .frameworks import Framework, framework
from .gpus import SM80
from .objectives import Objective, objective, resolve_reference, sequences
from .kbit import KbitFlow, kbit_flow
from .precisions import Precision, precision
from .sdpa import EFFICIENT_LSE_ALIGN, MASK_ALIGN, hf_call, select_backend
from .sharding import Sharding, sharding
from .versions import (
    cache_copies_kv,
    cache_values_in_key_dtype,
    hf_materializes_causal_mask,
    loss_form,
)


@dataclass(frozen=True)
class Dtypes:
    """The dtypes of the step (names of :data:`trainmem.dtypes.DTYPES`).

    ``load``: the parameters as loaded; ``base``: the base parameters as the step
    holds them (after the ZeRO cast; under QLoRA the non-quantized ones, the
    quantized Linears' dtype before quantization); ``buffers``: the RoPE buffers;
    ``module``: the dtype the whole module is
    cast to under the ZeRO layout (``None``: not cast); ``autocast``: torch.autocast's
    dtype (``None``: no autocast); ``compute``: what the matmuls run in;
    ``trainable``: the trainable parameters (full fine-tuning: the parameters';
    LoRA: the adapters'), which the gradients share; ``optimizer_states``: the
    states' dtype (``None``: each parameter's own); ``master``: the fp32 master copy
    the optimizer holds (``None``: none); ``quant_compute``/``quant_base``: QLoRA's
    bitsandbytes compute dtype and its non-quantized base weights (``None`` off
    QLoRA)."""

    load: str
    base: str
    buffers: str
    module: str | None
    autocast: str | None
    compute: str
    trainable: str
    gradients: str
    optimizer_states: str | None
    master: str | None
    quant_compute: str | None
    quant_base: str | None
    adapters: str | None


@dataclass(frozen=True)
class Decisions:
    """The step as it will run (see the module docstring). ``options`` keeps the
    sizes (batch, seq, LoRA rank and targets, ...) the record does not restate."""

    options: StepConfig
    precision: Precision
    sharding: Sharding
    framework: Framework
    dtypes: Dtypes
    #: what attention runs as far as memory goes: ``sdpa`` (a fused kernel: flash,
    #: cuDNN or memory-efficient), ``eager`` or ``math`` (SDPA's math path)
    attention: str
    #: the SDPA backend torch runs (:data:`trainmem.sdpa.BACKENDS`; ``None``: no
    #: SDPA call — eager, FlashAttention-2 — or a framework whose choice is not
    #: replayed) and why (:attr:`trainmem.sdpa.Choice.reason`)
    sdpa_backend: str | None
    attention_reason: str | None
    #: transformers ``repeat_kv``-ed key and value before SDPA (no ``enable_gqa``)
    sdpa_repeats_kv: bool
    #: asked for SDPA, torch runs its math path on this card, whether or not the
    #: framework's replay models it (``sdpa_backend`` is ``"math"`` where it does)
    sdpa_math_fallback: bool
    #: the step computes in bf16 (autocast or pure bf16 parameters)
    bf16_compute: bool
    #: the decoder the replay builds (``memory.step.DECODERS``), ``None``: closed form
    layout: str | None
    #: the causal-LM loss form of the transformers version (:func:`versions.loss_form`)
    loss_form: str
    #: ZeRO's mixed-precision layout: 16-bit module, fp32 master and states
    zero_layout: bool
    #: NCCL communicators of the process on more than one GPU
    communicators: int
    #: the forward's KV cache holds new copies of every layer's K and V
    #: (``StepConfig.cache_on`` and :func:`trainmem.versions.cache_copies_kv`)
    kv_cache_copies: bool
    #: the cache's copies of V take K's dtype
    #: (:func:`trainmem.versions.cache_values_in_key_dtype`)
    kv_cache_values_as_keys: bool
    versions: dict = dataclasses.field(default_factory=dict)
    #: transformers builds a ``batch x seq x seq`` bool causal mask and hands it to
    #: SDPA (no KV cache in the forward, :func:`versions.hf_materializes_causal_mask`)
    #: instead of ``is_causal=True``
    causal_mask: bool = False
    gpu: Any = None
    #: what the step optimises (:mod:`trainmem.objectives`), the reference it runs
    #: (``copy``, ``adapter``, ``precomputed`` or ``none``) and the (rows, tokens) of
    #: one micro-batch's forward (DPO: 2 x batch; GRPO: prompt + completion tokens)
    objective: Objective | None = None
    reference: str = "none"
    sequences: tuple[int, int] = (0, 0)
    #: rows per chunk of the chunked cross-entropy (``None``: lm_head's logits whole
    #: and ``cross_entropy``, :attr:`loss_form`)
    loss_chunk: int | None = None
    #: the forward's saved tensors are offloaded to the host (TRL's
    #: activation_offloading; :mod:`trainmem.memory.offload`)
    activation_offload: bool = False
    #: GPUs the sequence is sharded over (ring attention; 1: none)
    context_parallel: int = 1
    #: QLoRA's dtype flow (:mod:`trainmem.kbit`); ``None`` off QLoRA
    kbit: KbitFlow | None = None
    #: the sizes the sharding reads (DeepSpeed's buckets and thresholds for the
    #: model's width: :mod:`trainmem.deepspeed`), ``None`` when it reads none
    shard_sizes: Any = None

    @property
    def autocast(self) -> str | None:
        return self.dtypes.autocast

    @property
    def sdpa_lse_align(self) -> int:
        """The queries the fused kernel's saved logsumexp is padded to (the
        memory-efficient kernel's :data:`trainmem.sdpa.EFFICIENT_LSE_ALIGN`)."""
        return EFFICIENT_LSE_ALIGN if self.sdpa_backend == "efficient" else 1

    @property
    def sdpa_mask_align(self) -> int:
        """The last dim a mask handed to the memory-efficient kernel is padded to
        (``preprocess_mask``'s ``mem_eff_alignment`` in torch's attention.cpp: an
        unaligned mask is copied into a padded one, which backward keeps)."""
        return MASK_ALIGN if self.sdpa_backend == "efficient" else 1


def _dtypes(
    shape: Shape, step: StepConfig, prec: Precision, frame: Framework
) -> Dtypes:
    zero_half = prec.zero_half if step.zero >= 1 else None
    load = step.load_dtype or prec.default_load(step.method, frame.lora_16bit_load)
    autocast = None if zero_half else prec.autocast
    # QLoRA: the non-quantized weights as loaded and as peft's k-bit preparation
    # leaves them, and bitsandbytes' compute dtype (trainmem.kbit)
    flow = kbit_flow(step, prec, frame, step.library_versions)
    quant_compute = flow.compute if flow else None
    quant_base = flow.base if flow else None
    base = zero_half or (quant_base if step.method == "qlora" else None) or load
    if frame.adapter_dtype is None:  # the adapters follow the module
        adapters = zero_half or step.lora_dtype or base
    else:
        adapters = zero_half or step.lora_dtype or frame.adapter_dtype
    trainable = base if step.method == "full" else adapters
    return Dtypes(
        load=load,
        base=base,
        buffers=zero_half or load,
        module=zero_half,
        autocast=autocast,
        compute=autocast or base,
        trainable=trainable,
        gradients=trainable,
        optimizer_states="fp32" if zero_half else None,
        master="fp32" if zero_half else None,
        quant_compute=quant_compute,
        quant_base=quant_base,
        adapters=adapters if step.method != "full" else None,
    )


@dataclass(frozen=True)
class _Attention:
    kind: str
    backend: str | None
    reason: str | None
    repeats_kv: bool
    math_fallback: bool


def _attention(
    shape: Shape,
    step: StepConfig,
    dtypes: Dtypes,
    frame: Framework,
    gpu,
    versions,
    mask: bool = False,
) -> _Attention:
    """What attention runs (:mod:`trainmem.sdpa`): asked for ``sdpa``, the backend
    torch selects for the call transformers makes — on the card's compute capability,
    or torch's CPU choice without a card — for the step's compute dtype, head counts
    and head dim (no attention mask: the batch has no padding, so ``is_causal``; no
    attention dropout); the math path is replayed as such. ``math`` is SDPA restricted
    to its math backend (``sdpa_kernel(SDPBackend.MATH)``); FlashAttention-2 does not
    run below compute capability 8.0."""
    attn = step.attn_memory
    cap = None if gpu is None else tuple(gpu.capability)
    forced = getattr(shape.family, "attn", None)
    if forced and step.attn != forced:
        # a family whose transformers module has no SDPA path runs its own whatever
        # is asked (Gemma 2: ``_supports_sdpa = False``, softcapping)
        return _Attention(
            forced,
            None,
            f"{shape.arch} has no SDPA path in transformers (it runs {forced})",
            False,
            False,
        )
    if step.attn == "flash" and cap is not None and cap < SM80:
        major, minor = cap
        raise OptionError(
            "attn",
            f"attn 'flash' (FlashAttention-2) needs compute capability 8.0 or "
            f"newer; {gpu.name} is sm_{major}{minor}: use attn 'sdpa'",
        )
    if step.attn == "math":
        # with a mask transformers repeat_kv-s key and value (no enable_gqa)
        repeats = mask and shape.kv_heads != shape.heads
        return _Attention(
            "math", "math", "asked: sdpa_kernel(SDPBackend.MATH)", repeats, False
        )
    if step.attn != "sdpa":
        return _Attention(attn, None, None, False, False)
    layout = frame.layout or shape.family.replay
    if not frame.replays_math_fallback or layout != "llama":
        # LitGPT expands key and value to the query heads itself and calls SDPA
        # without enable_gqa; its replay, and the recorded families' (their traces
        # are CPU's flash kernel), have the fused kernels only
        kv_heads = shape.kv_heads if frame.replays_math_fallback else shape.heads
        call, _ = hf_call(
            dtypes.compute,
            shape.heads,
            kv_heads,
            shape.head_dim,
            step.seq,
            versions,
        )
        choice = select_backend(call, cap, versions["torch"])
        return _Attention(attn, None, None, False, choice.backend == "math")
    call, repeats = hf_call(
        dtypes.compute,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        step.seq,
        versions,
        mask=mask,
    )
    choice = select_backend(call, cap, versions["torch"])
    kind = "math" if choice.backend == "math" else "sdpa"
    return _Attention(kind, choice.backend, choice.reason, repeats, kind == "math")


def _causal_mask(step: StepConfig, layout, goal, versions) -> bool:
    """Whether the transformers decoder hands SDPA a materialised causal mask: the
    Llama-layout decoders through transformers, SDPA (any backend), no KV cache in the
    forward (``use_cache`` off, checkpointing, or TRL's ``use_cache=False`` for DPO and
    GRPO), on the versions of :func:`versions.hf_materializes_causal_mask`. Context
    parallelism's ring is replayed with ``is_causal`` only."""
    cache = step.cache_on and not goal.logps
    return (
        layout == "llama"
        and step.attn in ("sdpa", "math")
        and step.context_parallel == 1
        and not cache
        and hf_materializes_causal_mask(versions)
    )


def _per_rank(rows_tokens: tuple[int, int], ranks: int) -> tuple[int, int]:
    """(rows, tokens) one GPU holds when the sequence is sharded over ``ranks``."""
    rows, tokens = rows_tokens
    return rows, tokens // ranks


def decide(shape: Shape, step: StepConfig, gpu: Any = None) -> Decisions:
    """The :class:`Decisions` of ``step`` for the model ``shape`` on ``gpu`` (a
    :data:`trainmem.gpus.GPUS` name or entry; ``None``: no card)."""
    if isinstance(gpu, str):
        from .gpus import get_gpu

        gpu = get_gpu(gpu)
    prec = precision(step.precision)
    frame = framework(step.framework)
    shard = sharding(step.zero_impl)
    versions = step.library_versions
    dtypes = _dtypes(shape, step, prec, frame)
    goal = objective(step.objective)
    layout = frame.layout or shape.family.layout(shape, step)
    mask = _causal_mask(step, layout, goal, versions)
    cache_copies = step.cache_on and cache_copies_kv(versions) and not goal.logps
    att = _attention(shape, step, dtypes, frame, gpu, versions, mask)
    if step.context_parallel > 1 and (
        layout != "llama" or goal.name != "sft" or step.attn_memory != "sdpa"
    ):
        raise OptionError(
            "context_parallel",
            "context_parallel is replayed for the transformers decoders with SDPA "
            f"(the ring runs the fused kernel) and objective sft, got {shape.arch}, "
            f"framework {frame.name!r}, attn {step.attn!r}, objective {goal.name!r}",
        )
    if step.activation_offload and (layout != "llama" or step.checkpointing):
        raise OptionError(
            "activation_offload",
            "activation_offload is replayed for the transformers decoders without "
            f"checkpointing, got {shape.arch} with framework {frame.name!r}"
            + (" and checkpointing" if step.checkpointing else ""),
        )
    if step.loss_impl == "chunked" and (layout != "llama" or goal.logps):
        raise OptionError(
            "loss_impl",
            "loss_impl 'chunked' is replayed for the causal-LM loss (objective sft) "
            f"of the transformers decoders, got {shape.arch} with framework "
            f"{frame.name!r} and objective {goal.name!r}",
        )
    if goal.logps and layout != "llama":
        raise OptionError(
            "objective",
            f"objective {goal.name!r} is replayed for the transformers decoders "
            f"(Llama, Qwen2, Mistral) with framework hf, got {shape.arch} with "
            f"framework {frame.name!r}",
        )
    return Decisions(
        options=step,
        precision=prec,
        sharding=shard,
        framework=frame,
        dtypes=dtypes,
        attention=att.kind,
        sdpa_backend=att.backend,
        attention_reason=att.reason,
        sdpa_repeats_kv=att.repeats_kv,
        sdpa_math_fallback=att.math_fallback,
        bf16_compute=prec.compute == "bf16",
        layout=layout,
        loss_form=loss_form(versions),
        zero_layout=bool(prec.zero_half) and step.zero >= 1,
        communicators=shard.communicators,
        # TRL's DPO and GRPO forwards pass use_cache=False
        kv_cache_copies=cache_copies,
        kv_cache_values_as_keys=cache_copies and cache_values_in_key_dtype(versions),
        versions=versions,
        causal_mask=mask,
        gpu=gpu,
        objective=goal,
        reference=resolve_reference(step),
        sequences=_per_rank(sequences(step), step.context_parallel),
        loss_chunk=step.loss_chunk if step.loss_impl == "chunked" else None,
        activation_offload=step.activation_offload,
        context_parallel=step.context_parallel,
        kbit=kbit_flow(step, prec, frame, versions),
        shard_sizes=shard.replay.sizes(step.deepspeed_sizes, shape.hidden),
    )
