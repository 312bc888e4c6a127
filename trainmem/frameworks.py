"""Whose training step is modelled: one entry per framework, declared once.

A :class:`Framework` says what differs between stacks that run the same model: the
decoder layout the replay builds (:data:`trainmem.memory.step.DECODERS`), the options
it models (attention, sharding, the previous micro-batch), the adapters' default dtype,
what QLoRA quantizes, and what its loop runs after the optimizer step. Nothing else in
the package tests a framework's name (``tests/test_structure.py`` counts).

Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .errors import lookup


@dataclass(frozen=True)
class Framework:
    name: str
    summary: str
    #: the decoder layout the replay builds (a key of ``memory.step.DECODERS``);
    #: ``None``: the model family's own (``Family.replay``; ``None`` there: closed form)
    layout: str | None
    #: attention options it does not model, each with the reason
    attn_refused: Mapping[str, str] = field(default_factory=dict)
    #: the sharding implementations it models (``zero_impl``)
    zero_impls: tuple[str, ...] = ("fsdp", "deepspeed")
    #: the loop keeps the previous micro-batch's logits (``previous_seq``)
    previous_seq: bool = False
    #: ``trainmem.measuring.measure`` can build and run its model
    measurable: bool = True
    #: SDPA's math path, where a card has no fused kernel for the dtype, is replayed
    replays_math_fallback: bool = True
    #: LoRA adapters' dtype when ``lora_dtype`` is not given: a dtype name (peft
    #: upcasts adapters to fp32), or ``None``: the module's (LitGPT creates them inside
    #: the module)
    adapter_dtype: str | None = "fp32"
    #: LoRA under autocast loads the base in the autocast dtype when ``load_dtype`` is
    #: not given (a 16-bit checkpoint as transformers 5's ``from_pretrained`` loads
    #: it); ``False``: the precision's fp32 (LitGPT's ``bf16-mixed``/``16-mixed``:
    #: Fabric's MixedPrecision keeps the module in fp32 under autocast)
    lora_16bit_load: bool = True
    #: QLoRA's non-quantized base weights stay 16-bit whatever the k-bit preparation
    #: (Fabric's BitsandbytesPrecision builds the module under its dtype)
    quant_base_16bit: bool = False
    #: the model families it models (``Family.replay`` names); empty: any
    families: tuple[str, ...] = ()
    #: LoRA targets that must be named together (LitGPT's ``lora_mlp``)
    lora_together: tuple[str, ...] = ()
    #: LoRA may adapt ``lm_head`` (LitGPT's ``lora_head``)
    lora_head: bool = False
    #: its loop validates and generates after an optimizer step (at ``zero=0``)
    eval_after_step: bool = False
    #: multi-query attention depends on the framework's version (LitGPT before
    #: 50b1974b hands SDPA one key/value head)
    mqa_by_version: bool = False


FRAMEWORKS: dict[str, Framework] = {
    f.name: f
    for f in (
        Framework(
            "hf",
            "transformers + peft, the Trainer's loop",
            layout=None,
        ),
        Framework(
            "litgpt",
            "LitGPT's GPT, LoRA layers and finetune loop",
            layout="litgpt",
            attn_refused={
                "eager": "attn 'eager' is not a LitGPT option: its CausalSelfAttention "
                "always calls F.scaled_dot_product_attention (allowed: sdpa, flash)",
                "math": "attn 'math' is modelled for the hf framework only (LitGPT's "
                "replay has the fused SDPA kernels: sdpa, flash)",
            },
            zero_impls=("fsdp",),
            previous_seq=True,
            measurable=False,
            replays_math_fallback=False,
            adapter_dtype=None,
            lora_16bit_load=False,
            quant_base_16bit=True,
            families=("llama",),
            lora_together=("gate_proj", "up_proj", "down_proj"),
            lora_head=True,
            eval_after_step=True,
            mqa_by_version=True,
        ),
    )
}


def framework(name: str) -> Framework:
    """The entry of ``name``; an unknown name raises :class:`OptionError` for
    ``framework`` naming the allowed ones."""
    return lookup(FRAMEWORKS, "framework", name)
