"""QLoRA's dtype flow: what bitsandbytes' 4-bit Linear, peft's k-bit preparation and
peft's LoRA layer on a 4-bit Linear do to the dtypes of a training step, decided
once per step (:func:`kbit_flow`) and read by :func:`trainmem.decisions.decide` and
the replay (:mod:`trainmem.memory.llama`, :mod:`trainmem.memory.ops`).

The rules, each in the library source of the versions it belongs to:

* **Loading** (transformers' bitsandbytes quantizer): the decoder blocks' Linear
  weights become ``Params4bit`` (NF4); every other parameter (embeddings, norms,
  ``lm_head``) stays in the load dtype — ``from_pretrained``'s ``dtype``, which QLoRA
  recipes set to ``bnb_4bit_compute_dtype`` (``StepConfig.load_dtype`` overrides).
* **peft's** ``prepare_model_for_kbit_training`` (``peft/utils/other.py``, the same
  in 0.17.1 and 0.21.2, lines 204-209 of 0.21.2): ``for param in
  model.parameters(): if (param.dtype == torch.float16) or (param.dtype ==
  torch.bfloat16)) and param.__class__.__name__ != "Params4bit": param.data =
  param.data.to(torch.float32)`` — every non-quantized 16-bit parameter becomes
  fp32. The embedding then outputs fp32 and every RMSNorm (``weight *
  hidden_states.to(input_dtype)``, an fp32 weight) returns fp32: the residual stream
  and the input of every 4-bit Linear are fp32, under autocast too (neither the
  embedding nor the norm's multiply is an autocast op). With
  ``use_gradient_checkpointing`` it also calls ``gradient_checkpointing_enable``
  (and, for the reentrant form, ``enable_input_require_grads``): the estimate's
  ``checkpointing`` option.
* **bitsandbytes' 4-bit Linear** (``bitsandbytes/nn/modules.py``
  ``Linear4bit.forward``, 0.50.2 lines 626-637): ``inp_dtype = x.dtype``; ``x =
  x.to(self.compute_dtype)``; ``return bnb.matmul_4bit(x, self.weight, ...)
  .to(inp_dtype)``. The matmul runs in the compute dtype (an explicit ``.to``:
  autocast does not change it) and its **output is cast back to the input's
  dtype**: an fp32 input gives an fp32 output, with or without autocast.
  ``MatMul4Bit.forward`` (``autograd/_functions.py``, 0.50.2 line 358) keeps
  ``ctx.tensors = (None, B)``: no activation is saved for backward (before 0.43.2:
  ``(A, B)``, :func:`trainmem.versions.bnb_saves_input`). The output of the cast is
  a ``ToCopyBackward`` node, which saves nothing either.
* **peft's LoRA on a 4-bit Linear** (``peft/tuners/lora/bnb.py``
  ``Linear4bit.forward``, 0.21.2 lines 527-552, 0.17.1 lines 486-505): ``result =
  self.base_layer(x)``;
  ``result = result.clone()`` (a copy of the base output); ``requires_conversion =
  not torch.is_autocast_enabled()``: only **outside autocast** is ``x`` cast to the
  adapter's dtype and the adapter's output cast back to ``result``'s dtype; under
  autocast ``lora_A`` (an fp32 ``nn.Linear``) gets ``x`` as it is, so autocast makes
  a bf16 copy of an fp32 ``x`` that ``lora_A`` saves for its weight gradient — one
  copy per adapted projection (q, k and v each make their own). ``result + output``
  promotes: fp32 when the base output is fp32. (peft's plain ``lora.Linear`` casts
  ``x`` to the adapter dtype unconditionally; that layer is not this one.)
  ``torch.is_autocast_enabled()`` without a device type reports **CUDA's** autocast
  (torch 2.4+; ``torch.autocast("cpu")`` leaves it False): on the CPU the conversion
  runs under autocast too, each adapted projection saving a bf16 copy of its input
  made by autocast from the fp32 cast. That is the one place the CPU run saves
  different tensors from the CUDA one; ``StepConfig.kernels="cpu"`` selects it, so
  the CPU measurement checks the rest of the flow byte for byte.

So with the preparation, under autocast bf16 and without checkpointing, the MLP keeps
``gate`` and ``up`` (``result + output``), ``silu``'s output in fp32, and three bf16
copies (the inputs of the three ``lora_A``); without it every one of them is bf16 and
``down_proj``'s ``lora_A`` saves the product itself.

Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

from dataclasses import dataclass

from .versions import bnb_saves_input

#: the modules whose source this module follows, and the versions it was read in
SOURCES = {
    "peft": ("0.17.1", "0.21.2"),
    "bitsandbytes": ("0.43.2", "0.50.2"),
}


@dataclass(frozen=True)
class KbitFlow:
    """The dtype decisions of one QLoRA step (``None`` fields: not QLoRA).

    ``load``: the non-quantized parameters as loaded; ``base``: as the step holds them
    (fp32 after peft's preparation); ``compute``: bitsandbytes' compute dtype (the
    4-bit Linear's matmul); ``output_in_input_dtype``: the 4-bit Linear returns its
    input's dtype; ``saves_input``: ``MatMul4Bit`` keeps its input for backward;
    ``lora_sees_autocast``: peft's LoRA on a 4-bit Linear sees the step's autocast
    (CUDA's; on the CPU ``torch.is_autocast_enabled()`` is False under
    ``torch.autocast("cpu")``), so it casts its input to the adapters' dtype (and
    their output back) only outside autocast;
    ``clones_base_output``: it copies the base layer's output first; ``prepared``:
    ``prepare_model_for_kbit_training`` ran."""

    load: str
    base: str
    compute: str
    output_in_input_dtype: bool
    saves_input: bool
    lora_sees_autocast: bool
    clones_base_output: bool
    prepared: bool


def kbit_flow(step, prec, frame, versions: dict) -> KbitFlow | None:
    """The :class:`KbitFlow` of ``step`` (a :class:`~trainmem.config.StepConfig`)
    under the precision ``prec`` and framework ``frame`` for the library
    ``versions``; ``None`` when the step is not QLoRA."""
    if step.method != "qlora":
        return None
    compute = prec.quant_compute
    load = step.load_dtype or compute
    prepared = step.kbit_prepare == "peft" and not frame.quant_base_16bit
    base = "fp32" if prepared and load in ("fp16", "bf16") else load
    return KbitFlow(
        load=load,
        base=base,
        compute=compute,
        output_in_input_dtype=True,
        saves_input=bnb_saves_input(versions),
        lora_sees_autocast=step.kernels == "cuda",
        clones_base_output=True,
        prepared=prepared,
    )
