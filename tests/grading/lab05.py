"""Hidden tests for lab05 (LoRA from scratch, matched against peft). Format: tests/grading/README.md.

Weights, adapters and inputs are plain numbers drawn here; :data:`BUILD_SRC` turns them into modules
both in the student's kernel (probe) and in this process (check). The reference is ``peft`` itself,
run here: the same base weights and the same A, B copied into ``peft``'s ``lora.Linear`` must give the
same outputs, gradients and merged weights. The tiny Llama for ``inject_lora`` is built with
``trainmem.models.build_model(config, seed=...)`` on both sides (same seed → same weights).
"""
from __future__ import annotations

import math

from coursekit.grading import Question
from coursekit.grading.checks import close_floats, exec_source, quiet_warnings


_quiet = quiet_warnings

NOTEBOOK = "lab05_lora_from_scratch.ipynb"
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 240
PROBE_TIMEOUT = 60

RTOL, ATOL = 1e-5, 1e-5

BUILD_SRC = r'''
import random as _random
import zlib as _zlib
import torch as _torch
import torch.nn as _nn


def _lab05_tensor(rng, shape, scale=1.0):
    n = 1
    for s in shape:
        n *= s
    return _torch.tensor([rng.uniform(-scale, scale) for _ in range(n)], dtype=_torch.float32).reshape(shape)


def _lab05_base(case):
    rng = _random.Random(case["seed"])
    lin = _nn.Linear(case["d_in"], case["d_out"], bias=case["bias"])
    with _torch.no_grad():
        lin.weight.copy_(_lab05_tensor(rng, (case["d_out"], case["d_in"]), 0.5))
        if lin.bias is not None:
            lin.bias.copy_(_lab05_tensor(rng, (case["d_out"],), 0.5))
    return lin


def _lab05_adapters(case):
    rng = _random.Random(case["seed"] + 1)
    A = _lab05_tensor(rng, (case["r"], case["d_in"]), 0.5)
    B = _lab05_tensor(rng, (case["d_out"], case["r"]), 0.5)
    x = _lab05_tensor(rng, (2, 3, case["d_in"]), 1.0)
    w = _lab05_tensor(rng, (2, 3, case["d_out"]), 1.0)
    return A, B, x, w


def _lab05_llama_cfg(case):
    from trainmem.models import tiny_llama_config
    h, nh = case["hidden"], case["heads"]
    return tiny_llama_config(hidden_size=h, intermediate_size=case["inter"], num_hidden_layers=case["layers"],
                             num_attention_heads=nh, num_key_value_heads=nh, vocab_size=case["vocab"])


def _lab05_fill_adapter(name, A, B, seed):
    rng = _random.Random(_zlib.crc32(name.encode()) + seed)
    with _torch.no_grad():
        A.copy_(_lab05_tensor(rng, tuple(A.shape), 0.3))
        B.copy_(_lab05_tensor(rng, tuple(B.shape), 0.3))


def _lab05_ids(case):
    rng = _random.Random(case["seed"] + 2)
    return _torch.tensor([[rng.randrange(case["vocab"]) for _ in range(8)] for _ in range(2)])
'''


def _ns() -> dict:
    return exec_source(BUILD_SRC)


def _close(got, want, rtol=RTOL, atol=ATOL) -> bool:
    return close_floats(got, want, rtol, atol)


def _peft_layer(ns, case):
    """peft's lora.Linear around the case's base layer, with the case's A and B copied in."""
    import torch.nn as nn
    from peft import LoraConfig, get_peft_model

    class Wrap(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.proj = lin

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(Wrap(ns["_lab05_base"](case)),
                           LoraConfig(r=case["r"], lora_alpha=case["alpha"], target_modules=["proj"]))
    layer = model.base_model.model.proj
    A, B, x, w = ns["_lab05_adapters"](case)
    import torch
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(A)
        layer.lora_B["default"].weight.copy_(B)
    return model, layer, x, w


def _layer_cases(rng, n=4):
    cases = []
    for _ in range(n):
        d_in, d_out = rng.randint(3, 24), rng.randint(3, 24)
        cases.append(dict(seed=rng.randrange(10**6), d_in=d_in, d_out=d_out, r=rng.randint(1, min(d_in, d_out)),
                          alpha=rng.choice([1, 2, 4, 8, 16, 3.5]), bias=rng.random() < 0.7))
    return cases


# ---------------------------------------------------------------- __init__
def _init_inputs(rng):
    cases = _layer_cases(rng)
    cases.append(dict(seed=rng.randrange(10**6), d_in=256, d_out=64, r=16, alpha=32, bias=True))  # for the A statistics
    d_in, d_out = rng.randint(3, 12), rng.randint(3, 12)
    cases.append(dict(seed=1, d_in=d_in, d_out=d_out, r=0, alpha=4, bias=True, bad=True))
    cases.append(dict(seed=2, d_in=d_in, d_out=d_out, r=min(d_in, d_out) + rng.randint(1, 3), alpha=4, bias=True,
                      bad=True))
    return cases


INIT_PROBE = BUILD_SRC + r'''
RESULT = []
for _case in INPUTS:
    _base = _lab05_base(_case)
    if _case.get("bad"):
        try:
            LoRALinear(_base, _case["r"], _case["alpha"])
            RESULT.append({"raised": None})
        except Exception as _e:
            RESULT.append({"raised": type(_e).__name__})
        continue
    _layer = LoRALinear(_base, _case["r"], _case["alpha"])
    _A, _B, _x, _w = _lab05_adapters(_case)
    with _torch.no_grad():
        _diff = float((_layer(_x) - _base(_x)).abs().max())
    RESULT.append({
        "A_shape": list(_layer.lora_A.shape), "B_shape": list(_layer.lora_B.shape),
        "B_zero": bool(_torch.all(_layer.lora_B == 0)),
        "A_absmax": float(_layer.lora_A.abs().max()), "A_std": float(_layer.lora_A.float().std()) if _layer.lora_A.numel() > 1 else 0.0,
        "scaling": float(_layer.scaling),
        "trainable": sorted(n for n, p in _layer.named_parameters() if p.requires_grad),
        "base_is_same": _layer.base is _base,
        "out_diff": _diff})
'''


def check_init(inputs, result):
    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, f"expected {len(inputs)} results, got {type(result).__name__}"
    score, msgs, bad_ok, good_full = 0.0, [], 0, 0
    for case, got in zip(inputs, result):
        label = f"d_in={case['d_in']}, d_out={case['d_out']}, r={case['r']}, alpha={case['alpha']}"
        if not isinstance(got, dict):
            msgs.append(f"{label}: no result")
            continue
        if case.get("bad"):
            ok = got.get("raised") == "ValueError"
            bad_ok += ok
            if not ok:
                msgs.append(f"{label}: expected ValueError, got {got.get('raised')}")
            continue
        k, d, r = case["d_in"], case["d_out"], case["r"]
        bound = 1 / math.sqrt(k)
        checks = {
            "lora_A shape (r, d_in)": got.get("A_shape") == [r, k],
            "lora_B shape (d_out, r)": got.get("B_shape") == [d, r],
            "lora_B all zero": got.get("B_zero") is True,
            f"|lora_A| <= 1/sqrt(d_in)={bound:.4f} and not zero": isinstance(got.get("A_absmax"), (int, float))
            and 0 < got["A_absmax"] <= bound * (1 + 1e-6),
            f"scaling = alpha / r = {case['alpha'] / r:g}": isinstance(got.get("scaling"), (int, float))
            and abs(got["scaling"] - case["alpha"] / r) < 1e-9,
            "only lora_A and lora_B trainable (base frozen)": got.get("trainable") == ["lora_A", "lora_B"],
            "self.base is the given layer": got.get("base_is_same") is True,
            "output equals base output at init": got.get("out_diff") == 0.0,
        }
        if r * k >= 1000:  # Kaiming uniform: std = bound / sqrt(3)
            want_std = bound / math.sqrt(3)
            checks[f"std(lora_A) ≈ {want_std:.4f} (Kaiming uniform)"] = isinstance(got.get("A_std"), (int, float)) \
                and abs(got["A_std"] - want_std) < 0.15 * want_std
        score += sum(checks.values()) / len(checks)
        good_full += all(checks.values())
        wrong = [k_ for k_, v in checks.items() if not v]
        if wrong:
            msgs.append(f"{label}: wrong " + ", ".join(wrong))
    if good_full:        # raising ValueError only counts for a layer that is also built right
        score += bad_ok
    elif bad_ok:
        msgs.append("ValueError cases not counted: no valid case was fully correct")
    return score / len(inputs), "all cases correct" if not msgs else " | ".join(msgs[:3])


# ---------------------------------------------------------------- forward
FORWARD_PROBE = BUILD_SRC + r'''
RESULT = []
for _case in INPUTS:
    _layer = LoRALinear(_lab05_base(_case), _case["r"], _case["alpha"])
    _A, _B, _x, _w = _lab05_adapters(_case)
    with _torch.no_grad():
        _layer.lora_A.copy_(_A)
        _layer.lora_B.copy_(_B)
    _out = _layer(_x)
    (_out * _w).sum().backward()
    RESULT.append({"out": _out.detach().flatten().tolist(),
                   "gA": _layer.lora_A.grad.flatten().tolist(), "gB": _layer.lora_B.grad.flatten().tolist()})
'''


@_quiet
def check_forward(inputs, result):
    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, f"expected {len(inputs)} results, got {type(result).__name__}"
    ns = _ns()
    score, msgs = 0.0, []
    for case, got in zip(inputs, result):
        label = f"d_in={case['d_in']}, d_out={case['d_out']}, r={case['r']}, alpha={case['alpha']}, bias={case['bias']}"
        model, layer, x, w = _peft_layer(ns, case)
        out = model(x)
        (out * w).sum().backward()
        want = {"out": out.detach().flatten().tolist(),
                "gA": layer.lora_A["default"].weight.grad.flatten().tolist(),
                "gB": layer.lora_B["default"].weight.grad.flatten().tolist()}
        if not isinstance(got, dict):
            msgs.append(f"{label}: no result")
            continue
        checks = {"output": _close(got.get("out"), want["out"]),
                  "grad of lora_A": _close(got.get("gA"), want["gA"]),
                  "grad of lora_B": _close(got.get("gB"), want["gB"])}
        score += (2 * checks["output"] + checks["grad of lora_A"] + checks["grad of lora_B"]) / 4
        wrong = [k for k, v in checks.items() if not v]
        if wrong:
            msgs.append(f"{label}: differs from peft in " + ", ".join(wrong))
    return score / len(inputs), "all cases match peft" if not msgs else " | ".join(msgs[:3])


# ---------------------------------------------------------------- merge
MERGE_PROBE = BUILD_SRC + r'''
RESULT = []
for _case in INPUTS:
    _base = _lab05_base(_case)
    _w0 = _base.weight.detach().clone()
    _layer = LoRALinear(_base, _case["r"], _case["alpha"])
    _A, _B, _x, _w = _lab05_adapters(_case)
    with _torch.no_grad():
        _layer.lora_A.copy_(_A)
        _layer.lora_B.copy_(_B)
    _m = _layer.merge()
    RESULT.append({"is_linear": isinstance(_m, _nn.Linear),
                   "weight": _m.weight.detach().flatten().tolist(),
                   "bias": _m.bias.detach().flatten().tolist() if getattr(_m, "bias", None) is not None else None,
                   "base_untouched": bool(_torch.equal(_layer.base.weight, _w0))})
'''


@_quiet
def check_merge(inputs, result):
    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, f"expected {len(inputs)} results, got {type(result).__name__}"
    ns = _ns()
    score, msgs = 0.0, []
    for case, got in zip(inputs, result):
        label = f"d_in={case['d_in']}, d_out={case['d_out']}, r={case['r']}, alpha={case['alpha']}, bias={case['bias']}"
        model, layer, x, w = _peft_layer(ns, case)
        merged = model.merge_and_unload().proj
        want_w = merged.weight.detach().flatten().tolist()
        want_b = merged.bias.detach().flatten().tolist() if merged.bias is not None else None
        if not isinstance(got, dict):
            msgs.append(f"{label}: no result")
            continue
        checks = {"returns an nn.Linear": got.get("is_linear") is True,
                  "merged weight": _close(got.get("weight"), want_w),
                  "bias": (want_b is None and got.get("bias") is None) or (want_b is not None and _close(got.get("bias"), want_b)),
                  "self.base left unchanged": got.get("base_untouched") is True}
        score += (checks["returns an nn.Linear"] + 3 * checks["merged weight"] + checks["bias"]
                  + checks["self.base left unchanged"]) / 6
        wrong = [k for k, v in checks.items() if not v]
        if wrong:
            msgs.append(f"{label}: wrong " + ", ".join(wrong))
    return score / len(inputs), "all cases match peft merge_and_unload()" if not msgs else " | ".join(msgs[:3])


# ---------------------------------------------------------------- inject_lora
TARGET_SETS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"], ["o_proj", "down_proj"],
               ["gate_proj", "up_proj", "down_proj", "q_proj"]]


def _inject_inputs(rng):
    heads = rng.choice([2, 4])
    return dict(seed=rng.randrange(10**6), hidden=heads * rng.choice([8, 12]), heads=heads,
                inter=rng.choice([40, 56, 72]), layers=rng.randint(1, 2), vocab=rng.choice([48, 64, 96]),
                targets=rng.choice(TARGET_SETS), r=rng.choice([2, 4, 8]), alpha=rng.choice([4, 8, 16]))


INJECT_PROBE = BUILD_SRC + r'''
from trainmem.models import build_model as _build_model
_case = INPUTS
_model = _build_model(_lab05_llama_cfg(_case), seed=_case["seed"])
_names = list(inject_lora(_model, _case["targets"], _case["r"], _case["alpha"]))
for _n in _names:
    _mod = _model.get_submodule(_n)
    _lab05_fill_adapter(_n, _mod.lora_A, _mod.lora_B, _case["seed"])
_ids = _lab05_ids(_case)
_out = _model(input_ids=_ids, labels=_ids)
_out.loss.backward()
try:
    inject_lora(_build_model(_lab05_llama_cfg(_case), seed=0), ["not_a_module"], 2, 4)
    _raised = None
except Exception as _e:
    _raised = type(_e).__name__
RESULT = {"names": _names,
          "trainable": int(sum(p.numel() for p in _model.parameters() if p.requires_grad)),
          "logits": _out.logits.detach().flatten().tolist(),
          "grads": {_n: [_model.get_submodule(_n).lora_A.grad.flatten().tolist(),
                         _model.get_submodule(_n).lora_B.grad.flatten().tolist()] for _n in _names},
          "raised": _raised}
'''


@_quiet
def check_inject(case, got):
    from peft import LoraConfig, get_peft_model
    from trainmem.models import build_model

    ns = _ns()
    model = get_peft_model(build_model(ns["_lab05_llama_cfg"](case), seed=case["seed"]),
                           LoraConfig(r=case["r"], lora_alpha=case["alpha"], target_modules=case["targets"]))
    inner = model.base_model.model
    names = [n for n, m in inner.named_modules() if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})]
    for n in names:
        mod = inner.get_submodule(n)
        ns["_lab05_fill_adapter"](n, mod.lora_A["default"].weight, mod.lora_B["default"].weight, case["seed"])
    ids = ns["_lab05_ids"](case)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not isinstance(got, dict):
        return 0.0, f"expected a dict, got {type(got).__name__}"
    grads = got.get("grads") if isinstance(got.get("grads"), dict) else {}
    grads_ok = set(grads) == set(names) and all(
        isinstance(grads[n], list) and len(grads[n]) == 2
        and _close(grads[n][0], inner.get_submodule(n).lora_A["default"].weight.grad.flatten().tolist(), 1e-4, 1e-6)
        and _close(grads[n][1], inner.get_submodule(n).lora_B["default"].weight.grad.flatten().tolist(), 1e-4, 1e-6)
        for n in names)
    checks = {
        f"replaced modules ({len(names)} expected)": got.get("names") == names,
        f"trainable parameters (peft: {trainable})": got.get("trainable") == trainable,
        "logits": _close(got.get("logits"), out.logits.detach().flatten().tolist(), 1e-4, 1e-5),
        "LoRA gradients": grads_ok,
        "ValueError for a target that matches nothing": got.get("raised") == "ValueError",
    }
    weights = {0: 1, 1: 1, 2: 2, 3: 1, 4: 1}
    frac = sum(weights[i] * v for i, v in enumerate(checks.values())) / sum(weights.values())
    wrong = [k for k, v in checks.items() if not v]
    label = (f"Llama hidden={case['hidden']}, layers={case['layers']}, targets={case['targets']}, "
             f"r={case['r']}, alpha={case['alpha']}")
    return frac, (f"{label}: matches peft" if not wrong else f"{label}: wrong " + ", ".join(wrong))


QUESTIONS = [
    Question("lora_init", points=2, make_inputs=_init_inputs, probe=INIT_PROBE, check=check_init,
             description="LoRALinear.__init__：形状、B=0、A 为 Kaiming 均匀、scaling=alpha/r、冻结 base、非法 r 报 ValueError"),
    Question("lora_forward", points=3, make_inputs=_layer_cases, probe=FORWARD_PROBE, check=check_forward,
             description="LoRALinear.forward：输出与 A、B 的梯度与 peft 的 lora.Linear 一致"),
    Question("lora_merge", points=2, make_inputs=_layer_cases, probe=MERGE_PROBE, check=check_merge,
             description="LoRALinear.merge：新的 nn.Linear，权重与 peft merge_and_unload() 一致，不改 base"),
    Question("inject_lora", points=3, make_inputs=_inject_inputs, probe=INJECT_PROBE, check=check_inject,
             description="inject_lora：在小 Llama 上替换目标层，可训练参数量、logits 与梯度与 peft 一致"),
]
