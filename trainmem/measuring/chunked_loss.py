"""A cross-entropy over the output layer that never holds the logits whole: the
mechanism of Cut Cross-Entropy (Wijmans et al., 2024) and of Liger's fused linear
cross-entropy, written in plain torch so the CPU measurement can run it
(:mod:`trainmem.measuring.measure`, ``loss_impl="chunked"``; its replay:
:func:`trainmem.memory.ops.chunked_cross_entropy`).

Forward: for ``chunk`` rows of the hidden states at a time, the logits
``(chunk, vocab)`` are computed, their fp32 log-sum-exp and the label's logit kept
(``(rows,)`` floats each), the chunk's logits dropped. Autograd keeps the hidden
states, the weight and the log-sum-exp, nothing of ``rows x vocab``. Backward
recomputes each chunk's logits, turns them into the gradient of the loss (softmax minus
the one-hot label) and multiplies it into the gradients of the hidden states and of the
weight: the logits exist one chunk at a time in both directions, at the price of a
second pass over the output layer's matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: rows per chunk when not given (Liger sizes its chunks from rows and vocabulary;
#: a fixed number keeps the transient ``chunk x vocab`` easy to read)
DEFAULT_CHUNK = 1024
IGNORE = -100


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``mean(cross_entropy(h @ w.T, targets))`` over the rows whose target is not
    ``-100``, one chunk of rows at a time (see the module docstring)."""

    @staticmethod
    def forward(ctx, h, w, targets, chunk: int):
        rows = h.shape[0]
        valid = targets != IGNORE
        safe = targets.clamp_min(0)
        lse = torch.empty(rows, dtype=torch.float32, device=h.device)
        picked = torch.empty(rows, dtype=torch.float32, device=h.device)
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            logits = (h[start:end] @ w.t()).float()
            # log-sum-exp written out (torch.logsumexp makes the same exp(x - max)
            # temporary inside its kernel, where a dispatch-level tracker cannot
            # see it)
            top = logits.amax(-1, keepdim=True)
            shifted = logits - top
            shifted.exp_()
            lse[start:end] = shifted.sum(-1).log_().add_(top[:, 0])
            del shifted, top
            picked[start:end] = logits.gather(1, safe[start:end, None])[:, 0]
            del logits
        count = valid.sum()
        loss = ((lse - picked) * valid).sum() / count
        ctx.save_for_backward(h, w, safe, valid, lse, count)
        ctx.chunk = chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        h, w, safe, valid, lse, count = ctx.saved_tensors
        rows, chunk = h.shape[0], ctx.chunk
        scale = (grad_loss / count).float()
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = torch.zeros_like(w) if want_w else None
        for start in range(0, rows, chunk):
            end = min(start + chunk, rows)
            p = (h[start:end] @ w.t()).float()
            p.sub_(lse[start:end, None]).exp_()  # softmax
            ones = torch.full_like(lse[start:end, None], -1.0)
            p.scatter_add_(1, safe[start:end, None], ones)
            del ones
            p.mul_(valid[start:end, None] * scale)
            g = p.to(h.dtype)
            del p
            if want_h:
                torch.matmul(g, w, out=grad_h[start:end])
            if want_w:
                grad_w.addmm_(g.t(), h[start:end])
            del g
        return grad_h, grad_w, None, None


def shifted_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """The labels of every position, flattened: the next token, ``-100`` after the
    last (transformers' ``ForCausalLMLoss`` pads the labels the same way)."""
    return F.pad(input_ids[:, 1:], (0, 1), value=IGNORE).reshape(-1)


def causal_lm_loss(
    model, input_ids: torch.Tensor, chunk: int = DEFAULT_CHUNK, use_cache=False
):
    """The causal-LM loss of a transformers (or peft) model with the chunked
    cross-entropy in place of ``lm_head`` + ``cross_entropy``: the decoder's last
    hidden state (after the final norm), cast like autocast casts a linear's inputs,
    then :class:`ChunkedLinearCrossEntropy`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    out = base.model(input_ids=input_ids, use_cache=use_cache)
    h = out.last_hidden_state
    del out  # (with use_cache, its past_key_values)
    w = base.get_output_embeddings().weight
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, w = h.to(dtype), w.to(dtype)
    targets = shifted_targets(input_ids)
    h = h.reshape(-1, h.shape[-1])
    return ChunkedLinearCrossEntropy.apply(h, w, targets, chunk)
