"""trainmem.formats: bit-level encode/decode checked against torch's own casts and
torch.finfo."""

import math

import numpy as np
import pytest
import torch

from trainmem import formats as F

TORCH_FORMATS = ["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
INT_VIEW = {32: torch.int32, 16: torch.int16, 8: torch.uint8}


def torch_bits(values: np.ndarray, name: str) -> list[int]:
    f = F.get_format(name)
    t = torch.from_numpy(values.astype(np.float32)).to(f.torch())
    ints = t.view(INT_VIEW[f.storage_bits]).to(torch.int64) & ((1 << f.bits) - 1)
    return ints.tolist()


def random_fp32(n: int, seed: int = 0) -> np.ndarray:
    """Every kind of fp32: random bit patterns (normals, subnormals, inf), no NaN."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    return x[~np.isnan(x)]


@pytest.mark.parametrize("name", TORCH_FORMATS)
def test_constants_match_torch_finfo(name):
    f = F.get_format(name)
    fi = torch.finfo(f.torch())
    assert f.bits == fi.bits
    assert f.max_normal == fi.max
    assert f.min_normal == fi.tiny == fi.smallest_normal
    assert f.eps == fi.eps


def test_exact_constants():
    fp16, bf16, e4m3, e5m2, tf32 = (
        F.get_format(n) for n in ["fp16", "bf16", "e4m3", "e5m2", "tf32"]
    )
    assert (
        fp16.max_normal == 65504
        and fp16.min_subnormal == 2.0**-24
        and fp16.eps == 2.0**-10
    )
    assert (
        bf16.eps == 2.0**-7
        and bf16.min_normal == 2.0**-126
        and bf16.min_subnormal == 2.0**-133
    )
    assert e4m3.max_normal == 448 and e4m3.min_subnormal == 2.0**-9 and e4m3.bias == 7
    assert e5m2.max_normal == 57344 and e5m2.min_subnormal == 2.0**-16
    assert tf32.bits == 19 and tf32.storage_bits == 32 and tf32.eps == 2.0**-10
    assert tf32.max_normal == (2 - 2.0**-10) * 2.0**127


def test_smallest_subnormal_matches_torch():
    for name in TORCH_FORMATS:
        f = F.get_format(name)
        one = torch.tensor([1], dtype=INT_VIEW[f.storage_bits]).view(f.torch())
        assert one.float().item() == f.min_subnormal, name


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8_e5m2"])
def test_encode_matches_torch_cast_on_random_fp32(name):
    x = random_fp32(4000)
    # plus values near this format's range: around min subnormal, min normal and max
    f = F.get_format(name)
    rng = np.random.default_rng(1)
    for c in (f.min_subnormal, f.min_normal, f.max_normal, 1.0):
        with np.errstate(
            over="ignore"
        ):  # bf16's max * 2 overflows fp32 to inf: kept on purpose
            x = np.concatenate(
                [
                    x,
                    (c * rng.uniform(0.25, 2.0, 500) * rng.choice([-1, 1], 500)).astype(
                        np.float32
                    ),
                ]
            )
    ours = [F.encode(float(v), name) for v in x]
    assert ours == torch_bits(x, name)


def test_encode_matches_torch_cast_e4m3_in_range():
    # torch's CPU cast saturates out-of-range E4M3 (a version/backend choice); compare
    # in range.
    rng = np.random.default_rng(2)
    x = np.concatenate(
        [
            rng.uniform(-464, 464, 3000),
            rng.uniform(-1, 1, 2000) * 2.0**-6,
            rng.uniform(-1, 1, 1000) * 2.0**-9,
        ]
    ).astype(np.float32)
    assert [F.encode(float(v), "e4m3") for v in x] == torch_bits(x, "fp8_e4m3")


def test_fp32_encode_matches_numpy():
    x = np.random.default_rng(3).standard_normal(2000) * 10.0 ** np.random.default_rng(
        4
    ).uniform(-45, 38, 2000)
    ours = [F.encode(float(v), "fp32") for v in x]
    ref = x.astype(np.float32).view(np.uint32).astype(np.int64).tolist()
    assert ours == ref


@pytest.mark.parametrize("name", F.format_names())
def test_decode_encode_roundtrip_all_patterns(name):
    f = F.get_format(name)
    patterns = (
        range(1 << f.bits)
        if f.bits <= 16
        else np.random.default_rng(5).integers(0, 1 << f.bits, 3000).tolist()
    )
    for b in patterns:
        v = F.decode(b, f)
        if math.isnan(v):
            continue
        assert F.encode(v, f) == b, (name, b, v)


def test_known_bit_patterns():
    d = F.decompose(0.5, "fp16")
    assert (d.sign, d.exponent, d.mantissa, d.kind) == (0, 14, 0, "normal")
    assert d.bit_string() == "0 01110 0000000000" and d.unbiased_exponent == -1
    d = F.decompose(-2.5, "bf16")
    assert d.bits == 0xC020 and d.bit_string() == "1 10000000 0100000"
    assert F.encode(1.0, "fp32") == 0x3F800000
    assert F.round_to(0.1, "fp16") == 0.0999755859375
    assert F.decompose(1e-7, "fp16").kind == "subnormal"
    assert F.decompose(1e-9, "fp16").kind == "zero"


def test_overflow_rules():
    assert F.round_to(65504, "fp16") == 65504
    assert F.round_to(65519.99, "fp16") == 65504
    assert F.round_to(65520, "fp16") == math.inf  # max + ulp/2 ties to even → inf
    assert F.round_to(70000, "fp16") == math.inf
    assert F.round_to(-70000, "fp16") == -math.inf
    assert F.round_to(70000, "fp16", saturate=True) == 65504
    assert math.isnan(F.round_to(500, "e4m3"))  # E4M3 has no inf
    assert F.round_to(500, "e4m3", saturate=True) == 448
    assert F.round_to(464, "e4m3") == 448  # tie → even mantissa 110
    assert F.round_to(61440, "e5m2") == math.inf and F.round_to(61439, "e5m2") == 57344
    assert F.round_to(math.inf, "bf16") == math.inf
    assert math.isnan(F.round_to(math.nan, "fp16"))


def test_underflow_and_subnormals():
    assert F.round_to(2.0**-25, "fp16") == 0.0  # half the min subnormal: tie → 0
    assert F.round_to(2.0**-25 * 1.01, "fp16") == 2.0**-24
    assert F.round_to(1e-30, "fp16") == 0.0 and F.round_to(1e-30, "bf16") != 0.0
    assert math.copysign(1, F.round_to(-1e-30, "fp16")) == -1  # signed zero kept


def test_spacing_and_neighbours():
    assert F.ulp(0.5, "fp16") == 2.0**-11
    assert F.ulp(0.7, "fp16") == 2.0**-11
    assert F.ulp(0.4999, "fp16") == 2.0**-12
    assert F.ulp(0.5, "bf16") == 2.0**-8 and F.ulp(0.5, "fp32") == 2.0**-24
    assert F.ulp(0.0, "fp16") == 2.0**-24 and F.ulp(1e-7, "fp16") == 2.0**-24
    assert F.next_up(0.5, "fp16") == 0.5 + 2.0**-11
    assert F.next_down(0.5, "fp16") == 0.5 - 2.0**-12
    assert F.neighbours(0.5, "fp16") == (0.5, 0.5)
    assert F.neighbours(0.1, "fp16") == (0.0999755859375, 0.0999755859375 + 2.0**-14)
    assert F.neighbours(70000, "fp16") == (65504, math.inf)
    assert F.next_up(0.0, "bf16") == 2.0**-133 and F.next_down(0.0, "bf16") == -(
        2.0**-133
    )
    assert (
        F.next_up(65504, "fp16") == math.inf
        and F.next_down(-65504, "fp16") == -math.inf
    )
    assert F.next_up(-F.get_format("fp16").min_subnormal, "fp16") == 0.0
    # an update smaller than half the spacing is lost: 0.5 + 1e-5 rounds back to 0.5 in
    # fp16
    assert (
        F.round_to(0.5 + 1e-5, "fp16") == 0.5 and F.round_to(0.5 + 1e-5, "fp32") != 0.5
    )
    assert F.round_to(1 + 1e-3, "bf16") == 1.0


def test_ulp_array_matches_scalar():
    x = np.array([0.0, 1e-7, 0.1, 0.5, 0.4999, 3.0, 65504.0, -2.5])
    for name in F.format_names():
        assert F.ulp_array(x, name).tolist() == [F.ulp(v, name) for v in x]


@pytest.mark.parametrize("name", F.format_names())
def test_round_array_matches_scalar(name):
    x = random_fp32(3000, seed=6).astype(np.float64)
    x = np.concatenate([x, [0.0, -0.0, np.inf, -np.inf, np.nan, 464.0, 500.0, 70000.0]])
    got = F.round_array(x, name)
    ref = np.array([F.round_to(v, name) for v in x])
    assert np.array_equal(got, ref, equal_nan=True)
    sat = F.round_array(x, name, saturate=True)
    ref = np.array([F.round_to(v, name, saturate=True) for v in x])
    assert np.array_equal(sat, ref, equal_nan=True)


def test_round_tensor_tf32_equals_mantissa_mask():
    # TF32 keeps 10 mantissa bits: rounding fp32 to nearest-even on the low 13 bits, by
    # integer ops.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g) * 100
    i = a.view(torch.int32)
    rne = (i + 0x0FFF + ((i >> 13) & 1)) & ~0x1FFF
    assert torch.equal(F.round_tensor(a, "tf32"), rne.view(torch.float32))
    assert F.round_tensor(a, "tf32").dtype == torch.float32


def test_bad_input_names_allowed_values():
    with pytest.raises(ValueError, match="fmt must be one of fp32, tf32, fp16"):
        F.get_format("fp12")
    with pytest.raises(ValueError, match="dtype must be one of"):
        F.bytes_per_element("int3")
    with pytest.raises(ValueError, match="bits must be in"):
        F.decode(1 << 16, "fp16")
    with pytest.raises(ValueError, match="no torch storage dtype"):
        F.get_format("tf32").torch()
    assert (
        F.get_format(torch.bfloat16).name == "bf16"
        and F.get_format("half").name == "fp16"
    )


def test_weight_bytes():
    assert F.weight_bytes(7 * 10**9, "fp32") == 28 * F.GB
    assert F.weight_bytes(7 * 10**9, "int4") == 3.5 * F.GB
    assert F.weight_bytes(6_738_415_616, "bf16") == 13_476_831_232
    # the same bytes, two units
    assert 28 * F.GB / F.GiB == pytest.approx(26.077, abs=1e-3)
    assert F.bytes_per_element("torch.float16") == 2


def test_describe_value_rows():
    text = F.describe_value(70000.0)
    lines = text.splitlines()
    assert lines[0] == "x = 70000.0" and len(lines) == 2 + len(F.format_names())
    fp16 = next(line for line in lines if line.startswith("fp16"))
    assert "0 11111 0000000000" in fp16 and "inf" in fp16 and "65504" in fp16


def test_describe_rows_are_the_text_table():
    rows = F.describe_rows(0.1, ["fp16", "bf16"])
    assert [r["format"] for r in rows] == ["fp16", "bf16"]
    assert rows[0]["bits"] == "0 01011 1001100110" and rows[0]["rel.err"] == "2.44e-04"
    assert rows[1]["next below"] == "0.099609375"
    text = F.describe_value(0.1, ["fp16", "bf16"]).splitlines()
    for row, line in zip(rows, text[2:]):
        assert line.split() == " ".join(row.values()).split()


def test_e4m3_has_no_neighbour_beyond_its_largest_finite():
    """E4M3 ("fn") has no infinity: past 448 there is no next value, in either
    direction; formats with IEEE specials still show inf."""
    e4m3, fp16 = F.describe_rows(1000.0, ["fp8_e4m3", "fp16"])
    assert e4m3["next above"] == F.NO_NEIGHBOUR != "inf"
    assert e4m3["next below"] == "448"
    (neg,) = F.describe_rows(-1000.0, ["fp8_e4m3"])
    assert neg["next below"] == F.NO_NEIGHBOUR and neg["next above"] == "-448"
    assert F.describe_rows(70000.0, ["fp16"])[0]["next above"] == "inf"
    assert fp16["next above"] == "1000.5"
