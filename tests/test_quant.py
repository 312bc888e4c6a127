"""trainmem.demos.quant: codes, blockwise quantisation, 8-bit AdamW, bytes per
parameter."""

import pytest
import torch

from trainmem.demos import quant as Q

# NF4 table as published in the QLoRA paper (Appendix E) / bitsandbytes.
NF4_PUBLISHED = [
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
]


def test_codes_shapes_and_ranges():
    assert (
        Q.linear_code(8).numel() == 255
        and Q.linear_code(8, signed=False).numel() == 256
    )
    for signed in (True, False):
        c = Q.dynamic_code(signed)
        assert c.numel() == 256 and c.max() == 1.0 and bool((c[1:] >= c[:-1]).all())
    assert Q.dynamic_code(False).min() == 0.0
    # the dynamic code spans 7 decades: smallest non-zero magnitude < 1e-6
    c = Q.dynamic_code(False)
    assert 0 < c[c > 0].min() < 1e-6


def test_nf4_matches_published_table():
    torch.testing.assert_close(
        Q.nf4_code(), torch.tensor(NF4_PUBLISHED), atol=1e-6, rtol=0
    )


def test_blockwise_roundtrip_exact_on_code_values():
    code = Q.linear_code(8)
    x = torch.tensor([0.0, 0.5, -1.0, 1.0, 0.25]) * 3.0
    grid = code[[0, 63, 127, 200, 254]] * 3.0
    qx = Q.quantize_blockwise(grid, code, block_size=5)
    torch.testing.assert_close(Q.dequantize_blockwise(qx), grid)
    assert qx.absmax.tolist() == [3.0]
    assert x.shape == Q.dequantize_blockwise(Q.quantize_blockwise(x, code, 2)).shape


def test_blockwise_error_bound_and_padding():
    torch.manual_seed(0)
    x = torch.randn(1000)
    qx = Q.quantize_blockwise(x, Q.linear_code(8), block_size=64)
    assert qx.absmax.numel() == 16  # ceil(1000 / 64)
    err = (Q.dequantize_blockwise(qx) - x).abs()
    # half a step of the linear code times each block's absmax
    bound = (qx.absmax / 127 / 2).repeat_interleave(64)[:1000] + 1e-7
    assert bool((err <= bound).all())
    assert qx.nbytes() == 1000 + 16 * 4
    with pytest.raises(ValueError, match="block_size"):
        Q.quantize_blockwise(x, Q.linear_code(8), block_size=0)


def test_bytes_per_param_formulas():
    assert Q.adam_state_bytes_per_param(32) == 8.0
    assert Q.adam_state_bytes_per_param(8, 2048) == 2 * (1 + 4 / 2048)
    # bitsandbytes >= 0.44
    assert Q.adam_state_bytes_per_param(8) == 2 * (1 + 4 / 256) == 2.03125
    assert Q.nf4_bytes_per_param(64, double_quant=False) == 0.5625
    assert Q.nf4_bytes_per_param(64, True, 256) == 0.5 + 1 / 64 + 4 / (64 * 256)
    assert Q.int8_bytes_per_param("tensor", (4, 8)) == 1 + 4 / 32
    assert Q.int8_bytes_per_param("channel", (4, 8)) == 1 + 16 / 32
    assert Q.int8_bytes_per_param("group", (4, 8), group_size=4) == 1 + 32 / 32
    with pytest.raises(ValueError, match="granularity"):
        Q.int8_bytes_per_param("row", (4, 8))
    with pytest.raises(ValueError, match="bits"):
        Q.adam_state_bytes_per_param(4)


def test_int8_granularity_error_order_with_outlier_row():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    w[3, 7] = 1.0  # one outlier
    errs = {}
    for g in Q.GRANULARITIES:
        q, s = Q.quantize_int8_absmax(w, g, group_size=64)
        assert q.dtype == torch.int8
        errs[g] = (Q.dequantize_int8(q, s, w.shape) - w).abs().mean().item()
    assert errs["group"] < errs["channel"] < errs["tensor"]
    with pytest.raises(ValueError, match="granularity"):
        Q.quantize_int8_absmax(w, "row")
    with pytest.raises(ValueError, match="group_size"):
        Q.quantize_int8_absmax(w, "group", group_size=100)


def test_nf4_roundtrip_and_double_quant():
    torch.manual_seed(0)
    w = torch.randn(128, 128)
    qw = Q.quantize_nf4(w, 64)
    assert qw.codes.max() <= 15 and qw.absmax.numel() == 128 * 128 // 64
    back = Q.dequantize_nf4(qw, torch.float32)
    assert (back - w).abs().mean() < 0.1
    assert Q.dequantize_nf4(qw).dtype == torch.bfloat16
    absmax2, per_const = Q.double_quantize_absmax(qw.absmax, 256)
    assert per_const == 1 + 4 / 256
    assert ((absmax2 - qw.absmax).abs() / qw.absmax).max() < 0.02


def test_adamw8bit_tracks_fp32_adamw_and_saves_memory():
    def run(make):
        torch.manual_seed(0)
        m = torch.nn.Linear(128, 64)
        w0 = m.weight.detach().clone()
        opt = make(m.parameters())
        x, y = torch.randn(32, 128), torch.randn(32, 64)
        for _ in range(20):
            loss = (m(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        return m.weight.detach() - w0, opt, loss.item()

    w32, o32, l32 = run(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.01))
    w8, o8, l8 = run(lambda p: Q.AdamW8bit(p, lr=1e-2, weight_decay=0.01))
    assert abs(l8 - l32) / l32 < 0.02
    # the 8-bit run moves the weights along nearly the same path (relative difference <
    # 10 %)
    assert (w8 - w32).norm() / w32.norm() < 0.1
    # weight (8192 values) quantised in blocks of 256: 2 × (8192 + 32 blocks × 4 B);
    # bias (64) stays fp32: 2 × 256 B
    assert Q.optimizer_state_bytes(o8) == 2 * (8192 + 32 * 4) + 2 * 64 * 4
    with pytest.raises(ValueError, match="lr"):
        Q.AdamW8bit(torch.nn.Linear(2, 2).parameters(), lr=0)


def test_adamw8bit_code_option():
    p = torch.nn.Linear(2, 2).parameters()
    with pytest.raises(ValueError, match="code"):
        Q.AdamW8bit(p, code="log")
    opt = Q.AdamW8bit(torch.nn.Linear(2, 2).parameters(), code="linear")
    assert opt._codes[0].numel() == 255 and opt._codes[1].numel() == 256
