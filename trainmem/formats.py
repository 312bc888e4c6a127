"""Floating-point number formats, by bit manipulation: FP32, TF32, FP16, BF16, FP8 E4M3
/ E5M2.

A binary floating-point format is three fields — sign (1 bit), exponent (``e`` bits,
stored with a bias ``2**(e-1) - 1``) and mantissa (``m`` bits, the fraction after an
implicit leading 1):

* normal    (exponent field ``E`` not 0):  ``(-1)**s * 2**(E - bias) * (1 + M / 2**m)``
* subnormal (exponent field 0):            ``(-1)**s * 2**(1 - bias) * (M / 2**m)``

Everything here is derived from ``(e, m)`` and the way the all-ones exponent is used
(IEEE-style ``inf``/``NaN``, or the FP8 "fn" = finite-only convention of E4M3, whose
only NaN is ``S.1111.111``). Scalars are encoded exactly from Python floats (float64)
with integer arithmetic on the float64 bit pattern (``struct``), rounding to nearest,
ties to even — the rounding torch and the hardware use when casting. :func:`round_array`
does the same for numpy arrays / torch tensors.

Values are plain numbers (no unit); memory helpers at the end return **bytes**.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

if (
    TYPE_CHECKING
):  # numpy is imported where arrays are used: the scalar functions need only the
    # standard library (they also run in the book's page, under Pyodide)
    import numpy as np

__all__ = [
    "FloatFormat",
    "Encoded",
    "FORMATS",
    "get_format",
    "format_names",
    "encode",
    "decode",
    "decompose",
    "round_to",
    "round_array",
    "round_tensor",
    "next_up",
    "next_down",
    "neighbours",
    "ulp",
    "ulp_array",
    "BYTES_PER_ELEMENT",
    "bytes_per_element",
    "weight_bytes",
    "GB",
    "GiB",
    "describe_value",
]

# the byte units and sizes (one definition each, in trainmem.dtypes)
from .dtypes import DTYPES  # noqa: E402
from .dtypes import GB as GB  # noqa: E402
from .dtypes import GiB as GiB  # noqa: E402


@dataclass(frozen=True)
class FloatFormat:
    """One binary floating-point format.

    ``storage_bits`` is what one element occupies in memory (TF32 has 19 meaningful bits
    but lives in a 32-bit register). ``ieee_specials``: True when the all-ones exponent
    encodes inf/NaN (FP32, FP16, BF16, TF32, E5M2); False for E4M3 "fn" (finite only: no
    inf, one NaN pattern).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    storage_bits: int
    ieee_specials: bool = True
    torch_dtype: str | None = (
        None  # attribute of ``torch`` (None: no storage dtype, e.g. tf32)
    )

    @property
    def bits(self) -> int:
        """Meaningful bits: 1 + exponent_bits + mantissa_bits."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number (1 - bias)."""
        return 1 - self.bias

    @property
    def max_normal(self) -> float:
        """Largest finite value (65504 for fp16, 448 for E4M3, 57344 for E5M2)."""
        return decode(self.max_bits, self)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, ``2**emin`` (``torch.finfo(dtype).tiny``)."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value, ``2**(emin - mantissa_bits)``."""
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next value,
        ``2**-mantissa_bits``."""
        return math.ldexp(1.0, -self.mantissa_bits)

    # --- bit patterns (magnitude part; OR the sign bit in) ----------------------------
    @property
    def sign_bit(self) -> int:
        return 1 << (self.exponent_bits + self.mantissa_bits)

    @property
    def max_bits(self) -> int:
        """Bit pattern of the largest finite magnitude."""
        if self.ieee_specials:
            return ((2**self.exponent_bits - 1) << self.mantissa_bits) - 1
        return (
            1 << (self.exponent_bits + self.mantissa_bits)
        ) - 2  # S.1111.110 for E4M3

    @property
    def inf_bits(self) -> int | None:
        return (
            (2**self.exponent_bits - 1) << self.mantissa_bits
            if self.ieee_specials
            else None
        )

    @property
    def nan_bits(self) -> int:
        if self.ieee_specials:
            return self.inf_bits | (1 << (self.mantissa_bits - 1))  # quiet NaN
        return (1 << (self.exponent_bits + self.mantissa_bits)) - 1

    def torch(self):
        """The torch dtype of this format (raises ValueError for tf32, which has
        none)."""
        import torch

        if self.torch_dtype is None:
            raise ValueError(
                f"format {self.name!r} has no torch storage dtype (it is a compute "
                f"mode)"
            )
        return getattr(torch, self.torch_dtype)


FORMATS: dict[str, FloatFormat] = {
    "fp32": FloatFormat("fp32", 8, 23, 32, True, "float32"),
    "tf32": FloatFormat("tf32", 8, 10, 32, True, None),
    "fp16": FloatFormat("fp16", 5, 10, 16, True, "float16"),
    "bf16": FloatFormat("bf16", 8, 7, 16, True, "bfloat16"),
    "fp8_e4m3": FloatFormat("fp8_e4m3", 4, 3, 8, False, "float8_e4m3fn"),
    "fp8_e5m2": FloatFormat("fp8_e5m2", 5, 2, 8, True, "float8_e5m2"),
}

_ALIASES = {
    "float32": "fp32",
    "float": "fp32",
    "single": "fp32",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8e4m3": "fp8_e4m3",
    "e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
    "fp8e5m2": "fp8_e5m2",
}


def format_names() -> list[str]:
    return list(FORMATS)


def get_format(fmt: str | FloatFormat | Any) -> FloatFormat:
    """A :class:`FloatFormat` from its name (``"fp16"``, ``"bfloat16"``, ``"e4m3"`` …)
    or a torch dtype."""
    if isinstance(fmt, FloatFormat):
        return fmt
    key = str(fmt).lower().replace("torch.", "")
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise ValueError(
            f"fmt must be one of {', '.join(FORMATS)} (or a torch float dtype), got "
            f"{fmt!r}"
        )
    return FORMATS[key]


# --------------------------------------------------------------------------------------
# Scalars: encode / decode with integer arithmetic on the bit patterns
# --------------------------------------------------------------------------------------
def encode(x: float, fmt: str | FloatFormat, saturate: bool = False) -> int:
    """Bit pattern (an unsigned int of ``fmt.bits`` bits) of ``x`` rounded to ``fmt``.

    Round to nearest, ties to even, directly from the float64 value (one rounding). A
    magnitude above the largest finite value becomes inf (IEEE formats) or NaN (E4M3,
    which has no inf) — or the largest finite value when ``saturate=True`` (what FP8
    training recipes do on purpose).
    """
    f = get_format(fmt)
    m = f.mantissa_bits
    (b64,) = struct.unpack("<Q", struct.pack("<d", float(x)))
    sign = f.sign_bit if b64 >> 63 else 0
    e64 = (b64 >> 52) & 0x7FF
    m64 = b64 & ((1 << 52) - 1)
    if e64 == 0x7FF:  # inf or NaN
        if m64:
            return sign | f.nan_bits
        if saturate:
            return sign | f.max_bits
        return sign | (f.inf_bits if f.ieee_specials else f.nan_bits)
    if (
        e64 == 0
    ):  # zero, or a float64 subnormal (< 2.2e-308): far below every format here
        return sign
    e = e64 - 1023  # x = sig * 2**(e - 52), sig has 53 bits
    sig = (1 << 52) | m64
    q = max(e, f.emin) - m  # exponent of the grid spacing (ulp) at x in fmt
    shift = q - (e - 52)  # how many low bits of sig fall below the grid
    n, rem = sig >> shift, sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rem > half or (rem == half and n & 1):
        n += 1  # round to nearest, ties to even
    # n counts grid steps of 2**q and includes the implicit 1, so adding it to the
    # exponent field's base carries naturally: subnormal → min normal, 1.11..1 → next
    # binade.
    mag = ((max(e, f.emin) - f.emin) << m) + n
    if mag > f.max_bits:
        if saturate:
            mag = f.max_bits
        elif f.ieee_specials:
            mag = f.inf_bits
        else:
            return sign | f.nan_bits
    return sign | mag


def decode(bits: int, fmt: str | FloatFormat) -> float:
    """The value (a Python float) of bit pattern ``bits`` in ``fmt``."""
    f = get_format(fmt)
    if not 0 <= int(bits) < (1 << f.bits):
        raise ValueError(f"bits must be in [0, 2**{f.bits}) for {f.name}, got {bits!r}")
    m = f.mantissa_bits
    s = -1.0 if bits & f.sign_bit else 1.0
    ef = (bits >> m) & (2**f.exponent_bits - 1)
    mf = bits & ((1 << m) - 1)
    if f.ieee_specials and ef == 2**f.exponent_bits - 1:
        return s * math.inf if mf == 0 else math.nan
    if not f.ieee_specials and (bits & ~f.sign_bit) == f.nan_bits:
        return math.nan
    if ef == 0:
        return s * math.ldexp(mf, f.emin - m)
    return s * math.ldexp((1 << m) + mf, ef - f.bias - m)


@dataclass(frozen=True)
class Encoded:
    """A value stored in one format, split into its fields."""

    format: str
    bits: int  # the whole pattern, unsigned
    sign: int  # 0 or 1
    exponent: int  # raw (biased) exponent field
    mantissa: int  # raw mantissa field
    value: float  # what the bits mean
    kind: str  # "zero" | "subnormal" | "normal" | "inf" | "nan"

    def bit_string(self, sep: str = " ") -> str:
        """``"0 01110 0000000000"``: sign, exponent and mantissa fields in binary."""
        f = get_format(self.format)
        return sep.join(
            [
                str(self.sign),
                format(self.exponent, f"0{f.exponent_bits}b"),
                format(self.mantissa, f"0{f.mantissa_bits}b"),
            ]
        )

    @property
    def unbiased_exponent(self) -> int:
        f = get_format(self.format)
        return f.emin if self.exponent == 0 else self.exponent - f.bias


def decompose(x: float, fmt: str | FloatFormat, saturate: bool = False) -> Encoded:
    """Round ``x`` to ``fmt`` and split the result into sign / exponent / mantissa
    fields."""
    f = get_format(fmt)
    bits = encode(x, f, saturate)
    m = f.mantissa_bits
    ef = (bits >> m) & (2**f.exponent_bits - 1)
    mf = bits & ((1 << m) - 1)
    v = decode(bits, f)
    if math.isnan(v):
        kind = "nan"
    elif math.isinf(v):
        kind = "inf"
    elif v == 0:
        kind = "zero"
    else:
        kind = "subnormal" if ef == 0 else "normal"
    return Encoded(f.name, bits, int(bits & f.sign_bit != 0), ef, mf, v, kind)


def round_to(x: float, fmt: str | FloatFormat, saturate: bool = False) -> float:
    """``x`` rounded to the nearest value of ``fmt`` (ties to even), as a Python
    float."""
    return decode(encode(x, fmt, saturate), fmt)


def _step(v: float, f: FloatFormat, up: bool) -> float:
    """The representable neighbour of a representable ``v`` in direction ``up``."""
    if math.isnan(v):
        return math.nan
    if math.isinf(v):
        if (v > 0) == up:
            return v
        return math.copysign(f.max_normal, v)
    if v == 0:
        return f.min_subnormal if up else -f.min_subnormal
    bits = encode(v, f)
    mag = bits & ~f.sign_bit
    away = (v > 0) == up  # moving away from zero means a larger magnitude
    mag = mag + 1 if away else mag - 1
    if mag > f.max_bits:
        return math.copysign(math.inf, v)
    return math.copysign(decode(mag, f), v) if mag else (0.0 if v > 0 else -0.0)


def next_up(x: float, fmt: str | FloatFormat) -> float:
    """Smallest value of ``fmt`` strictly greater than ``x`` (inf at or above the
    largest finite)."""
    f = get_format(fmt)
    x = float(x)
    if math.isnan(x):
        return math.nan
    if x >= f.max_normal:
        return math.inf
    if x < -f.max_normal:
        return -f.max_normal
    r = round_to(x, f)  # finite: |x| <= max_normal here
    return r if r > x else _step(r, f, up=True)


def next_down(x: float, fmt: str | FloatFormat) -> float:
    """Largest value of ``fmt`` strictly less than ``x`` (-inf below the most negative
    finite)."""
    return -next_up(-float(x), fmt)


def neighbours(x: float, fmt: str | FloatFormat) -> tuple[float, float]:
    """``(below, above)``: the representable values of ``fmt`` around ``x``.

    ``below <= x <= above``; both equal ``x`` when ``x`` is representable. Outside the
    finite range the missing side is ``±inf``.
    """
    f = get_format(fmt)
    x = float(x)
    if math.isnan(x):
        return (math.nan, math.nan)
    if math.isinf(x):
        return (x, x)
    r = round_to(x, f) if abs(x) <= f.max_normal else math.nan
    if r == x:
        return (x, x)
    return (next_down(x, f), next_up(x, f))


def ulp(x: float, fmt: str | FloatFormat) -> float:
    """Spacing of ``fmt``'s grid at ``x``: the gap from ``|x|``'s binade start to the
    next value.

    ``2**(max(floor(log2|x|), emin) - mantissa_bits)``; at an exact power of two this is
    the gap *above* it (the gap below is half as large). ``ulp(0)`` is the smallest
    subnormal.
    """
    f = get_format(fmt)
    x = abs(float(x))
    if math.isnan(x) or math.isinf(x):
        return math.nan
    e = math.frexp(x)[1] - 1 if x else f.emin
    return math.ldexp(1.0, max(e, f.emin) - f.mantissa_bits)


def ulp_array(x: Any, fmt: str | FloatFormat) -> np.ndarray:
    """Vectorised :func:`ulp` over a numpy array (float64 result, same shape)."""
    import numpy as np

    f = get_format(fmt)
    a = np.abs(np.asarray(x, dtype=np.float64))
    e = np.frexp(a)[1].astype(np.int64) - 1
    e = np.where(a == 0, f.emin, e)
    return np.ldexp(1.0, np.maximum(e, f.emin) - f.mantissa_bits)


# --------------------------------------------------------------------------------------
# Arrays and tensors
# --------------------------------------------------------------------------------------
def round_array(x: Any, fmt: str | FloatFormat, saturate: bool = False) -> np.ndarray:
    """Round every element of ``x`` to ``fmt`` (ties to even); float64 array of the same
    shape.

    Exact: the value is scaled by a power of two so the grid becomes the integers,
    rounded with ``np.rint`` (ties to even), and scaled back — power-of-two scaling
    loses nothing in float64. Overflow follows :func:`encode` (inf, NaN for E4M3, or
    ±max with ``saturate``).
    """
    import numpy as np

    f = get_format(fmt)
    a = np.asarray(x, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.frexp(a)[1].astype(np.int64) - 1
        q = np.maximum(e, f.emin) - f.mantissa_bits
        r = np.ldexp(np.rint(np.ldexp(a, -q)), q)
        big = np.abs(r) > f.max_normal
        if saturate:
            over = np.copysign(f.max_normal, a)
        elif f.ieee_specials:
            over = np.copysign(np.inf, a)
        else:
            over = np.full_like(a, np.nan)
        r = np.where(big, over, r)
        r = np.where(np.isnan(a), np.nan, r)
    return r


def round_tensor(t, fmt: str | FloatFormat, saturate: bool = False):
    """:func:`round_array` for a torch tensor; returns a tensor of ``t``'s dtype and
    device.

    Used to emulate TF32 on a CPU: ``round_tensor(A, "tf32") @ round_tensor(B, "tf32")``
    is what a TF32 matmul computes, up to accumulation order.
    """
    import torch

    r = round_array(t.detach().to("cpu", torch.float64).numpy(), fmt, saturate)
    return torch.from_numpy(r).to(device=t.device, dtype=t.dtype)


# --------------------------------------------------------------------------------------
# Memory: bytes per element (the number the chapter multiplies by a parameter count)
# --------------------------------------------------------------------------------------
BYTES_PER_ELEMENT: dict[str, float] = {
    name: DTYPES[name].bytes
    for name in (
        "fp32",
        "tf32",
        "fp16",
        "bf16",
        "fp8",
        "fp8_e4m3",
        "fp8_e5m2",
        "int8",
        "int4",
    )
}  # from the one table, trainmem.dtypes.DTYPES


def bytes_per_element(dtype: str) -> float:
    """Bytes one element of ``dtype`` occupies (int4: 0.5, two values packed per
    byte)."""
    key = _ALIASES.get(str(dtype).lower().replace("torch.", ""), str(dtype).lower())
    if key not in BYTES_PER_ELEMENT:
        raise ValueError(
            f"dtype must be one of {', '.join(BYTES_PER_ELEMENT)}, got {dtype!r}"
        )
    return BYTES_PER_ELEMENT[key]


def weight_bytes(n_params: int, dtype: str) -> float:
    """Bytes to store ``n_params`` weights in ``dtype`` (no quantization scales, no
    padding)."""
    if n_params < 0:
        raise ValueError(f"n_params must be >= 0, got {n_params}")
    return n_params * bytes_per_element(dtype)


# --------------------------------------------------------------------------------------
# A text report: what the widget and the book print for one value
# --------------------------------------------------------------------------------------
def _g(v: float) -> str:
    return f"{v:.10g}"


def describe_rows(
    x: float,
    formats: Iterable[str] = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"),
) -> list[dict[str, str]]:
    """How ``x`` is stored in each format, one dict of display strings per format.

    Keys: ``format``, ``bits`` (sign exponent mantissa of the stored, rounded value),
    ``stored``, ``next below`` / ``next above`` (nearest representable values strictly
    below and above ``x``), ``ulp`` (the spacing at ``x``) and ``rel.err`` (relative
    rounding error).
    """
    x = float(x)
    rows = []
    for name in formats:
        f = get_format(name)
        d = decompose(x, f)
        lo, hi = next_down(x, f), next_up(x, f)
        if math.isfinite(d.value) and x != 0:
            err = f"{abs(d.value - x) / abs(x):.2e}"
        else:
            err = "0" if d.value == x else "-"
        rows.append(
            {
                "format": f.name,
                "bits": d.bit_string(),
                "stored": _g(d.value),
                "next below": _g(lo),
                "next above": _g(hi),
                "ulp": _g(ulp(x, f)),
                "rel.err": err,
            }
        )
    return rows


def describe_value(
    x: float,
    formats: Iterable[str] = ("fp32", "tf32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2"),
) -> str:
    """A table: how ``x`` is stored in each format (plain text; :func:`describe_rows` as
    dicts).

    Columns: the bit fields of the stored (rounded) value, the stored value, the nearest
    representable values strictly below and above ``x``, the spacing (ulp) at ``x`` and
    the relative rounding error.
    """
    x = float(x)
    rows = [
        (
            "format",
            "sign exponent mantissa",
            "stored",
            "next below",
            "next above",
            "ulp",
            "rel.err",
        )
    ]
    rows += [tuple(r.values()) for r in describe_rows(x, formats)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return f"x = {x!r}\n" + "\n".join(lines)


#: the largest finite fp16 value, 65504 (the loss-scaling limit)
FP16_MAX = get_format("fp16").max_normal
