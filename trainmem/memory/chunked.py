"""The chunked (fused linear) cross-entropy replayed: what
:class:`trainmem.measuring.chunked_loss.ChunkedLinearCrossEntropy` allocates, chunk by
chunk, in its forward and in its backward, in place of the ``lm_head`` linear, the
logits and ``cross_entropy`` (:func:`.llama.llama_loss` with ``loss_chunk`` set)."""

from __future__ import annotations

from .accounting import SimTensor, Simulator, new, view
from .autograd import record
from .ops import _autocast_input


def _chunk_logits(sim: Simulator, rows: int, vocab: int, dtype: str) -> SimTensor:
    """One chunk's logits in fp32: the matmul's output in the compute dtype, then
    ``.float()`` (no copy when it is fp32 already)."""
    logits = new(sim, (rows, vocab), dtype)
    if dtype == "fp32":
        return logits
    out = new(sim, (rows, vocab), "fp32")
    del logits
    return out


def chunked_cross_entropy(
    sim: Simulator, held: list, w: SimTensor, chunk: int
) -> SimTensor:
    """The loss of the hidden states ``held[0]`` ``(b, s, hidden)``, handed over (the
    caller keeps no reference: once cast to the autocast dtype the uncast ones are
    gone), under the output weight
    ``w`` ``(vocab, hidden)``, one ``chunk`` of rows at a time.

    Forward: the labels' mask (bool) and clamped copy (int64), the fp32 log-sum-exp and
    picked logits ``(rows,)``; per chunk the logits (compute dtype, then fp32) and
    ``logsumexp``'s ``exp(x - max)`` temporary ``(chunk, vocab)`` fp32. Saved: ``h``
    and ``w`` (cast to the autocast dtype), the labels, the mask, the log-sum-exp.
    Backward: the gradient of ``h`` ``(rows, hidden)`` and of ``w`` (zeros, accumulated
    in place) when they need one; per chunk the recomputed logits (compute dtype, fp32)
    and the gradient of the chunk's logits cast to the compute dtype."""
    h = held.pop()
    b, s, hidden = h.shape
    rows = b * s
    hc = _autocast_input(sim, h)
    del h
    wc = _autocast_input(sim, w, param=True)
    hc = view(hc, (rows, hidden))
    vocab = wc.shape[0]
    dtype = hc.dtype
    labels = new(sim, (b, s), "i64")  # F.pad(input_ids[:, 1:], (0, 1), -100)
    valid = new(sim, (rows,), "u8")
    safe = new(sim, (rows,), "i64")
    lse = new(sim, (rows,), "fp32")
    picked = new(sim, (rows,), "fp32")
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        logits = _chunk_logits(sim, n, vocab, dtype)
        top = new(sim, (n, 1), "fp32")  # amax(-1, keepdim=True)
        shifted = new(sim, (n, vocab), "fp32")  # logits - top, exp_() in place
        total = new(sim, (n,), "fp32")  # .sum(-1), log_() and add_() in place
        del total, shifted, top
        picked_n = new(sim, (n, 1), "fp32")  # logits.gather(...)
        del picked_n, logits
    count = new(sim, (), "i64")
    diff = new(sim, (rows,), "fp32")
    masked = new(sim, (rows,), "fp32")
    del diff
    total = new(sim, (), "fp32")
    del masked
    loss = new(sim, (), "fp32")
    del total, picked
    h_shape, w_shape = hc.shape, wc.shape
    want_h, want_w = hc.requires_grad, wc.requires_grad

    def backward_fn(node, g):
        scale = new(sim, (), "fp32")
        grad_h = new(sim, h_shape, dtype) if want_h else None
        grad_w = new(sim, w_shape, dtype) if want_w else None
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            p = _chunk_logits(sim, n, vocab, dtype)
            ones = new(sim, (n, 1), "fp32")  # full_like(..., -1.0) for scatter_add_
            del ones
            factor = new(sim, (n, 1), "fp32")  # valid * scale
            del factor
            grad = p if dtype == "fp32" else new(sim, (n, vocab), dtype)
            del p, grad
        del scale
        return [grad_h, grad_w]

    record(sim, loss, [hc, wc], [hc, wc, safe, valid, lse, count], backward_fn)
    del labels
    return loss


def chunked_loss(sim: Simulator, held: list, lm_head: SimTensor, cfg) -> SimTensor:
    """:func:`chunked_cross_entropy` with the step's chunk (``cfg["loss_chunk"]``)."""
    return chunked_cross_entropy(sim, held, lm_head, cfg["loss_chunk"])
