"""DeepSpeed ZeRO as the replay models it (``zero_impl="deepspeed"``): the sizes that
set its memory, and where each comes from.

Three numbers of a DeepSpeed config decide what ZeRO-2/3 holds beyond the model states
(all counted in elements, not bytes):

* ``reduce_bucket_size``: gradients are copied into one contiguous bucket of this many
  elements in the module's dtype before they are reduced (``contiguous_gradients``,
  on by default). ZeRO-3 allocates it once when the optimizer is built
  (``DeepSpeedZeroOptimizer_Stage3._setup_for_real_optimizer``:
  ``self.__ipg_bucket_flat_buffer = torch.empty(self.reduce_bucket_size, dtype=
  self.dtype, ...)``) and keeps it; ZeRO-1/2 allocate it at the start of every
  backward (``DeepSpeedZeroOptimizer.backward``; a second one with ``overlap_comm``,
  off by default below stage 3) and drop it after the reduction
  (``_release_ipg_buffers``). ``deepspeed/runtime/zero/stage3.py`` and
  ``stage_1_and_2.py``, the same from v0.10 to v0.16.
* ``stage3_prefetch_bucket_size``: ZeRO-3 all-gathers the parameters of the modules
  about to run, up to this many elements ahead of the one running
  (``PartitionedParameterCoordinator.fetch_sub_module``).
* ``stage3_param_persistence_threshold``: a parameter of fewer elements is never
  partitioned (``ds_persist``): whole on every rank (norm weights, small LoRA matrices).

And one that HF's example configs write out and accelerate's leaves to the default:
``stage3_max_reuse_distance`` (1e9): a module's parameters are not released after it
ran if the trace of one step uses them again within that many elements
(``PartitionedParameterCoordinator.__params_to_release``), see :func:`kept`.

A config that leaves them out gets DeepSpeed's defaults (``deepspeed/runtime/zero/
config.py``: 5e8, 5e7, 1e5); that is what ``accelerate``'s DeepSpeed plugin writes when
it builds the config from its yaml (``DeepSpeedPlugin.__post_init__`` names only the
stage, the offload devices and ``stage3_gather_16bit_weights_on_model_save``).
Hugging Face's example configs set them to ``"auto"``, which the Trainer fills from the
model's hidden size h (``transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.
trainer_config_finalize``): h², int(0.9·h²) and 10·h.

Standard library only (the in-page calculator runs it in Pyodide)."""

from __future__ import annotations

from dataclasses import dataclass

#: the estimator's ``deepspeed_sizes`` choices
SIZES = ("defaults", "hf-auto")


@dataclass(frozen=True)
class Sizes:
    """DeepSpeed's bucket sizes, persistence threshold and reuse distance, in
    elements."""

    reduce_bucket: int
    prefetch_bucket: int
    persistence_threshold: int
    max_reuse_distance: int = 1_000_000_000


#: DeepSpeed's own defaults (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig:
#: reduce_bucket_size, stage3_prefetch_bucket_size, stage3_param_persistence_threshold)
DEFAULTS = Sizes(
    reduce_bucket=500_000_000, prefetch_bucket=50_000_000, persistence_threshold=100_000
)


#: the ``zero_optimization`` key of each size a run's config may set, by the ZeRO stage
#: that reads it (stage 2 has only the bucket)
CONFIG_KEYS = {
    "reduce_bucket": "reduce_bucket_size",
    "prefetch_bucket": "stage3_prefetch_bucket_size",
    "persistence_threshold": "stage3_param_persistence_threshold",
}
STAGE_SIZES = {2: ("reduce_bucket",), 3: tuple(CONFIG_KEYS)}


def sizes(which: str, hidden: int) -> Sizes:
    """The sizes a run gets: DeepSpeed's ``"defaults"``, or the Trainer's ``"auto"``
    values for a model of hidden size ``hidden`` (``"hf-auto"``)."""
    if which == "defaults":
        return DEFAULTS
    if which == "hf-auto":
        return Sizes(
            reduce_bucket=hidden * hidden,
            prefetch_bucket=int(0.9 * hidden * hidden),
            persistence_threshold=10 * hidden,
        )
    raise ValueError(f"deepspeed sizes must be one of {SIZES}, got {which!r}")


def kept(trace: list[tuple[tuple, int]], sizes: Sizes) -> set[tuple[int, object]]:
    """``(position, parameter)`` pairs of ``trace`` whose parameter is not released
    after the module at that position ran.

    ``trace``: one step's module uses in order (``(parameters, elements)``: the
    parameters a module fetches, and their elements, persistent ones included).
    After the use at position k, DeepSpeed walks the trace from k + 1, adding each
    module's elements, and keeps each of the module's parameters that some module
    there uses again before the sum reaches ``max_reuse_distance``
    (``__params_to_release``: the sum is checked before each module is read)."""
    prefix = [0]
    for _, n in trace:
        prefix.append(prefix[-1] + n)
    nxt: dict[object, int] = {}
    out = set()
    for k in range(len(trace) - 1, -1, -1):
        for p in trace[k][0]:
            j = nxt.get(p)
            # the elements of the modules between the two uses
            if j is not None and prefix[j] - prefix[k + 1] < sizes.max_reuse_distance:
                out.add((k, p))
        for p in trace[k][0]:
            nxt[p] = k
    return out
