"""Hidden tests for lab01 (number formats by bit manipulation). Format: tests/grading/README.md.

References are computed here, in the grader's process, with numpy / torch casts (independent of the
student's kernel and of the lab's own code).
"""
from __future__ import annotations

import math
import struct

from coursekit.grading import Question

NOTEBOOK = "lab01_number_formats.ipynb"
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 180
PROBE_TIMEOUT = 10

SPECIAL16 = [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x7C01,
             0x0080, 0x007F, 0x7F7F, 0x7F80, 0xFF80, 0x7FC0, 0x3F80, 0x8001]


def same(a, b) -> bool:
    """Equal floats (NaN == NaN, signed zeros distinguished); False for non-numbers."""
    if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or isinstance(b, bool):
        return False
    a, b = float(a), float(b)
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)


def _fraction(inputs, want, got, show=lambda x: repr(x)):
    if not isinstance(got, list) or len(got) != len(want):
        return 0.0, f"expected a list of {len(want)} results, got {type(got).__name__}"
    bad = [i for i, (w, g) in enumerate(zip(want, got)) if not same(w, g)]
    if not bad:
        return 1.0, f"all {len(want)} cases correct"
    i = bad[0]
    return 1 - len(bad) / len(want), f"{len(bad)} of {len(want)} wrong; e.g. input {show(inputs[i])}: got {got[i]!r}, expected {want[i]!r}"


def ref_decode16(bits: list[int], dtype: str) -> list[float]:
    import numpy as np
    import torch

    a = np.array(bits, dtype=np.uint16)
    if dtype == "fp16":
        return a.view(np.float16).astype(np.float64).tolist()
    t = torch.from_numpy(a.astype(np.int32)).to(torch.int16).view(torch.bfloat16)
    return t.double().tolist()


def _bits16(rng):
    return SPECIAL16 + [rng.getrandbits(16) for _ in range(300)]


def check_decode_fp16(inputs, result):
    return _fraction(inputs, ref_decode16(inputs, "fp16"), result, lambda b: f"{b:#06x}")


def check_decode_bf16(inputs, result):
    return _fraction(inputs, ref_decode16(inputs, "bf16"), result, lambda b: f"{b:#06x}")


def _fp32_values(rng):
    pats = [rng.getrandbits(32) for _ in range(200)]
    pats += [(rng.getrandbits(16) << 16) | 0x8000 for _ in range(60)]          # ties
    pats += [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00008000, 0x80018000, 0x7F800000]
    vals = [struct.unpack("<f", struct.pack("<I", p))[0] for p in pats]
    return [v for v in vals if not math.isnan(v)] + [math.nan]


def check_fp32_to_bf16(inputs, result):
    import torch

    want = []
    for x in inputs:
        if math.isnan(x):
            want.append("nan")
        else:
            want.append(int(torch.tensor([x], dtype=torch.float32).to(torch.bfloat16).view(torch.int16)[0]) & 0xFFFF)
    if not isinstance(result, list) or len(result) != len(want):
        return 0.0, f"expected a list of {len(want)} ints"
    bad = []
    for i, (w, g) in enumerate(zip(want, result)):
        if not isinstance(g, int) or isinstance(g, bool):
            bad.append(i)
        elif w == "nan":
            if not ((g >> 7) & 0xFF == 0xFF and g & 0x7F and 0 <= g < 2**16):
                bad.append(i)
        elif g != w:
            bad.append(i)
    if not bad:
        return 1.0, f"all {len(want)} values correct (ties, overflow and NaN included)"
    i = bad[0]
    return 1 - len(bad) / len(want), (f"{len(bad)} of {len(want)} wrong; e.g. x={inputs[i]!r}: got {result[i]!r}, "
                                      f"expected {want[i] if want[i] == 'nan' else hex(want[i])}")


FMT = {"fp32": (8, 23), "fp16": (5, 10), "bf16": (8, 7)}


def ref_ulp(x: float, fmt: str) -> float:
    e, m = FMT[fmt]
    bias = 2 ** (e - 1) - 1
    if x == 0:
        return math.ldexp(1.0, 1 - bias - m)
    k = max(math.frexp(abs(x))[1] - 1, 1 - bias)
    return math.ldexp(1.0, k - m)


def _ulp_inputs(rng):
    out = []
    for _ in range(150):
        fmt = rng.choice(["fp32", "fp16", "bf16"])
        if fmt == "fp32":
            bits = rng.getrandbits(32)
            x = struct.unpack("<f", struct.pack("<I", bits))[0]
        else:
            x = ref_decode16([rng.getrandbits(16)], fmt)[0]
        if math.isfinite(x):
            out.append([x, fmt])
    return out + [[0.0, "fp16"], [65504.0, "fp16"], [-1.0, "bf16"], [6.103515625e-05, "fp16"]]


def check_ulp(inputs, result):
    return _fraction(inputs, [ref_ulp(x, f) for x, f in inputs], result)


QUESTIONS = [
    Question("decode_fp16", points=3, make_inputs=_bits16, check=check_decode_fp16,
             probe="RESULT = [float(decode_fp16(b)) for b in INPUTS]",
             description="decode_fp16：16 位模式 → 数值（正规/次正规/±0/inf/NaN）"),
    Question("decode_bf16", points=2, make_inputs=_bits16, check=check_decode_bf16,
             probe="RESULT = [float(decode_bf16(b)) for b in INPUTS]",
             description="decode_bf16：16 位模式 → 数值"),
    Question("fp32_to_bf16_bits", points=3, make_inputs=_fp32_values, check=check_fp32_to_bf16,
             probe="RESULT = [int(fp32_to_bf16_bits(x)) for x in INPUTS]",
             description="fp32_to_bf16_bits：就近舍入、平局取偶；溢出成 inf；NaN 保持 NaN"),
    Question("ulp", points=2, make_inputs=_ulp_inputs, check=check_ulp,
             probe="RESULT = [float(ulp(x, f)) for x, f in INPUTS]",
             description="ulp(x, fmt)：fp32/fp16/bf16 的最后一位单位"),
]
