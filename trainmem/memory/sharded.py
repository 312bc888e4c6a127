"""What sharding does to a replayed step: the state a sharding plan
(:func:`trainmem.memory.shard_plan._shard_for_zero` and the ``replay`` of the
:mod:`trainmem.sharding` entry) sets up, and the hooks the ops, autograd, the decoder
and the step call without knowing who shards. The :class:`~.accounting.Simulator` holds
one (``sim.sharded``), or ``None`` when nothing is sharded."""

from __future__ import annotations

from dataclasses import dataclass, field

from .accounting import Simulator, SimTensor


@dataclass
class Sharded:
    #: ZeRO >= 2: the fraction of each gradient kept locally
    grad_scale: float = 1.0
    #: ZeRO-3: the fraction of each weight autocast casts (its local shard)
    param_cast_scale: float = 1.0
    #: ZeRO >= 2 on N > 1 with per-unit reduce-scatter (FSDP): one unit's unsharded
    #: gradient, alive during backward
    reduce_scatter_bytes: int = 0
    #: a gradient bucket allocated for each backward (DeepSpeed ZeRO-2)
    backward_bucket_bytes: int = 0
    #: modules gathered one by one when they run (DeepSpeed ZeRO-3: embeddings,
    #: lm_head): bytes each gathers to, by the parameter's id
    gathered_modules: dict[int, int] = field(default_factory=dict)
    #: layers' parameters kept gathered from the forward into the backward beyond the
    #: module being computed (DeepSpeed ZeRO-3's max_reuse_distance)
    kept_bytes: int = 0
    #: their buffer, from the end of the decoder stack to the end of backward
    kept: object = None

    def gathered(self, sim: Simulator, p: SimTensor) -> SimTensor:
        """``p`` as its module uses it: a gathered copy that lives as long as the ops
        keep it (the embedding's forward keeps nothing; lm_head's keeps it for its
        backward) when the plan gathers its module alone, else ``p`` itself."""
        nbytes = self.gathered_modules.get(id(p))
        if nbytes is None:
            return p
        g = SimTensor(sim.alloc(nbytes, "weights"), p.shape, p.dtype, p.requires_grad)
        g.grad_accumulator = p.grad_accumulator
        return g

    def after_layers(self, sim: Simulator) -> None:
        """At the end of the decoder stack's forward: the layers kept gathered until
        their backward, held from here (released by :meth:`after_backward`)."""
        if self.kept_bytes:
            self.kept = sim.alloc(self.kept_bytes, "weights")

    def after_backward(self) -> None:
        """At the end of backward: the layers kept from the forward are released
        (each after its own backward)."""
        self.kept = None

    def backward_buffers(self, sim: Simulator) -> tuple:
        """What the sharding allocates when a backward starts: the unsharded unit
        gradient and the gradient bucket (each ``None`` when there is none)."""
        unsharded = bucket = None
        if self.reduce_scatter_bytes:
            unsharded = sim.alloc(self.reduce_scatter_bytes, "temporaries")
        if self.backward_bucket_bytes:
            bucket = sim.alloc(self.backward_bucket_bytes, "gradients")
        return unsharded, bucket


def gathered(sim: Simulator, p: SimTensor) -> SimTensor:
    """``p`` as its module uses it under ``sim.sharded`` (``p`` when unsharded)."""
    return p if sim.sharded is None else sim.sharded.gathered(sim, p)
