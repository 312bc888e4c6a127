"""What one training step will do, resolved once: :func:`decide` turns the options
(:class:`~trainmem.config.StepConfig`), the model (:class:`~trainmem.config.Shape`),
the GPU and the library versions into a frozen :class:`Decisions` record — the dtypes
(load, compute/autocast, trainable, gradients, optimizer states, master copy), the
attention backend, the sharding plan, the decoder layout and the loss form. The replay
(:mod:`trainmem.memory.step`), the closed forms and the notes
(:mod:`trainmem.estimate`) and the measurement (:mod:`trainmem.measure`) read the
record; none of them looks at a precision, sharding or framework name again (those
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
from .precisions import Precision, precision
from .sharding import Sharding, sharding
from .versions import cache_copies_kv, loss_form

#: compute capability from which SDPA's fused kernels take bf16 (:data:`gpus.SM80`)
SDPA_BF16_FROM = SM80


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
    #: what attention runs as far as memory goes: ``sdpa`` (a fused kernel; flash is
    #: the same memory), ``eager`` or ``math`` (SDPA's math path)
    attention: str
    #: why ``attention`` differs from the option asked (``None``: it does not)
    attention_reason: str | None
    #: the card runs this step's SDPA on its math path (bf16 below sm_80), whether or
    #: not the framework's replay models it (``attention_reason`` says it does)
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
    versions: dict = dataclasses.field(default_factory=dict)
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

    @property
    def autocast(self) -> str | None:
        return self.dtypes.autocast


def _dtypes(
    shape: Shape, step: StepConfig, prec: Precision, frame: Framework
) -> Dtypes:
    zero_half = prec.zero_half if step.zero >= 1 else None
    load = step.load_dtype or prec.params
    autocast = None if zero_half else prec.autocast
    quant_compute = quant_base = None
    if step.method == "qlora":
        quant_compute = prec.quant_compute
        # the non-quantized weights as loaded: the 16-bit dtype QLoRA loads in unless
        # the load dtype is given
        quant_base = step.load_dtype or quant_compute
        if step.kbit_prepare == "peft" and not frame.quant_base_16bit:
            # peft's prepare_model_for_kbit_training: every fp16/bf16 parameter that
            # is not quantized (embeddings, norms, lm_head) is cast to fp32
            quant_base = "fp32"
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


def _attention(step: StepConfig, prec: Precision, frame: Framework, gpu):
    """The attention backend as far as memory goes, and why it differs from the
    option. Below compute capability 8.0 no fused SDPA kernel takes bf16, so
    ``scaled_dot_product_attention`` dispatches to its math path, which materialises
    the ``b x heads x s x s`` scores in fp32; FlashAttention-2 does not run there at
    all."""
    attn = step.attn_memory
    if gpu is None or gpu.capability >= SDPA_BF16_FROM:
        return attn, None
    major, minor = gpu.capability
    if step.attn == "flash":
        raise OptionError(
            "attn",
            f"attn 'flash' (FlashAttention-2) needs compute capability 8.0 or "
            f"newer; {gpu.name} is sm_{major}{minor}: use attn 'sdpa'",
        )
    if sdpa_falls_back_to_math(step, prec, gpu) and frame.replays_math_fallback:
        return "math", "sdpa-math"
    return attn, None


def sdpa_falls_back_to_math(step: StepConfig, prec: Precision, gpu) -> bool:
    """Whether ``gpu`` runs this step's SDPA on the math path: bf16 activations below
    :data:`SDPA_BF16_FROM`."""
    return (
        step.attn == "sdpa"
        and prec.compute == "bf16"
        and gpu.capability < SDPA_BF16_FROM
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
    attention, reason = _attention(step, prec, frame, gpu)
    versions = step.library_versions
    goal = objective(step.objective)
    layout = frame.layout or shape.family.replay
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
        dtypes=_dtypes(shape, step, prec, frame),
        attention=attention,
        attention_reason=reason,
        sdpa_math_fallback=gpu is not None and sdpa_falls_back_to_math(step, prec, gpu),
        bf16_compute=prec.compute == "bf16",
        layout=layout,
        loss_form=loss_form(versions),
        zero_layout=bool(prec.zero_half) and step.zero >= 1,
        communicators=shard.communicators,
        # TRL's DPO and GRPO forwards pass use_cache=False
        kv_cache_copies=step.cache_on and cache_copies_kv(versions) and not goal.logps,
        versions=versions,
        gpu=gpu,
        objective=goal,
        reference=resolve_reference(step),
        sequences=_per_rank(sequences(step), step.context_parallel),
        loss_chunk=step.loss_chunk if step.loss_impl == "chunked" else None,
        activation_offload=step.activation_offload,
        context_parallel=step.context_parallel,
    )
