"""The FSDP2 demo really runs (2 gloo processes on CPU) and matches the sharding
formula."""

import pytest
import torch

from trainmem.demos import fsdp_demo
from trainmem import zero
from trainmem.measuring.models import build_model, get_config

pytestmark = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
    reason="torch.distributed with gloo is required",
)


@pytest.fixture(scope="module")
def results():
    return fsdp_demo.run(world_size=2, model="tiny", timeout=120)


@pytest.fixture(scope="module")
def n_params():
    return sum(
        p.numel() for p in build_model(get_config("tiny"), device="meta").parameters()
    )


def test_per_rank_bytes_match_formula(results):
    for row in fsdp_demo.summarize(results):
        assert row["param_bytes"] == row["expected_param_bytes"]
        assert row["grad_bytes"] == row["expected_grad_bytes"]
        assert row["optim_bytes"] == row["expected_optim_bytes"]


def test_shards_partition_the_model(results, n_params):
    rows = fsdp_demo.summarize(results)
    assert sum(r["local_numel"] for r in rows) == n_params
    # the pitfall: DTensor.numel() is the global size on every rank
    assert all(r["global_numel"] == n_params for r in rows)
    # ZeRO-3 / FSDP formula: 16 bytes per parameter / N, plus AdamW's fp32 step scalars
    for r in rows:
        states = r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"]
        assert (
            states
            == zero.per_gpu_memory(n_params, "fsdp", 2).model_states
            + 4 * results[0]["n_param_tensors"]
        )


def test_optimizer_order_and_activations(results):
    for r in results:
        assert r["backend"] == "gloo"
        assert r["right_order_changed"] == r["n_param_tensors"]
        assert (
            r["wrong_order_changed"] == 0
            and not r["wrong_order_optimizer_sees_module_params"]
        )
        assert r["saved_bytes_fsdp"] == r["saved_bytes_plain"] > 0
    assert results[0]["loss"] == results[1]["loss"] and 0 < results[0]["loss"] < 10


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        fsdp_demo.run(world_size=0)


def test_bad_start_method():
    with pytest.raises(ValueError, match="start_method"):
        fsdp_demo.run(start_method="fork")
