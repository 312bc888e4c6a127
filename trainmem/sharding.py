"""Who shards the model under ZeRO (``zero_impl``): one entry each, declared once.

A :class:`Sharding` carries how the replay partitions and gathers — its ``replay``,
the functions :mod:`trainmem.memory.shard_plan` calls without asking which sharding it
is: a decoder layer per unit with the next prefetched and the root unit kept
(:mod:`trainmem.memory.shard_fsdp`), or module by module with a prefetch bucket and
small parameters never partitioned (:mod:`trainmem.memory.shard_deepspeed`) — and
where the gradients wait for their reduction (one unit's unsharded gradient, or a
contiguous bucket); and the stages and frameworks it is modelled for and how many NCCL
communicators it holds. Nothing else in the package tests a sharding's name
(``tests/test_structure.py`` counts). The rules themselves, each with its source line,
are in those two modules and :mod:`trainmem.deepspeed`.

Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import lookup
from .memory.shard_deepspeed import DEEPSPEED
from .memory.shard_fsdp import FSDP
from .memory.shard_plan import ShardReplay


@dataclass(frozen=True)
class Sharding:
    name: str
    summary: str
    #: the ZeRO stages it is modelled for, and why not the others
    stages: tuple[int, ...]
    stages_refused: str
    #: the frameworks whose model it shards (empty: any), and why not the others
    frameworks: tuple[str, ...]
    frameworks_refused: str
    #: only for the replayed decoders (not the closed forms)
    replayed_only: bool
    #: what it does in the replay: the sizes it reads, the parameters it never
    #: partitions, what it gathers at once and where the gradients wait for their
    #: reduction (:class:`~trainmem.memory.shard_plan.ShardReplay`)
    replay: ShardReplay
    #: NCCL communicators its process holds (DeepSpeed clones the default group)
    communicators: int
    #: takes ``deepspeed_sizes``
    sizes: bool
    #: ZeRO-3 + LoRA + non-reentrant checkpointing stops with a CheckpointError in
    #: releases without deepspeedai/DeepSpeed#8148
    checkpoint_error: bool


SHARDINGS: dict[str, Sharding] = {
    s.name: s
    for s in (
        Sharding(
            "fsdp",
            "torch FSDP: a decoder layer per unit, the next one prefetched, the root "
            "unit kept gathered through backward",
            stages=(0, 1, 2, 3),
            stages_refused="",
            frameworks=(),
            frameworks_refused="",
            replayed_only=False,
            replay=FSDP,
            communicators=1,
            sizes=False,
            checkpoint_error=False,
        ),
        Sharding(
            "deepspeed",
            "DeepSpeed ZeRO: a gradient bucket, each module's parameters gathered as "
            "it runs plus a prefetch bucket, small parameters never partitioned",
            stages=(2, 3),
            stages_refused="(stage 1 with bf16 runs DeepSpeed's BF16_Optimizer, whose "
            "whole-model fp32 gradient buffers are not modelled)",
            frameworks=("hf",),
            frameworks_refused="(LitGPT shards with FSDP through Fabric)",
            replayed_only=True,
            replay=DEEPSPEED,
            communicators=2,
            sizes=True,
            checkpoint_error=True,
        ),
    )
}


def sharding(name: str) -> Sharding:
    """The entry of ``name``; an unknown name raises :class:`OptionError` for
    ``zero_impl`` naming the allowed ones."""
    return lookup(SHARDINGS, "zero_impl", name)
