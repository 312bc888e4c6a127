"""Bytes of every storage format the course counts, and the byte units: the one table.

* :data:`DTYPES` — name → :class:`Dtype` (bytes per element, the ``torch`` attribute,
  the safetensors tag). The estimator, the replay, the adapter-file demo, the number
  formats chapter and the torch code
  (:func:`trainmem.measuring.training_setup.torch_dtype`) all read it.
* :func:`nf4_bytes_per_weight` — bitsandbytes' NF4 (QLoRA's 4-bit format) with and
  without double quantisation of its absmax constants.
* :data:`GiB`, :data:`GB`, :data:`MiB` — the byte units.

Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import lookup

#: bytes in a gibibyte — what ``nvidia-smi`` / ``torch.cuda`` counts (often written
#: "GB")
GiB = 2**30
#: bytes in a (decimal, SI) gigabyte — what disk and model cards mean by "GB"
GB = 10**9
MiB = 2**20


@dataclass(frozen=True)
class Dtype:
    """One storage format: ``bytes`` per element (int4: 0.5, two values per byte),
    the ``torch`` attribute of its dtype (``None``: no torch storage dtype) and the
    safetensors header tag (``None``: not one the course writes)."""

    name: str
    bytes: float
    torch: str | None = None
    safetensors: str | None = None


DTYPES: dict[str, Dtype] = {
    d.name: d
    for d in (
        Dtype("fp32", 4, "float32", "F32"),
        Dtype("tf32", 4),  # 19 meaningful bits in a 32-bit register
        Dtype("fp16", 2, "float16", "F16"),
        Dtype("bf16", 2, "bfloat16", "BF16"),
        Dtype("fp8", 1),
        Dtype("fp8_e4m3", 1, "float8_e4m3fn"),
        Dtype("fp8_e5m2", 1, "float8_e5m2"),
        Dtype("int8", 1, "int8", "I8"),
        Dtype("u8", 1, "uint8", "U8"),  # bitsandbytes' 8-bit optimizer states
        Dtype("int4", 0.5),
        Dtype("i64", 8, "int64", "I64"),  # token ids
    )
}
#: the floating-point dtypes a parameter, a LoRA adapter or an autocast region may have
FLOAT_DTYPES = ("fp32", "bf16", "fp16")


def dtype(name: str, option: str = "dtype") -> Dtype:
    """The :class:`Dtype` called ``name``; unknown names raise
    :class:`~trainmem.errors.OptionError` for ``option``."""
    return lookup(DTYPES, option, name)


def itemsize(name: str) -> int:
    """Bytes per element of a whole-byte dtype (``"fp32"`` → 4)."""
    size = dtype(name).bytes
    if size != int(size):
        raise ValueError(f"{name} packs {size} bytes per element: not a whole byte")
    return int(size)


# --------------------------------------------------------------------------------------
# quantised formats
# --------------------------------------------------------------------------------------
NF4_BLOCK = 64  # weights per absmax constant (bitsandbytes' blocksize for 4-bit)
NF4_DQ_BLOCK = 256  # absmax constants per fp32 constant under double quantisation


def nf4_state_tables(double_quant: bool = True) -> tuple[int, ...]:
    """The bytes of the tensors bitsandbytes keeps beside each 4-bit weight's absmax
    constants (its ``QuantState``; bitsandbytes 0.50.2 ``functional.py``): the NF4
    code table (``get_4bit_type``: 16 fp32, a new tensor per weight) and, under double
    quantisation, the fp32 ``offset`` (``_absmax.mean()``) and the 8-bit dynamic map
    of the nested state (``quantize_blockwise``: ``code.to(A.device, copy=True)``,
    256 fp32 copied per weight)."""
    return (16 * 4,) + ((4, 256 * 4) if double_quant else ())


def nf4_bytes_per_weight(
    double_quant: bool = True,
    block_size: int = NF4_BLOCK,
    dq_block_size: int = NF4_DQ_BLOCK,
    scale_bytes: int = 4,
) -> float:
    """Bytes one NF4 weight occupies: 4 bits + its share of the absmax constants
    (QLoRA, Dettmers et al. 2023).

    Without double quantisation one absmax of ``scale_bytes`` (fp32: 4; an fp16 scale:
    2) per ``block_size`` weights: 0.5 + 4/64 = 0.5625. With it an 8-bit absmax per
    block plus one fp32 constant per ``dq_block_size`` blocks: 0.5 + 1/64 + 4/(64·256)
    ≈ 0.5159."""
    if block_size < 1 or dq_block_size < 1:
        raise ValueError(
            f"block_size and dq_block_size must be ≥ 1, got {block_size}, "
            f"{dq_block_size}"
        )
    if not double_quant:
        return 0.5 + scale_bytes / block_size
    return 0.5 + 1 / block_size + 4 / (block_size * dq_block_size)


BLOCKWISE8_BLOCK = 256  # values per fp32 absmax in bitsandbytes' 8-bit optimizer states


def blockwise8_bytes_per_value(block_size: int = BLOCKWISE8_BLOCK) -> float:
    """Bytes one value of a blockwise 8-bit state occupies: 1 + its share of one fp32
    absmax per ``block_size`` values (Dettmers et al. 2022; bitsandbytes: 256)."""
    if block_size < 1:
        raise ValueError(f"block_size must be ≥ 1, got {block_size}")
    return 1 + 4 / block_size


def adam_state_bytes_per_param(bits: int = 32, block_size: int = 256) -> float:
    """Adam(W) state bytes per parameter: two moments at ``bits`` + one float32 absmax
    per block each.

    ``bits=32`` → 8.0; ``bits=8`` with bitsandbytes' block of 256 (since 0.44) → 2 × (1
    + 4/256) = 2.03125; with the paper's 2048 → 2.00390625.
    """
    if bits not in (8, 16, 32):
        raise ValueError(f"bits must be 8, 16 or 32, got {bits}")
    if bits == 32 or bits == 16:
        return 2 * bits / 8
    return 2 * blockwise8_bytes_per_value(block_size)
