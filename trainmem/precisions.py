"""The precisions of a training step: one entry each, declared once.

A :class:`Precision` says which dtypes a ``precision`` name stands for; nothing else in
the package tests a precision's name (``tests/test_structure.py`` counts):

* ``params`` — the dtype the parameters are in when nothing else decides it (the
  load dtype's default for full fine-tuning: fp32 under autocast, bf16 for pure
  bf16; under LoRA see :meth:`Precision.default_load`);
* ``autocast`` — the ``torch.autocast`` dtype the forward runs under (``None``: no
  autocast);
* ``loss_scaling`` — fp16's ``GradScaler`` (the loss is scaled before backward);
* ``zero_half`` — under ZeRO (stage >= 1) the 16-bit dtype the module is cast to, with
  fp32 master weights and states in the optimizer (the ZeRO paper's layout); ``None``:
  the layout does not change under ZeRO;
* ``quant_compute`` — QLoRA's 16-bit dtype (bitsandbytes' ``bnb_4bit_compute_dtype``
  and the non-quantized base weights as loaded).

Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import lookup


@dataclass(frozen=True)
class Precision:
    name: str
    summary: str
    params: str
    autocast: str | None
    loss_scaling: bool
    zero_half: str | None
    quant_compute: str

    @property
    def compute(self) -> str:
        """The dtype the matmuls run in: autocast's, else the parameters'."""
        return self.autocast or self.params

    def default_load(self, method: str, lora_16bit_load: bool = True) -> str:
        """The load dtype when none is given. Full fine-tuning and QLoRA:
        :attr:`params` (torch AMP's fp32 weights are the master copy; QLoRA's base
        is decided by its own rule). LoRA under autocast: the autocast dtype — the
        recipe LoRA users run, a 16-bit base loaded from a 16-bit checkpoint
        (``from_pretrained``'s default from transformers 5.0 is ``dtype="auto"``,
        the stored dtype), peft's fp32 adapters (``get_peft_model(...,
        autocast_adapter_dtype=True)`` upcasts fp16/bf16 adapter weights to fp32:
        ``cast_adapter_dtype`` in peft 0.21's ``tuners/tuners_utils.py``) and
        autocast (``Trainer(bf16=True)``/``fp16=True``). ``lora_16bit_load=False``
        (a framework whose mixed precision keeps the module in fp32:
        ``Framework.lora_16bit_load``): :attr:`params` under LoRA too."""
        if method == "lora" and self.autocast and lora_16bit_load:
            return self.autocast
        return self.params


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(
            "fp32", "fp32 parameters, no autocast", "fp32", None, False, None, "bf16"
        ),
        Precision(
            "fp16-amp",
            "torch.autocast(fp16) over the parameters, with loss scaling",
            "fp32",
            "fp16",
            True,
            "fp16",
            "fp16",
        ),
        Precision(
            "bf16-amp",
            "torch.autocast(bf16) over the parameters",
            "fp32",
            "bf16",
            False,
            "bf16",
            "bf16",
        ),
        Precision(
            "bf16",
            "pure bf16 parameters, grads and states",
            "bf16",
            None,
            False,
            None,
            "bf16",
        ),
    )
}


def precision(name: str) -> Precision:
    """The entry of ``name``; an unknown name raises :class:`OptionError` for
    ``precision`` naming the allowed ones."""
    return lookup(PRECISIONS, "precision", name)
