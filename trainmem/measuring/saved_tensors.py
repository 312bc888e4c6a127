"""What autograd saves in one decoder layer, each saved tensor named by its producer.

``saved_tensors_of_one_layer`` runs the forward of one Llama-style decoder layer under
``torch.autograd.graph.saved_tensors_hooks`` (every tensor autograd keeps for backward
passes through the pack hook) and a ``TorchDispatchMode`` that names every new storage
by the module running and the ATen op that made it. ``size_class`` then names a saved
tensor by the product of sizes its element count equals (``b*s*h``, ``b*s*i``,
``b*a*s*s``, ...), which is how the activation formula's coefficients are read off.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainmem.measuring.models import build_model

#: The name ``NameProducers`` gives autocast's cached low-precision copy of a weight.
WEIGHT_COPY = "weight -> bf16"


class SavedTensor(NamedTuple):
    name: str  # "module: op that made it", or "layer input", "RoPE cos", ...
    tensor: torch.Tensor


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class NameProducers(TorchDispatchMode):
    """Name every new storage by the module running and the op that made it."""

    def __init__(self, names: dict[int, str], params: set[int]):
        super().__init__()
        self.names, self.params, self.stack = names, params, ["layer"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {_storage(a) for a in args if isinstance(a, torch.Tensor)}
        op = func.__name__.split(".")[0]
        if op == "_to_copy" and ins & self.params:
            op = WEIGHT_COPY  # autocast's cached copy of a weight
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and _storage(t) not in ins:
                self.names[_storage(t)] = f"{self.stack[-1]}: {op}"
        return out


def _check_sizes(config, batch: int, seq: int) -> None:
    if batch < 1 or seq < 1:
        raise ValueError(
            f"batch and seq must be positive, got batch={batch}, seq={seq}"
        )
    h, i = config.hidden_size, config.intermediate_size
    for other, name in ((h, "hidden_size"), (i, "intermediate_size")):
        if batch * seq == other:
            raise ValueError(
                f"batch*seq = {batch * seq} equals {name}: a flattened (b*s, h) "
                "activation would have a weight's element count; choose another seq"
            )


def saved_tensors_of_one_layer(
    config, attn: str = "sdpa", batch: int = 2, seq: int = 24, amp: bool = True
) -> list[SavedTensor]:
    """Every tensor autograd saves in the forward of the first decoder layer of a
    model built from ``config`` (deduplicated by storage; parameters excluded, their
    autocast copies included), in the order they were saved. ``amp``: under
    ``torch.autocast`` to bf16 on the CPU."""
    _check_sizes(config, batch, seq)
    model = build_model(config, attn_implementation=attn)
    layer = model.model.layers[0]
    h = torch.randn(batch, seq, config.hidden_size, requires_grad=True)
    cos, sin = model.model.rotary_emb(h, torch.arange(seq).unsqueeze(0))
    names = {
        _storage(t): n
        for t, n in ((h, "layer input"), (cos, "RoPE cos"), (sin, "RoPE sin"))
    }
    mode = NameProducers(names, {_storage(p) for p in layer.parameters()})

    def leave(module, args, output):
        mode.stack.pop()  # returns None: the output is left as it is

    hooks = []
    for name, mod in layer.named_modules():
        if name:
            enter = lambda m, a, n=name: mode.stack.append(n)  # noqa: E731
            hooks += [
                mod.register_forward_pre_hook(enter),
                mod.register_forward_hook(leave),
            ]
    seen: set[int] = set()
    saved: list[SavedTensor] = []

    def pack(t):
        ptr = _storage(t)
        if ptr not in seen and ptr not in mode.params:  # parameters are not activations
            seen.add(ptr)
            saved.append(SavedTensor(names.get(ptr, "?"), t))
        return t

    try:
        with (
            mode,
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp),
        ):
            layer(h, position_embeddings=(cos, sin), attention_mask=None)
    finally:
        for hook in hooks:
            hook.remove()
    return saved


def size_units(config, batch: int, seq: int) -> dict[str, int]:
    """Element counts of the size products an activation can have in one layer."""
    h, i, a = config.hidden_size, config.intermediate_size, config.num_attention_heads
    b, s = batch, seq
    return {
        "b*s*h": b * s * h,
        "b*s*i": b * s * i,
        "b*a*s*s": b * a * s * s,
        "b*a*s": b * a * s,
        "b*s": b * s,
        "s*d": s * h // a,
    }


def size_class(name: str, t: torch.Tensor, config, batch: int, seq: int) -> str:
    """Name a saved tensor by the product of sizes its element count equals
    (``"weight copy"`` for autocast's copy of a weight, ``"other"`` if none)."""
    if WEIGHT_COPY in name:
        return "weight copy"
    units = size_units(config, batch, seq)
    return next((k for k, v in units.items() if t.numel() == v), "other")


def saved_table(
    config, attn: str = "sdpa", batch: int = 2, seq: int = 24
) -> list[dict]:
    """One row per saved tensor of one layer under bf16 autocast: producer, shape,
    dtype, size class and bytes of its storage."""
    return [
        {
            "saved tensor (module: op that made it)": n,
            "shape": tuple(t.shape),
            "dtype": str(t.dtype).replace("torch.", ""),
            "size class": size_class(n, t, config, batch, seq),
            "bytes": t.untyped_storage().nbytes(),
        }
        for n, t in saved_tensors_of_one_layer(config, attn, batch, seq)
    ]
