"""trainmem.demos.accum: accumulation equivalence, checkpointing placement, exact memory
meters."""

import pytest
import torch

from trainmem.demos.accum import (
    PeakLiveBytes,
    SavedTensorBytes,
    Stack,
    grads,
    max_abs_diff,
    measure_step,
)
from trainmem.measuring.data import counting_batches


def test_accumulated_equals_big_batch():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    ).double()
    x, y = (
        torch.randn(12, 8, dtype=torch.float64),
        torch.randn(12, 1, dtype=torch.float64),
    )
    torch.nn.functional.mse_loss(model(x), y).backward()
    big = grads(model)
    model.zero_grad()
    for xs, ys in zip(x.chunk(3), y.chunk(3)):
        (torch.nn.functional.mse_loss(model(xs), ys) / 3).backward()
    assert max_abs_diff(big, grads(model)) < 1e-15


def test_saved_bytes_exact_for_linear():
    lin = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(5, 4)
    with SavedTensorBytes(exclude=lin) as m:
        lin(x).sum()
    assert m.bytes == 5 * 4 * 4 and m.count == 1  # only the fp32 input (5, 4) is kept


def test_peak_live_bytes_counts_and_frees():
    with PeakLiveBytes() as m:
        a = torch.ones(256)  # 1 KiB
        b = torch.ones(512)  # 2 KiB
        del a
        c = torch.ones(128)  # 0.5 KiB
    assert m.peak == 256 * 4 + 512 * 4
    assert m.current == 512 * 4 + 128 * 4
    del b, c


def test_checkpoint_keeps_only_segment_inputs_same_grads():
    model = Stack(n_layers=4, d=16, mult=2)
    x = torch.randn(2, 8, 16)
    ref = measure_step(model, x, repeats=0)
    model(x).square().mean().backward()
    g_ref = grads(model)
    model.zero_grad()
    for k in (1, 2, 4):
        m = measure_step(model, x, segment=k, repeats=0)
        assert m.seconds != m.seconds  # nan: timing skipped
        # one fp32 (2, 8, 16) input per segment
        assert m.saved_bytes == (4 // k) * 2 * 8 * 16 * 4
        assert m.saved_bytes < ref.saved_bytes and m.flops > ref.flops
        model.segment = k
        model(x).square().mean().backward()
        assert max_abs_diff(g_ref, grads(model)) < 1e-6
        model.zero_grad()
        model.segment = 0


def test_stack_rejects_bad_placement():
    with pytest.raises(ValueError, match="segment must be"):
        Stack(n_layers=2, segment=3)
    with pytest.raises(ValueError, match="exclusive"):
        Stack(n_layers=4, segment=2, every=2)


def test_counting_batches_deterministic():
    a, b = counting_batches(2, 3, 5, seed=1), counting_batches(2, 3, 5, seed=1)
    assert all(torch.equal(u, v) for u, v in zip(a, b)) and a[0].shape == (3, 5)
    d = (a[0][:, 1:] - a[0][:, :-1]) % 256
    assert ((d >= 1) & (d <= 3)).all()
    with pytest.raises(ValueError, match="seq_len"):
        counting_batches(1, 1, 0)
