"""Quantisation in a few lines of torch: blockwise 8-bit Adam states, INT8/NF4 weights,
and the bytes per parameter each really costs (quantisation constants included).

Conventions
-----------
* A *code* is a sorted 1-D float32 tensor of representable values in [-1, 1] (256
  entries for 8 bits, 16 for 4 bits). Quantising ``x`` means: split into blocks, divide
  each block by its absolute maximum (``absmax``, one float32 per block), store the
  index of the nearest code value.
* Byte counts are bytes (``float``, because constants are fractions of a byte per
  parameter).
* Shapes: ``quantize_blockwise`` flattens its input; ``dequantize_blockwise`` restores
  the shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..dtypes import adam_state_bytes_per_param as adam_state_bytes_per_param
from ..dtypes import nf4_bytes_per_weight

__all__ = [
    "linear_code",
    "dynamic_code",
    "nf4_code",
    "Quantized",
    "quantize_blockwise",
    "dequantize_blockwise",
    "double_quantize_absmax",
    "AdamW8bit",
    "optimizer_state_bytes",
    "adam_state_bytes_per_param",
    "quantize_int8_absmax",
    "dequantize_int8",
    "int8_bytes_per_param",
    "nf4_bytes_per_param",
    "quantize_nf4",
    "dequantize_nf4",
]


# ----------------------------------------------------------------------------------
# codes
def linear_code(bits: int = 8, signed: bool = True) -> torch.Tensor:
    """Evenly spaced code: signed → 2^bits − 1 values in [-1, 1] (symmetric, 0
    included); unsigned → 2^bits in [0, 1]."""
    if bits < 2 or bits > 8:
        raise ValueError(f"bits must be in 2..8, got {bits}")
    n = 2**bits
    if signed:  # 2^bits - 1 values k/(2^(bits-1)-1): exactly symmetric INT absmax
        return torch.linspace(-1.0, 1.0, n - 1, dtype=torch.float32)
    return torch.linspace(0.0, 1.0, n, dtype=torch.float32)


def dynamic_code(signed: bool = True) -> torch.Tensor:
    """The 8-bit *dynamic* code of 8-bit optimizers (Dettmers et al. 2022, "dynamic
    tree").

    Values are ``10^-e · fraction``: exponent ``e`` spans 7 decades, the fraction gets
    more bits for larger values. Small magnitudes (typical of Adam's second moment) keep
    relative precision, which a linear code would flush to zero. 256 sorted values in
    [-1, 1] (signed) or [0, 1].
    """
    values = [0.0, 1.0]
    for i in range(7):  # decade 10^(i-6)
        n = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, n + 1)
        mids = ((edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)).tolist()
        values += mids
        if signed:
            values += [-x for x in mids]
    values += [0.0] * (256 - len(values))  # signed code has one spare slot
    return torch.tensor(sorted(values), dtype=torch.float32)


def nf4_code() -> torch.Tensor:
    """The 16 NormalFloat-4 values (Dettmers et al. 2023, QLoRA): quantiles of N(0, 1),
    scaled to [-1, 1].

    Eight positive and seven negative quantiles plus an exact zero (asymmetric so that 0
    is representable). Matches the table in bitsandbytes to ~1e-7.
    """
    normal = torch.distributions.Normal(0.0, 1.0)
    offset = 0.9677083
    pos = normal.icdf(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -normal.icdf(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return (v / v.abs().max()).to(torch.float32)


# ---------------------------------------------------------------------- blockwise
# quantiser
@dataclass
class Quantized:
    """``codes`` (uint8 indices into ``code``), ``absmax`` (float32, one per block),
    original shape."""

    codes: torch.Tensor
    absmax: torch.Tensor
    code: torch.Tensor
    shape: torch.Size
    block_size: int

    def nbytes(self, index_bits: int = 8) -> float:
        """Storage in bytes: indices at ``index_bits`` each + 4 bytes per absmax (code
        table not counted)."""
        return self.codes.numel() * index_bits / 8 + self.absmax.numel() * 4


def _nearest(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    mids = (code[1:] + code[:-1]) / 2
    return torch.bucketize(x, mids).to(torch.uint8)


def quantize_blockwise(
    x: torch.Tensor, code: torch.Tensor, block_size: int = 256
) -> Quantized:
    """Blockwise absmax quantisation of ``x`` (any shape) onto ``code``; last block may
    be short."""
    if block_size < 1:
        raise ValueError(f"block_size must be ≥ 1, got {block_size}")
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    pad = (-n) % block_size
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, block_size)
    absmax = blocks.abs().amax(dim=1)
    scaled = blocks / absmax.clamp_min(1e-30).unsqueeze(1)
    codes = _nearest(scaled, code.to(flat.device)).reshape(-1)[:n]
    return Quantized(codes, absmax, code, x.shape, block_size)


def dequantize_blockwise(
    qx: Quantized, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise` (up to rounding): ``code[codes] *
    absmax``."""
    n = qx.codes.numel()
    vals = qx.code.to(qx.codes.device)[qx.codes.long()]
    pad = (-n) % qx.block_size
    vals = torch.nn.functional.pad(vals, (0, pad)).view(
        -1, qx.block_size
    ) * qx.absmax.unsqueeze(1)
    return vals.reshape(-1)[:n].reshape(qx.shape).to(dtype)


def double_quantize_absmax(
    absmax: torch.Tensor, block_size: int = 256
) -> tuple[torch.Tensor, float]:
    """QLoRA's double quantisation: the float32 absmax constants themselves → 8 bits.

    Subtract their mean (they are all positive), quantise blockwise with the signed
    dynamic code, one float32 constant per ``block_size`` constants. Returns
    (dequantised absmax, bytes per original constant), the latter being ``1 + 4 /
    block_size``.
    """
    mean = absmax.mean()
    q = quantize_blockwise(absmax - mean, dynamic_code(signed=True), block_size)
    return dequantize_blockwise(q) + mean, 1 + 4 / block_size


# --------------------------------------------------------------------------- 8-bit
# AdamW
class AdamW8bit(torch.optim.Optimizer):
    """AdamW whose two moment tensors are stored blockwise-quantised to 8 bits.

    Each step: dequantise m and v (float32), do the ordinary AdamW update, quantise them
    back. ``m`` uses the signed dynamic code, ``v`` (never negative) the unsigned one;
    each block of ``block_size`` values carries one float32 absmax (256 as in
    bitsandbytes since 0.44; the 8-bit optimizers paper used 2048). Tensors with fewer
    than ``min_8bit_size`` elements keep float32 states (as bitsandbytes does, default
    4096). ``code="linear"`` uses evenly spaced codes instead — a deliberately bad
    choice the book uses to show why the dynamic code exists (small ``v`` entries round
    to zero → huge steps).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        block_size: int = 256,
        min_8bit_size: int = 4096,
        code: str = "dynamic",
    ):
        if lr <= 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if code not in ("dynamic", "linear"):
            raise ValueError(f"code must be 'dynamic' or 'linear', got {code!r}")
        super().__init__(
            params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        )
        self.block_size, self.min_8bit_size = block_size, min_8bit_size
        if code == "dynamic":
            self._codes = (dynamic_code(signed=True), dynamic_code(signed=False))
        else:
            self._codes = (linear_code(8, signed=True), linear_code(8, signed=False))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                quant = p.numel() >= self.min_8bit_size
                if not st:
                    st["step"] = 0
                    z = torch.zeros_like(p, dtype=torch.float32)
                    st["m"] = (
                        quantize_blockwise(z, self._codes[0], self.block_size)
                        if quant
                        else z
                    )
                    st["v"] = (
                        quantize_blockwise(z, self._codes[1], self.block_size)
                        if quant
                        else z.clone()
                    )
                st["step"] += 1
                m = dequantize_blockwise(st["m"]) if quant else st["m"]
                v = dequantize_blockwise(st["v"]) if quant else st["v"]
                g = p.grad.float()
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                t = st["step"]
                denom = (v / (1 - b2**t)).sqrt_().add_(group["eps"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.addcdiv_(
                    (m / (1 - b1**t)).to(p.dtype), denom.to(p.dtype), value=-group["lr"]
                )
                if quant:
                    st["m"] = quantize_blockwise(m, self._codes[0], self.block_size)
                    st["v"] = quantize_blockwise(v, self._codes[1], self.block_size)
        return loss


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> float:
    """Bytes held by an optimizer's state: tensors at their size, :class:`Quantized` via
    ``nbytes``."""
    total = 0.0
    for st in opt.state.values():
        for val in st.values():
            if isinstance(val, Quantized):
                total += val.nbytes()
            elif isinstance(val, torch.Tensor):
                total += val.numel() * val.element_size()
    return total


# -------------------------------------------------------------------- weight
# quantisation
GRANULARITIES = ("tensor", "channel", "group")


def quantize_int8_absmax(
    w: torch.Tensor, granularity: str = "channel", group_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric absmax INT8 quantisation of a 2-D weight ``(out, in)``; returns (int8
    q, scale).

    ``granularity``: ``"tensor"`` (one scale), ``"channel"`` (one per output row),
    ``"group"`` (one per ``group_size`` consecutive inputs of a row). ``w ≈ q * scale``
    with ``scale`` broadcastable after reshaping to ``(out, in // group_size,
    group_size)`` for groups. Use :func:`dequantize_int8`.
    """
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D (out, in), got shape {tuple(w.shape)}")
    if granularity not in GRANULARITIES:
        raise ValueError(
            f"granularity must be one of {GRANULARITIES}, got {granularity!r}"
        )
    w = w.detach().float()
    if granularity == "tensor":
        x, absmax = w, w.abs().amax()
    elif granularity == "channel":
        x, absmax = w, w.abs().amax(dim=1, keepdim=True)
    else:
        if w.shape[1] % group_size:
            raise ValueError(
                f"group_size must divide in_features={w.shape[1]}, got {group_size}"
            )
        x = w.view(w.shape[0], -1, group_size)
        absmax = x.abs().amax(dim=2, keepdim=True)
    scale = absmax.clamp_min(1e-30) / 127
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(
    q: torch.Tensor, scale: torch.Tensor, shape: torch.Size
) -> torch.Tensor:
    """``q * scale`` reshaped to the original ``shape`` (float32)."""
    return (q.float() * scale).reshape(shape)


def int8_bytes_per_param(
    granularity: str,
    shape: tuple[int, int],
    group_size: int = 128,
    scale_bytes: int = 4,
) -> float:
    """INT8 storage per parameter of a ``(out, in)`` weight: 1 byte + its share of the
    scales."""
    out_f, in_f = shape
    n = out_f * in_f
    scales = {"tensor": 1, "channel": out_f, "group": n // group_size}.get(granularity)
    if scales is None:
        raise ValueError(
            f"granularity must be one of {GRANULARITIES}, got {granularity!r}"
        )
    return 1 + scales * scale_bytes / n


def nf4_bytes_per_param(
    block_size: int = 64,
    double_quant: bool = True,
    dq_block_size: int = 256,
    scale_bytes: int = 4,
) -> float:
    """NF4 storage per parameter: 4 bits + absmax constants (QLoRA §2); the one
    formula is :func:`trainmem.dtypes.nf4_bytes_per_weight`.

    Without double quantisation: 0.5 + 4/64 = 0.5625 bytes (0.5 bit/param of constants;
    an fp16 scale instead, ``scale_bytes=2``: 0.5 + 2/64). With it: 0.5 + 1/64 +
    4/(64·256) ≈ 0.5159 bytes (≈0.127 bit/param of constants).
    """
    return nf4_bytes_per_weight(double_quant, block_size, dq_block_size, scale_bytes)


def quantize_nf4(w: torch.Tensor, block_size: int = 64) -> Quantized:
    """NF4 quantisation of ``w`` with one float32 absmax per ``block_size`` values (no
    packing)."""
    return quantize_blockwise(w, nf4_code(), block_size)


def dequantize_nf4(qw: Quantized, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Back to ``dtype`` — what a QLoRA layer does to each base weight at every forward
    *and* backward."""
    return dequantize_blockwise(qw, dtype)


@dataclass(frozen=True)
class QLoRAPlan:
    """Chapter 7's QLoRA cell: the BitsAndBytesConfig arguments and the optimizer to
    use."""

    quant_kwargs: dict  # for transformers.BitsAndBytesConfig
    compute_dtype: object
    optimizer: str  # bitsandbytes optimizer class name (paged 8-bit AdamW)
    lora_baseline_dtype: object  # dtype of the plain-LoRA comparison run


def qlora_plan(compute_dtype) -> QLoRAPlan:
    """NF4 + double quantization computing in ``compute_dtype`` (the device decides
    it: :func:`coursekit.gpu.qlora_plan`); paged 8-bit AdamW."""
    kwargs = {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True,
        "bnb_4bit_compute_dtype": compute_dtype,
    }
    return QLoRAPlan(kwargs, compute_dtype, "PagedAdamW8bit", compute_dtype)
