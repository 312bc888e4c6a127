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

    ZeRO-0/1/2 agree to within AdamW's per-tensor ``step`` scalars (bytes, not
    per-parameter); ZeRO-3 differs by the gathered (unsharded) layers the estimator adds
    (two on more than one GPU: FSDP prefetches the next unit)."""
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
        if stage < 3:
            assert abs(states - mine) <= 8 * 64  # a few scalars per parameter tensor
        else:
            # ZeRO-3: the estimator also holds the gathered (unsharded) decoder layers
            # while they compute; that is the whole difference.
            from trainmem.models import build_model, get_config

            meta = build_model(get_config("tiny"), device="meta")
            layer = sum(p.numel() for p in meta.model.layers[0].parameters())
            # two units on 4 GPUs: the one computing and the prefetched next one
            assert abs(states - mine - 2 * 4 * layer) <= 8 * 64  # fp32: 4 B/param


# --------------------------------------------------------------------------------------
# FSDP's buffers on N > 1 GPUs, each isolated in the replayed step's allocations
# --------------------------------------------------------------------------------------
def _step_events(**kw):
    from trainmem.config import StepConfig
    from trainmem.estimate import model_shape
    from trainmem.memory.step import simulate_step

    step = StepConfig(batch=1, seq=8, **kw)
    return simulate_step(model_shape("tiny"), step, record_events=True)["events"]


def _tiny_layer():
    """The tiny preset's first decoder layer as transformers builds it (meta)."""
    from trainmem.models import build_model, get_config

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
    from trainmem.models import build_model, get_config

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
