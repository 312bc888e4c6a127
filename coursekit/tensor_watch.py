"""Watch the tensors a piece of code allocates, to check a lab's "never build X".

Lab 5 asks for a LoRA forward that multiplies by A, then by B, "不构造 d×k 的矩阵":
the point of LoRA is that the d x k update B A never exists during training.
:func:`largest_new_tensor` runs a call under a ``TorchDispatchMode`` and returns the
largest tensor any ATen op produced in storage of its own (a view, an in-place op or
a parameter passed in is not new), so a forward that computes ``B @ A`` -- or adds it
to the frozen weight -- shows a d x k tensor. The lab's self-check and the grader's
hidden tests call the student's forward through it, with token counts smaller than
d and k, so no legitimate intermediate is that large.

It runs in the student's kernel (inside the grader's sandbox); torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> set[int]:
    return {
        t.untyped_storage().data_ptr()
        for t in tree_flatten(tree)[0]
        if isinstance(t, torch.Tensor)
    }


@dataclass
class Largest:
    """The largest new tensor seen: its element count, shape and the op that made
    it."""

    numel: int = 0
    shape: tuple = ()
    op: str = ""


class _Watch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = Largest()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _storages((args, kwargs))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.numel() <= self.largest.numel:
                continue
            if t.untyped_storage().data_ptr() in inputs:
                continue  # a view or an in-place result: no new memory
            self.largest = Largest(t.numel(), tuple(t.shape), str(func.overloadpacket))
        return out


def largest_new_tensor(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), Largest)``: the call's result and the largest tensor
    any op inside it allocated."""
    with _Watch() as watch:
        result = fn(*args, **kwargs)
    return result, watch.largest


def check_lora_forward_is_low_rank(layer_class) -> Largest:
    """Run ``layer_class(base, r, alpha).forward`` on 6 tokens of a 24 -> 32 layer
    with a non-zero B, and raise ``AssertionError`` (in Chinese, naming the tensor)
    if it allocates a tensor as large as the d x k update."""
    import torch.nn as nn

    torch.manual_seed(0)
    d_in, d_out, r = 24, 32, 4
    layer = layer_class(nn.Linear(d_in, d_out), r, 8)
    with torch.no_grad():
        layer.lora_B.normal_()
    x = torch.randn(2, 3, d_in)
    _, big = largest_new_tensor(layer, x)
    assert big.numel < d_in * d_out, (
        f"前向里新分配的最大张量形状为 {big.shape}（{big.op} 的结果，{big.numel} "
        f"个元素），达到了 d×k = {d_out}×{d_in} = {d_out * d_in}：LoRA 的前向"
        "先乘 A 再乘 B（x → x Aᵀ → x Aᵀ Bᵀ），训练时 d×k 的 BA 从不出现"
    )
    return big
