"""trainmem.demos.scaler follows torch.amp.GradScaler step by step (growth, backoff,
skipped steps)."""

import math

import pytest
import torch

from trainmem.demos.scaler import (
    DynamicLossScaler,
    equilibrium_scale,
    simulate_overflow,
    trace_scale,
)


def _run_both(flags, **kw):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.1)
    gs = torch.amp.GradScaler("cpu", **kw)
    ours = DynamicLossScaler(**kw)
    rows = []
    for bad in flags:
        opt.zero_grad()
        gs.scale((p * (math.inf if bad else 1.0)).sum()).backward()
        before = p.detach().clone()
        used = gs.get_scale()
        gs.step(opt)
        gs.update()
        ev = ours.update(bad)
        rows.append((used, not torch.equal(before, p.detach()), gs.get_scale(), ev))
    return rows


@pytest.mark.parametrize(
    "kw",
    [
        dict(init_scale=8.0, growth_interval=3),
        dict(
            init_scale=2.0**16,
            growth_factor=4.0,
            backoff_factor=0.25,
            growth_interval=2,
        ),
    ],
)
def test_matches_gradscaler_step_by_step(kw):
    flags = [False, False, False, True, False, True, True, False, False, False]
    for used, stepped, nxt, ev in _run_both(flags, **kw):
        assert ev.scale_used == used
        assert ev.stepped == stepped
        assert ev.scale_next == nxt


def test_growth_and_backoff_exact():
    h = trace_scale([False, False, True, False], init_scale=8.0, growth_interval=2)
    assert [e.scale_next for e in h] == [8.0, 16.0, 8.0, 8.0]
    assert [e.stepped for e in h] == [True, True, False, True]
    assert [e.growth_tracker for e in h] == [1, 0, 0, 1]


def test_scale_and_unscale_roundtrip():
    s = DynamicLossScaler(init_scale=1024.0)
    p = torch.nn.Parameter(torch.tensor([2.0]))
    s.scale_loss(p.sum() * 3).backward()
    assert p.grad.item() == 3 * 1024
    assert s.unscale_([p]) is False and p.grad.item() == 3.0


def test_step_skips_on_nan_and_backs_off():
    p = torch.nn.Parameter(torch.tensor([1.0]))
    opt = torch.optim.SGD([p], lr=1.0)
    s = DynamicLossScaler(init_scale=4.0)
    (p * float("nan")).sum().backward()
    ev = s.step(opt)
    assert not ev.stepped and p.item() == 1.0 and s.scale == 2.0


def test_simulated_overflow_settles_at_equilibrium():
    h = simulate_overflow(
        max_grad=10.0, steps=60, init_scale=2.0**16, growth_interval=5
    )
    eq = equilibrium_scale(10.0)
    assert eq == 4096.0
    # probes one step above, then backs off
    assert max(e.scale_used for e in h[20:]) == 2 * eq
    assert min(e.scale_next for e in h[20:]) == eq


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(init_scale=0), "init_scale"),
        (dict(growth_factor=1.0), "growth_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(growth_interval=0), "growth_interval"),
    ],
)
def test_bad_arguments_are_named(kw, msg):
    with pytest.raises(ValueError, match=msg):
        DynamicLossScaler(**kw)
