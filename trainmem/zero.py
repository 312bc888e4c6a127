"""Per-GPU memory and communication of data parallel, ZeRO-1/2/3 and FSDP (chapter 09).

The model-state formulas are those of the ZeRO paper (Rajbhandari et al., 2020, §3 and
§5): with Ψ parameters, mixed-precision Adam keeps

* 2Ψ bytes of fp16/bf16 weights,
* 2Ψ bytes of fp16/bf16 gradients,
* KΨ bytes of optimizer states, K = 12 for Adam (fp32 master weights 4 + momentum 4 +
  variance 4).

Data parallel (DP) replicates all three on every GPU: (2 + 2 + K)Ψ. ZeRO shards them
over the N_d data-parallel GPUs one after another:

==========  ===========================  ======================
stage       per-GPU model states         communication / step
==========  ===========================  ======================
``dp``      (2 + 2 + K)Ψ                 2Ψ (all-reduce)
``zero1``   2Ψ + 2Ψ + KΨ/N_d             2Ψ
``zero2``   2Ψ + (2 + K)Ψ/N_d            2Ψ
``zero3``   (2 + 2 + K)Ψ/N_d             3Ψ
``fsdp``    (4 + 4 + 8)Ψ/N_d (+ units)   3Ψ
==========  ===========================  ======================

``fsdp`` is PyTorch FSDP/FSDP2 ``FULL_SHARD`` (= ZeRO-3) as it is usually run: the
*sharded* parameters and gradients are fp32 (a mixed-precision policy casts to bf16 only
for the all-gathered copies used in compute), AdamW keeps two fp32 states, so the
sharded part is 16 bytes per parameter; on top, the all-gathered (unsharded) parameters
and gradients of the FSDP units in flight take ``inflight_units × unit_params × 2 ×
param_bytes`` bytes (unsharded weights and their gradients, before reduce-scatter). That
working set is what ``unit_params`` adds.

Communication is counted in *elements* (multiply by bytes per element of the
communicated dtype): an all-reduce of Ψ elements is a reduce-scatter plus an all-gather,
each moving Ψ elements per GPU (exactly (N_d − 1)/N_d · Ψ with a ring); ZeRO-3/FSDP
all-gathers the weights twice (forward, and again in backward) and reduce-scatters the
gradients once: 3Ψ.

Nothing here shards activations: they are per-GPU, proportional to the local
micro-batch, and must be added separately (``activation_bytes``).

All sizes are in **bytes** unless a name says otherwise (``*_gib`` are GiB = 2**30
bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import ZERO_STAGES
from .dtypes import GiB

STAGES = ("dp", "zero1", "zero2", "zero3", "fsdp")
#: the estimator's ``zero`` option (:data:`trainmem.config.ZERO_STAGES`, 0-3) by name
_STAGE_ALIASES = {
    **dict(zip(ZERO_STAGES, STAGES)),
    "ddp": "dp",
    "zero0": "dp",
    "fsdp2": "fsdp",
    "full_shard": "fsdp",
}
OFFLOAD_DEVICES = ("none", "cpu")
GIB = GiB  # the book's name for it


def normalize_stage(stage) -> str:
    """Return one of :data:`STAGES` for ``stage`` (``0..3``, ``"dp"``, ``"zero1"`` …,
    ``"fsdp"``)."""
    key = stage.lower() if isinstance(stage, str) else stage
    key = _STAGE_ALIASES.get(key, key)
    if key not in STAGES:
        raise ValueError(
            f"stage must be one of {', '.join(STAGES)} or 0..3, got {stage!r}"
        )
    return key


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer ≥ 1, got {value!r}")


@dataclass(frozen=True)
class ZeroMemory:
    """Per-GPU model-state memory, in bytes, of one (stage, n_gpus) choice.

    ``weights``/``grads``/``optimizer`` are what each GPU holds for its shard (or full
    copy); ``working`` is the unsharded working set (FSDP units in flight),
    ``activations`` what the caller passed in (never sharded), ``offloaded`` what lives
    in CPU memory instead of the GPU.
    """

    stage: str
    n_gpus: int
    weights: float
    grads: float
    optimizer: float
    working: float = 0.0
    activations: float = 0.0
    offloaded: float = 0.0

    @property
    def model_states(self) -> float:
        """Weights + gradients + optimizer states on the GPU (bytes)."""
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        """Everything on the GPU (bytes): model states + working set + activations."""
        return self.model_states + self.working + self.activations

    @property
    def total_gib(self) -> float:
        return self.total / GIB


def per_gpu_memory(
    n_params: int,
    stage="dp",
    n_gpus: int = 1,
    *,
    weight_bytes: float = 2,
    grad_bytes: float = 2,
    k: float = 12,
    unit_params: int = 0,
    inflight_units: int = 2,
    activation_bytes: float = 0.0,
    offload_optimizer: str = "none",
) -> ZeroMemory:
    """Per-GPU memory (bytes) of training ``n_params`` parameters with ``stage`` on
    ``n_gpus``.

    ``weight_bytes``, ``grad_bytes`` and ``k`` are bytes per parameter of the compute
    weights, the gradients and the optimizer states (ZeRO paper: 2, 2, 12). For
    ``stage="fsdp"`` they are ignored: sharded fp32 weights 4, fp32 grads 4, AdamW
    states 8, and the working set is ``inflight_units × unit_params × 2 × 2`` bytes
    (bf16 unsharded weights + grads of the units being all-gathered/computed; pass
    ``unit_params`` = parameters of the largest FSDP unit, e.g. one decoder layer).
    ``activation_bytes`` (per GPU) is added unsharded. ``offload_optimizer="cpu"`` moves
    the optimizer states (the K part, fp32 master weights included) to CPU memory, where
    the optimizer step then runs (ZeRO-Offload); they are reported in ``offloaded``.
    (ZeRO-Offload also streams the gradients to the CPU; that traffic is not modelled
    here.)
    """
    stage = normalize_stage(stage)
    _check_positive_int("n_gpus", n_gpus)
    if not isinstance(n_params, int) or isinstance(n_params, bool) or n_params < 0:
        raise ValueError(f"n_params must be an integer ≥ 0, got {n_params!r}")
    if offload_optimizer not in OFFLOAD_DEVICES:
        raise ValueError(
            f"offload_optimizer must be one of {', '.join(OFFLOAD_DEVICES)}, got "
            f"{offload_optimizer!r}"
        )
    if min(weight_bytes, grad_bytes, k) < 0:
        raise ValueError("weight_bytes, grad_bytes and k must be ≥ 0")
    psi, n = n_params, n_gpus
    working = 0.0
    if stage == "dp":
        w, g, o = weight_bytes * psi, grad_bytes * psi, k * psi
    elif stage == "zero1":
        w, g, o = weight_bytes * psi, grad_bytes * psi, k * psi / n
    elif stage == "zero2":
        w, g, o = weight_bytes * psi, grad_bytes * psi / n, k * psi / n
    elif stage == "zero3":
        w, g, o = weight_bytes * psi / n, grad_bytes * psi / n, k * psi / n
    else:  # fsdp: fp32 sharded params + fp32 sharded grads + AdamW (2 fp32 states)
        w, g, o = 4 * psi / n, 4 * psi / n, 8 * psi / n
        if n > 1:
            working = inflight_units * unit_params * 2 * 2
    offloaded = 0.0
    if offload_optimizer == "cpu":
        offloaded, o = o, 0.0
    return ZeroMemory(
        stage,
        n,
        float(w),
        float(g),
        float(o),
        float(working),
        float(activation_bytes),
        float(offloaded),
    )


def comm_volume(
    n_params: int, stage="dp", n_gpus: int = 1, *, exact: bool = False
) -> float:
    """Elements each GPU sends per training step (multiply by bytes per element for
    bytes).

    DP, ZeRO-1 and ZeRO-2: 2Ψ (one all-reduce, or reduce-scatter + all-gather);
    ZeRO-3/FSDP: 3Ψ (all-gather in forward, all-gather in backward, reduce-scatter of
    gradients). ``exact=True`` applies the ring factor (N_d − 1)/N_d, so one GPU
    communicates nothing.
    """
    stage = normalize_stage(stage)
    _check_positive_int("n_gpus", n_gpus)
    factor = 3 if stage in ("zero3", "fsdp") else 2
    ring = (n_gpus - 1) / n_gpus if exact else 1.0
    return factor * n_params * ring


def max_params_per_gpu(gpu_bytes: float, stage="dp", n_gpus: int = 1, **kw) -> int:
    """Largest parameter count whose model states fit in ``gpu_bytes`` (bytes) per GPU.

    Uses :func:`per_gpu_memory` with ``n_params=1`` (memory is linear in Ψ when
    ``unit_params=0`` and ``activation_bytes=0``).
    """
    per_param = per_gpu_memory(1, stage, n_gpus, **kw).total
    return int(gpu_bytes // per_param)


def table(
    n_params_by_name: dict[str, int],
    gpus=(1, 2, 4, 8, 16, 32, 64),
    stages=("dp", "zero1", "zero2", "zero3"),
    **kw,
) -> list[dict]:
    """Rows ``{model, n_params, stage, n_gpus, gib}`` of per-GPU model-state memory in
    GiB."""
    rows = []
    for name, psi in n_params_by_name.items():
        for stage in stages:
            for n in gpus:
                m = per_gpu_memory(psi, stage, n, **kw)
                rows.append(
                    dict(
                        model=name,
                        n_params=psi,
                        stage=normalize_stage(stage),
                        n_gpus=n,
                        gib=m.total / GIB,
                    )
                )
    return rows


def fsdp_local_rows(dim0: int, world_size: int, rank: int) -> int:
    """Rows of a ``dim0``-row parameter held by ``rank`` under FSDP2's dim-0 sharding.

    FSDP2 splits dim 0 like ``torch.chunk``: chunks of ``ceil(dim0 / world_size)`` rows,
    the last non-empty chunk shorter, trailing ranks possibly empty (storage is padded
    to the chunk size).
    """
    _check_positive_int("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in 0..{world_size - 1}, got {rank!r}")
    chunk = -(-dim0 // world_size)
    return max(0, min(chunk, dim0 - rank * chunk))


def fsdp_local_numel(shape, world_size: int, rank: int) -> int:
    """Elements of a parameter of ``shape`` held by ``rank`` (see
    :func:`fsdp_local_rows`)."""
    shape = tuple(shape)
    if not shape:
        return 1 if rank == 0 else 0
    rest = 1
    for s in shape[1:]:
        rest *= s
    return fsdp_local_rows(shape[0], world_size, rank) * rest
