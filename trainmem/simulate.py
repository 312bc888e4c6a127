"""The step replay behind :mod:`trainmem.estimate` (public names; the code is in
:mod:`trainmem.memory`, split by job: accounting, autograd, ops, llama, step)."""
from __future__ import annotations

from .memory.accounting import CATS, ITEMSIZE, Buf, Sim, T, new, shrink, view
from .memory.autograd import AccGrad, Node, backward, checkpoint, param, record
from .memory.llama import (attention, build_params, decoder_layer, llama_loss, lora_linear, mlp,
                           rmsnorm, trainable_params)
from .memory.ops import (add, add_scalar, bmm, cast, clone_contig, embedding, linear, log_softmax,
                         mean_last, mul, mul_scalar, neg, nll_loss, pow2, repeat_kv, rotate_half,
                         rsqrt, sdpa, silu, softmax_fp32)
from .memory.step import adamw_step_scratch, simulate_step

__all__ = ["CATS", "ITEMSIZE", "Buf", "Sim", "T", "new", "shrink", "view", "AccGrad", "Node",
           "backward", "checkpoint", "param", "record", "attention", "build_params",
           "decoder_layer", "llama_loss", "lora_linear", "mlp", "rmsnorm", "trainable_params",
           "add", "add_scalar", "bmm", "cast", "clone_contig", "embedding", "linear",
           "log_softmax", "mean_last", "mul", "mul_scalar", "neg", "nll_loss", "pow2",
           "repeat_kv", "rotate_half", "rsqrt", "sdpa", "silu", "softmax_fp32",
           "adamw_step_scratch", "simulate_step"]
