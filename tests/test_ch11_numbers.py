"""Chapter 11's glued numbers, read from the executed notebook (no kernel) and checked
independently: byte formulas from the model's config, the claims its prose makes
(equal peaks, a linear growth, model states that context parallelism does not
divide), and the estimator's values recomputed."""

from __future__ import annotations

import functools
from pathlib import Path

import nbformat
import pytest

from coursekit.labs import glued_values
from trainmem.closed_form import count_params
from trainmem.estimate import estimate
from trainmem.reference import GiB, LLAMA3_8B

NB = Path(__file__).resolve().parents[1] / "book" / "11_beyond_sft.ipynb"
BIG = dict(
    precision="bf16-amp",
    optimizer_impl="fused",
    lora_targets="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
)


@functools.cache
def glued() -> dict[str, str]:
    return glued_values(nbformat.read(NB, as_version=4))


def num(key: str) -> float:
    return float(glued()[key].rstrip("%"))


def test_dpo_rows_are_twice_the_pairs():
    assert num("c11_dpo_rows") == 2 * num("c11_dpo_pairs")


def test_reference_copy_is_the_fp32_weights():
    head_dim = LLAMA3_8B["hidden_size"] // LLAMA3_8B["num_attention_heads"]
    rope = 2 * (head_dim // 2) * 4
    want = (4 * count_params(LLAMA3_8B) + rope) / GiB
    assert num("c11_dpo_ref_weights_gib") == pytest.approx(want, abs=0.05)


def test_precomputed_dpo_equals_sft_at_twice_the_batch():
    assert glued()["c11_dpo_pre_gib"] == glued()["c11_sft2_gib"]


def test_kv_cache_growth_by_formula():
    c = LLAMA3_8B
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    rows, extra = int(num("c11_grpo_n")), 1024
    # K in the residual stream's dtype (fp32 when the weights load in fp32), V in bf16
    from trainmem.config import StepConfig, model_shape
    from trainmem.decisions import decide

    step = StepConfig(objective="grpo", batch=rows, method="lora", **BIG)
    load = decide(model_shape(LLAMA3_8B), step).dtypes.load
    k_bytes = 4 if load == "fp32" else 2
    elems = c["num_hidden_layers"] * rows * c["num_key_value_heads"] * head_dim * extra
    assert num("c11_kv_growth") == pytest.approx(elems * (k_bytes + 2) / GiB, abs=5e-4)


def test_logits_bytes_by_formula():
    want = 8192 * LLAMA3_8B["vocab_size"] * 4 / GiB
    assert num("c11_logp_gib") == pytest.approx(want, abs=0.005)


def test_activations_grow_linearly():
    assert num("c11_act_ratio") == pytest.approx(65536 / 4096, abs=0.05)


def test_context_parallel_keeps_model_states():
    one = estimate(LLAMA3_8B, seq=32768, method="lora", checkpointing=True, **BIG)
    eight = estimate(
        LLAMA3_8B,
        seq=32768,
        method="lora",
        checkpointing=True,
        context_parallel=8,
        **BIG,
    )
    assert one.model_state_bytes == eight.model_state_bytes
    assert num("c11_cp_states") == pytest.approx(one.model_state_bytes / GiB, abs=5e-3)
    assert num("c11_cp1_peak") == pytest.approx(one.total_bytes / GiB, abs=0.05)
    assert num("c11_cp8_peak") == pytest.approx(eight.total_bytes / GiB, abs=0.05)


def test_offload_round_trip_is_twice_what_left():
    moved = 2 * (num("c11_off_before") - num("c11_off_after"))
    assert num("c11_off_moved") == pytest.approx(moved, abs=0.15)


def test_dpo_peaks_recomputed():
    est = estimate(LLAMA3_8B, seq=2048, objective="dpo", batch=1, **BIG)
    assert num("c11_dpo_copy_gib") == pytest.approx(est.total_bytes / GiB, abs=0.05)
    lora = estimate(LLAMA3_8B, seq=2048, objective="dpo", batch=1, method="lora", **BIG)
    assert num("c11_dpo_lora_gib") == pytest.approx(lora.total_bytes / GiB, abs=0.05)


def test_measured_errors_within_one_percent():
    assert num("c11_dpo_worst") < 1 and num("c11_grpo_worst") < 1


def count(key: str) -> int:
    return int(glued()[key].replace(",", ""))


def _compiled_step_shape() -> tuple[int, int, int]:
    """Tokens, model width and MLP width of the measured block stack (its defaults)."""
    import inspect

    from trainmem.measuring.compiled_step import step_memory

    p = inspect.signature(step_memory).parameters
    b, s = p["shape"].default
    assert p["n"].default == 2
    return b * s, p["d"].default, p["f"].default


def test_compiled_saved_bytes_by_autograd_formulas():
    # What each autograd formula saves (fp32, N tokens, width d, MLP width f).
    # Eager, block 1 (its input needs no grad): x*rsqrt for the norm weight's grad, h
    # for gate/up's weight grads, gate, up, silu(gate) and the product for down's
    # weight grad; block 2 also its input and rsqrt (its input needs grad); the loss
    # saves the output: 6 N d + N + 8 N f floats.
    n, d, f = _compiled_step_shape()
    assert count("c11_cmp_saved_eager") == 4 * (6 * n * d + n + 8 * n * f)
    # Min-cut: silu(gate) and x*rsqrt are recomputed in the backward; each block keeps
    # its input, rsqrt, h, gate, up and the product, plus the output for the loss.
    assert count("c11_cmp_saved_mincut") == 4 * (5 * n * d + 2 * n + 6 * n * f)
    drop = 1 - count("c11_cmp_saved_mincut") / count("c11_cmp_saved_eager")
    assert num("c11_cmp_saved_drop") == pytest.approx(100 * drop, abs=0.5)


def test_compiled_peaks_order_and_drop():
    eager, default = count("c11_cmp_peak_eager"), count("c11_cmp_peak_default")
    mincut = count("c11_cmp_peak_mincut")
    assert mincut < default < eager
    assert num("c11_cmp_peak_drop") == pytest.approx(
        100 * (1 - mincut / eager), abs=0.5
    )


def test_mask_versions_differ_by_the_saved_masks_and_kv_copies():
    """transformers 4.57.1 minus 5.24.0 for the 8B DPO LoRA step: every layer saves
    one bf16 additive mask per row (2 rows a pair) and K and V repeated from the KV
    heads to the query heads."""
    c = LLAMA3_8B
    layers, heads, kv = (
        c["num_hidden_layers"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
    )
    d, rows, s = c["hidden_size"] // heads, 2, 2048
    masks = layers * rows * s * s * 2
    copies = layers * 2 * rows * (heads - kv) * s * d * 2
    assert num("c11_mask_diff") == pytest.approx((masks + copies) / GiB, abs=0.005)
    assert num("c11_mask_old") - num("c11_mask_new") == pytest.approx(
        num("c11_mask_diff"), abs=0.011
    )
