"""Exact checks of trainmem.zero against the ZeRO paper's worked example and the
formulas."""

import pytest

from trainmem import zero

GB = 1e9


def test_zero_paper_figure1_numbers():
    # ZeRO paper, Figure 1: Ψ = 7.5B, N_d = 64, K = 12 → 120, 31.4, 16.6, 1.9 GB per
    # GPU.
    psi = 7_500_000_000
    got = [
        zero.per_gpu_memory(psi, s, 64).total / GB
        for s in ("dp", "zero1", "zero2", "zero3")
    ]
    # The paper prints one decimal (120, 31.4, 16.6, 1.9): compare at the printed
    # rounding.
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


@pytest.mark.parametrize("stage", ["dp", "zero1", "zero2", "zero3"])
def test_one_gpu_is_plain_dp(stage):
    assert zero.per_gpu_memory(1000, stage, 1).total == 16 * 1000


def test_terms_per_stage():
    m = zero.per_gpu_memory(800, "zero2", 8)
    assert (m.weights, m.grads, m.optimizer) == (1600, 200, 1200)
    m = zero.per_gpu_memory(800, "zero1", 8)
    assert (m.weights, m.grads, m.optimizer) == (1600, 1600, 1200)


def test_fsdp_is_16_bytes_sharded_plus_units():
    m = zero.per_gpu_memory(1000, "fsdp", 4, unit_params=10, inflight_units=2)
    assert (m.weights, m.grads, m.optimizer) == (1000, 1000, 2000)
    assert m.working == 2 * 10 * 2 * 2
    assert zero.per_gpu_memory(1000, "fsdp", 1, unit_params=10).working == 0


def test_activations_not_sharded_and_offload():
    a = zero.per_gpu_memory(1000, "zero3", 1, activation_bytes=500).activations
    b = zero.per_gpu_memory(1000, "zero3", 64, activation_bytes=500).activations
    assert a == b == 500
    m = zero.per_gpu_memory(1000, "zero2", 2, offload_optimizer="cpu")
    assert m.optimizer == 0 and m.offloaded == 6000 and m.total == 2000 + 1000


def test_comm_volume():
    assert zero.comm_volume(10, "dp", 8) == 20
    assert zero.comm_volume(10, 1, 8) == zero.comm_volume(10, 2, 8) == 20
    assert zero.comm_volume(10, "zero3", 8) == zero.comm_volume(10, "fsdp", 8) == 30
    assert zero.comm_volume(10, "zero3", 1, exact=True) == 0
    assert zero.comm_volume(8, "dp", 4, exact=True) == 12


def test_aliases_and_errors():
    assert zero.normalize_stage(3) == "zero3" and zero.normalize_stage("DDP") == "dp"
    with pytest.raises(ValueError, match="stage must be one of"):
        zero.normalize_stage(4)
    with pytest.raises(ValueError, match="n_gpus"):
        zero.per_gpu_memory(10, "dp", 0)
    with pytest.raises(ValueError, match="offload_optimizer"):
        zero.per_gpu_memory(10, "dp", 1, offload_optimizer="nvme")


def test_max_params_and_table():
    assert zero.max_params_per_gpu(16 * 1000, "dp", 1) == 1000
    assert zero.max_params_per_gpu(16 * 1000, "zero3", 4) == 4000
    rows = zero.table({"m": 2**30}, gpus=(1, 2), stages=("dp", "zero3"))
    assert [r["gib"] for r in rows] == [16.0, 16.0, 16.0, 8.0]


def test_fsdp_local_rows_follow_torch_chunk():
    import torch

    for dim0 in (1, 3, 7, 8, 13):
        for world in (1, 2, 3, 4):
            sizes = [c.shape[0] for c in torch.chunk(torch.empty(dim0), world)]
            sizes += [0] * (world - len(sizes))
            assert [zero.fsdp_local_rows(dim0, world, r) for r in range(world)] == sizes
    assert zero.fsdp_local_numel((7, 32), 2, 1) == 96
    with pytest.raises(ValueError, match="rank"):
        zero.fsdp_local_rows(4, 2, 2)


def test_agrees_with_the_estimator_for_fp32_adamw():
    """Cross-check with trainmem.estimate (independent code): fp32 AdamW = 4 + 4 + 8
    bytes/param.

    ZeRO-0 (torch DDP) differs by DDP's gradient buckets; ZeRO-1/2 agree to within
    AdamW's per-tensor ``step`` scalars (bytes, not per-parameter); ZeRO-3 differs by
    the gathered (unsharded) layers the estimator adds (two on more than one GPU: FSDP
    prefetches the next unit)."""
    from trainmem import estimate

    for stage in (0, 1, 2, 3):
        e = estimate.estimate(
            "tiny", precision="fp32", zero=stage, gpus=4, batch=1, seq=8
        )
        # at the optimizer step (the peak itself may sit in backward, where FSDP's
        # unsharded gradient of one unit waits for its reduce-scatter)
        states = e.model_state_bytes
        mine = zero.per_gpu_memory(
            e.n_params, stage, 4, weight_bytes=4, grad_bytes=4, k=8
        ).model_states
        if stage == 0:
            # torch DDP: its gradient buckets, a second copy of every gradient, which
            # the ZeRO paper's data-parallel baseline leaves out
            assert abs(states - mine - 4 * e.n_params) <= 8 * 64
        elif stage < 3:
            assert abs(states - mine) <= 8 * 64  # a few scalars per parameter tensor
        else:
            # ZeRO-3: the estimator also holds the gathered (unsharded) decoder layers
            # while they compute; that is the whole difference.
            from trainmem.measuring.models import build_model, get_config

            meta = build_model(get_config("tiny"), device="meta")
            layer = sum(p.numel() for p in meta.model.layers[0].parameters())
            # two units on 4 GPUs: the one computing and the prefetched next one
            assert abs(states - mine - 2 * 4 * layer) <= 8 * 64  # fp32: 4 B/param


def test_ddp_buckets_are_c10ds():
    """The DDP buckets the replay allocates are the ones c10d forms: the same
    assignment as ``dist._compute_bucket_assignment_by_size`` (mixed dtypes, a tensor
    larger than a cap, the 1 MiB first cap), and a real DistributedDataParallel (gloo,
    one rank) keeps buckets holding every trainable parameter's bytes, with
    ``gradient_as_bucket_view`` off."""
    import torch
    import torch.distributed as dist

    from trainmem.memory.step import DDP_BUCKET_CAPS, ddp_bucket_sizes

    sizes = [3_000, 700_000, 9_000_000, 400_000, 30_000_000, 5, 6_000_000, 2_000_000]
    dtypes = [torch.float32, torch.bfloat16]
    tensors = [
        torch.empty(n, dtype=dtypes[i % 2], device="meta") for i, n in enumerate(sizes)
    ]
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, list(DDP_BUCKET_CAPS))
    theirs = sorted(
        sum(tensors[i].numel() * tensors[i].element_size() for i in bucket)
        for bucket in indices
    )
    mine = ddp_bucket_sizes((t.numel() * t.element_size(), t.dtype) for t in tensors)
    assert sorted(mine) == theirs and len(theirs) > 3

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64))
    model[0].requires_grad_(False)  # frozen parameters get no bucket
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp(torch.randn(2, 64)).sum().backward()
        data = ddp._get_ddp_logging_data()
    finally:
        dist.destroy_process_group()
    trainable = sum(p.numel() * 4 for p in model[1].parameters())
    assert sum(map(int, data["bucket_sizes"].split(","))) == trainable
    assert data["gradient_as_bucket_view"] == 0


def test_ddp_keeps_a_second_copy_of_the_gradients():
    """zero=0 on more than one GPU is DDP: besides ``param.grad`` the step holds its
    buckets, every trainable gradient's bytes once more (fp32 full fine-tuning: 4 B a
    parameter; LoRA: the fp32 adapters'), from before the forward to the end."""
    from trainmem import estimate

    def grads(**kw):
        e = estimate.estimate("tiny", batch=1, seq=16, **kw)
        return e.breakdown["gradients"], e.model_state_bytes, e.n_trainable

    for kw in (dict(precision="fp32"), dict(method="lora", precision="bf16")):
        _, one, n = grads(gpus=1, **kw)
        at_peak, two, _ = grads(gpus=2, **kw)
        assert two - one == 4 * n  # fp32 gradients (peft's fp32 adapters under LoRA)
        assert at_peak >= 4 * n  # the buckets are alive at the peak, wherever it is


# --------------------------------------------------------------------------------------
# FSDP's buffers on N > 1 GPUs, each isolated in the replayed step's allocations
# --------------------------------------------------------------------------------------
def _step_events(**kw):
    from trainmem.config import StepConfig
    from trainmem.estimate import model_shape
    from trainmem.decisions import decide
    from trainmem.memory.step import simulate_step

    step = StepConfig(batch=1, seq=8, **kw)
    shape = model_shape("tiny")
    return simulate_step(shape, decide(shape, step), record_events=True)["events"]


def _tiny_layer():
    """The tiny preset's first decoder layer as transformers builds it (meta)."""
    from trainmem.measuring.models import build_model, get_config

    meta = build_model(get_config("tiny"), device="meta")
    return meta.model.layers[0]


def test_reduce_scatter_holds_one_unsharded_unit_gradient():
    """ZeRO >= 2 on N > 1 GPUs: during backward one unit's gradient exists unsharded
    (fp32 full fine-tune: 4 bytes per parameter of the layer, counted from
    transformers' own layer) until FSDP reduce-scatters it; one GPU or ZeRO-1 has no
    such buffer."""
    want = 4 * sum(p.numel() for p in _tiny_layer().parameters())
    for zero_stage, gpus, present in ((2, 4, True), (3, 2, True), (2, 1, False)):
        events = _step_events(
            method="full", precision="fp32", zero=zero_stage, gpus=gpus
        )
        hits = [
            e
            for e in events
            if e[0] == "alloc" and e[4] == "backward" and e[3] == "temporaries"
        ]
        found = [e for e in hits if e[2] == want]
        assert bool(found) == present, (zero_stage, gpus, want)
        if present:  # freed again before the optimizer step
            uid = found[0][1]
            assert ("free", uid) in events


def test_fsdp_gathers_a_qlora_unit_in_its_packed_nf4_size():
    """ZeRO-3 under QLoRA all-gathers each unit's parameters: a 4-bit weight's packed
    data, 4 bits a weight. Its absmax constants are not a parameter (bitsandbytes keeps
    them whole on every rank as the module's quant_state), so they are neither
    gathered nor sharded. The gathered buffers (the unit and the prefetched next one on
    2 GPUs) are smaller than LoRA's bf16 ones by exactly (2 - 0.5) bytes per Linear
    weight of the layer (counted from transformers' layer), and each sharded 4-bit
    weight keeps its whole quant state next to half its packed data."""
    import math

    from trainmem.config import StepConfig
    from trainmem.dtypes import nf4_bytes_per_weight

    linears = [m for m in _tiny_layer().modules() if type(m).__name__ == "Linear"]
    n_weights = sum(m.weight.numel() for m in linears)
    assert len(linears) == 7
    bpw = nf4_bytes_per_weight(StepConfig().qlora_double_quant)
    common = dict(precision="bf16", zero=3, gpus=2, kbit_prepare="none")

    def weight_allocs(method):
        from collections import Counter

        events = _step_events(method=method, **common)
        return Counter(e[2] for e in events if e[0] == "alloc" and e[3] == "weights")

    q, lo = weight_allocs("qlora"), weight_allocs("lora")
    # besides, every 4-bit weight of every layer keeps its QuantState's code tables
    # (never sharded either: not parameters)
    from collections import Counter

    from trainmem.dtypes import nf4_state_tables
    from trainmem.families import model_shape

    n_linears = model_shape("tiny").layers * len(linears)
    tables = Counter({n: n_linears for n in nf4_state_tables(True)})
    assert q - lo >= tables
    q = q - tables
    only_q, only_lo = list((q - lo).elements()), list((lo - q).elements())
    assert len(only_q) == len(only_lo) == 1, (only_q, only_lo)
    units = 2  # the computing unit and the prefetched one
    want = units * n_weights * (2 - 0.5)
    # storage is rounded up per tensor (math.ceil): < 1 byte per Linear weight
    assert abs(want - (only_lo[0] - only_q[0])) < units * len(linears)

    # the last size of each 4-bit weight: half its packed data + its whole quant state
    events = _step_events(method="qlora", **common)
    final = {}
    for e in events:
        if e[0] in ("alloc", "resize"):
            final[e[1]] = e[2]
    for m in linears:
        n = m.weight.numel()
        state = math.ceil(n * (bpw - 0.5))
        packed = math.ceil(n * bpw) - state
        assert math.ceil(packed / 2) + state in final.values(), m


def test_fsdp_keeps_the_root_unit_gathered_through_backward():
    """FSDP does not reshard the root unit after the forward (torch's
    ``_post_forward_reshard``: ``not state._is_root``), and its frozen parameters have
    no gradient whose hook would reshard them sooner: the root's parameters (what no
    decoder layer holds: embeddings, final norm, lm_head; counted from transformers'
    model) stay all-gathered from before the forward until the end of backward, on
    top of their 1/N shards. One GPU gathers nothing beyond the layer."""
    from trainmem.measuring.models import build_model, get_config

    meta = build_model(get_config("tiny"), device="meta")
    root = [p for n, p in meta.named_parameters() if ".layers." not in n]
    root_bytes = 2 * sum(p.numel() for p in root)  # bf16
    embed = meta.get_input_embeddings().weight

    for gpus in (2, 4, 1):
        events = _step_events(method="lora", precision="bf16", zero=3, gpus=gpus)
        gathered = [
            i
            for i, e in enumerate(events)
            if e[0] == "alloc" and e[3] == "weights" and e[2] == root_bytes
        ]
        if gpus == 1:
            assert not gathered
            continue
        assert len(gathered) == 1, gpus
        start = gathered[0]
        uid = events[start][1]
        end = events.index(("free", uid))
        phases = [e[4] for e in events if e[0] == "alloc"]
        allocs = [i for i, e in enumerate(events) if e[0] == "alloc"]
        first_forward = allocs[phases.index("forward")]
        last_backward = allocs[len(phases) - 1 - phases[::-1].index("backward")]
        first_optimizer = allocs[phases.index("optimizer")]
        assert start < first_forward and last_backward < end < first_optimizer
        # the frozen embeddings are sharded like every other parameter
        sizes = {}
        for e in events:
            if e[0] in ("alloc", "resize"):
                sizes[e[1]] = e[2]
        assert 2 * embed.numel() // gpus in sizes.values(), gpus


# --------------------------------------------------------------------------------------
# DeepSpeed ZeRO (zero_impl="deepspeed"): its bucket, module-by-module gathering and
# persistent small parameters, each isolated in the replayed step's allocations
# --------------------------------------------------------------------------------------
DS = dict(method="lora", precision="bf16-amp", zero_impl="deepspeed", gpus=2)


def _hf_auto(hidden: int) -> dict:
    """The sizes transformers' Trainer writes for ``"auto"`` (its own
    ``trainer_config_finalize`` run on a DeepSpeed config; ``is_auto`` is the check
    transformers' ``HfDeepSpeedConfig`` makes when deepspeed is installed)."""
    from types import SimpleNamespace

    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig as T

    class Config(HfDeepSpeedConfig):
        fill_only, fill_match = T.fill_only, T.fill_match
        finalize = T.trainer_config_finalize

        def is_auto(self, key):
            return self.get_value(key) == "auto"

    keys = (
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
    )
    zero = {"stage": 3, **dict.fromkeys(keys, "auto")}
    config = Config({"zero_optimization": zero})
    config.mismatches = []
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=hidden))
    config.finalize(TrainingArguments(output_dir="unused", report_to=[]), model, 10)
    return {k: config.config["zero_optimization"][k] for k in keys}


def test_hf_auto_sizes_are_the_trainers():
    from trainmem import deepspeed

    for hidden in (64, 4096, 8192):
        got = deepspeed.sizes("hf-auto", hidden)
        assert _hf_auto(hidden) == {
            "reduce_bucket_size": got.reduce_bucket,
            "stage3_prefetch_bucket_size": got.prefetch_bucket,
            "stage3_param_persistence_threshold": got.persistence_threshold,
        }
    # DeepSpeed's defaults, read from deepspeed/runtime/zero/config.py
    assert deepspeed.sizes("defaults", 64) == deepspeed.Sizes(
        5 * 10**8, 5 * 10**7, 10**5
    )


def _alloc_index(events):
    """(indices of the alloc events, their phases)."""
    allocs = [i for i, e in enumerate(events) if e[0] == "alloc"]
    return allocs, [events[i][4] for i in allocs]


def test_deepspeed_gradient_bucket():
    """DeepSpeed copies gradients into one bucket of reduce_bucket_size elements in the
    module's dtype (bf16 here): ZeRO-3 allocates it with the optimizer and keeps it
    through the step; ZeRO-2 allocates it when each backward starts and drops it
    after. FSDP has no such buffer."""
    hidden = 64  # the tiny preset
    bucket = _hf_auto(hidden)["reduce_bucket_size"] * 2

    def buckets(events):
        return [
            i
            for i, e in enumerate(events)
            if e[0] == "alloc" and e[3] == "gradients" and e[2] == bucket
        ]

    events = _step_events(zero=3, deepspeed_sizes="hf-auto", grad_accum=2, **DS)
    allocs, phases = _alloc_index(events)
    (start,) = buckets(events)
    end = events.index(("free", events[start][1]))
    assert start < allocs[phases.index("forward")]
    assert end > allocs[phases.index("optimizer")]

    events = _step_events(zero=2, deepspeed_sizes="hf-auto", grad_accum=2, **DS)
    allocs, phases = _alloc_index(events)
    found = buckets(events)
    assert len(found) == 2  # one per micro-batch's backward
    for i in found:
        assert events[i][4] == "backward"
        end = events.index(("free", events[i][1]))
        later = [a for a, p in zip(allocs, phases) if a > i and p != "backward"]
        assert not later or end < later[0]  # gone before the next forward/step

    fsdp = dict(DS, zero_impl="fsdp")
    events = _step_events(zero=3, grad_accum=2, **fsdp)
    assert not buckets(events)


def test_deepspeed_gathers_the_embeddings_and_lm_head_module_by_module():
    """ZeRO-3 under DeepSpeed gathers a module's parameters when it runs and releases
    them after it unless they are used again soon: the embedding for its forward
    only, lm_head from its forward to its backward. Nothing keeps FSDP's root unit
    (embeddings + final norm + lm_head) gathered."""
    from trainmem.measuring.models import build_model, get_config

    meta = build_model(get_config("tiny"), device="meta")
    embed = 2 * meta.get_input_embeddings().weight.numel()
    head = 2 * meta.get_output_embeddings().weight.numel()
    root = 2 * sum(p.numel() for n, p in meta.named_parameters() if ".layers." not in n)
    events = _step_events(zero=3, deepspeed_sizes="hf-auto", **DS)
    allocs, phases = _alloc_index(events)
    first_backward = allocs[phases.index("backward")]
    last_backward = allocs[len(phases) - 1 - phases[::-1].index("backward")]
    gathered = [
        i
        for i, e in enumerate(events)
        if e[0] == "alloc"
        and e[3] == "weights"
        and e[4] == "forward"
        and e[2] in (embed, head)
    ]
    assert [events[i][2] for i in gathered] == [embed, head]
    ends = [events.index(("free", events[i][1])) for i in gathered]
    assert ends[0] < first_backward  # the embedding: its forward only
    assert first_backward < ends[1] < last_backward  # lm_head: into the backward
    assert not [e for e in events if e[0] == "alloc" and e[2] == root]


def _final_sizes(events) -> dict:
    sizes = {}
    for e in events:
        if e[0] in ("alloc", "resize"):
            sizes[e[1]] = e[2]
    return sizes


def test_deepspeed_keeps_small_parameters_whole():
    """A parameter of fewer elements than stage3_param_persistence_threshold is never
    partitioned. DeepSpeed's default threshold (1e5) is larger than every tensor of the
    tiny preset, so nothing of it is sharded; the Trainer's 'auto' (10 x hidden = 640)
    keeps the 64-element norm weights whole and shards the 64 x 64 q_proj weight."""
    layer = _tiny_layer()
    norm = 2 * layer.input_layernorm.weight.numel()
    q_proj = 2 * layer.self_attn.q_proj.weight.numel()
    for sizes, sharded in (("defaults", False), ("hf-auto", True)):
        events = _step_events(zero=3, deepspeed_sizes=sizes, **DS)
        params = [
            e[1]
            for e in events
            if e[0] == "alloc" and e[3] == "weights" and e[4] == "idle"
        ]
        first = {e[1]: e[2] for e in events if e[0] == "alloc"}
        final = _final_sizes(events)
        norms = [u for u in params if first[u] == norm]
        assert norms and all(final[u] == norm for u in norms)
        qs = [u for u in params if first[u] == q_proj]
        want = q_proj // 2 if sharded else q_proj
        assert qs and all(final[u] == want for u in qs), sizes


def test_deepspeed_gathers_one_layer_plus_the_prefetch_bucket():
    """What ZeRO-3 holds gathered of the decoder layers: with checkpointing the
    recomputed layer (kept for its backward, max_reuse_distance) without its persistent
    parameters, without checkpointing the largest Linear; on top the prefetch: the
    next layer's parameters in module order while fewer than
    stage3_prefetch_bucket_size elements are in flight (the one crossing the bound
    whole; bf16). Counted from transformers' layer and peft's LoRA shapes (rank 8 on
    q_proj and v_proj)."""
    sizes = _hf_auto(64)
    threshold = sizes["stage3_param_persistence_threshold"]
    layer = _tiny_layer()
    rank = 8
    tensors = {}
    for name, m in layer.named_modules():
        if type(m).__name__ == "Linear":
            shapes = [tuple(m.weight.shape)]
            if name.split(".")[-1] in ("q_proj", "v_proj"):
                shapes += [(rank, m.in_features), (m.out_features, rank)]
            tensors[name] = [a * b for a, b in shapes]
    sharded = {k: [n for n in v if n >= threshold] for k, v in tensors.items()}
    unit = 2 * sum(map(sum, sharded.values()))
    largest = 2 * max(map(sum, sharded.values()))
    prefetch = 0
    for n in (n for v in sharded.values() for n in v):
        if prefetch // 2 >= sizes["stage3_prefetch_bucket_size"]:
            break
        prefetch += 2 * n
    assert 0 < prefetch <= unit
    for checkpointing, live in ((True, unit), (False, largest)):
        want = live + prefetch
        events = _step_events(
            zero=3, deepspeed_sizes="hf-auto", checkpointing=checkpointing, **DS
        )
        idle = [
            e[2]
            for e in events
            if e[0] == "alloc" and e[3] == "weights" and e[4] == "idle"
        ]
        assert idle[-1] == want, (checkpointing, idle[-1], want)


def test_deepspeed_options_are_checked():
    from trainmem.config import OptionError, StepConfig
    from trainmem.estimate import estimate

    for bad, option in (
        (dict(zero=1, zero_impl="deepspeed"), "zero_impl"),
        (dict(zero=0, zero_impl="deepspeed"), "zero_impl"),
        (dict(zero=3, zero_impl="deepspeed", framework="litgpt"), "zero_impl"),
        (dict(zero=3, deepspeed_sizes="hf-auto"), "deepspeed_sizes"),
        (dict(zero=3, zero_impl="megatron"), "zero_impl"),
        (dict(zero=3, zero_impl="deepspeed", deepspeed_sizes="big"), "deepspeed_sizes"),
    ):
        with pytest.raises(OptionError) as e:
            StepConfig(**bad)
        assert e.value.option == option, bad
    with pytest.raises(OptionError) as e:
        estimate("gpt2", zero=3, gpus=2, zero_impl="deepspeed")
    assert e.value.option == "zero_impl"


def test_deepspeed_reuse_distance_rule():
    """``__params_to_release``: after the use at position k the trace is read from
    k + 1, each module's elements added; a parameter of the module is kept if some
    module uses it again while the sum read so far is under max_reuse_distance (the
    module need not be the same one: peft's LoRA wrapper uses lora_A's weight)."""
    from trainmem import deepspeed

    trace = [(("a",), 10), (("b",), 5), (("a",), 10), (("c", "b"), 1), (("b",), 5)]

    def kept(limit):
        return deepspeed.kept(trace, deepspeed.Sizes(0, 0, 0, limit))

    assert kept(5) == {(3, "b")}  # nothing between 3 and 4; a: 5 elements, not < 5
    assert kept(6) == {(0, "a"), (3, "b")}  # b at 1: 10 elements until c uses it
    assert kept(11) == {(0, "a"), (1, "b"), (3, "b")}
    assert kept(10**9) == kept(11)  # a last use (a at 2, c at 3, b at 4): never


def _tiny_layer_embed_numel() -> int:
    from trainmem.measuring.models import build_model, get_config

    meta = build_model(get_config("tiny"), device="meta")
    return meta.get_input_embeddings().weight.numel()


def test_deepspeed_keeps_layers_within_the_reuse_distance():
    """A model of fewer elements than max_reuse_distance keeps every layer gathered
    from its forward to its backward: for the tiny preset, every decoder-layer
    parameter that is partitioned and the embeddings (their whole, bf16), less what is
    already counted as the module being computed, are held from the end of the
    forward (before the final norm) until the backward has ended. A 70B model keeps
    none beyond the layer being computed (its last layer is the one recomputed
    first). DeepSpeed's own choice is checked on CPU by
    benchmarks/deepspeed_cpu_check.py."""
    from trainmem.config import StepConfig
    from trainmem.estimate import model_shape
    from trainmem.decisions import decide
    from trainmem.memory import shard_deepspeed as plan
    from trainmem.memory import step as st

    sizes = _hf_auto(64)
    threshold = sizes["stage3_param_persistence_threshold"]
    rank = 8
    layer_bytes = 0
    for name, m in _tiny_layer().named_modules():
        if type(m).__name__ == "Linear":
            shapes = [tuple(m.weight.shape)]
            if name.split(".")[-1] in ("q_proj", "v_proj"):
                shapes += [(rank, m.in_features), (m.out_features, rank)]
            layer_bytes += sum(2 * a * b for a, b in shapes if a * b >= threshold)
    events = _step_events(zero=3, deepspeed_sizes="hf-auto", checkpointing=True, **DS)
    idle = [
        e[2] for e in events if e[0] == "alloc" and e[3] == "weights" and e[4] == "idle"
    ]
    live = idle[-1]  # the gathered layer + prefetch (tested above)
    embed = 2 * _tiny_layer_embed_numel()
    want = 2 * layer_bytes + embed - live  # the tiny preset's two layers, embeddings
    allocs, phases = _alloc_index(events)
    found = [
        i
        for i, e in enumerate(events)
        if e[0] == "alloc" and e[3] == "weights" and e[4] == "forward" and e[2] == want
    ]
    assert len(found) == 1, want
    end = events.index(("free", events[found[0]][1]))
    last_backward = allocs[len(phases) - 1 - phases[::-1].index("backward")]
    assert last_backward < end

    seen = {}

    def spy(*args):
        seen["extra"] = original(*args)
        return seen["extra"]

    original, plan._deepspeed_kept = plan._deepspeed_kept, spy
    try:
        step = StepConfig(
            method="qlora",
            precision="bf16-amp",
            batch=1,
            seq=8,
            checkpointing=True,
            zero=3,
            gpus=2,
            zero_impl="deepspeed",
            kbit_prepare="none",
        )
        shape = model_shape("llama2-70b")
        st.simulate_step(shape, decide(shape, step))
    finally:
        plan._deepspeed_kept = original
    assert seen["extra"] == 0
