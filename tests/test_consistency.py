"""The same quantity glued in two chapters agrees — with the other chapter and with its
one source.

Reads the glued values stored in the executed notebooks (no kernel), converts each to
the unit of its reference function in :mod:`trainmem.reference` (bytes, bytes per
parameter, a fraction) and asserts it equals the reference to within the rounding of its
displayed digits. A chapter that was not re-executed after a change of the library, or
that computes a shared number its own way, fails here with the chapter, the glue key and
both values in the message.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import nbformat
import pytest

from coursekit.labs import glued_values
from trainmem import quant
from trainmem import reference as R
from trainmem.lora import lora_param_count_for_config
from trainmem.models import get_config

BOOK = Path(__file__).resolve().parents[1] / "book"
GB, GiB, MiB, B, M = R.GB, R.GiB, 2**20, 1e9, 1e6
ALL_LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
CFG7 = get_config(R.MODEL_7B)


def _lora_states(r: int, targets) -> int:
    """fp32 adapters with grads and AdamW m, v: 16 bytes per trainable parameter."""
    return 16 * lora_param_count_for_config(CFG7, targets, r)


# quantity -> (reference value, [(chapter file prefix, glue key, unit of the glued
# number)])
QUANTITIES = {
    "7B parameters": (
        lambda: R.n_params(),
        [("03", "n7", 1), ("06", "n7", 1), ("08", "n7_b", B)],
    ),
    "7B bf16 weights": (
        lambda: R.weights_bytes(),
        [
            ("08", "w16_gb", GB),
            ("10", "q_w7_bf16", GiB),
            ("06", "e7_w_full", GiB),
            ("09", "ckpt7_gib", GiB),
            ("10", "q_ckpt7_gib", GiB),
        ],
    ),
    "extra bytes on GPU 0 when 8 ranks load a 7B bf16 checkpoint saved from cuda:0": (
        lambda: 7 * R.weights_bytes(),
        [("09", "rank0_extra_8_gib", GiB), ("10", "q_rank0_extra8_gib", GiB)],
    ),
    "7B AdamW m and v (fp32) for LoRA r=8 on q, k, v, o": (
        lambda: 8 * lora_param_count_for_config(CFG7, QKVO, 8),
        [("06", "opt7_lora_mib", MiB), ("10", "q_lora_adam_mib", MiB)],
    ),
    "7B AdamW m and v (fp32) for full fine-tuning": (
        lambda: 8 * R.n_params(),
        [("06", "opt7_full_gib", GiB), ("10", "q_full_adam_gib", GiB)],
    ),
    "7B MLP activations over 32 layers, bf16, 2048 tokens, no TP": (
        lambda: 32 * 2 * 2048 * (CFG7.hidden_size + 4 * CFG7.intermediate_size),
        [("09", "tp7_mlp_1_gib", GiB), ("10", "q_tp1_act7_gib", GiB)],
    ),
    "the same per GPU with TP=8 (the layer input stays whole)": (
        lambda: 32 * 2 * 2048 * (CFG7.hidden_size + 4 * CFG7.intermediate_size // 8),
        [("09", "tp7_mlp_8_gib", GiB), ("10", "q_tp8_act7_gib", GiB)],
    ),
    "7B fp32 weights": (
        lambda: R.weights_bytes(bytes_per_param=4),
        [("03", "w7_fp32_gib", GiB), ("10", "q_w7_fp32", GiB)],
    ),
    "7B activations, bf16 autocast, SDPA, batch 1, 2048 tokens": (
        lambda: R.activation_bytes(),
        [
            ("03", "act7_sdpa_gb", GB),
            ("08", "act7_2k", GB),
            ("09", "act7_gib", GiB),
            ("10", "q_act7", GiB),
        ],
    ),
    "the same with eager attention": (
        lambda: R.activation_bytes(attn="eager"),
        [
            ("03", "act7_eager_gb", GB),
            ("08", "act7_2k_eager", GB),
            ("10", "q_act7_eager", GiB),
        ],
    ),
    "the same with per-layer checkpointing": (
        lambda: R.activation_bytes(checkpointing=True),
        [
            ("03", "act7_ckpt_gb", GB),
            ("09", "act7_ckpt_gib", GiB),
            ("10", "q_act7_ckpt", GiB),
        ],
    ),
    "activation bytes per b*s*h (bf16 autocast Llama layer)": (
        lambda: 34,
        [("03", "c_h_sdpa", 1), ("03", "c_h_eager", 1), ("10", "q_c_h", 1)],
    ),
    "activation bytes per b*s*i": (
        lambda: 8,
        [("03", "c_i_sdpa", 1), ("10", "q_c_i", 1)],
    ),
    "eager attention bytes per b*a*s*s": (
        lambda: 6,
        [("03", "c_a_eager", 1), ("10", "q_c_a", 1)],
    ),
    "8-bit AdamW state bytes/param (block 256)": (
        lambda: R.adam8_bytes_per_param(),
        [("07", "st8", 1), ("10", "q_adam8_bpp", 1)],
    ),
    "8-bit AdamW saving on the states": (
        lambda: R.adam8_saving(),
        [("03", "opt8_saving", 1), ("07", "st_saving", 1), ("10", "q_adam8_saving", 1)],
    ),
    "NF4 + double quant bytes/param": (
        lambda: quant.nf4_bytes_per_param(),
        [("07", "nf4dq_bpp", 1), ("10", "q_nf4", 1)],
    ),
    "NF4 bytes/param without double quant": (
        lambda: quant.nf4_bytes_per_param(double_quant=False),
        [("07", "nf4_bpp", 1), ("10", "q_nf4_nodq", 1)],
    ),
    "7B QLoRA base (NF4 Linears, 16-bit embeddings/lm_head/norms)": (
        lambda: R.qlora_base_bytes(),
        [("07", "nf4dq_7b", GB), ("10", "q_qlora_base_gib", GiB)],
    ),
    "7B QLoRA r=16 on all Linears, model states": (
        lambda: R.qlora_base_bytes() + _lora_states(16, ALL_LINEARS),
        [("09", "seed_qlora_7b", GiB), ("10", "cs_qlora_7b", GiB)],
    ),
    "7B LoRA r=16 on all Linears, bf16 base, model states": (
        lambda: R.weights_bytes() + _lora_states(16, ALL_LINEARS),
        [("09", "seed_lora_7b", GiB), ("10", "cs_lora_7b", GiB)],
    ),
    "7B mixed-precision AdamW model states (16 B/param)": (
        lambda: 16 * R.n_params(),
        [("09", "seed_full_7b", GiB), ("10", "cs_amp_7b", GiB), ("10", "q_amp7", GiB)],
    ),
    "mixed-precision AdamW bytes/param": (
        lambda: 16,
        [("03", "amp_bpp", 1), ("10", "cs_amp_bpp", 1)],
    ),
    "the same at the peak, with autocast's bf16 weight copies": (
        lambda: 18,
        [("03", "amp_peak_bpp", 1), ("10", "cs_amp18_bpp", 1)],
    ),
    "7B LoRA r=8 on q_proj, v_proj: trainable parameters": (
        lambda: lora_param_count_for_config(CFG7, ("q_proj", "v_proj"), 8),
        [
            ("03", "lora_trainable", 1),
            ("06", "p_qv_tr", 1),
            ("08", "lora_params_m", M),
            ("10", "q_peft_qv", 1),
        ],
    ),
}


@functools.lru_cache(maxsize=None)
def _glued(prefix: str) -> dict[str, str]:
    (path,) = BOOK.glob(f"{prefix}_*.ipynb")
    return glued_values(nbformat.read(path, as_version=4))


def _parse(text: str) -> tuple[float, float]:
    """(value, half a unit in the last displayed digit) of a glued number such as
    '1,234.5' or '74.6%'."""
    t = text.strip().replace(",", "")
    pct = t.endswith("%")
    t = t.rstrip("%")
    if not re.fullmatch(r"[-+]?\d+(\.\d+)?", t):
        raise ValueError(f"not a plain number: {text!r}")
    decimals = len(t.split(".")[1]) if "." in t else 0
    scale = 0.01 if pct else 1.0
    return float(t) * scale, 0.5 * 10.0**-decimals * scale


@pytest.mark.parametrize("quantity", list(QUANTITIES))
def test_shared_quantity_agrees_across_chapters(quantity):
    reference, uses = QUANTITIES[quantity]
    ref = reference()
    chapters = {prefix for prefix, _, _ in uses}
    assert len(chapters) >= 2, (
        f"{quantity}: listed for one chapter only; this test is for shared numbers"
    )
    for prefix, key, unit in uses:
        values = _glued(prefix)
        assert key in values, (
            f"chapter {prefix}: glue key {key!r} ({quantity}) not in the stored outputs"
        )
        value, half_digit = _parse(values[key])
        assert abs(value * unit - ref) <= half_digit * unit * (1 + 1e-9) + 1e-9 * abs(
            ref
        ), (
            f"{quantity}: chapter {prefix} glues {key}={values[key]!r} (x {unit:g}), "
            f"the reference is {ref / unit:.6g}"
        )


def test_parse_reads_the_displayed_precision():
    assert _parse("1,234.5") == (1234.5, 0.05)
    assert _parse("74.61%") == pytest.approx((0.7461, 0.00005))
    with pytest.raises(ValueError, match="not a plain number"):
        _parse("QLoRA r=8 + ckpt")
