"""Hidden tests for lab01 (number formats by bit manipulation). Format:
tests/grading/README.md.

Every question grades fixed quotas of case types (zero, subnormal, normal, inf, NaN,
ties …) with weights that put the special cases the lab teaches on a par with the
ordinary ones. References are computed here, in the grader's process, with numpy / torch
casts (independent of the student's kernel and of the lab's own code).
"""

from __future__ import annotations

import math
import struct

from coursekit.grading import CaseType, Question
from coursekit.grading.checks import hex16, same_float

NOTEBOOK = "lab01_number_formats.ipynb"
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 180
PROBE_TIMEOUT = 10

# (exponent bits, mantissa bits)
FMT = {
    "fp32": (8, 23),
    "fp16": (5, 10),
    "bf16": (8, 7),
}


def ref_decode16(bits: list[int], dtype: str) -> list[float]:
    import numpy as np
    import torch

    a = np.array(bits, dtype=np.uint16)
    if dtype == "fp16":
        return a.view(np.float16).astype(np.float64).tolist()
    t = torch.from_numpy(a.astype(np.int32)).to(torch.int16).view(torch.bfloat16)
    return t.double().tolist()


# ---------------------------------------------------------------- bit patterns by case
# type
def _pattern(rng, fmt: str, exponent: int, mantissa: int | None = None) -> int:
    e, m = FMT[fmt]
    if mantissa is None:
        mantissa = rng.getrandbits(m)
    return (rng.getrandbits(1) << (e + m)) | (exponent << m) | mantissa


def _zero(fmt):
    e, m = FMT[fmt]
    return lambda rng: [0, 1 << (e + m)]


def _subnormal(fmt, n=16):
    e, m = FMT[fmt]
    return lambda rng: (
        [1, (1 << m) - 1]
        + [_pattern(rng, fmt, 0, rng.randrange(1, 1 << m)) for _ in range(n)]
    )


def _normal(fmt, n=40):
    e, m = FMT[fmt]
    top, bias = (1 << e) - 1, (1 << (e - 1)) - 1
    # min normal, max finite, 1.0
    edges = [
        1 << m,
        ((top - 1) << m) | ((1 << m) - 1),
        bias << m,
    ]
    return lambda rng: (
        edges + [_pattern(rng, fmt, rng.randrange(1, top)) for _ in range(n)]
    )


def _inf(fmt):
    e, m = FMT[fmt]
    return lambda rng: [((1 << e) - 1) << m, (1 << (e + m)) | (((1 << e) - 1) << m)]


def _nan(fmt, n=6):
    e, m = FMT[fmt]
    return lambda rng: [
        _pattern(rng, fmt, (1 << e) - 1, rng.randrange(1, 1 << m)) for _ in range(n)
    ]


def decode_types(fmt: str) -> list[CaseType]:
    e, m = FMT[fmt]
    bias = (1 << (e - 1)) - 1
    return [
        CaseType(
            "zero",
            "±0（指数段与尾数段全 0）",
            1,
            _zero(fmt),
            fix="指数段为 0、尾数段为 0 时值是 ±0，符号位决定正负"
            "（-0.0 也要返回 -0.0）",
        ),
        CaseType(
            "subnormal",
            "次正规数（指数段为 0）",
            2,
            _subnormal(fmt),
            fix=f"指数段为 0 时没有隐含的 1：值 = (-1)^s · M · 2^({1 - bias}-{m})",
        ),
        CaseType(
            "normal",
            "正规数",
            2,
            _normal(fmt),
            fix=f"正规数：值 = (-1)^s · (2^{m} + M) · 2^(E-{bias}-{m})",
        ),
        CaseType(
            "inf",
            "±inf（指数段全 1，尾数段为 0）",
            1,
            _inf(fmt),
            fix="指数段全 1 且尾数段为 0 时返回 math.inf（带符号）",
        ),
        CaseType(
            "nan",
            "NaN（指数段全 1，尾数段不为 0）",
            1,
            _nan(fmt),
            fix="指数段全 1 且尾数段不为 0 时返回 math.nan",
        ),
        CaseType(
            "integer_only",
            "只用整数位运算（numpy / torch / struct 被拿走时照样算对）",
            3,
            _guarded(fmt),
            fix="本实验要求只用整数位运算与 math.ldexp（或 2.0 ** k）：不要用 "
            "np.float16、torch 的 view 或 struct 替你转换（第 2 节）",
        ),
    ]


def _guarded(fmt):
    """Patterns of every kind, each decoded by the student's function with numpy,
    torch and struct taken away (coursekit.integer_only)."""
    kinds = (_zero(fmt), _subnormal(fmt, 2), _normal(fmt, 4), _inf(fmt), _nan(fmt, 2))
    return lambda rng: [{"guarded": b} for k in kinds for b in k(rng)]


def _bits(x) -> int:
    return x["guarded"] if isinstance(x, dict) else x


def _show16(x) -> str:
    return hex16(_bits(x)) + (
        "（拿走 numpy/torch/struct）" if isinstance(x, dict) else ""
    )


def _probe16(fn: str) -> str:
    return (
        "from coursekit.integer_only import integer_only as _integer_only\n"
        f"_guarded = _integer_only({fn})\n"
        "CASE = lambda x: (\n"
        f"    _guarded(x['guarded']) if isinstance(x, dict) else {fn}(x)\n"
        ")\n"
    )


def _expect_fp16(bits):
    return ref_decode16([_bits(bits)], "fp16")[0]


def _expect_bf16(bits):
    return ref_decode16([_bits(bits)], "bf16")[0]


# ---------------------------------------------------------------- fp32 -> bf16 bits
def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0]


def _finite_high(rng) -> int:
    """A random upper half of a finite, normal fp32 pattern (exponent 1..254)."""
    return (
        (rng.getrandbits(1) << 15) | (rng.randrange(1, 255) << 7) | rng.getrandbits(7)
    )


def _round_down(rng):
    return [
        _f32((_finite_high(rng) << 16) | rng.randrange(1, 0x8000)) for _ in range(20)
    ]


def _round_up(rng):
    return [
        _f32((_finite_high(rng) << 16) | rng.randrange(0x8001, 0x10000))
        for _ in range(20)
    ]


def _ties(rng):
    highs = [_finite_high(rng) for _ in range(20)]
    # even and odd last bits
    highs = [h & ~1 for h in highs[:10]] + [h | 1 for h in highs[10:]]
    return [_f32((h << 16) | 0x8000) for h in highs]


def _carry(rng):
    # the rounding carry runs into the exponent (next power of two) or overflows to inf
    pats = [0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8001]
    pats += [
        (rng.getrandbits(1) << 31)
        | (rng.randrange(1, 254) << 23)
        | 0x7FFFFF
        | rng.randrange(0x8001, 0x10000)
        for _ in range(7)
    ]
    return [_f32(p) for p in pats]


def _fp32_subnormal(rng):
    return [
        _f32((rng.getrandbits(1) << 31) | rng.randrange(1, 1 << 23)) for _ in range(10)
    ]


def _fp32_special(rng):
    return [0.0, -0.0, math.inf, -math.inf]


def _nan_payloads(rng):
    """NaN inputs as fp32 bit patterns (JSON would turn every NaN into one): quiet NaNs
    whose upper half is 0x7FFF / 0xFFFF, where the rounding carry runs out of the
    mantissa (into -0.0 or +0.0) unless NaN is special-cased, and one plain NaN."""
    pats = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8000, 0xFFFF8000]
    pats += [
        (rng.getrandbits(1) << 31) | 0x7FFF0000 | rng.randrange(0x8001, 0x10000)
        for _ in range(3)
    ]
    return [{"fp32_bits": p} for p in pats] + [math.nan]


FP32_TO_BF16_PROBE = """
import struct as _struct


def CASE(x):
    if isinstance(x, dict):  # a NaN with its payload, handed over as its bit pattern
        x = _struct.unpack("<f", _struct.pack("<I", x["fp32_bits"]))[0]
    return fp32_to_bf16_bits(x)
"""


def expect_fp32_to_bf16(x: float):
    import torch

    if isinstance(x, dict) or math.isnan(x):
        return "NaN"
    return (
        int(
            torch.tensor([x], dtype=torch.float32)
            .to(torch.bfloat16)
            .view(torch.int16)[0]
        )
        & 0xFFFF
    )


def _bf16_kind(bits: int) -> str:
    exponent, mantissa = (bits >> 7) & 0xFF, bits & 0x7F
    sign = "−" if bits >> 15 else "+"
    if exponent == 0xFF:
        return "NaN" if mantissa else f"{sign}inf"
    if exponent == 0:
        return f"{sign}0.0" if not mantissa else "次正规数"
    return "正规数"


def compare_bf16_bits(got, want):
    """Exact bit pattern (any NaN for NaN). ``why`` describes what came back by
    category and by its distance from the right pattern, never the pattern itself."""
    if not isinstance(got, int) or isinstance(got, bool) or not 0 <= got < 2**16:
        return False, f"应返回 0 到 0xFFFF 的 int，得到 {type(got).__name__}"
    if want == "NaN":
        ok = (got >> 7) & 0xFF == 0xFF and bool(got & 0x7F)
        return ok, "" if ok else (
            f"NaN 的输入得到了 {_bf16_kind(got)} 的位模式：进位从尾数段一路进到了"
            "指数段之外（自检里的 0x7fffffff 就是这样的 NaN）"
        )
    if got == want:
        return True, ""
    if (got ^ want) & 0x8000:
        return False, "符号位不对"
    diff = got - want
    if abs(diff) == 1:
        return False, (
            f"比正确的位模式{'大' if diff > 0 else '小'} 1：舍入的方向不对"
            + ("（像是直接截断）" if diff < 0 else "")
        )
    return False, (
        f"得到的是 {_bf16_kind(got)}，应为 {_bf16_kind(want)}；"
        f"与正确的位模式相差 {abs(diff)}"
    )


def show_bf16_bits(v) -> str:
    return "任一 NaN 位模式（指数全 1、尾数不为 0）" if v == "NaN" else hex16(v)


def _show_fp32(x) -> str:
    if isinstance(x, dict):
        return f"NaN（fp32 位模式 {x['fp32_bits']:#010x}）"
    return f"{x!r}（fp32 位模式 {struct.unpack('<I', struct.pack('<f', x))[0]:#010x}）"


# ---------------------------------------------------------------- ulp
def ref_ulp(x: float, fmt: str) -> float:
    e, m = FMT[fmt]
    bias = 2 ** (e - 1) - 1
    if x == 0:
        return math.ldexp(1.0, 1 - bias - m)
    k = max(math.frexp(abs(x))[1] - 1, 1 - bias)
    return math.ldexp(1.0, k - m)


def _value(fmt: str, bits: int) -> float:
    return _f32(bits) if fmt == "fp32" else ref_decode16([bits], fmt)[0]


def _ulp_cases(kind: str):
    def make(rng):
        out = []
        for fmt in ("fp32", "fp16", "bf16"):
            e, m = FMT[fmt]
            top, bias = (1 << e) - 1, (1 << (e - 1)) - 1
            if kind == "zero":
                bits = [0, 1 << (e + m)]
            elif kind == "subnormal":
                bits = [1] + [
                    _pattern(rng, fmt, 0, rng.randrange(1, 1 << m)) for _ in range(3)
                ]
            elif kind == "power_of_two":
                bits = [
                    _pattern(rng, fmt, rng.randrange(1, top), 0) for _ in range(3)
                ] + [bias << m]
            elif kind == "edge":
                # min normal, max finite
                bits = [
                    1 << m,
                    ((top - 1) << m) | ((1 << m) - 1),
                ]
            else:
                bits = [_pattern(rng, fmt, rng.randrange(1, top)) for _ in range(8)]
            out += [[_value(fmt, b), fmt] for b in bits]
        return out

    return make


ULP_TYPES = [
    CaseType(
        "zero",
        "x = ±0",
        1,
        _ulp_cases("zero"),
        fix="0 要单独处理：frexp(0) 的指数是 0，套公式会错；0 处的间距是最小次正规数 "
        "2^(1-bias-m)",
    ),
    CaseType(
        "subnormal",
        "次正规数",
        1,
        _ulp_cases("subnormal"),
        fix="次正规数的间距固定为 2^(1-bias-m)：k 要与 1 - bias 取较大者",
    ),
    CaseType(
        "power_of_two",
        "2 的整数次幂",
        1,
        _ulp_cases("power_of_two"),
        fix="math.frexp(|x|) 返回 (f, e)，|x| = f·2^e 且 0.5 ≤ f < 1，所以 |x| 在 "
        "[2^k, 2^(k+1)) "
        "时 k = e - 1（不是 e）",
    ),
    CaseType(
        "edge",
        "最小正规数与最大有限数",
        1,
        _ulp_cases("edge"),
        fix="最小正规数 2^(1-bias) 与最大有限数都按正规数的公式 2^(k-m) 计算",
    ),
    CaseType(
        "normal",
        "一般的正规数",
        3,
        _ulp_cases("normal"),
        fix="正规数 |x| ∈ [2^k, 2^(k+1)) 的间距是 2^(k-m)，m 是该格式的尾数位数",
    ),
]


def _show_ulp(case) -> str:
    return f"ulp({case[0]!r}, {case[1]!r})"


QUESTIONS = [
    Question(
        "decode_fp16",
        points=3,
        cases=decode_types("fp16"),
        expect=_expect_fp16,
        probe=_probe16("decode_fp16"),
        compare=same_float,
        show_input=_show16,
        description="decode_fp16：16 位模式 → 数值（正规/次正规/±0/inf/NaN），"
        "只用整数位运算",
    ),
    Question(
        "decode_bf16",
        points=2,
        cases=decode_types("bf16"),
        expect=_expect_bf16,
        probe=_probe16("decode_bf16"),
        compare=same_float,
        show_input=_show16,
        description="decode_bf16：16 位模式 → 数值",
    ),
    Question(
        "fp32_to_bf16_bits",
        points=3,
        probe=FP32_TO_BF16_PROBE,
        cases=[
            CaseType(
                "round_up",
                "丢掉的低 16 位 > 0x8000（进位）",
                2,
                _round_up,
                fix="低 16 位大于 0x8000 时要进位：直接截断（>> 16）是朝 0 舍入，"
                "不是就近舍入",
            ),
            CaseType(
                "round_down",
                "丢掉的低 16 位 < 0x8000（舍去）",
                1,
                _round_down,
                fix="低 16 位小于 0x8000 时直接舍去",
            ),
            CaseType(
                "tie",
                "平局（低 16 位 = 0x8000）",
                2,
                _ties,
                fix="平局取偶：保留部分的最低位为 1 时进位，为 0 时舍去"
                "（自检的 0x3f818000 → 0x3f82 进位，0x3f808000 → 0x3f80 舍去）",
            ),
            CaseType(
                "carry",
                "进位进入指数段或溢出成 inf",
                1,
                _carry,
                fix="进位可以一路传进指数段（变成下一个 2 的幂）或溢出成 inf，"
                "这正是正确结果；"
                "结果要 & 0xFFFF",
            ),
            CaseType(
                "subnormal",
                "fp32 次正规数",
                1,
                _fp32_subnormal,
                fix="次正规数用同一个舍入公式，不需要特殊处理",
            ),
            CaseType(
                "special",
                "±0 与 ±inf",
                1,
                _fp32_special,
                fix="±0 与 ±inf 的高 16 位就是结果（低 16 位全 0，不会进位）",
            ),
            CaseType(
                "nan",
                "NaN（含尾数高位全 1 的 NaN）",
                2,
                _nan_payloads,
                fix="NaN 要先单独处理、返回一个 NaN 模式：舍入的进位会把尾数高位全 1 "
                "的 NaN 变成 ±0 或 inf（本实验第 4 节）",
            ),
        ],
        expect=expect_fp32_to_bf16,
        compare=compare_bf16_bits,
        show_input=_show_fp32,
        show_value=show_bf16_bits,
        description="fp32_to_bf16_bits：就近舍入、平局取偶；溢出成 inf；NaN 保持 NaN",
    ),
    Question(
        "ulp",
        points=2,
        cases=ULP_TYPES,
        expect=lambda c: ref_ulp(c[0], c[1]),
        probe="CASE = lambda case: ulp(case[0], case[1])",
        compare=same_float,
        show_input=_show_ulp,
        description="ulp(x, fmt)：fp32/fp16/bf16 的最后一位单位（含 0、次正规数与 2 "
        "的幂）",
    ),
]
