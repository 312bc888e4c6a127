"""Context parallelism: what sharding the sequence divides (activations per GPU) and
what it does not (weights, gradients, optimizer states); the rest of the step is the
replay at seq / N tokens, checked against the CPU measurement of that step."""

from __future__ import annotations

import pytest

from trainmem.config import OptionError
from trainmem.estimate import estimate

TINY = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize(
    "options", [dict(batch=2), dict(batch=1, method="lora", checkpointing=True)]
)
def test_activations_per_gpu_are_the_measured_shard(options):
    from transformers import LlamaConfig

    from trainmem.measuring.measure import measure

    cfg = LlamaConfig(**TINY)
    cp = estimate(cfg, seq=512, context_parallel=4, **options)
    got = measure(cfg, seq=128, **options)
    assert cp.activation_bytes == pytest.approx(got.activation_bytes, abs=16)
    assert cp.total_bytes >= got.total_bytes - 16


def test_model_states_are_not_divided():
    one = estimate("llama-7b", seq=8192, method="lora", checkpointing=True)
    four = estimate(
        "llama-7b", seq=8192, method="lora", checkpointing=True, context_parallel=4
    )
    assert four.model_state_bytes == one.model_state_bytes
    assert four.activation_bytes < one.activation_bytes / 3.5


def test_ring_buffers_add_to_the_attention_transient():
    """The ring's send and receive buffers and fp32 accumulators: the forward peak of
    a layer whose attention dominates grows over the plain shard's."""
    opts = dict(model="tiny", batch=8, precision="fp32", method="lora")
    ring = estimate(**opts, seq=1024, context_parallel=2)
    shard = estimate(**opts, seq=512)
    assert ring.phase_peaks["forward"] > shard.phase_peaks["forward"]
    assert ring.activation_bytes == shard.activation_bytes


def test_errors_name_the_option():
    with pytest.raises(OptionError) as e:
        estimate("tiny", seq=100, context_parallel=4)
    assert e.value.option == "context_parallel" and "divide" in str(e.value)
    with pytest.raises(OptionError) as e:
        estimate("tiny", seq=128, context_parallel=2, attn="eager")
    assert e.value.option == "context_parallel"
