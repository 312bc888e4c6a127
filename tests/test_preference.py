"""DPO and GRPO in the estimator (trainmem.objectives, trainmem.memory.preference)
against the CPU measurement of the same step (trainmem.measuring.preference_losses), the
reference's rules, and TRL's config names."""

from __future__ import annotations

import pytest

from trainmem.config import OptionError, StepConfig
from trainmem.estimate import estimate
from trainmem.from_hf import hf_options

# a tiny Llama whose vocabulary makes the logits a visible share of the step
TINY = dict(
    model_type="llama",
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)


def _config():
    from transformers import LlamaConfig

    cfg = dict(TINY)
    cfg.pop("model_type")
    return LlamaConfig(**cfg)


CASES = [
    dict(objective="dpo", seq=64),
    dict(objective="dpo", seq=48, batch=2, method="lora", checkpointing=True),
    dict(objective="dpo", seq=64, reference="precomputed", precision="fp32"),
    dict(objective="grpo", batch=4, group_size=4, seq=32, max_completion_length=32),
    dict(
        objective="grpo",
        batch=2,
        group_size=2,
        seq=16,
        max_completion_length=48,
        method="lora",
        reference="adapter",
    ),
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: str(sorted(o.items())))
def test_objective_agrees_with_cpu_measurement(options):
    from trainmem.measuring.measure import measure

    cfg = _config()
    est = estimate(cfg, **options)
    got = measure(cfg, **options)
    assert est.peak_phase == got.peak_phase
    assert est.total_bytes == pytest.approx(got.total_bytes, rel=1e-3)
    assert est.activation_bytes == pytest.approx(got.activation_bytes, rel=1e-3)
    for k, v in got.breakdown.items():
        assert est.breakdown[k] == pytest.approx(v, rel=2e-3, abs=1024), k


def test_reference_copy_holds_a_second_set_of_weights():
    copy = estimate(TINY, objective="dpo", seq=64, precision="fp32")
    pre = estimate(
        TINY, objective="dpo", seq=64, precision="fp32", reference="precomputed"
    )
    sft = estimate(TINY, seq=64, precision="fp32")
    # the frozen copy: every parameter once more, in the load dtype (fp32), and its
    # two RoPE buffers (inv_freq, original_inv_freq: head_dim / 2 floats each)
    assert copy.options["reference"] == "copy"
    rope = 2 * (64 // 4 // 2) * 4
    assert copy.model_state_bytes - pre.model_state_bytes == 4 * copy.n_params + rope
    assert pre.model_state_bytes == sft.model_state_bytes


def test_adapter_reference_adds_no_weights():
    lora = dict(objective="dpo", seq=64, method="lora")
    est = estimate(TINY, **lora)
    assert est.options["reference"] == "adapter"
    pre = estimate(TINY, **lora, reference="precomputed")
    assert est.model_state_bytes == pre.model_state_bytes


def test_dpo_batch_counts_pairs():
    """batch counts preference pairs: the policy's forward runs over 2 x batch
    sequences, so the activations at the end of the forward of one pair are those of
    two sequences."""
    one = estimate(TINY, objective="dpo", seq=64, reference="precomputed")
    two = estimate(TINY, objective="dpo", seq=64, reference="precomputed", batch=2)
    sft2 = estimate(TINY, seq=64, batch=2, use_cache="off")
    sft4 = estimate(TINY, seq=64, batch=4, use_cache="off")
    assert two.activation_bytes - one.activation_bytes > 0.9 * (
        sft4.activation_bytes - sft2.activation_bytes
    )


def test_grpo_generation_cache_grows_with_completion():
    """The rollouts' KV cache: K and V of every layer for prompt + completion tokens
    of the generation batch (K in fp32 under autocast over fp32 weights: RoPE's cos
    and sin follow the fp32 residual stream; V in bf16)."""
    base = dict(objective="grpo", batch=8, seq=16, model="tiny")
    a = estimate(**base, max_completion_length=512)
    b = estimate(**base, max_completion_length=1024)
    layers, kv_heads, head_dim = 2, 4, 16
    cache = layers * 8 * kv_heads * head_dim * 512 * (4 + 2)
    ids = 2 * 8 * 512 * 8  # the step's input ids and labels, alive between steps
    assert b.phase_peaks["generate"] - a.phase_peaks["generate"] == cache + ids


def test_errors_name_the_option():
    with pytest.raises(OptionError) as e:
        StepConfig(objective="dpo", reference="adapter")
    assert e.value.option == "reference"
    with pytest.raises(OptionError) as e:
        StepConfig(objective="dpo", reference="none")
    assert e.value.option == "reference"
    with pytest.raises(OptionError) as e:
        StepConfig(objective="grpo", batch=4, group_size=8)
    assert e.value.option == "group_size" and "divide" in str(e.value)
    with pytest.raises(OptionError) as e:
        StepConfig(objective="dpo", zero=2, gpus=2)
    assert e.value.option == "zero"
    with pytest.raises(OptionError) as e:
        StepConfig(objective="ppo")
    assert e.value.option == "objective"
    with pytest.raises(OptionError) as e:
        estimate("gpt2", objective="dpo")
    assert e.value.option == "objective"


def test_trl_configs():
    dpo = hf_options(
        "tiny",
        dict(
            per_device_train_batch_size=2, max_length=64, precompute_ref_log_probs=True
        ),
    )
    assert dpo["objective"] == "dpo" and dpo["reference"] == "precomputed"
    assert dpo["batch"] == 2 and dpo["seq"] == 64
    grpo = dict(per_device_train_batch_size=8, num_generations=4, beta=0.0)
    opts = hf_options("tiny", grpo, seq=32)
    assert opts["objective"] == "grpo" and opts["reference"] == "none"
    assert opts["group_size"] == 4 and opts["max_completion_length"] == 512
    lora = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    opts = hf_options("tiny", dict(grpo, beta=0.04), lora, seq=32)
    assert opts["reference"] == "adapter"
    assert hf_options("tiny", dict(grpo, beta=0.04), seq=32)["reference"] == "copy"
    assert "objective" not in hf_options("tiny", dict(max_length=64))
