"""trainmem.demos.parallel: tensor parallelism, throughput levers, checkpoints under
DDP."""

import io

import pytest
import torch

from trainmem.demos import parallel
from trainmem.measuring.models import build_model, get_config
from trainmem.reference import weights_bytes

CFG = get_config("tiny")


def _mlp():
    return build_model(CFG, seed=0).model.layers[0].mlp


# ------------------------------------------------------------------ tensor parallelism
def test_shards_partition_the_weights():
    mlp = _mlp()
    shards = [parallel.tp_shard_mlp(mlp, r, 2) for r in range(2)]
    assert shards[0]["gate"].shape == (CFG.intermediate_size // 2, CFG.hidden_size)
    assert shards[0]["down"].shape == (CFG.hidden_size, CFG.intermediate_size // 2)
    torch.testing.assert_close(
        torch.cat([s["up"] for s in shards], 0), mlp.up_proj.weight.detach()
    )
    torch.testing.assert_close(
        torch.cat([s["down"] for s in shards], 1), mlp.down_proj.weight.detach()
    )


def test_shard_rejects_bad_input():
    with pytest.raises(ValueError, match="rank must be in"):
        parallel.tp_shard_mlp(_mlp(), 2, 2)
    with pytest.raises(ValueError, match="divisible by world_size=5"):
        parallel.tp_shard_mlp(_mlp(), 0, 5)  # 172 is not a multiple of 5


def test_partial_sums_add_up_to_the_mlp():
    """One process, no collectives: the sum over ranks of the row-parallel outputs."""
    mlp = _mlp()
    x = torch.randn(2, 3, CFG.hidden_size, generator=torch.Generator().manual_seed(0))
    world = 4
    total = 0
    for r in range(world):
        s = parallel.tp_shard_mlp(mlp, r, world)
        h = torch.nn.functional.silu(x @ s["gate"].T) * (x @ s["up"].T)
        total = total + h @ s["down"].T
    torch.testing.assert_close(total, mlp(x))


def test_saved_bytes_of_the_plain_mlp_match_the_formula():
    mlp = _mlp()
    x = torch.randn(2, 16, CFG.hidden_size, requires_grad=True)
    r = parallel.saved_bytes(lambda: mlp(x), exclude=list(mlp.parameters()))
    assert r["bytes"] == parallel.mlp_saved_bytes(
        32, CFG.hidden_size, CFG.intermediate_size
    )
    assert r["tensors"] == 5
    # with nothing excluded, the three weights are counted too
    r_all = parallel.saved_bytes(lambda: mlp(x))
    weights = sum(p.numel() * 4 for p in mlp.parameters())
    assert r_all["bytes"] == r["bytes"] + weights


def test_mlp_saved_bytes_exact():
    # x (tokens, h) + 4 x (tokens, i / tp), 4 bytes each
    assert parallel.mlp_saved_bytes(32, 64, 172) == 4 * 32 * (64 + 4 * 172)
    assert parallel.mlp_saved_bytes(32, 64, 172, tp=2) == 4 * 32 * (64 + 2 * 172)
    assert parallel.mlp_saved_bytes(2048, 4096, 11008, tp=8, bytes_per=2) == (
        2 * 2048 * (4096 + 4 * 1376)
    )
    with pytest.raises(ValueError, match="divisible by tp=3"):
        parallel.mlp_saved_bytes(1, 64, 172, tp=3)


@pytest.mark.slow
@pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is required",
)
def test_run_tp_two_ranks():
    results = parallel.run_tp(world_size=2, timeout=120)
    assert [r["rank"] for r in results] == [0, 1]
    tokens = parallel.TP_BATCH[0] * parallel.TP_BATCH[1]
    h, i = CFG.hidden_size, CFG.intermediate_size
    for r in results:
        assert r["allreduce_forward"] == 1 and r["allreduce_backward"] == 1
        assert r["allreduce_elements"] == tokens * h
        assert r["torch_tp_allreduces"]["forward"] == 1
        assert r["max_abs_diff"] < 1e-6
        assert r["saved_plain"]["bytes"] == parallel.mlp_saved_bytes(tokens, h, i)
        assert r["saved_fsdp"]["bytes"] == r["saved_plain"]["bytes"]
        assert r["saved_tp"]["bytes"] == parallel.mlp_saved_bytes(tokens, h, i, tp=2)
        assert r["shard_shapes"]["gate"] == [i // 2, h]


# ------------------------------------------------------------------ throughput levers
def test_pad_vs_pack_tokens_exact():
    t = parallel.pad_vs_pack_tokens([1, 3, 2, 2, 5], batch_size=2, max_len=5)
    # batches [1, 3] [2, 2] [5]: 2*3 + 2*2 + 1*5; 13 tokens in rows of 5: 15
    assert t == dict(real=13, padded=15, packed=15)
    t = parallel.pad_vs_pack_tokens([4, 4, 1, 1], batch_size=4, max_len=4)
    assert t == dict(real=10, padded=16, packed=12)
    with pytest.raises(ValueError, match=r"lengths must be in \[1, max_len=4\]"):
        parallel.pad_vs_pack_tokens([5], batch_size=1, max_len=4)
    with pytest.raises(ValueError, match="batch_size and max_len"):
        parallel.pad_vs_pack_tokens([1], batch_size=0, max_len=4)


def test_optimizer_step_ms_runs_each_implementation():
    ms = parallel.optimizer_step_ms(n_tensors=4, shape=(2, 2), steps=1, repeats=1)
    assert list(ms) == ["foreach=False", "foreach=True", "fused=True"]
    assert all(v > 0 for v in ms.values())
    with pytest.raises(ValueError, match="impls must be among"):
        parallel.optimizer_step_ms(impls=("fused=False",))


def test_optimizer_step_ms_times_on_one_thread_and_restores(monkeypatch):
    """The steps run on one intra-op thread (OpenMP's barrier under load from other
    processes would swamp the comparison); torch's setting is restored after."""
    seen = []
    real = parallel.fastest_seconds

    def spy(fns, repeats):
        seen.append(torch.get_num_threads())
        return real(fns, repeats)

    monkeypatch.setattr(parallel, "fastest_seconds", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        parallel.optimizer_step_ms(n_tensors=2, shape=(2, 2), steps=1, repeats=1)
        assert seen == [1] and torch.get_num_threads() == 2
        parallel.optimizer_step_ms(
            n_tensors=2, shape=(2, 2), steps=1, repeats=1, threads=None
        )
        assert seen == [1, 2]
    finally:
        torch.set_num_threads(before)


def test_optimizer_implementations_agree():
    """The three implementations compute the same AdamW update (what is timed)."""
    out = []
    for kw in (dict(foreach=False), dict(foreach=True), dict(fused=True)):
        p = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
        p.grad = torch.ones(2, 3)
        torch.optim.AdamW([p], lr=0.1, **kw).step()
        out.append(p.detach())
    torch.testing.assert_close(out[0], out[1])
    torch.testing.assert_close(out[0], out[2])


def test_slow_dataset_and_loader_single_process():
    ds = parallel.SlowDataset(3, decode_s=0.0, seq=4)
    assert len(ds) == 3 and ds[2].tolist() == [2, 2, 2, 2]
    r = parallel.loader_timing(0, n_items=6, batch_size=4, decode_s=0.0, step_s=0.0)
    assert r["batches"] == 2 and sorted(r["ids"]) == list(range(6))
    assert 0 <= r["wait_fraction"] <= 1
    with pytest.raises(ValueError, match="num_workers must be"):
        parallel.loader_timing(-1)
    with pytest.raises(ValueError, match="need n ≥ 1"):
        parallel.SlowDataset(0, 0.0)


def test_loader_timing_splits_first_batch_from_steady_state():
    # one process: every batch waits decode_s x batch_size, the first one included
    r = parallel.loader_timing(0, n_items=8, batch_size=2, decode_s=0.01, step_s=0.0)
    assert r["batches"] == 4
    assert r["first_batch_s"] + r["steady_s"] == pytest.approx(r["wall_s"])
    assert r["first_batch_s"] >= 0.02 and r["steady_wait_s"] >= 3 * 0.02
    assert r["steady_wait_s"] <= r["wait_s"] and 0 < r["steady_wait_fraction"] <= 1


@pytest.mark.slow
def test_loader_with_workers_sees_every_item_once():
    r = parallel.loader_timing(2, n_items=8, batch_size=2, decode_s=0.0, step_s=0.0)
    assert sorted(r["ids"]) == list(range(8))


# ------------------------------------------------------------- checkpoints under DDP
def test_save_tagged_records_the_location_and_load_refuses_on_cpu():
    state = {"w": torch.randn(3, 3), "b": torch.zeros(3)}
    buf = io.BytesIO()
    parallel.save_tagged(state, buf, location="cuda:0")
    buf.seek(0)
    assert parallel.saved_locations(buf) == ["cuda:0", "cuda:0"]
    if not torch.cuda.is_available():
        buf.seek(0)
        with pytest.raises(RuntimeError, match="deserialize object on a CUDA device"):
            torch.load(buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location="cpu")
    torch.testing.assert_close(loaded["w"], state["w"])


def test_save_tagged_leaves_other_saves_alone():
    buf = io.BytesIO()
    parallel.save_tagged({"w": torch.ones(2)}, buf)
    other = io.BytesIO()
    torch.save({"v": torch.ones(2)}, other)
    other.seek(0)
    assert parallel.saved_locations(other) == ["cpu"]
    with pytest.raises(ValueError, match="dict of tensors"):
        parallel.save_tagged({"w": 1}, io.BytesIO())


def test_rank0_extra_bytes_exact():
    ckpt = weights_bytes()  # 7B, bf16
    assert parallel.rank0_extra_bytes(ckpt, 1) == 0
    assert parallel.rank0_extra_bytes(ckpt, 8) == 7 * 2 * 6_738_415_616
    with pytest.raises(ValueError, match="world_size must be an integer"):
        parallel.rank0_extra_bytes(ckpt, 0)


def test_fastest_seconds_times_every_run_and_keeps_the_minimum():
    calls = []
    best = parallel.fastest_seconds(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3
    )
    assert calls == ["a", "b"] * 3  # the runs take turns within each round
    assert set(best) == {"a", "b"} and all(0 <= t < 1 for t in best.values())
    with pytest.raises(ValueError, match="rounds must be an integer"):
        parallel.fastest_seconds({"a": lambda: None}, rounds=0)
