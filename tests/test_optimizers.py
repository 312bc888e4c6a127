"""The optimizer registry: every consumer reads one entry per optimizer, and the two
entries added through it (Lion, Adafactor) agree with a real torch measurement."""

from __future__ import annotations

import math

import pytest

from trainmem.config import OPTIMIZERS, OptionError, StepConfig
from trainmem.dtypes import DTYPES
from trainmem.estimate import bytes_per_param, estimate, estimate_from_hf
from trainmem.optimizers import OPTIMIZERS as REGISTRY
from trainmem.optimizers import hf_optims, optimizer


def test_every_consumer_lists_the_registry():
    from trainmem.cli import build_parser
    from trainmem.from_hf import HF_OPTIMS

    assert OPTIMIZERS == tuple(REGISTRY)
    assert HF_OPTIMS == hf_optims()
    estimate_parser = build_parser()._subparsers._group_actions[0].choices["estimate"]
    (action,) = [a for a in estimate_parser._actions if a.dest == "optimizer"]
    assert tuple(action.choices) == tuple(REGISTRY)


def test_unknown_optimizer_or_implementation_is_an_option_error():
    with pytest.raises(OptionError, match="optimizer must be one of adamw") as e:
        StepConfig(optimizer="adam")
    assert e.value.option == "optimizer"
    with pytest.raises(
        OptionError, match="for-loop, fused for lion, got 'foreach'"
    ) as e:
        StepConfig(optimizer="lion", optimizer_impl="foreach")
    assert e.value.option == "optimizer_impl"
    with pytest.raises(OptionError, match="optimizer must be one of"):
        optimizer("lamb")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_the_estimate_holds_exactly_the_states_the_entry_declares(name):
    """The replay allocates the entry's states for every trainable parameter: an
    optimizer with states never shows 0 bytes (the trap of a dispatch with no else)."""
    from trainmem.measuring.models import get_config

    spec = REGISTRY[name]
    est = estimate("tiny", optimizer=name, precision="fp32", batch=1, seq=8)
    cfg = get_config("tiny")
    h, inner, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    layer = [(h, h)] * 4 + [(inner, h)] * 2 + [(h, inner)] + [(h,)] * 2
    shapes = [(vocab, h), (vocab, h), (h,)] + layer * cfg.num_hidden_layers
    want = sum(
        math.prod(st.shape) * DTYPES[st.dtype].bytes
        for shape in shapes
        for st in spec.states(shape, "fp32")
    )
    # the states exist for the whole step: the same bytes at any peak
    assert est.breakdown["optimizer_states"] == want
    assert (want > 0) == spec.keeps_states


def test_adafactor_states_are_factored_and_lion_keeps_one_buffer():
    ada, lion = optimizer("adafactor"), optimizer("lion")
    assert [s.shape for s in ada.states((4096, 11008), "bf16")] == [
        (),
        (4096, 1),
        (1, 11008),
    ]
    assert [s.shape for s in ada.states((4096,), "bf16")] == [(), (4096,)]
    assert [s.shape for s in lion.states((8, 8), "bf16")] == [(8, 8)]
    assert bytes_per_param("bf16-amp", "lion") == 4 + 2 + 4 + 4
    with pytest.raises(OptionError, match="depends on each parameter's shape"):
        bytes_per_param("bf16-amp", "adafactor")


def test_adafactor_states_match_torch():
    """The entry's state shapes and dtypes are those torch.optim.Adafactor creates."""
    torch = pytest.importorskip("torch")
    from trainmem.measuring.training_setup import torch_dtype

    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((6, 5), (3, 4, 5), (7,))]
    opt = torch.optim.Adafactor(params, foreach=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for p in params:
        got = [(tuple(t.shape), t.dtype) for t in opt.state[p].values()]
        want = [
            (s.shape, torch_dtype(s.dtype))
            for s in optimizer("adafactor").states(tuple(p.shape), "fp32")
        ]
        assert got == want


def test_lion_update_is_the_sign_of_the_interpolation():
    torch = pytest.importorskip("torch")
    from trainmem.measuring.lion import Lion

    p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = Lion([p], lr=0.1, betas=(0.9, 0.99), weight_decay=0.5)
    m = torch.tensor([0.0, 0.0, 0.0])
    for grad in ([1.0, -1.0, 0.5], [-3.0, 2.0, 0.01]):
        g = torch.tensor(grad)
        p.grad = g.clone()
        want = p.detach() * (1 - 0.1 * 0.5) - 0.1 * torch.sign(0.9 * m + 0.1 * g)
        m = 0.99 * m + 0.01 * g
        opt.step()
        assert torch.equal(p.detach(), want)
        assert torch.allclose(opt.state[p]["exp_avg"], m)


@pytest.mark.parametrize("name", ["lion", "adafactor"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-amp"])
def test_lion_and_adafactor_estimates_equal_a_torch_measurement(name, precision):
    """Full fine-tuning of the tiny Llama, a step whose peak is the optimizer step:
    the estimate equals the tensor-level measurement to the byte, term by term (the
    states and the step's scratch); under LoRA the optimizer phase is exact too."""
    pytest.importorskip("torch")
    from trainmem.measuring.measure import measure

    kw = dict(optimizer=name, precision=precision, batch=1, seq=4)
    est, meas = estimate("tiny", **kw), measure("tiny", **kw)
    assert est.peak_phase == meas.peak_phase == "optimizer"
    assert est.total_bytes == meas.total_bytes
    assert est.breakdown == meas.breakdown
    lora = dict(kw, method="lora", lora_targets=("q_proj", "v_proj", "down_proj"))
    est, meas = estimate("tiny", **lora), measure("tiny", **lora)
    assert est.phase_peaks["optimizer"] == meas.phase_peaks["optimizer"]
    assert est.breakdown["optimizer_states"] == meas.breakdown["optimizer_states"] > 0


def test_hf_optim_names_come_from_the_registry():
    args = {"optim": "lion_32bit", "bf16": True, "max_length": 64}
    est = estimate_from_hf("tiny", args)
    assert (est.options["optimizer"], est.options["optimizer_impl"]) == (
        "lion",
        "fused",
    )
    est = estimate_from_hf("tiny", dict(args, optim="adafactor"))
    assert est.options["optimizer"] == "adafactor"


def test_the_cli_takes_the_new_optimizers(capsys):
    import json

    from trainmem.cli import main

    assert main(["estimate", "--model", "tiny", "--optimizer", "lion", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["optimizer"] == "lion"
    assert out["breakdown"]["optimizer_states"] > 0
    assert main(["estimate", "--model", "tiny", "--optimizer", "adafactor"]) == 0
