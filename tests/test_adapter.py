"""trainmem.adapter: adapter tensors, safetensors file size and the demo's cost row,
checked against peft (meta-device counts, a real saved adapter) and safetensors itself.
"""

import os

import peft
import pytest
import safetensors.torch as safetensors_torch
import torch

from trainmem.adapter import (
    adapter_file_bytes,
    adapter_tensors,
    lora_costs,
    safetensors_bytes,
    safetensors_header,
)
from trainmem.estimate import estimate
from trainmem.measuring.models import build_model, get_config, tiny_llama_config

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ATT = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATT + ["gate_proj", "up_proj", "down_proj"]


def test_trainable_vs_peft_meta_qwen():
    """Qwen2.5-0.5B (grouped-query attention, tied embeddings) on the meta device, all 7
    linears."""
    cfg = get_config("qwen2.5-0.5b")
    p = peft.get_peft_model(
        build_model(cfg, "meta"), peft.LoraConfig(r=16, target_modules=ALL)
    )
    trainable, total = p.get_nb_trainable_parameters()
    row = lora_costs("qwen2.5-0.5b", ALL, 16)
    assert row["trainable"] == trainable == 8_798_208
    assert row["total"] + row["trainable"] == total
    shapes = adapter_tensors("qwen2.5-0.5b", ALL, 16)
    assert sum(a * b for a, b in shapes.values()) == trainable
    assert len(shapes) == 2 * 7 * cfg.num_hidden_layers


@pytest.mark.parametrize("targets,r", [(["q_proj", "v_proj"], 4), (ALL, 8)])
def test_adapter_file_size_matches_peft_save(tmp_path, targets, r):
    """The computed file size equals the bytes of the file peft's save_pretrained
    writes."""
    cfg = tiny_llama_config(num_key_value_heads=2)
    model = peft.get_peft_model(
        build_model(cfg, seed=0), peft.LoraConfig(r=r, target_modules=targets)
    )
    model.save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "adapter_model.safetensors")
    saved = safetensors_torch.load_file(path)
    assert {k: tuple(v.shape) for k, v in saved.items()} == adapter_tensors(
        cfg, targets, r
    )
    assert os.path.getsize(path) == adapter_file_bytes(cfg, targets, r, "fp32")
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        assert (
            len(
                safetensors_header(
                    adapter_tensors(cfg, targets, r), "fp32", {"format": "pt"}
                )
            )
            == n
        )


@pytest.mark.parametrize(
    "dtype,torch_dtype",
    [("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
)
def test_safetensors_bytes_matches_library(tmp_path, dtype, torch_dtype):
    tensors = {"b.weight": (3, 5), "a.weight": (7,), "c": (2, 2, 2)}
    path = os.path.join(tmp_path, "x.safetensors")
    safetensors_torch.save_file(
        {k: torch.zeros(s, dtype=torch_dtype) for k, s in tensors.items()},
        path,
        metadata={"format": "pt"},
    )
    assert os.path.getsize(path) == safetensors_bytes(tensors, dtype, {"format": "pt"})
    assert safetensors_bytes({"w": (4, 4)}, "bf16") == 8 + 64 + 4 * 4 * 2


def test_costs_row_llama7b():
    row = lora_costs("llama-7b", ["q_proj", "v_proj"], 8, dtype="bf16")
    assert row["trainable"] == 4_194_304
    assert row["total"] == 6_738_415_616
    assert row["data_bytes"] == 2 * 4_194_304
    header = row["adapter_bytes"] - row["data_bytes"] - 8
    assert 0 < header < 64 * 1024 and header % 8 == 0
    assert (
        row["lora_peak_bytes"]
        == estimate(
            "llama-7b",
            method="lora",
            precision="bf16",
            batch=1,
            seq=512,
            lora_rank=8,
            lora_targets=["q_proj", "v_proj"],
            lora_dtype="bf16",
        ).total_bytes
    )
    assert row["full_peak_bytes"] > 3 * row["lora_peak_bytes"]
    # file size grows linearly in the rank (header aside)
    assert (
        lora_costs("llama-7b", "q_proj,v_proj", 16, dtype="bf16")["data_bytes"]
        == 2 * row["data_bytes"]
    )


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(model="gpt2", targets=["c_attn"], rank=8), "Llama-shaped"),
        (
            dict(model="llama-7b", targets=["query"], rank=8),
            "unknown target module 'query'",
        ),
        (dict(model="llama-7b", targets=["q_proj"], rank=0), "lora_rank must be"),
    ],
)
def test_bad_input_one_clear_error(kw, msg):
    with pytest.raises(ValueError, match=msg):
        adapter_tensors(kw["model"], kw["targets"], kw["rank"])


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype must be one of fp32, bf16, fp16"):
        adapter_file_bytes("tiny", ["q_proj"], 4, dtype="int8")
