"""The sharding plan of a replayed step: what every ZeRO sharding does alike —
partition the optimizer's masters and states (stage 1), the gradients (stage 2), the
weights (stage 3: every parameter but those the sharding never partitions, a 4-bit
weight's packed data but not its quant_state) — and DDP's gradient buckets at
``zero=0``. What differs between shardings — what is gathered at once, where the
gradients wait for their reduction, the sizes they read — is the :class:`ShardReplay`
the :mod:`trainmem.sharding` entry carries (:mod:`.shard_fsdp`,
:mod:`.shard_deepspeed`); nothing here tests which sharding it is. The state the rest of
the replay reads goes into a :class:`~.sharded.Sharded` (``sim.sharded``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from ..dtypes import nf4_bytes_per_weight
from .accounting import ITEMSIZE, Simulator, new, resize, shrink
from .sharded import Sharded


def _quant_state_bytes(weight, step) -> int:
    """The absmax constants of a 4-bit weight (its bytes beyond 4 bits a weight)."""
    per_weight = nf4_bytes_per_weight(step.qlora_double_quant) - 0.5
    return int(math.ceil(weight.numel * per_weight))


def _linears(model) -> list:
    """Every Linear of ``model`` (LitGPT's ``lm_head`` included: it is quantized with
    the rest under QLoRA)."""
    if hasattr(model, "linears") and callable(model.linears):
        return model.linears()
    return [linear for layer in model.layers for linear in layer.linears.values()]


class Weights:
    """The parameters' storage as it is all-gathered, read before sharding shrinks it.

    A 4-bit weight is two things: its packed data (4 bits a weight, the parameter
    FSDP/DeepSpeed shard and all-gather) and its quant_state (the absmax constants),
    which bitsandbytes keeps whole on every rank as an attribute of the Linear4bit
    module (bitsandbytes/nn/modules.py, fix_4bit_weight_quant_state_from_module,
    0.43.0+: the state is put back on the gathered weight), so it is neither sharded
    nor gathered."""

    def __init__(self, model, step):
        self.quant_state = {
            id(linear.w): _quant_state_bytes(linear.w, step)
            for linear in _linears(model)
            if linear.quantized
        }
        self._nbytes = {id(t): t.buffer.nbytes for t in model.parameters()}

    def gathered_bytes(self, tensors) -> int:
        """The tensors' storage as it is all-gathered: their buffers before sharding
        (NF4 weights in their packed size, without the quant_state), not their shapes
        in the compute dtype."""
        return sum(
            self._nbytes[id(t)] - self.quant_state.get(id(t), 0) for t in tensors
        )

    def elements(self, tensors) -> int:
        """The elements DeepSpeed counts for the tensors (``ds_numel``: of a 4-bit
        weight, its packed data)."""
        return sum(self.gathered_bytes([t]) // ITEMSIZE[t.dtype] for t in tensors)


def root_tensors(model) -> list:
    """The root unit: every parameter no decoder layer holds (the embeddings, the final
    norm, lm_head)."""
    in_layers = {id(t) for layer in model.layers for t in layer.tensors()}
    return [t for t in model.parameters() if id(t) not in in_layers]


@dataclass(frozen=True)
class ShardReplay:
    """What one sharding does in the replay: the functions a
    :class:`trainmem.sharding.Sharding` entry carries (``replay``)."""

    #: ``(deepspeed_sizes option, hidden size) -> sizes``: the bucket sizes and
    #: thresholds it reads (``None`` when it reads none), resolved once by
    #: :func:`trainmem.decisions.decide` (``Decisions.shard_sizes``)
    sizes: Callable[[str, int], Any]
    #: ``(model, weights, sizes) -> ids``: parameters it never partitions
    persisted: Callable[[Any, Weights, Any], set]
    #: ZeRO-3, after the weights are sharded: ``(sim, model, step, weights,
    #: persisted, sizes) -> (gathered layers' buffer, gathered root unit's buffer or
    #: None)``; what the decoder gathers module by module goes into ``sim.sharded``
    gather: Callable[..., tuple]
    #: ``(sim, model, params, step, sizes) -> buffer or None``: where the gradients
    #: wait for their reduction — a buffer kept until the step ends, or what
    #: ``sim.sharded`` allocates at each backward (nothing below the stage that
    #: shards gradients)
    gradients: Callable[..., Any]


def _shard_weights(sim: Simulator, model, d, shard: float, sizes):
    """ZeRO-3: every weight sharded, frozen ones too (FSDP flattens whatever a unit
    holds, embeddings, norms and lm_head included; DeepSpeed partitions every
    parameter), except those the sharding never partitions; a 4-bit weight's packed
    data, not its quant_state. Then what the sharding gathers at once
    (``replay.gather``). Returns the gathered layers' buffer and the gathered root
    unit's (``None`` when there is none)."""
    step, replay = d.options, d.sharding.replay
    weights = Weights(model, step)
    persisted = replay.persisted(model, weights, sizes)
    for p in model.parameters():
        if p.buffer.category == "weights" and id(p) not in persisted:
            kept = weights.quant_state.get(id(p), 0)
            packed = p.buffer.nbytes - kept
            resize(sim, p.buffer, math.ceil(packed * shard) + kept)
    sim.sharded.param_cast_scale = shard
    return replay.gather(sim, model, step, weights, persisted, sizes)


def _shard_for_zero(sim: Simulator, model, params: list, d):
    """ZeRO partitioning over ``step.gpus``: the optimizer's fp32 master copies
    (DeepSpeed layout) and the master weights from stage 1, gradients from 2, weights
    from 3 (plus what the sharding gathers); at ``zero=0`` on more than one GPU, DDP's
    gradient buckets. Returns the master copies, what lives until the step ends (the
    gathered layers' buffer and the sharding's gradient buffer, each ``None`` when
    there is none, and DDP's buckets) and the gathered root unit's buffer (``None``
    when there is none), which FSDP frees at the end of backward."""
    step, replay = d.options, d.sharding.replay
    sim.sharded = Sharded()
    shard = 1.0 / step.gpus
    masters = []
    gathered_layer = gathered_root = None
    sizes = d.shard_sizes
    if d.dtypes.master:
        masters = [
            new(sim, p.shape, d.dtypes.master, category="master_weights")
            for p in params
        ]
        for master in masters:
            shrink(sim, master.buffer, shard)
    if step.zero >= 1:
        for p in params:
            if p.buffer.category == "master_weights":
                shrink(sim, p.buffer, shard)
    if step.zero >= 3:
        gathered_layer, gathered_root = _shard_weights(sim, model, d, shard, sizes)
    sim.sharded.grad_scale = shard if step.zero >= 2 else 1.0
    bucket = replay.gradients(sim, model, params, step, sizes)
    ddp = _ddp_buckets(sim, params, step)
    return masters, (gathered_layer, bucket, ddp), gathered_root


#: DDP's bucket caps once its first iteration has rebuilt the buckets in the order
#: the gradients became ready: the first bucket 1 MiB
#: (``dist._DEFAULT_FIRST_BUCKET_BYTES``), the others ``bucket_cap_mb`` = 25 MiB
#: (torch/nn/parallel/distributed.py; the Reducer's ``rebuild_buckets`` in
#: torch/csrc/distributed/c10d/reducer.cpp; the Trainer's ``ddp_bucket_cap_mb``
#: defaults to None, DDP's 25)
DDP_BUCKET_CAPS = (1 << 20, 25 << 20)


def ddp_bucket_sizes(tensors, caps=DDP_BUCKET_CAPS) -> list[int]:
    """The bytes of each DDP bucket over ``tensors`` (``(nbytes, dtype)`` in the order
    their gradients become ready), as c10d's ``compute_bucket_assignment_by_size``
    forms them: one open bucket per dtype, closed once it holds at least its cap; each
    closed bucket moves that dtype on to the next cap, and what stays open at the end
    is a bucket too."""
    open_, out = {}, []
    for nbytes, dtype in tensors:
        bucket = open_.setdefault(dtype, [0, 0])  # bytes, index of its cap
        bucket[0] += nbytes
        if bucket[0] >= caps[bucket[1]]:
            out.append(bucket[0])
            bucket[:] = [0, min(bucket[1] + 1, len(caps) - 1)]
    return out + [b[0] for b in open_.values() if b[0]]


def _ddp_buckets(sim: Simulator, params: list, step) -> list:
    """DistributedDataParallel's gradient buckets (``zero=0`` on ``gpus`` > 1): the
    Reducer allocates one flat tensor per bucket (``at::empty`` of the bucket's
    elements, in its parameters' dtype) when DDP wraps the model and keeps them. With
    ``gradient_as_bucket_view=False`` — DDP's default; neither accelerate's
    ``DistributedDataParallelKwargs`` nor the Trainer changes it — each gradient is
    copied into its bucket for the all-reduce and back into ``param.grad``, so the
    buckets are a second copy of every trainable gradient, alive the whole run."""
    if step.zero != 0 or step.gpus <= 1:
        return []
    ready = [(p.nbytes, p.dtype) for p in params]
    return [sim.alloc(n, "gradients") for n in ddp_bucket_sizes(reversed(ready))]
