"""trainmem.measuring.measure: tensor-level accounting is repeatable, fake tensors give
the real numbers, and the per-layer extrapolation equals the full run."""

import pytest

from trainmem.estimate import CATEGORIES
from trainmem.measuring.measure import measure


@pytest.mark.parametrize(
    "kw",
    [
        dict(method="full", precision="fp32", attn="eager"),
        dict(method="lora", precision="bf16-amp", checkpointing=True),
    ],
)
def test_fake_equals_real_on_tiny(kw):
    real = measure("tiny", device="cpu", batch=2, seq=16, **kw)
    fake = measure("tiny", device="fake", batch=2, seq=16, **kw)
    assert fake.total_bytes == real.total_bytes
    assert fake.breakdown == real.breakdown
    assert fake.activation_bytes == real.activation_bytes
    assert sum(real.breakdown.values()) == real.total_bytes
    assert set(real.breakdown) == set(CATEGORIES)


def test_repeatable_and_lora_has_no_frozen_grads():
    a = measure("tiny", device="cpu", method="lora", batch=1, seq=16, optimizer="sgd")
    b = measure("tiny", device="cpu", method="lora", batch=1, seq=16, optimizer="sgd")
    assert (
        a.to_dict()["breakdown"] == b.to_dict()["breakdown"]
        and a.total_bytes == b.total_bytes
    )
    # gradients never exceed the adapters' size (frozen weights get no .grad)
    assert a.breakdown["gradients"] <= a.n_trainable * 4
    assert a.n_trainable == 2 * 8 * (64 + 64) * 2


def test_extrapolation_equals_full_run():
    from trainmem.measuring.models import get_config

    cfg = get_config("tiny", num_hidden_layers=5)
    full = measure(cfg, device="fake", batch=2, seq=16, extrapolate=False)
    ext = measure(cfg, device="fake", batch=2, seq=16, extrapolate=True)
    assert ext.extrapolated_from_layers == (2, 3)
    assert ext.total_bytes == full.total_bytes
    assert ext.breakdown == full.breakdown
    assert ext.activation_bytes == full.activation_bytes


def test_unmeasurable_options_are_rejected():
    with pytest.raises(ValueError, match="allowed for a fake measurement: full, lora"):
        measure("tiny", method="qlora", device="fake")
    with pytest.raises(ValueError, match="device must be one of cpu, fake, cuda"):
        measure("tiny", device="tpu")


@pytest.mark.parametrize(
    "kw",
    [
        # LoRA + checkpointing + accumulation: MemTracker's own module hooks used to
        # keep the frozen embedding's output (a leaf that requires grad) and its .grad
        # alive from micro-batch 1
        dict(
            method="lora",
            precision="bf16-amp",
            checkpointing=True,
            grad_accum=2,
            optimizer_impl="for-loop",
        ),
        # fp16-amp: the measured step is one where GradScaler really steps (optimizer
        # states exist)
        dict(method="full", precision="fp16-amp", optimizer_impl="fused"),
    ],
)
def test_memtracker_agrees_with_measure(kw):
    from trainmem.estimate import estimate
    from trainmem.measuring.measure import measure_memtracker

    meas = measure("tiny", device="cpu", batch=2, seq=16, **kw)
    mt = measure_memtracker("tiny", batch=2, seq=16, **kw)
    assert abs(mt - meas.total_bytes) <= 16
    est = estimate("tiny", batch=2, seq=16, **kw)
    assert abs(est.total_bytes - meas.total_bytes) <= 0.001 * meas.total_bytes
    assert meas.breakdown["optimizer_states"] == est.breakdown["optimizer_states"] > 0


@pytest.mark.parametrize("impl", ["fused", "for-loop"])
def test_fake_equals_real_per_optimizer_impl(impl):
    kw = dict(method="full", precision="bf16-amp", batch=1, seq=8, optimizer_impl=impl)
    real = measure("tiny", device="cpu", **kw)
    fake = measure("tiny", device="fake", **kw)
    assert fake.total_bytes == real.total_bytes and fake.breakdown == real.breakdown
