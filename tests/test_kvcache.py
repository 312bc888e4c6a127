"""trainmem.kvcache: parameter counts equal the built models; KV cache formula; GQA."""

import pytest

from trainmem.kvcache import inference_memory, kv_cache_bytes, param_count
from trainmem.measuring.models import build_model, get_config


@pytest.mark.parametrize(
    "name", ["tiny", "qwen2.5-0.5b", "llama-7b", "llama2-70b", "gpt2"]
)
def test_param_count_matches_meta_model(name):
    cfg = get_config(name)
    model = build_model(cfg, device="meta")
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_kv_cache_exact_values():
    # Llama-7B, MHA: 2 × 32 layers × 32 heads × 128 × 2048 tokens × 2 B = 1 GiB
    assert kv_cache_bytes(get_config("llama-7b"), 1, 2048) == 2**30
    # Llama-2-70B, GQA 8 KV heads: 2 × 80 × 8 × 128 × 4096 × 2 B = 1.25 GiB
    assert kv_cache_bytes(get_config("llama2-70b"), 1, 4096) == int(1.25 * 2**30)
    # same model with MHA would need 64/8 = 8× more
    mha = get_config("llama2-70b", num_key_value_heads=64)
    assert kv_cache_bytes(mha, 1, 4096) == 8 * kv_cache_bytes(
        get_config("llama2-70b"), 1, 4096
    )
    with pytest.raises(ValueError, match="batch"):
        kv_cache_bytes(get_config("tiny"), 0, 10)


def test_inference_memory_ratio():
    cfg = get_config("llama-7b")
    m = inference_memory(cfg, batch=1, context=2048)
    assert m.weights == 2 * 6_738_415_616 and m.kv_cache == 2**30
    assert m.ratio == pytest.approx(1 + 2**30 / (2 * 6_738_415_616))
    assert inference_memory(cfg, batch=32, context=4096).ratio > 5
