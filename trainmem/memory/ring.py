"""Context parallelism's ring attention replayed on one rank: torch's
``_templated_ring_attention`` and ``_templated_ring_attention_backward``
(``torch.distributed.tensor.experimental._context_parallel._attention``, torch 2.13).

Each of the ``n`` ranks holds ``seq / n`` tokens of every activation (the sequence is
sharded; weights, gradients and optimizer states are not). Attention needs every key
and value, so they travel round the ring:

* forward: ``key.contiguous()``, ``value.contiguous()`` (what SDPA saves), then for
  each step but the last the send buffer ``cat([k.flatten(), v.flatten()])`` and the
  receive buffer of the same size; each step's output and log-sum-exp are merged
  into fp32 accumulators (``_SDPAMerger``, ``convert_to_f32``), the result cast back;
* backward: fp32 accumulators for the gradients of q, k and v, the key/value buffers
  again (send, receive), and the gradients of k and v travelling the other way (send,
  receive, fp32), besides each step's kernel gradients.

A model of the transient, not measured (one process cannot run the ring); the rest of
the step is the replay at ``seq / n`` tokens, which the CPU measurement checks."""

from __future__ import annotations

from .accounting import SimTensor, Simulator, new
from .autograd import record
from .ops import _autocast_input, clone_contig


def ring_sdpa(
    sim: Simulator, q: SimTensor, k: SimTensor, v: SimTensor, ranks: int
) -> SimTensor:
    """SDPA of the local queries against every rank's keys and values (see the module
    docstring); saves what the fused kernel saves: q, k, v, out, lse."""
    q, k, v = _autocast_input(sim, q), _autocast_input(sim, k), _autocast_input(sim, v)
    b, a, s, d = q.shape
    kv_bytes = k.nbytes + v.nbytes
    kc = clone_contig(sim, k)  # key.contiguous(): what the kernel saves
    vc = clone_contig(sim, v)
    dtype = q.dtype
    send = new(sim, (kv_bytes,), "u8") if ranks > 1 else None
    recv = new(sim, (kv_bytes,), "u8") if ranks > 1 else None
    merged = new(sim, (b, a, s, d), "fp32")  # _SDPAMerger's fp32 output
    merged_lse = new(sim, (b, a, s, 1), "fp32")
    step_out = new(sim, (b, a, s, d), dtype)  # one step's kernel output
    step_lse = new(sim, (b, a, s), "fp32")
    del step_out, step_lse, send, recv
    out = new(sim, (b, a, s, d), dtype, layout="bshd")  # merged, cast back
    lse = new(sim, (b, a, s), "fp32")
    del merged, merged_lse
    q_shape, k_shape, v_shape = q.shape, k.shape, v.shape
    needs = (q.requires_grad, k.requires_grad, v.requires_grad)

    def backward_fn(node, g):
        acc = [new(sim, sh, "fp32") for sh in (q_shape, k_shape, v_shape)]
        kv_send = new(sim, (kv_bytes,), "u8")
        kv_recv = new(sim, (kv_bytes,), "u8")
        step = [new(sim, sh, dtype) for sh in (q_shape, k_shape, v_shape)]
        dkv_send = new(sim, (2 * kv_bytes,), "u8")  # fp32 gradients of k and v
        dkv_recv = new(sim, (2 * kv_bytes,), "u8")
        del step, kv_send, kv_recv, dkv_send, dkv_recv
        grads = [
            new(sim, sh, dtype, layout="bshd") if need else None
            for sh, need in zip((q_shape, k_shape, v_shape), needs)
        ]
        del acc
        return grads

    record(sim, out, [q, kc, vc], [q, kc, vc, lse], backward_fn, save_out=True)
    return out
