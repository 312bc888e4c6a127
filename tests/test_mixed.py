"""trainmem.demos.mixed: FP16 spacing facts and FP32 master weights."""

import pytest
import torch

from trainmem.demos.mixed import (
    MasterWeights,
    spacing,
    train_regression,
    update_survives,
)


def test_spacing_at_half_exact():
    assert spacing(0.5, "fp16", "up") == 2.0**-11
    assert spacing(0.5, "fp16", "down") == 2.0**-12
    assert spacing(0.5, "bf16", "up") == 2.0**-8
    assert spacing(0.5, torch.float32, "up") == 2.0**-24


def test_update_vanishes_in_fp16_not_fp32():
    assert not update_survives(0.5, 1e-5, "fp16")
    assert not update_survives(0.5, -1e-5, "fp16")
    assert update_survives(0.5, 1e-5, "fp32")
    assert update_survives(0.5, 2.0**-11, "fp16")


def test_bad_dtype_named():
    with pytest.raises(ValueError, match="dtype must be one of"):
        spacing(0.5, "fp8")


def test_master_weights_copy_back_and_skip_inf():
    lin = torch.nn.Linear(2, 1, bias=False).half()
    with torch.no_grad():
        lin.weight.fill_(0.5)
    mw = MasterWeights(lin, lambda ps: torch.optim.SGD(ps, lr=1e-5))
    for _ in range(100):
        lin.weight.grad = torch.ones_like(lin.weight)  # fp16 grads
        assert mw.step()
    assert mw.master[0].dtype == torch.float32
    assert torch.allclose(mw.master[0], torch.full((1, 2), 0.5 - 100e-5), atol=1e-7)
    assert lin.weight.dtype == torch.float16 and float(
        lin.weight.detach()[0, 0]
    ) == float(torch.tensor(0.499, dtype=torch.float16))
    lin.weight.grad = torch.full_like(lin.weight, float("inf"))
    before = mw.master[0].clone()
    assert not mw.step() and torch.equal(before, mw.master[0])


def test_pure_fp16_stalls_master_learns():
    fp32 = train_regression("fp32", steps=60)
    fp16 = train_regression("fp16", steps=60)
    master = train_regression("fp16_master", steps=60)
    assert fp16[-1] == fp16[0]  # every update rounded away
    assert fp32[-1] < 0.5 * fp32[0]
    assert abs(master[-1] - fp32[-1]) < 0.1 * fp32[-1]
    with pytest.raises(ValueError, match="mode must be one of"):
        train_regression("bf16")
