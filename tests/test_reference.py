"""trainmem.reference: the shared cross-chapter numbers, each checked by an independent
count."""

import pytest
import torch

from trainmem import reference as R
from trainmem.measuring.models import build_model, get_config


def test_7b_parameters_and_weights_match_a_meta_model():
    model = build_model(get_config("llama-7b"), device="meta")
    n = sum(p.numel() for p in model.parameters())
    assert R.n_params() == n == 6_738_415_616
    assert R.weights_bytes() == 2 * n and R.weights_bytes(bytes_per_param=4) == 4 * n


def test_qlora_base_keeps_embeddings_head_and_norms_16bit():
    model = build_model(get_config("llama-7b"), device="meta")
    linear = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")
    )
    rest = sum(p.numel() for p in model.parameters()) - linear
    assert R.qlora_base_split() == (linear, rest)
    # 4 bits + 8-bit absmax + fp32 per 256 absmax
    nf4_dq = 0.5 + 1 / 64 + 4 / (64 * 256)
    assert R.qlora_base_bytes() == pytest.approx(linear * nf4_dq + 2 * rest)
    assert R.qlora_base_bytes(double_quant=False) == pytest.approx(
        linear * (0.5 + 4 / 64) + 2 * rest
    )
    # not 3.48: not every parameter is NF4
    assert round(R.qlora_base_bytes() / 1e9, 2) == 3.87


def test_adam8_block_256_and_paper_2048():
    assert R.ADAM8_BLOCK == 256 and R.ADAM8_PAPER_BLOCK == 2048
    assert R.adam8_bytes_per_param() == 2 * (1 + 4 / 256)
    assert R.adam8_saving() == pytest.approx(0.74609375)
    assert R.adam8_bytes_per_param(R.ADAM8_PAPER_BLOCK) == 2 * (1 + 4 / 2048)


def test_activation_bytes_conditions():
    sdpa = R.activation_bytes()
    # the closed form of one layer (bf16 autocast, SDPA) times 32, plus embedding/logits
    b, s, h, i, a = 1, 2048, 4096, 11008, 32
    per_layer = b * s * (34 * h + 8 * i) + 8 * b * s + 4 * b * a * s
    assert 32 * per_layer < sdpa < 32 * per_layer + 0.5e9
    assert R.activation_bytes(attn="eager") > 2 * sdpa
    with pytest.raises(ValueError, match="conditions"):
        R.activation_bytes(micro_batch=2)


def test_throughput_arithmetic():
    assert R.decode_seconds_per_token() == pytest.approx(2 * 6_738_415_616 / 3.35e12)
    assert R.decode_seconds_per_token(bytes_per_param=1) == pytest.approx(
        R.decode_seconds_per_token() / 2
    )
    assert R.pipeline_bubble(1, 4) == 0 and R.pipeline_bubble(4, 1) == 0.75
    assert R.pipeline_bubble(8, 64) == pytest.approx(7 / 71)
    with pytest.raises(ValueError, match="stages"):
        R.pipeline_bubble(0, 4)
    assert R.mfu(1e12 / (6 * 6_738_415_616), peak_flops=1e12) == pytest.approx(1.0)
