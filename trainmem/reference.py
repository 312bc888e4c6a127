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

from dataclasses import dataclass

from .dtypes import adam_state_bytes_per_param, nf4_bytes_per_weight
from .estimate import GB, GiB, count_params, estimate


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
    "int8_7b_bytes",
    "INT8_RULES",
    "H100_HBM_BYTES_PER_S",
    "H100_BF16_DENSE_FLOPS",
    "H100_PCIE_HBM_BYTES_PER_S",
    "H100_PCIE_BF16_DENSE_FLOPS",
    "H100_SXM_FP32_FLOPS",
    "H100_SXM_TF32_DENSE_FLOPS",
    "LLAMA3_8B",
    "llama3_8b",
    "Capacity",
    "CAPACITIES",
    "capacity",
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


def llama3_8b():
    """The transformers config of Llama-3-8B, built from :data:`LLAMA3_8B` (the one
    definition), usable wherever a preset name is."""
    from .families import transformers_config

    return transformers_config(LLAMA3_8B, LLAMA3_8B["name_or_path"])


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
    return linear * nf4_bytes_per_weight(double_quant, block_size) + rest * other_bytes


#: The rules a "7B in INT8" size can be counted by (:func:`int8_7b_bytes`).
INT8_RULES = ("every-parameter", "bitsandbytes")


def int8_7b_bytes(rule: str, model: str = MODEL_7B) -> float:
    """A model's weights in INT8 by ``rule``.

    ``"every-parameter"``: 1 byte per parameter, scales not counted. ``"bitsandbytes"``
    (LLM.int8(), ``load_in_8bit``): the decoder Linears in INT8 with one fp32 scale
    per output row, the embeddings, ``lm_head`` and norms in 16 bits.
    """
    if rule not in INT8_RULES:
        raise ValueError(f"rule must be one of {INT8_RULES}, got {rule!r}")
    if rule == "every-parameter":
        return float(n_params(model))
    from .estimate import model_shape

    linear, rest = qlora_base_split(model)
    s = model_shape(model)
    rows = s.layers * sum(d_out for _, d_out in s.linear_shapes().values())
    return float(linear + 4 * rows + 2 * rest)


# ------------------------------------------------------------------ 4-bit weights
#: The rules a "7B at 4 bits" size can be computed by, each named once (the one list:
#: chapter 1 and chapter 7 quote the same rule by the same name).
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
        return nf4_bytes_per_weight(double_quant=False)
    if rule == "nf4-dq":
        return nf4_bytes_per_weight(double_quant=True)
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
# arithmetic NVIDIA H100 datasheet, dense (no sparsity) tensor-core peaks. The SXM5
# board (HBM3): 3.35 TB/s, BF16 989 TFLOPS, TF32 494.5 TFLOPS, FP32 (no tensor
# cores) 67 TFLOPS. The PCIe board (HBM2e): 2.0 TB/s, BF16 756 TFLOPS.
H100_HBM_BYTES_PER_S = 3.35e12
H100_BF16_DENSE_FLOPS = 989e12
H100_PCIE_HBM_BYTES_PER_S = 2.0e12
H100_PCIE_BF16_DENSE_FLOPS = 756e12
H100_SXM_FP32_FLOPS = 67e12
H100_SXM_TF32_DENSE_FLOPS = 494.5e12


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


# ------------------------------------------------------------------ GPU capacity
# One card has three capacities; the book names which one each number uses:
#
# * ``smi_bytes``: ``nvidia-smi``'s ``memory.total`` (the :mod:`trainmem.gpus` preset,
#   what the estimator's ``fits`` compares with). The card's name ("16GB", "80GB") is
#   the marketing size in GB, ``marketing_gb``.
# * ``torch_total_bytes``: ``torch.cuda.mem_get_info()[1]`` (= the "total capacity" of
#   torch's out-of-memory message): what the driver gives CUDA, less than memory.total.
# * ``allocatable_bytes``: ``torch_total_bytes`` less the CUDA context of a PyTorch
#   process, which is created before the first tensor: what one process can allocate.
#
# Sources of ``torch_total_bytes`` (the OOM message prints GiB to 2 decimals, so those
# are ± 0.005 GiB): T4 14.56 GiB, AlphaGPU/leetgpu-challenges#52 and
# Zheng-Chong/CatVTON#133 (2025; a 2024 Colab driver printed 14.75 GiB,
# hpcaitech/Open-Sora#697); RTX 4090 23.64 GiB, ali-vilab/VGen#104 and
# 3DTopia/Phidias-Diffusion#8; A100 40GB 39.50 GiB, TianheWu/CoSeR#10; A100 80GB
# 79.15 GiB, Lightning-AI/litgpt tutorials/oom.md; H100 80GB 79.11 GiB,
# vllm-project/vllm#27508; H200 measured on
# the course's run of 2026-12-04 (torch 2.11 / CUDA 13: mem_get_info total
# 150,109,880,320 B, nvidia-smi memory.total 143,771 MiB, a process's context 618
# MiB; the run's record is coursekit/data/gpu_runs/h200-2026-12-04.json and
# tests/test_consistency.py checks the two agree). The context of the other cards is
# the estimator's (:func:`trainmem.gpus.context_bytes`, a published lazy-loading
# measurement); the H200 run shows a newer torch/CUDA takes more.
H200_SMI_MIB = 143_771
H200_TORCH_TOTAL = 150_109_880_320
H200_CONTEXT_MIB = 618


@dataclass(frozen=True)
class Capacity:
    """The three capacities of one card (see the comment above)."""

    gpu: str
    marketing_gb: int
    smi_bytes: int
    torch_total_bytes: int
    context_bytes: int
    source: str

    @property
    def allocatable_bytes(self) -> int:
        return self.torch_total_bytes - self.context_bytes


def _preset(name: str, marketing_gb: int, torch_gib: float, source: str) -> Capacity:
    from .gpus import context_bytes, get_gpu

    g = get_gpu(name)
    return Capacity(
        name,
        marketing_gb,
        g.capacity_bytes,
        round(torch_gib * GiB),
        context_bytes(g, (2, 4)),
        source,
    )


CAPACITIES = {
    c.gpu: c
    for c in (
        _preset(
            "T4", 16, 14.56, "AlphaGPU/leetgpu-challenges#52, Zheng-Chong/CatVTON#133"
        ),
        _preset(
            "RTX4090", 24, 23.64, "ali-vilab/VGen#104, 3DTopia/Phidias-Diffusion#8"
        ),
        _preset("A100-40GB", 40, 39.50, "TianheWu/CoSeR#10"),
        _preset("A100-80GB", 80, 79.15, "Lightning-AI/litgpt tutorials/oom.md"),
        _preset("H100-80GB", 80, 79.11, "vllm-project/vllm#27508"),
        Capacity(
            "H200",
            141,
            H200_SMI_MIB * 2**20,
            H200_TORCH_TOTAL,
            H200_CONTEXT_MIB * 2**20,
            "this course's H200 run, 2026-12-04",
        ),
    )
}


def capacity(gpu: str) -> Capacity:
    """The :class:`Capacity` of ``gpu`` (a key of :data:`CAPACITIES`)."""
    if gpu not in CAPACITIES:
        raise ValueError(f"gpu must be one of {sorted(CAPACITIES)}, got {gpu!r}")
    return CAPACITIES[gpu]
