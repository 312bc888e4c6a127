"""Attention three ways: eager (materialises the s×s score matrix), tiled with online
softmax (the FlashAttention idea in plain torch), and the memory each needs.

Shapes: ``q`` is ``(batch, heads, s_q, d)``, ``k`` and ``v`` are ``(batch, heads, s_k,
d)``; the output has the shape of ``q``. ``causal=True`` masks key ``j > i`` for query
``i`` (queries and keys aligned at the end, like
``F.scaled_dot_product_attention(is_causal=True)`` when ``s_q == s_k``). Byte counts are
``int`` bytes.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

__all__ = [
    "eager_attention",
    "tiled_attention",
    "peak_extra_bytes",
    "eager_score_bytes",
]


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (batch, heads, seq, head_dim), got {q.dim()}, "
            f"{k.dim()}, {v.dim()}"
        )
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)}"
        )


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
) -> torch.Tensor:
    """softmax(q kᵀ / √d) v, materialising the ``(batch, heads, s_q, s_k)`` score
    matrix."""
    _check(q, k, v)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s_q, s_k = q.shape[-2], k.shape[-2]
        mask = torch.ones(s_q, s_k, dtype=torch.bool, device=q.device).tril(
            diagonal=s_k - s_q
        )
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """FlashAttention-style forward: loop over key/value tiles with an online softmax.

    For each tile of ``block_q`` queries, keep a running row maximum ``m``, a running
    denominator ``l`` and an unnormalised output ``acc``; each key tile rescales them by
    ``exp(m_old - m_new)``. Extra memory is O(block_q · block_k + s·d) instead of O(s²).
    Same FLOPs as eager attention (the point of FlashAttention is memory traffic, not
    FLOPs).
    """
    _check(q, k, v)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"block_q and block_k must be ≥ 1, got {block_q}, {block_k}")
    s_q, s_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    offset = s_k - s_q  # query i may see keys j ≤ i + offset
    out = torch.empty_like(q)
    for qs in range(0, s_q, block_q):
        qi = q[..., qs : qs + block_q, :] * scale
        nq = qi.shape[-2]
        m = torch.full(
            q.shape[:2] + (nq, 1), float("-inf"), dtype=q.dtype, device=q.device
        )
        l = torch.zeros_like(m)
        acc = torch.zeros_like(qi)
        rows = torch.arange(qs, qs + nq, device=q.device).unsqueeze(1) + offset
        k_end = min(s_k, qs + nq + offset) if causal else s_k
        for ks in range(0, k_end, block_k):
            s = qi @ k[..., ks : ks + block_k, :].transpose(-2, -1)
            if causal:
                cols = torch.arange(ks, ks + s.shape[-1], device=q.device).unsqueeze(0)
                s = s.masked_fill(cols > rows, float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            p = torch.exp(s - m_new)
            alpha = torch.exp(m - m_new)  # rescale what was accumulated so far
            l = l * alpha + p.sum(dim=-1, keepdim=True)
            acc = acc * alpha + p @ v[..., ks : ks + block_k, :]
            m = m_new
        out[..., qs : qs + nq, :] = acc / l
    return out


def eager_score_bytes(batch: int, heads: int, seq: int, dtype_bytes: int = 2) -> int:
    """Bytes of one ``(batch, heads, seq, seq)`` score/probability matrix."""
    return batch * heads * seq * seq * dtype_bytes


def peak_extra_bytes(fn: Callable[..., torch.Tensor], *args, **kwargs) -> int:
    """Peak bytes allocated while running ``fn(*args, **kwargs)``, beyond its inputs
    (CPU or CUDA).

    CUDA: ``max_memory_allocated`` delta. CPU:
    :class:`trainmem.demos.monitor.TensorMemoryTracker` (operator outputs only; kernels'
    internal scratch is not seen). The output tensor counts.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if tensors and tensors[0].is_cuda:
        dev = tensors[0].device
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn(*args, **kwargs)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del out
        return int(peak)
    from .monitor import TensorMemoryTracker

    with TensorMemoryTracker() as tr:
        out = fn(*args, **kwargs)
    del out
    return tr.peak_bytes
