"""The same quantity glued in two chapters agrees — with the other chapter and with its
one source.

Reads the glued values stored in the executed notebooks (no kernel), converts each to
the unit of its reference function in :mod:`trainmem.reference` (bytes, bytes per
parameter, a fraction) and asserts it equals the reference to within the rounding of its
displayed digits. A chapter that was not re-executed after a change of the library, or
that computes a shared number its own way, fails here with the chapter, the glue key and
both values in the message.

Each quantity's name carries its conditions (precision, the optimizer states' dtype,
batch, sequence length, attention, GB or GiB): two numbers with different conditions are
different quantities and get different entries.

The second half reads the prose with the glued values put in: a sentence that states
bytes per parameter next to a 7B size in GB/GiB must multiply out, and the named claims
in ``CLAIMS`` (a saving, a ratio a chapter asserts in words) must equal their
reference.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pytest
import torch

from coursekit.labs import glued_values
from trainmem.demos import quant
from trainmem import reference as R
from trainmem import zero
from trainmem.estimate import estimate
from trainmem.demos.lora import lora_param_count_for_config
from trainmem.families import LLAMA_LINEARS
from trainmem.measuring.models import get_config

BOOK = Path(__file__).resolve().parents[1] / "book"
GB, GiB, MiB, B, M = R.GB, R.GiB, 2**20, 1e9, 1e6
ALL_LINEARS = LLAMA_LINEARS
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
CFG7 = get_config(R.MODEL_7B)


def _peak7(**kw) -> float:
    """One 7B full fine-tuning step: bf16 AMP, AdamW (foreach), batch 1, 512 tokens,
    SDPA."""
    return estimate(R.MODEL_7B, batch=1, seq=512, **kw).total_bytes


def _lora_states(r: int, targets) -> int:
    """fp32 adapters with grads and AdamW m, v: 16 bytes per trainable parameter."""
    return 16 * lora_param_count_for_config(CFG7, targets, r)


def _4bit_error(code) -> float:
    """Chapter 7's measure of a 4-bit code: N(0, 0.02^2) weights (2^20, seed 0) in
    blocks of 64, mean |error| / mean |weight|."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(2**20, generator=g, dtype=torch.float64) * 0.02).float()
    deq = quant.dequantize_blockwise(quant.quantize_blockwise(w, code, 64)).double()
    return ((deq - w.double()).abs().mean() / w.double().abs().mean()).item()


def _int8_bnb_bytes() -> int:
    """Counted from the config: every decoder Linear (q, k, v, o, gate, up, down)
    stores INT8 plus a 4-byte scale per output row; the rest stays 2 bytes."""
    h, i, n = CFG7.hidden_size, CFG7.intermediate_size, CFG7.num_hidden_layers
    linear = n * (4 * h * h + 3 * h * i)
    rows = n * (5 * h + 2 * i)
    return linear + 4 * rows + 2 * (R.n_params() - linear)


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
            ("10", "q_full_ckpt_gib", GiB),
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
    "7B INT8 weights by the bitsandbytes rule (decoder Linears INT8 with one fp32 "
    "scale per output row; embeddings, lm_head and norms 16-bit)": (
        lambda: _int8_bnb_bytes(),
        [
            ("07", "int8_7b_bnb", GB),
            ("07", "int8_7b_bnb_gib", GiB),
            ("10", "q_w7_int8", GiB),
            ("10", "q_w7_int8_gb", GB),
        ],
    ),
    "7B INT8 weights, every parameter 1 byte (scales not counted)": (
        lambda: R.int8_7b_bytes("every-parameter"),
        [("07", "int8_7b", GB), ("10", "q_w7_int8_all", GiB)],
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
    "NF4 error, N(0, 0.02^2) weights, block 64, mean |error| / mean |weight|": (
        lambda: _4bit_error(quant.nf4_code()),
        [("07", "q4_err_nf4", 1), ("10", "q_nf4_err", 1)],
    ),
    "the same for INT4 (evenly spaced, absmax)": (
        lambda: _4bit_error(quant.linear_code(4)),
        [("07", "q4_err_int4", 1), ("10", "q_int4_err", 1)],
    ),
    "NF4 bytes/param without double quant": (
        lambda: quant.nf4_bytes_per_param(double_quant=False),
        [("07", "nf4_bpp", 1), ("10", "q_nf4_nodq", 1)],
    ),
    "7B at 4 bits, every parameter, NF4 + double quantisation": (
        lambda: R.four_bit_weight_bytes("nf4-dq"),
        [("07", "nf4dq_all_7b", GB), ("10", "q_qlora_all_nf4_gib", GiB)],
    ),
    "7B QLoRA base (NF4 Linears, 16-bit embeddings/lm_head/norms)": (
        lambda: R.four_bit_weight_bytes("bnb"),
        [("07", "nf4dq_7b", GB), ("10", "q_qlora_base_gib", GiB)],
    ),
    # A "7B at 4 bits" is one of three named rules (reference.FOUR_BIT_RULES); chapter 1
    # once used a fourth (an fp16 scale per 64 weights, 3.58 GB) that no other chapter
    # shared.
    "7B at 4 bits, rule 'bnb' (as bitsandbytes stores it)": (
        lambda: R.four_bit_weight_bytes("bnb"),
        [("01", "w4_bnb_gb", GB), ("07", "nf4dq_7b", GB)],
    ),
    "7B at 4 bits, rule 'nf4-dq' (every parameter NF4 + double quantisation)": (
        lambda: R.four_bit_weight_bytes("nf4-dq"),
        [("01", "w4_nf4dq_gb", GB), ("07", "nf4dq_all_7b", GB)],
    ),
    "NF4 constants, bits per parameter, rule 'nf4' (fp32 absmax per 64)": (
        lambda: (R.four_bit_bytes_per_param("nf4") - 0.5) * 8,
        [("01", "w4_nf4_bits", 1), ("07", "nf4_const_bits", 1)],
    ),
    "Llama-3-8B parameters": (
        lambda: R.n_params(R.LLAMA3_8B),
        [("01", "l3_n", 1), ("03", "l3_n", 1)],
    ),
    "one layer's activations, bf16 autocast, SDPA, batch 1, 2048 tokens, LLaMA-7B": (
        lambda: _layer(R.MODEL_7B, 2048),
        [("03", "layer7_sdpa_mb", M), ("04", "a7_mb", M)],
    ),
    "the same for Llama-3-8B (GQA: narrower k, v; wider MLP)": (
        lambda: _layer(R.LLAMA3_8B, 2048),
        [("03", "l3_layer_mb", M), ("04", "a8_mb", M)],
    ),
    "Llama-3-8B vocabulary": (
        lambda: R.LLAMA3_8B["vocab_size"],
        [("01", "l3_vocab", 1), ("03", "l3_vocab", 1)],
    ),
    "Llama-3-8B LoRA r=8 on q_proj, v_proj: trainable parameters (GQA: v is narrow)": (
        lambda: lora_param_count_for_config(
            SimpleNamespace(**R.LLAMA3_8B), ("q_proj", "v_proj"), 8
        ),
        [("03", "l3_lora_n", 1), ("05", "sv8_qv", 1)],
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
    "+ autocast's bf16 weight copies, kept until backward (not the step's peak)": (
        lambda: 18,
        [("03", "amp_peak_bpp", 1), ("10", "cs_amp18_bpp", 1)],
    ),
    "7B LoRA r=8 on q_proj, v_proj: trainable parameters": (
        lambda: lora_param_count_for_config(CFG7, ("q_proj", "v_proj"), 8),
        [
            ("03", "lora_trainable", 1),
            ("03", "l2_lora_n", 1),
            ("05", "sv7_qv", 1),
            ("06", "p_qv_tr", 1),
            ("08", "lora_params_m", M),
            ("08", "lora_qv_n", 1),
            ("10", "q_tutorial_count", 1),
        ],
    ),
    "7B full fine-tuning step peak, bf16 AMP, AdamW foreach, batch 1, 512 tokens": (
        lambda: _peak7(),
        [
            ("03", "p7_gib", GiB),
            ("03", "p7_gb", GB),
            ("10", "cs_peak_gib", GiB),
            ("10", "q_amp7_peak", GiB),
        ],
    ),
    "the same per parameter (the optimizer step: model states + foreach scratch)": (
        lambda: _peak7() / R.n_params(),
        [("03", "p7_bpp", 1), ("10", "cs_peak_bpp", 1), ("08", "bpp_amp_peak", 1)],
    ),
    "mixed-precision AdamW model states, bytes/param (fp32 m, v)": (
        lambda: 16,
        [("08", "bpp_amp_states", 1), ("09", "bpp_states", 1), ("10", "q_bpp_amp", 1)],
    ),
    "pure bf16 AdamW model states, bytes/param (bf16 weights, grads, m, v)": (
        lambda: 8,
        [("08", "bpp_pure_states", 1), ("10", "q_bpp_pure", 1)],
    ),
    "AdamW m and v in fp32, bytes per trainable parameter": (
        lambda: 8,
        [
            ("06", "bpp_mv32", 1),
            ("06", "opt_bpp_adamw", 1),
            ("10", "q_states32_bpp", 1),
        ],
    ),
    "7B mixed-precision model states in GB (16 B/param)": (
        lambda: 16 * R.n_params(),
        [("08", "states_amp_gb", GB), ("10", "q_amp7", GiB)],
    ),
    "ZeRO-3 traffic per GPU per step, 7B, bf16, 8 GPUs, ring factor (N-1)/N, GiB": (
        lambda: 2 * zero.comm_volume(R.n_params(), "zero3", 8, exact=True),
        [
            ("09", "comm_z3_7b", GiB),
            ("09", "net_comm_gib", GiB),
            ("10", "q_z3_comm_gib", GiB),
        ],
    ),
    "7B ZeRO-3 model states per GPU on 8 GPUs (16 B/param)": (
        lambda: zero.per_gpu_memory(R.n_params(), "zero3", 8).total,
        [("09", "z3_7b_8", GiB), ("10", "q_z3_7b_8", GiB)],
    ),
    "7B per GPU under torch DDP's defaults, 8 GPUs: 16 B/param + fp32 bucket copy": (
        lambda: 20 * R.n_params(),
        [("09", "ddp_torch_7b", GiB), ("10", "q_ddp_torch7", GiB)],
    ),
    "torch DDP's gradient-bucket copy of the 7B fp32 gradients": (
        lambda: 4 * R.n_params(),
        [("09", "xcheck_z0_gib", GiB), ("10", "q_ddp_bucket_gib", GiB)],
    ),
    "foreign CUDA contexts on GPU 0 when 8 ranks touch CUDA before set_device": (
        lambda: 8 - 1,
        [("09", "rec_foreign", 1), ("10", "q_ctx_foreign", 1)],
    ),
    "a PyTorch process's CUDA context on the H200 (torch 2.11, CUDA 13)": (
        lambda: _recorded_context_mib() * MiB,
        [
            ("09", "rec_ctx_mib", MiB),
            ("08", "cap_h200_ctx_mib", MiB),
            ("10", "q_ctx_h200_mib", MiB),
        ],
    ),
    "7B lm_head parameters (modules_to_save)": (
        lambda: CFG7.vocab_size * CFG7.hidden_size,
        [("06", "sw_lm_head", 1), ("10", "q_lm_head", 1)],
    ),
    "LLaMA-7B FFN (gate, up, down) parameters over attention projections": (
        lambda: 3 * CFG7.intermediate_size / (4 * CFG7.hidden_size),
        [("07", "ffn_attn_ratio", 1), ("10", "q_ffn_attn_x", 1)],
    ),
    "LLaMA-7B FFN share of the linear layers' parameters": (
        lambda: (
            3
            * CFG7.intermediate_size
            / (3 * CFG7.intermediate_size + 4 * CFG7.hidden_size)
        ),
        [("07", "ffn_share", 1), ("10", "q_ffn_share", 1)],
    ),
    "LoRA r=8 q, k, v, o parameters of the over-fitting task's tiny Llama": (
        lambda: lora_param_count_for_config(_task_config(), QKVO, 8),
        [("06", "of_n_trainable_r8", 1), ("10", "q_of_trainable", 1)],
    ),
    "bytes left alive per step by a validation loss kept with its graph, KB": (
        lambda: _parse(_glued("08")["leak_per_step_kb"])[0] * 1024,
        [("08", "leak_per_step_kb", 1024), ("10", "q_leak_kb", 1024)],
    ),
    "7B LoRA r=8 q, k, v, o adapter file, fp32, MiB": (
        lambda: 4 * lora_param_count_for_config(CFG7, QKVO, 8),
        [("06", "sz7_adapter", MiB), ("10", "q_adapter_mib", MiB)],
    ),
}


# Quantities glued in one chapter only, with the same check against their reference
# (a ZeRO-3 difference, a capacity, a rule's size, a board's ridge point).
ONE_CHAPTER = {
    "7B at 4 bits, every parameter, one FP16 scale per 64": (
        lambda: (
            R.n_params() * quant.nf4_bytes_per_param(double_quant=False, scale_bytes=2)
        ),
        [("07", "nf4_fp16_7b", GB)],
    ),
    "7B at 4 bits, every parameter, one FP32 absmax per 64 (QLoRA without DQ)": (
        lambda: R.four_bit_weight_bytes("nf4"),
        [("07", "nf4_fp32_7b", GB)],
    ),
    "Llama-3-8B QLoRA base as bitsandbytes stores it": (
        lambda: R.four_bit_weight_bytes("bnb", R.llama3_8b()),
        [("07", "l3_base_gb", GB)],
    ),
    "Llama-3-8B LoRA r=8 on q, k, v, o: trainable parameters (GQA k, v)": (
        lambda: lora_param_count_for_config(R.llama3_8b(), QKVO, 8),
        [("06", "l3_lora_tr", 1)],
    ),
    "ZeRO-3 on 8 GPUs: the estimator's gathered layers (computed + prefetched), fp32": (
        lambda: 2 * 4 * _layer_params(),
        [("09", "xcheck_z3_mib", MiB)],
    ),
    "the same in bf16": (
        lambda: 2 * 2 * _layer_params(),
        [("09", "xcheck_z3_mib_bf16", MiB)],
    ),
    "layers gathered at once by FSDP on more than one GPU": (
        lambda: 2,
        [("09", "xcheck_units", 1)],
    ),
    "T4 memory.total (nvidia-smi), the capacity the estimator's fit uses": (
        lambda: R.capacity("T4").smi_bytes,
        [
            ("08", "t4_cap_gb", GB),
            ("08", "t4_cap_mib", MiB),
            ("08", "cap_t4_smi_mib", MiB),
        ],
    ),
    "T4 total as torch sees it (mem_get_info)": (
        lambda: R.capacity("T4").torch_total_bytes,
        [("08", "cap_t4_torch_gib", GiB)],
    ),
    "A100 80GB memory.total (nvidia-smi)": (
        lambda: R.capacity("A100-80GB").smi_bytes,
        [("09", "cap_a100_smi_mib", MiB), ("09", "cap_a100_smi_gib", GiB)],
    ),
    "A100 80GB total as torch sees it (mem_get_info)": (
        lambda: R.capacity("A100-80GB").torch_total_bytes,
        [("09", "cap_a100_torch_gib", GiB)],
    ),
    "H100 PCIe: FLOPs per byte to be compute-bound (BF16 dense / HBM2e)": (
        lambda: R.H100_PCIE_BF16_DENSE_FLOPS / R.H100_PCIE_HBM_BYTES_PER_S,
        [("08", "dec_ridge_pcie", 1)],
    ),
    "H100 PCIe: 7B bf16 weights read once per decoded token": (
        lambda: R.decode_seconds_per_token(hbm_bytes_per_s=R.H100_PCIE_HBM_BYTES_PER_S),
        [("08", "dec_bf16_ms_pcie", 1e-3)],
    ),
    "H100 SXM: BF16 dense tensor-core peak over TF32 dense": (
        lambda: R.H100_BF16_DENSE_FLOPS / R.H100_SXM_TF32_DENSE_FLOPS,
        [("10", "q_bf16_tf32_x", 1)],
    ),
}


@pytest.mark.parametrize("quantity", list(ONE_CHAPTER))
def test_single_chapter_quantity_is_its_reference(quantity):
    reference, uses = ONE_CHAPTER[quantity]
    _check(quantity, reference(), uses)


def _layer_params() -> int:
    """Parameters of one LLaMA-7B decoder layer."""
    h, i = CFG7.hidden_size, CFG7.intermediate_size
    return 4 * h * h + 3 * h * i + 2 * h


def _recorded_context_mib() -> int:
    """The CUDA context the H200 run measured (chapter 9's GPU cell, as printed)."""
    from coursekit.gpu_runs import recorded_match

    (mib,) = recorded_match("09_beyond_one_gpu/fde0c96b", r"dropped by ([\d,]+) MiB")
    return int(mib.replace(",", ""))


def _task_config():
    from trainmem.demos import synthetic_task

    return synthetic_task.task_config()


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
    _check(quantity, ref, uses)


def _check(quantity, ref, uses):
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


# ---------------------------------------------------------------- claims in the prose
GLUE_ROLE = re.compile(r"\{glue(?::\w*)?\}`([^`:]+)[^`]*`")
SENTENCE = re.compile(r"(?<=[。！？；])|\n\s*\n|\n(?=\s*[|#>*-])")
NUM = r"\d+(?:\.\d+)?"
# "20.0 字节/参数，7B 为 125.5 GiB", "每参数共 16 字节，估算 135 GB", and the size
# first: "共 37.7 GiB（fp32 下 4 + 8 字节/参数）" (a sum of bytes is added up)
BPP = (
    rf"(?P<bpp>{NUM}(?:\s*\+\s*{NUM})*)\s*(?:字节/参数|字节每参数|B/param)"
    rf"|每参数[^\d，,；。]{{0,4}}(?P<bpp2>{NUM})\s*字节(?!/)"
)
SIZE = rf"(?P<size>{NUM})\s*(?P<unit>GiB|GB)\b"
# Between the two: no sentence end, no closing parenthesis (the bytes belonged to what
# came before it) and no other number (digits inside a name such as fp32 are fine). A
# size written before its bytes per parameter must be in the same short clause (no
# comma, colon or line break): "临时张量达 27.0 GB，使峰值达到每参数 20.0 字节" pairs
# nothing.
GAP = r"(?:[^；。）)\d]|(?<=[A-Za-z])\d+){0,24}?"
CLAUSE_GAP = r"(?:[^；。，,：:\n\d]|(?<=[A-Za-z])\d+){0,12}?"
PAIRS = (
    re.compile(rf"(?:{BPP}){GAP}{SIZE}"),
    re.compile(rf"{SIZE}{CLAUSE_GAP}(?:{BPP})"),
)
UNITS = {"GB": GB, "GiB": GiB}


@dataclass(frozen=True)
class Claim:
    name: str  # the quantity and its conditions
    context: str  # regex a markdown cell must match for the claim to apply
    pattern: str  # regex with one group: the stated number
    reference: Callable[[], float]


CLAIMS = [
    Claim(
        "pure bf16 (no fp32 master, bf16 m, v) saves bytes/param over mixed precision",
        r"纯\s*BF16",
        rf"(?:省下?每参数|每参数省)\s*({NUM})\s*字节",
        lambda: 16 - 8,
    ),
    Claim(
        "not dividing the loss by k: SGD's first update over the correct one (k = 4)",
        r"累积",
        rf"SGD\s*({NUM})[，,]",
        lambda: 4.0,
    ),
]


def rendered_cells(source: str, values: dict[str, str]) -> list[str]:
    """Markdown cells of a notebook text with each glue role replaced by its value."""
    nb = nbformat.reads(source, as_version=4)
    return [
        GLUE_ROLE.sub(lambda m: values.get(m.group(1), m.group(0)), c.source)
        for c in nb.cells
        if c.cell_type == "markdown"
    ]


def bpp_size_mismatches(text: str, n_params: int) -> list[str]:
    """Sentences about 7B where N bytes/param sits next to a size that is not N x Ψ."""
    out = []
    for sentence in SENTENCE.split(text):
        if not sentence or "7B" not in sentence and "7B" not in text:
            continue
        # a sentence about the current shape multiplies out with its own count
        n = R.n_params(R.LLAMA3_8B) if "Llama-3-8B" in sentence else n_params
        for m in (m for p in PAIRS for m in p.finditer(sentence)):
            bpp_text = m.group("bpp") or m.group("bpp2")
            bpp = sum(float(x) for x in re.findall(NUM, bpp_text))
            size, unit = float(m.group("size")), UNITS[m.group("unit")]
            decimals = (
                len(m.group("size").split(".")[1]) if "." in m.group("size") else 0
            )
            tol = 0.5 * 10.0**-decimals + 0.005 * size
            if abs(bpp * n / unit - size) > tol:
                out.append(
                    f"{bpp_text} B/param x {n:,} = "
                    f"{bpp * n / unit:.1f} {m.group('unit')}, "
                    f"the text says {m.group('size')} {m.group('unit')}: "
                    f"{sentence.strip()}"
                )
    return out


def claim_mismatches(text: str) -> list[str]:
    out = []
    for claim in CLAIMS:
        if not re.search(claim.context, text):
            continue
        for m in re.finditer(claim.pattern, text):
            if abs(float(m.group(1)) - claim.reference()) > 1e-6:
                out.append(
                    f"{claim.name}: the text says {m.group(1)}, the reference is "
                    f"{claim.reference():g}: {m.group(0)}"
                )
    return out


def prose_mismatches(source: str, values: dict[str, str]) -> list[str]:
    out = []
    for text in rendered_cells(source, values):
        out += bpp_size_mismatches(text, R.n_params()) + claim_mismatches(text)
    return out


@pytest.mark.parametrize("path", sorted(BOOK.glob("*.ipynb")), ids=lambda p: p.stem)
def test_prose_numbers_agree_with_their_conditions(path):
    values = _glued(path.name[:2])
    bad = prose_mismatches(path.read_text(encoding="utf-8"), values)
    assert not bad, f"{path.stem}:\n" + "\n".join(bad)


def _synthetic(*markdown: str) -> str:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(m) for m in markdown]
    return nbformat.writes(nb)


# The three contradictions the question bank once had, reintroduced with glued values.
@pytest.mark.parametrize(
    "markdown, values",
    [
        (  # 16 B/param x 6.74 B parameters is 107.8 GB; 135 GB is the 20 B/param peak
            "7B：BF16 权重与梯度、FP32 主权重、Adam m、v，每参数共 {glue:}`bpp` 字节，"
            "估算 {glue:}`peak` GB。",
            {"bpp": "16", "peak": "135"},
        ),
        (  # 37.7 GiB is pure bf16 (2 + 4 B/param); fp32 4 + 8 would be 75.3 GiB
            "7B 上：梯度 + 优化器状态共 {glue:}`s` GiB（fp32 下 4 + 8 字节/参数）。",
            {"s": "37.7"},
        ),
        (  # pure bf16 is 8 B/param against 16: it saves 8, not 4
            ":::{admonition} Q20：纯 BF16 训练有什么风险？\n:class: dropdown\n"
            "它省下每参数 {glue:}`save` 字节。\n:::",
            {"save": "4"},
        ),
    ],
    ids=["ch8-Q1 16 B = 135 GB", "ch6 fp32 4 + 8 = 37.7 GiB", "S-Q20 saves 4 bytes"],
)
def test_reintroduced_contradictions_fail(markdown, values):
    assert prose_mismatches(_synthetic(markdown), values)


def test_consistent_sentences_pass():
    ok = _synthetic(
        "7B：共 {glue:}`bpp` 字节/参数，7B 为 {glue:}`gib` GiB。",
        "7B 上：梯度 + 优化器状态共 {glue:}`s` GiB（纯 bf16：2 + 4 字节/参数）。",
        "纯 BF16：模型状态从 16 降到 8 字节/参数，每参数省 {glue:}`save` 字节。",
    )
    values = {"bpp": "20.0", "gib": "125.5", "s": "37.7", "save": "8"}
    assert prose_mismatches(ok, values) == []


@pytest.mark.parametrize("path", sorted(BOOK.glob("*.ipynb")), ids=lambda p: p.stem)
def test_every_glue_role_has_a_stored_value(path):
    """A role whose key no cell glues renders as a build warning and an empty number."""
    values = _glued(path.name[:2])
    nb = nbformat.read(path, as_version=4)
    missing = sorted(
        {
            m.group(1)
            for c in nb.cells
            if c.cell_type == "markdown"
            for m in GLUE_ROLE.finditer(c.source)
            if m.group(1) not in values
        }
    )
    assert not missing, f"{path.stem}: glue roles without a glued value: {missing}"


# The same three contradictions reintroduced into the page itself: the chapter's cell
# with its stored values passes; the same cell with the contradicting value (or
# sentence) put back fails. A changed sentence fails the `original in source`
# assertion.
ON_THE_PAGE = [
    (  # ch8-Q1: 16 B/param x 6.74 B parameters shown as 135 GB
        "08",
        "Q1：常见说法",
        None,
        {"states_amp_gb": "135"},
    ),
    (  # ch6: 37.7 GiB of gradients + states, said to be fp32 4 + 8 bytes per parameter
        "06",
        "7B 上：全量微调的梯度 + 优化器状态共",
        (
            "（纯 bf16：每参数 {glue:}`e7_state_bpp` 字节）",
            "（fp32 下 4 + 8 字节/参数）",
        ),
        {},
    ),
    (  # S-Q20: pure bf16 saves 8 bytes per parameter, shown as 4
        "10",
        "纯 BF16 训练（不要主权重）有什么风险",
        None,
        {"q_pure_saving": "4"},
    ),
]


@pytest.mark.parametrize(
    "prefix, marker, sentence, values",
    ON_THE_PAGE,
    ids=["ch8-Q1 on the page", "ch6 fp32 4 + 8 on the page", "S-Q20 on the page"],
)
def test_reintroduced_contradiction_on_the_page_fails(prefix, marker, sentence, values):
    (path,) = BOOK.glob(f"{prefix}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    (source,) = [
        c.source for c in nb.cells if c.cell_type == "markdown" and marker in c.source
    ]
    stored = _glued(prefix)
    assert prose_mismatches(_synthetic(source), stored) == []
    if sentence is not None:
        original, reintroduced = sentence
        assert original in source, f"chapter {prefix} no longer says {original!r}"
        source = source.replace(original, reintroduced)
    for key in values:
        assert key in source, f"chapter {prefix}: {key!r} not in the cell"
    assert prose_mismatches(_synthetic(source), {**stored, **values})


# ------------------------------------------------- capacities: one named definition
def test_h200_capacities_are_the_recorded_run():
    from coursekit.gpu_runs import load_run

    run = load_run("h200-2026-12-04")
    h200 = R.capacity("H200")
    assert h200.torch_total_bytes == run["mem_get_info_total"]
    assert h200.smi_bytes == run["nvidia_smi_memory_total_mib"] * MiB
    assert h200.context_bytes == _recorded_context_mib() * MiB


def test_capacities_are_the_presets_and_the_picker():
    from coursekit.gpu import REPORTED_GIB
    from trainmem.gpus import get_gpu

    for name, c in R.CAPACITIES.items():
        if name != "H200":  # no estimator preset
            assert c.smi_bytes == get_gpu(name).capacity_bytes, name
        assert c.allocatable_bytes < c.torch_total_bytes < c.smi_bytes, name
        assert c.smi_bytes < (c.marketing_gb + 1) * GiB, name
    assert sorted(REPORTED_GIB.values()) == sorted(
        round(c.torch_total_bytes / GiB, 2) for c in R.CAPACITIES.values()
    )


def test_four_bit_rules():
    n = R.n_params()
    assert quant.nf4_bytes_per_param(double_quant=False, scale_bytes=2) == 0.5 + 2 / 64
    assert R.four_bit_weight_bytes("nf4") == n * (0.5 + 4 / 64)
    assert R.four_bit_weight_bytes("nf4-dq") == n * (0.5 + 1 / 64 + 4 / (64 * 256))
    assert R.four_bit_weight_bytes("bnb") == R.qlora_base_bytes()
    linear, rest = R.qlora_base_split()
    assert (
        R.four_bit_weight_bytes("bnb") == linear * (0.5 + 1 / 64 + 4 / 16384) + 2 * rest
    )
    assert set(R.FOUR_BIT_RULES) == {"nf4", "nf4-dq", "bnb"}
    with pytest.raises(ValueError, match="rule must be one of"):
        R.four_bit_weight_bytes("double-quant")
    with pytest.raises(ValueError, match="'bnb' keeps some parameters in 16 bits"):
        R.four_bit_bytes_per_param("bnb")


# ------------------------------------- a number that has several rules names its rule
# (chapter, glue key, words one of which the paragraph showing it must contain): a
# 4-bit or INT8 size says how it was counted, a capacity which capacity it is, a
# ZeRO-3 difference how many layers, a DDP per-GPU figure its bucket copy.
NAMED = [
    ("07", "nf4_fp16_7b", ("FP16",)),
    ("07", "nf4_fp32_7b", ("FP32 absmax",)),
    ("07", "nf4dq_all_7b", ("双重量化",)),
    ("07", "nf4dq_7b", ("bitsandbytes",)),
    ("10", "q_qlora_all_nf4_gib", ("双重量化",)),
    ("10", "q_qlora_base_gib", ("bitsandbytes",)),
    ("10", "q_nf4_nodq", ("FP32 absmax",)),
    ("07", "int8_7b", ("所有参数", "每个参数")),
    ("07", "int8_7b_bnb", ("bitsandbytes",)),
    ("10", "q_w7_int8", ("bitsandbytes",)),
    ("10", "q_w7_int8_all", ("每个参数",)),
    ("09", "xcheck_z3_mib", ("{glue:}`xcheck_units` 层",)),
    ("09", "dp_7b", ("ddp_torch_7b", "加卡没用")),
    ("10", "q_amp7", ("q_ddp_torch7", "模型状态 {glue")),
    ("08", "t4_cap_gb", ("显存总量",)),
    ("08", "cap_t4_torch_gib", ("torch 可见",)),
    ("09", "cap_a100_torch_gib", ("mem_get_info",)),
    ("09", "cap_a100_smi_mib", ("显存总量",)),
    ("08", "dec_ridge", ("SXM",)),
    ("07", "qs_extra_512", ("SXM",)),
    ("10", "q_mfu", ("SXM",)),
    ("10", "q_bf16_flops_x", ("不用 Tensor Core",)),
    ("10", "q_ctx_a100_x7_gib", ("q_ctx_foreign",)),
]


def _sentences_with(source: str, key: str) -> list[str]:
    nb = nbformat.reads(source, as_version=4)
    role = f"{{glue:}}`{key}`"
    return [
        s
        for c in nb.cells
        if c.cell_type == "markdown"
        for s in re.split(r"\n\s*\n", c.source)
        if s and role in s
    ]


def unnamed(source: str, key: str, words) -> list[str]:
    return [s for s in _sentences_with(source, key) if not any(w in s for w in words)]


@pytest.mark.parametrize(
    "prefix, key, words", NAMED, ids=[f"{p}-{k}" for p, k, _ in NAMED]
)
def test_each_number_names_its_rule(prefix, key, words):
    (path,) = BOOK.glob(f"{prefix}_*.ipynb")
    source = path.read_text(encoding="utf-8")
    assert _sentences_with(source, key), f"chapter {prefix} no longer shows {key}"
    bad = unnamed(source, key, words)
    assert not bad, f"chapter {prefix}: {key} shown without {words}:\n" + "\n".join(bad)


# The sentences these items once had fail the same check.
@pytest.mark.parametrize(
    "key, words, sentence",
    [
        (
            "xcheck_z3_mib",
            ("{glue:}`xcheck_units` 层",),
            "ZeRO-3 分别差 {glue:}`xcheck_z3_mib` MiB 和 "
            "{glue:}`xcheck_z3_mib_bf16` MiB，"
            "正好是估算器额外计入的「一层 all-gather 出来的完整权重」。",
        ),
        (
            "q_qlora_all_nf4_gib",
            ("双重量化",),
            "7B 底座 {glue:}`q_qlora_base_gib` GiB（把全部参数乘以 NF4 字节数会得 "
            "{glue:}`q_qlora_all_nf4_gib` GiB）。",
        ),
        (
            "t4_cap_gb",
            ("显存总量",),
            "同一个 LLaMA-7B QLoRA 步骤在 T4（{glue:}`t4_cap_gb` GB）上放得下。",
        ),
        (
            "dec_ridge",
            ("SXM",),
            "而 H100 要约 {glue:}`dec_ridge` FLOP/字节才是算力受限。",
        ),
        (
            "q_amp7",
            ("q_ddp_torch7", "模型状态 {glue"),
            "数字（7B、8 卡、每卡模型状态）：DDP {glue:}`q_amp7` GiB，FSDP "
            "{glue:}`q_z3_7b_8` GiB。",
        ),
    ],
    ids=["ch9 one layer", "Q55 NF4", "ch8 T4 GB", "ch8 H100", "Q31 DDP"],
)
def test_old_unnamed_sentences_fail(key, words, sentence):
    assert unnamed(_synthetic(sentence), key, words)


# Interview answers that were wrong or dated: what each must now say.
ANSWERS = [
    ("06", "Q7：LoRA、Adapter", ("P-tuning v2", "PrefixTuningConfig"), ()),
    ("09", "Q5：FSDP 和 DeepSpeed", ("set_requires_gradient_sync",), ()),
    (
        "10",
        "Q31：FSDP 和 DDP",
        ("set_requires_gradient_sync", "gradient_as_bucket_view"),
        (),
    ),
    ("10", "Q11：一个能用的 FP8", ("1×128", "128×128", "MXFP8", "E8M0"), ()),
    ("10", "Q21：为什么要用混合精度", ("q_bf16_tf32_x", "TF32"), ()),
    ("10", "Q81：MFU 怎么算", ("FLOPs",), ("次乘加每参数",)),
    ("10", "Q95：每个进程都在 GPU 0", ("q_ctx_foreign",), ()),
    ("09", "Q6：8 张「80GB」", ("ddp_torch_7b", "gradient_as_bucket_view"), ()),
]


@pytest.mark.parametrize(
    "prefix, marker, must, must_not", ANSWERS, ids=[a[1][:12] for a in ANSWERS]
)
def test_corrected_interview_answers(prefix, marker, must, must_not):
    (path,) = BOOK.glob(f"{prefix}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    cells = [
        c.source for c in nb.cells if c.cell_type == "markdown" and marker in c.source
    ]
    assert cells, f"chapter {prefix}: no cell with {marker!r}"
    text = cells[0][cells[0].index(marker) :]
    text = text[: text.find("\n:::", 1) if "\n:::" in text else None]
    missing = [w for w in must if w not in text]
    present = [w for w in must_not if w in text]
    assert not missing and not present, (prefix, marker, missing, present)


def test_fsdp2_has_no_no_sync():
    """FSDP2's fully_shard modules skip the gradient sync with
    set_requires_gradient_sync(False); no_sync() is DDP's and FSDP1's."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    assert hasattr(FSDPModule, "set_requires_gradient_sync")
    assert not hasattr(FSDPModule, "no_sync")
    assert hasattr(FullyShardedDataParallel, "no_sync")
    assert hasattr(DistributedDataParallel, "no_sync")


# ------------------------------------------------------ one chapter, one source
def _gap_gb() -> float:
    """GB a GiB reading undercounts when read as GB: the 7B peak in GB minus the same
    bytes in GiB (the two numbers of chapter 3's misconception 1)."""
    b = _peak7(precision="bf16-amp", optimizer="adamw", method="full", attn="sdpa")
    return b / GB - b / GiB


# quantity -> (reference, [(chapter, glue key, unit)]): a number one chapter states,
# checked against its one source.
ONE_SOURCE = {
    "GB a GiB reading of the 7B peak undercounts": (_gap_gb, [("03", "gap_gb", 1)]),
    "Llama-3-8B SDPA activations outside the layers, 2048 tokens (logits, loss)": (
        lambda: R.activation_bytes(R.LLAMA3_8B) - 32 * _layer(R.LLAMA3_8B, 2048),
        [("03", "l3_rest_gb", GB)],
    ),
    "Llama-3-8B at 4 bits, rule 'bnb'": (
        lambda: R.four_bit_weight_bytes("bnb", R.LLAMA3_8B),
        [("01", "l3_w4_bnb_gb", GB)],
    ),
    "Llama-3-8B LoRA r=8 on all Linears: trainable parameters": (
        lambda: lora_param_count_for_config(
            SimpleNamespace(**R.LLAMA3_8B), ALL_LINEARS, 8
        ),
        [("05", "sv8_t", 1)],
    ),
}


def _layer(model, seq: int) -> int:
    from trainmem.estimate import activation_bytes_per_layer

    return activation_bytes_per_layer(
        model, batch=1, seq=seq, precision="bf16-amp", attn="sdpa"
    )


@pytest.mark.parametrize("quantity", list(ONE_SOURCE))
def test_one_chapter_quantity_equals_its_source(quantity):
    reference, uses = ONE_SOURCE[quantity]
    ref = reference()
    for prefix, key, unit in uses:
        value, half_digit = _parse(_glued(prefix)[key])
        assert abs(value * unit - ref) <= half_digit * unit * (1 + 1e-9), (
            f"{quantity}: chapter {prefix} glues {key}={value} (x {unit:g}), the "
            f"reference is {ref / unit:.6g}"
        )


def _markdown(prefix: str) -> str:
    (path,) = BOOK.glob(f"{prefix}_*.ipynb")
    nb = nbformat.read(path, as_version=4)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def test_gb_gib_gap_states_its_unit():
    """Chapter 3's misconception 1 once said "大 9.3" (134.8 GB - 125.5 GiB, no
    unit)."""
    text = _markdown("03")
    assert "{glue:}`gap_gb` GB" in text
    assert re.search(r"大 \{glue:\}`gap_gb`(?! G)", text) is None


def test_fsdp2_gradient_accumulation_switch():
    """FSDP2 (fully_shard) has no no_sync(): chapter 4 glues what torch has and says
    which generation has which."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    g = _glued("04")
    assert g["fsdp2_no_sync"] == str(hasattr(FSDPModule, "no_sync")) == "False"
    assert g["fsdp2_sync_switch"] == "True"
    assert hasattr(FSDPModule, "set_requires_gradient_sync")
    assert g["fsdp1_no_sync"] == str(hasattr(FullyShardedDataParallel, "no_sync"))
    text = _markdown("04")
    assert "FSDP 也有 `no_sync()`" not in text
    (q8,) = [b for b in text.split(":::") if "Q8：" in b]
    assert "set_requires_gradient_sync" in q8 and "FSDP1" in q8


def test_qlora_hyperparameters_are_the_papers():
    """QLoRA used r=64, alpha=16 on all linear layers; alpha = 2r is not from it."""
    text = _markdown("05")
    (q6,) = [b for b in text.split(":::") if "Q6：" in b]
    assert "$r=64$" in q6 and "$\\alpha=16$" in q6
    for sentence in re.split(r"[。；]", text):
        if "QLoRA" in sentence:
            assert "2r" not in sentence, sentence


def test_fp8_answer_names_the_block_scaled_recipes():
    text = _markdown("01")
    (q6,) = [b for b in text.split(":::") if "Q6：FP8" in b]
    for term in ("按块", "1×128", "128×128", "MXFP8", "E8M0"):
        assert term in q6, term
