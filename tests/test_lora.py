"""trainmem.demos.lora against peft: same seed → same A/B, outputs, gradients, merged
weights; counts."""

import peft
import pytest
import torch
from torch import nn

from trainmem.demos.lora import (
    LoRALinear,
    count_parameters,
    inject_lora,
    lora_layers,
    lora_param_count,
    lora_param_count_for_config,
    lora_state_dict,
    merge_lora,
    unmerge_lora,
)
from trainmem.measuring.models import build_model, get_config, tiny_llama_config

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

ATT = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def _pair(targets, r=4, alpha=8, dropout=0.0, init="kaiming", cfg=None, seed=1):
    """Our model and a peft model, built from the same base weights with the same
    adapter seed."""
    cfg = cfg or tiny_llama_config()
    ours, theirs = build_model(cfg, seed=0), build_model(cfg, seed=0)
    torch.manual_seed(seed)
    inject_lora(ours, targets, r=r, alpha=alpha, dropout=dropout, init=init)
    torch.manual_seed(seed)
    lcfg = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        lora_dropout=dropout,
        init_lora_weights=True if init == "kaiming" else "gaussian",
    )
    theirs = peft.get_peft_model(theirs, lcfg)
    return ours, theirs


def _adapters(model):
    return {
        k.replace("base_model.model.", "").replace(".default", ""): v
        for k, v in model.state_dict().items()
        if "lora_A" in k or "lora_B" in k
    }


def _randomise_B(ours, theirs, seed=2):
    """B = 0 at init makes A's gradient 0; give both the same non-zero B to test
    gradients."""
    g = torch.Generator().manual_seed(seed)
    a, b = _adapters(ours), _adapters(theirs)
    for k in a:
        if "lora_B" in k:
            v = torch.randn(a[k].shape, generator=g) * 0.05
            with torch.no_grad():
                a[k].copy_(v)
                b[k].copy_(v)


IDS = torch.randint(256, (2, 10), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("init", ["kaiming", "gaussian"])
@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ATT + MLP])
def test_same_seed_same_adapters(targets, init):
    ours, theirs = _pair(targets, init=init)
    a, b = _adapters(ours), _adapters(theirs)
    assert list(a) == list(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k
        if "lora_B" in k:
            assert torch.count_nonzero(a[k]) == 0  # ΔW = 0 at step 0


def test_outputs_and_gradients_match_peft():
    ours, theirs = _pair(ATT + MLP, r=4, alpha=16)
    _randomise_B(ours, theirs)
    lo, lt = ours(input_ids=IDS, labels=IDS), theirs(input_ids=IDS, labels=IDS)
    torch.testing.assert_close(lo.logits, lt.logits, rtol=1e-5, atol=1e-5)
    lo.loss.backward()
    lt.loss.backward()
    go = {n: p.grad for n, p in ours.named_parameters() if p.requires_grad}
    gt = {
        n.replace("base_model.model.", "").replace(".default", ""): p.grad
        for n, p in theirs.named_parameters()
        if p.requires_grad
    }
    assert list(go) == list(gt)
    for n in go:
        assert go[n].abs().sum() > 0, n
        torch.testing.assert_close(go[n], gt[n], rtol=1e-4, atol=1e-6)


def test_dropout_on_adapter_path_matches_peft():
    ours, theirs = _pair(["q_proj", "v_proj"], dropout=0.3)
    _randomise_B(ours, theirs)
    ours.train()
    theirs.train()
    torch.manual_seed(5)
    lo = ours(input_ids=IDS).logits
    torch.manual_seed(5)
    lt = theirs(input_ids=IDS).logits
    torch.testing.assert_close(lo, lt, rtol=1e-5, atol=1e-5)
    ours.eval()
    # dropout really is active in train mode: eval output differs
    assert not torch.allclose(ours(input_ids=IDS).logits, lo)


def test_merge_equals_peft_merge_and_unload():
    ours, theirs = _pair(ATT, r=8, alpha=16)
    _randomise_B(ours, theirs)
    ours.eval()
    theirs.eval()
    before = ours(input_ids=IDS).logits
    assert merge_lora(ours) == 8
    after = ours(input_ids=IDS).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    merged = theirs.merge_and_unload()
    wo = {
        n.replace(".base.", "."): p
        for n, p in ours.named_parameters()
        if "lora_" not in n
    }
    wt = dict(merged.named_parameters())
    assert sorted(wo) == sorted(wt)
    for n in wt:
        torch.testing.assert_close(wo[n], wt[n], rtol=1e-6, atol=1e-7)
    unmerge_lora(ours)
    torch.testing.assert_close(ours(input_ids=IDS).logits, before, rtol=1e-5, atol=1e-5)


def test_layer_formula_and_freezing():
    torch.manual_seed(0)
    base = nn.Linear(6, 5)
    w0 = base.weight.detach().clone()
    lay = LoRALinear(base, r=2, alpha=4)
    assert not base.weight.requires_grad and not base.bias.requires_grad
    assert lay.scaling == 2.0
    with torch.no_grad():
        lay.lora_B.weight.normal_()
    x = torch.randn(3, 6)
    expected = (
        x @ w0.T + base.bias + 2.0 * (x @ lay.lora_A.weight.T @ lay.lora_B.weight.T)
    )
    torch.testing.assert_close(lay(x), expected)
    assert lay.delta_weight().shape == (5, 6)
    assert torch.linalg.matrix_rank(lay.delta_weight()) == 2
    lay.merge()
    with pytest.raises(RuntimeError, match="already merged"):
        lay.merge()
    lay.unmerge()
    torch.testing.assert_close(base.weight, w0)
    with pytest.raises(RuntimeError, match="not merged"):
        lay.unmerge()


@pytest.mark.parametrize("r", [0, -1, 7, 2.5])
def test_bad_rank(r):
    with pytest.raises(
        ValueError,
        match=r"r \(lora rank\) must be an integer ≥ 1 and ≤ min\(d_in, d_out\)=6",
    ):
        LoRALinear(nn.Linear(6, 8), r=r)


def test_bad_arguments():
    with pytest.raises(TypeError, match="nn.Linear"):
        LoRALinear(nn.Conv1d(2, 2, 1), r=1)
    with pytest.raises(ValueError, match="dropout"):
        LoRALinear(nn.Linear(4, 4), r=1, dropout=1.0)
    with pytest.raises(ValueError, match="init must be one of"):
        LoRALinear(nn.Linear(4, 4), r=1, init="zeros")
    model = build_model(tiny_llama_config())
    with pytest.raises(
        ValueError,
        match=r"\['query'\] match no nn.Linear.*allowed suffixes: \['down_proj'",
    ):
        inject_lora(model, ["q_proj", "query"], r=2)
    with pytest.raises(ValueError, match="at least one"):
        inject_lora(model, [], r=2)
    assert lora_layers(model) == []  # nothing was replaced by the failed calls


def test_inject_freezes_everything_else_and_state_dict():
    model = build_model(tiny_llama_config())
    names = inject_lora(model, "v_proj", r=2)
    assert names == [
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.v_proj",
    ]
    trainable, total = count_parameters(model)
    assert trainable == 2 * lora_param_count(64, 64, 2) == 512
    sd = lora_state_dict(model)
    assert len(sd) == 4 and sum(v.numel() for v in sd.values()) == trainable


def test_param_count_formula():
    assert lora_param_count(4096, 4096, 8) == 65_536
    assert lora_param_count(4, 4, 1) == 8
    with pytest.raises(ValueError, match="r must be an integer ≥ 1"):
        lora_param_count(4, 4, 0)
    with pytest.raises(ValueError, match="target_modules must be a non-empty subset"):
        lora_param_count_for_config(tiny_llama_config(), ["qkv"], 8)


# grouped-query attention: k/v are narrower
@pytest.mark.parametrize(
    "cfg_kw,targets,r",
    [
        ({}, ["q_proj", "v_proj"], 8),
        ({}, ATT, 4),
        ({}, ATT + MLP, 16),
        (
            {"num_key_value_heads": 2},
            ATT + MLP,
            8,
        ),
        (
            {"num_key_value_heads": 1, "head_dim": 32},
            ["k_proj", "o_proj", "down_proj"],
            3,
        ),
    ],
)
def test_count_formula_vs_peft_and_ours(cfg_kw, targets, r):
    cfg = tiny_llama_config(**cfg_kw)
    expected = lora_param_count_for_config(cfg, targets, r)
    p = peft.get_peft_model(
        build_model(cfg, "meta"), peft.LoraConfig(r=r, target_modules=targets)
    )
    assert p.get_nb_trainable_parameters()[0] == expected
    ours = build_model(cfg)
    inject_lora(ours, targets, r=r)
    assert count_parameters(ours)[0] == expected


def test_llama7b_counts_vs_peft_meta():
    """The seed's 4,194,304 is q_proj+v_proj at r=8; q,k,v,o gives twice that."""
    cfg = get_config("llama-7b")
    base_total = count_parameters(build_model(cfg, "meta"))[1]
    assert base_total == 6_738_415_616
    for targets, trainable in ((["q_proj", "v_proj"], 4_194_304), (ATT, 8_388_608)):
        assert lora_param_count_for_config(cfg, targets, 8) == trainable
        p = peft.get_peft_model(
            build_model(cfg, "meta"),
            peft.LoraConfig(
                r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"
            ),
        )
        assert p.get_nb_trainable_parameters() == (trainable, base_total + trainable)
    assert base_total + 4_194_304 == 6_742_609_920


def test_two_injections_different_ranks():
    model = build_model(tiny_llama_config())
    inject_lora(model, ATT, r=8)
    inject_lora(model, MLP, r=32)
    cfg = tiny_llama_config()
    expected = lora_param_count_for_config(cfg, ATT, 8) + lora_param_count_for_config(
        cfg, MLP, 32
    )
    assert count_parameters(model)[0] == expected
    assert sorted({m.r for m in lora_layers(model)}) == [8, 32]


def test_rank_sweep_exact_on_known_spectrum():
    """diag(3, 2, 1) padded into a 3×5 matrix, rotated: errors are sqrt of the tail
    energy."""
    from trainmem.demos.lora import rank_sweep

    g = torch.Generator().manual_seed(0)
    q1, _ = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))
    q2, _ = torch.linalg.qr(torch.randn(5, 5, generator=g, dtype=torch.float64))
    sigma = torch.zeros(3, 5, dtype=torch.float64)
    sigma[range(3), range(3)] = torch.tensor([3.0, 2.0, 1.0], dtype=torch.float64)
    m = q1 @ sigma @ q2
    rows = rank_sweep(m, [1, 2, 3])
    assert [r["lora_params"] for r in rows] == [8, 16, 24]
    assert all(r["full_params"] == 15 for r in rows)
    assert rows[0]["rel_error"] == pytest.approx((5 / 14) ** 0.5, rel=1e-9)
    assert rows[1]["rel_error"] == pytest.approx((1 / 14) ** 0.5, rel=1e-9)
    assert rows[2]["rel_error"] == pytest.approx(0.0, abs=1e-7)
    assert rows[0]["energy"] == pytest.approx(9 / 14, rel=1e-9)


def test_rank_sweep_matches_explicit_truncation():
    from trainmem.demos.lora import rank_sweep

    m = torch.randn(
        12, 20, generator=torch.Generator().manual_seed(3), dtype=torch.float64
    )
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    for row in rank_sweep(m, [1, 5, 11]):
        r = row["r"]
        approx = u[:, :r] @ torch.diag(s[:r]) @ vh[:r]
        assert row["rel_error"] == pytest.approx(
            ((m - approx).norm() / m.norm()).item(), rel=1e-9
        )


@pytest.mark.parametrize(
    "m,ranks,msg",
    [
        (torch.ones(4, 4), [0], "rank must be an integer in 1..min"),
        (torch.ones(4, 4), [5], "rank must be an integer in 1..min"),
        (torch.zeros(4, 4), [1], "all zeros"),
        (torch.ones(4), [1], "2-D matrix"),
    ],
)
def test_rank_sweep_bad_input(m, ranks, msg):
    from trainmem.demos.lora import rank_sweep

    with pytest.raises(ValueError, match=msg):
        rank_sweep(m, ranks)
