"""Numbers that several chapters quote, each computed in exactly one place.

A quantity that appears in two chapters (the 7B weights, the 7B activations at 2048
tokens, the bytes per parameter of 8-bit Adam, the NF4 QLoRA base ...) comes from a
function here, so the chapters cannot drift apart; ``tests/test_consistency.py`` checks
the glued values of the stored notebooks against these functions.

Units: every ``*_bytes`` function returns bytes (int or float); ``GiB`` = 2**30, ``GB``
= 10**9. Each function states the conditions its number holds under — a memory number
without them (batch, sequence length, attention implementation, precision) is not a
number.
"""

from __future__ import annotations

from .estimate import GB, GiB, count_params, estimate
from .quant import adam_state_bytes_per_param, nf4_bytes_per_param

__all__ = [
    "MODEL_7B",
    "LLAMA3_8B",
    "FOUR_BIT_RULES",
    "four_bit_bytes_per_param",
    "four_bit_weight_bytes",
    "GB",
    "GiB",
    "ADAM8_BLOCK",
    "ADAM8_PAPER_BLOCK",
    "ACT_CONDITIONS",
    "n_params",
    "weights_bytes",
    "activation_bytes",
    "adam8_bytes_per_param",
    "adam8_saving",
    "qlora_base_split",
    "qlora_base_bytes",
    "H100_HBM_BYTES_PER_S",
    "H100_BF16_DENSE_FLOPS",
    "decode_seconds_per_token",
    "pipeline_bubble",
    "mfu",
]

MODEL_7B = "llama-7b"
# A current 7-8B shape beside the LLaMA-1/2 one: the fields of Meta-Llama-3-8B's
# config.json (128,256-token vocabulary, GQA with 8 K/V heads, MLP width 14,336). Every
# function here takes it as ``model`` (a dict of config.json fields is a model).
LLAMA3_8B = {
    "model_type": "llama",
    "name_or_path": "meta-llama/Meta-Llama-3-8B",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}
# bitsandbytes quantises Adam's states in blocks of 256 values since 0.44 (2024); the
# 8-bit optimizers paper (Dettmers et al., 2022) used 2048.
ADAM8_BLOCK = 256
ADAM8_PAPER_BLOCK = 2048
# The conditions of the activation number every chapter quotes.
ACT_CONDITIONS = dict(
    precision="bf16-amp", attn="sdpa", batch=1, seq=2048, checkpointing=False
)


def n_params(model: str = MODEL_7B) -> int:
    """Parameters of ``model`` (a preset name or config), counted from its shapes."""
    return count_params(model)


def weights_bytes(model: str = MODEL_7B, bytes_per_param: float = 2) -> float:
    """Bytes of the weights alone at ``bytes_per_param`` (2 = fp16/bf16, 4 = fp32)."""
    return n_params(model) * bytes_per_param


def activation_bytes(model: str = MODEL_7B, **conditions) -> int:
    """Bytes held for backward at the end of the forward pass (the estimator's replay).

    Defaults: :data:`ACT_CONDITIONS` (bf16 autocast over fp32 parameters, SDPA
    attention, batch 1, 2048 tokens, no checkpointing, full fine-tuning); any of them
    can be overridden, e.g. ``attn="eager"`` or ``checkpointing=True``.
    """
    unknown = set(conditions) - set(ACT_CONDITIONS) - {"method"}
    if unknown:
        raise ValueError(
            f"conditions must be among {sorted(ACT_CONDITIONS)} or 'method', got "
            f"{sorted(unknown)}"
        )
    return estimate(model, **{**ACT_CONDITIONS, **conditions}).activation_bytes


def adam8_bytes_per_param(block_size: int = ADAM8_BLOCK) -> float:
    """Bytes per parameter of 8-bit AdamW's m and v: 2 × (1 + 4/block) (one fp32 absmax
    per block)."""
    return adam_state_bytes_per_param(8, block_size=block_size)


def adam8_saving(block_size: int = ADAM8_BLOCK) -> float:
    """Fraction of the 8 B/param of fp32 Adam states that 8-bit states save."""
    return 1 - adam8_bytes_per_param(block_size) / adam_state_bytes_per_param(32)


def qlora_base_split(model: str = MODEL_7B) -> tuple[int, int]:
    """(parameters in decoder Linear layers, all other parameters) of a Llama-family
    model.

    bitsandbytes/transformers quantise the ``nn.Linear`` modules of the decoder layers
    to 4 bits and keep the embeddings, ``lm_head`` and the norms in 16 bits.
    """
    from .estimate import model_shape

    s = model_shape(model)
    linear = s.layers * sum(d_in * d_out for d_in, d_out in s.linear_shapes().values())
    return linear, n_params(model) - linear


def qlora_base_bytes(
    model: str = MODEL_7B,
    double_quant: bool = True,
    block_size: int = 64,
    other_bytes: float = 2,
) -> float:
    """Bytes of a QLoRA base model: NF4 decoder Linears (constants included) + 16-bit
    rest."""
    linear, rest = qlora_base_split(model)
    return (
        linear * nf4_bytes_per_param(block_size, double_quant=double_quant)
        + rest * other_bytes
    )


# ------------------------------------------------------------------ 4-bit weights
# : The rules a "7B at 4 bits" size can be computed by, each named once. Chapter 1 and
# : chapter 7 quote the same rule by the same name.
FOUR_BIT_RULES = {
    "nf4": "every parameter NF4, one fp32 absmax per 64 weights (QLoRA without double"
    " quantisation)",
    "nf4-dq": "every parameter NF4 with double quantisation (8-bit absmax per 64, one"
    " fp32 constant per 256 of them)",
    "bnb": "as bitsandbytes stores a model: decoder Linears NF4 + double quantisation,"
    " embeddings, lm_head and norms in 16 bits",
}


def four_bit_bytes_per_param(rule: str = "nf4") -> float:
    """Bytes per 4-bit weight, constants included, of an all-parameter rule
    (``"nf4"`` or ``"nf4-dq"``; ``"bnb"`` depends on the model: see
    :func:`four_bit_weight_bytes`)."""
    if rule == "nf4":
        return nf4_bytes_per_param(64, double_quant=False)
    if rule == "nf4-dq":
        return nf4_bytes_per_param(64, double_quant=True)
    raise ValueError(
        f"rule must be 'nf4' or 'nf4-dq' for bytes per parameter (got {rule!r}); "
        "'bnb' keeps some parameters in 16 bits: use four_bit_weight_bytes"
    )


def four_bit_weight_bytes(rule: str = "nf4", model=MODEL_7B) -> float:
    """Bytes of ``model``'s weights at 4 bits under ``rule`` (a key of
    :data:`FOUR_BIT_RULES`)."""
    if rule not in FOUR_BIT_RULES:
        raise ValueError(f"rule must be one of {sorted(FOUR_BIT_RULES)}, got {rule!r}")
    if rule == "bnb":
        return qlora_base_bytes(model, double_quant=True)
    return n_params(model) * four_bit_bytes_per_param(rule)


# ------------------------------------------------------------------ throughput
# arithmetic NVIDIA H100 SXM datasheet: HBM3 bandwidth and dense (no sparsity) BF16
# tensor-core peak.
H100_HBM_BYTES_PER_S = 3.35e12
H100_BF16_DENSE_FLOPS = 989e12


def decode_seconds_per_token(
    model: str = MODEL_7B,
    bytes_per_param: float = 2,
    hbm_bytes_per_s: float = H100_HBM_BYTES_PER_S,
) -> float:
    """Lower bound of one decode step at batch 1: every weight is read once from memory.

    Decode does 2 FLOPs per weight per token, far below what the GPU needs to be
    compute-bound, so the time is the weight bytes over the memory bandwidth (KV cache
    and kernels ignored).
    """
    return n_params(model) * bytes_per_param / hbm_bytes_per_s


def pipeline_bubble(stages: int, micro_batches: int) -> float:
    """Idle fraction of a GPipe/1F1B pipeline: (p - 1) / (m + p - 1)."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(
            f"stages and micro_batches must be ≥ 1, got {stages}, {micro_batches}"
        )
    return (stages - 1) / (micro_batches + stages - 1)


def mfu(
    tokens_per_s: float,
    model: str = MODEL_7B,
    peak_flops: float = H100_BF16_DENSE_FLOPS,
) -> float:
    """Model FLOPs utilisation: 6 FLOPs per parameter per token (forward 2 + backward 4)
    / peak."""
    return 6 * n_params(model) * tokens_per_s / peak_flops
