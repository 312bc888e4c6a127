"""torch FSDP in the replay (the ``"fsdp"`` entry of :mod:`trainmem.sharding`): a
decoder layer per unit, the unit being computed all-gathered and on more than one GPU
the next one too, the root unit kept gathered from the forward to the end of backward,
and each unit's gradient unsharded until its reduce-scatter."""

from __future__ import annotations

from .accounting import Simulator
from .shard_plan import ShardReplay, Weights, root_tensors


def _sizes(which: str, hidden: int) -> None:
    return None  # FSDP reads no bucket sizes of its own here


def _persisted(model, weights: Weights, sizes) -> set:
    return set()  # FSDP flattens and shards every parameter of a unit


def _gather(sim: Simulator, model, step, weights: Weights, persisted, sizes):
    """The unit being computed is all-gathered, and on more than one GPU so is the
    next one: FSDP issues the next unit's all-gather while this one computes
    (forward: torch/distributed/fsdp/_runtime_utils.py _pre_forward_unshard and the
    rate limiter of _limit_all_gathers, which lets two all-gathers be in flight;
    backward: the default BackwardPrefetch.BACKWARD_PRE prefetches the previous unit
    before this one's gradient is computed; FSDP2's all-gather stream overlaps the
    same way, fully_shard in torch/distributed/fsdp/_fully_shard/
    _fsdp_param_group.py; torch 2.4-2.13). With one GPU FSDP runs NO_SHARD: no
    gathered copy beyond the one unit.

    The root unit (what no decoder layer holds: the embeddings, the final norm,
    lm_head), measured before sharding, is not resharded after the forward: FSDP
    keeps the root's parameters all-gathered "with the intention that they are
    immediately used for backward computation" (FSDP1:
    torch/distributed/fsdp/_runtime_utils.py _post_forward_reshard,
    free_unsharded_flat_param = not state._is_root and ...; FSDP2: the root's param
    group gets post_forward_mesh_info = None in FSDPState._lazy_init). Its frozen
    parameters have no post-backward hook that reshards them earlier (the
    reshard-only hook waits for gradients of the root's inputs, token ids that need
    none), so they stay gathered until the backward's final callback
    (_catch_all_reshard) at the end of backward: the whole forward and backward, on
    top of their shard."""
    unit_bytes = weights.gathered_bytes(model.layers[0].tensors())
    root = [t for t in root_tensors(model) if t.buffer.category == "weights"]
    root_bytes = weights.gathered_bytes(root)
    units = 2 if step.gpus > 1 else 1
    gathered_layer = sim.alloc(units * unit_bytes, "weights")
    gathered_root = None
    if step.gpus > 1 and root_bytes:
        gathered_root = sim.alloc(root_bytes, "weights")
    return gathered_layer, gathered_root


def _gradients(sim: Simulator, model, params, step, sizes) -> None:
    """Before a unit's gradient is reduce-scattered it exists unsharded: FSDP's
    _post_backward_hook (_runtime_utils.py) reduce-scatters flat_param.grad (the
    whole unit, in the gradient dtype) into a 1/N shard (torch.empty_like of one
    chunk), then frees the unsharded gradient; one unit's trainable gradients are
    therefore alive during backward on top of the sharded ones (ZeRO >= 2, N > 1)."""
    if step.zero >= 2 and step.gpus > 1:
        sim.sharded.reduce_scatter_bytes = sum(
            t.nbytes for t in model.layers[0].tensors() if t.requires_grad
        )
    return None


FSDP = ShardReplay(
    sizes=_sizes, persisted=_persisted, gather=_gather, gradients=_gradients
)
