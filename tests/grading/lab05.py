"""Hidden tests for lab05 (LoRA from scratch, matched against peft). Format:
tests/grading/README.md.

Weights, adapters and inputs are plain numbers drawn here; :data:`BUILD_SRC` turns them
into modules both in the student's kernel (probe) and in this process (check). The
reference is ``peft`` itself, run here: the same base weights and the same A, B copied
into ``peft``'s ``lora.Linear`` must give the same outputs, gradients and merged
weights. The tiny Llama for ``inject_lora`` is built with
``trainmem.measuring.models.build_model(config, seed=...)`` on both sides (same seed →
same weights).
"""

from __future__ import annotations

import math

from coursekit.grading import CaseType, Question
from coursekit.grading.checks import (
    close_floats,
    exec_source,
    quiet_warnings,
    raised_naming,
)

_quiet = quiet_warnings

NOTEBOOK = "lab05_lora_from_scratch.ipynb"
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 240
PROBE_TIMEOUT = 60

RTOL, ATOL = 1e-5, 1e-5

BUILD_SRC = r"""
import random as _random
import zlib as _zlib
import torch as _torch
import torch.nn as _nn


def _lab05_tensor(rng, shape, scale=1.0):
    n = 1
    for s in shape:
        n *= s
    return _torch.tensor(
        [rng.uniform(-scale, scale) for _ in range(n)], dtype=_torch.float32
    ).reshape(shape)


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
    from trainmem.measuring.models import tiny_llama_config

    h, nh = case["hidden"], case["heads"]
    return tiny_llama_config(
        hidden_size=h,
        intermediate_size=case["inter"],
        num_hidden_layers=case["layers"],
        num_attention_heads=nh,
        num_key_value_heads=nh,
        vocab_size=case["vocab"],
    )


def _lab05_fill_adapter(name, A, B, seed):
    rng = _random.Random(_zlib.crc32(name.encode()) + seed)
    with _torch.no_grad():
        A.copy_(_lab05_tensor(rng, tuple(A.shape), 0.3))
        B.copy_(_lab05_tensor(rng, tuple(B.shape), 0.3))


def _lab05_ids(case):
    rng = _random.Random(case["seed"] + 2)
    return _torch.tensor(
        [[rng.randrange(case["vocab"]) for _ in range(8)] for _ in range(2)]
    )
"""


_NS: dict = {}


def _ns() -> dict:
    """The builders, run once in this process (the same source the probe runs in the
    kernel)."""
    if not _NS:
        _NS.update(exec_source(BUILD_SRC))
    return _NS


def _close(got, want, rtol=RTOL, atol=ATOL) -> bool:
    return close_floats(got, want, rtol, atol)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _verdict(checks: dict) -> tuple[bool, str]:
    wrong = [k for k, ok in checks.items() if not ok]
    return not wrong, ("不对的是：" + "、".join(wrong)) if wrong else ""


def _peft_layer(ns, case):
    """peft's lora.Linear around the case's base layer, with the case's A and B copied
    in."""
    import torch.nn as nn
    from peft import LoraConfig, get_peft_model

    class Wrap(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.proj = lin

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(
        Wrap(ns["_lab05_base"](case)),
        LoraConfig(
            r=case["r"],
            lora_alpha=case["alpha"],
            lora_dropout=case.get("dropout", 0.0),
            target_modules=["proj"],
        ),
    )
    layer = model.base_model.model.proj
    A, B, x, w = ns["_lab05_adapters"](case)
    import torch

    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(A)
        layer.lora_B["default"].weight.copy_(B)
    return model, layer, x, w


def _layer_case(rng, **fixed):
    d_in, d_out = rng.randint(3, 24), rng.randint(3, 24)
    case = dict(
        seed=rng.randrange(10**6),
        d_in=d_in,
        d_out=d_out,
        r=rng.randint(1, min(d_in, d_out)),
        alpha=rng.choice([1, 2, 4, 8, 16, 3.5]),
        bias=rng.random() < 0.7,
    )
    case.update(fixed)
    return case


def _layers(n=2, **fixed):
    return lambda rng: [_layer_case(rng, **fixed) for _ in range(n)]


def _show_layer(c):
    return (
        f"d_in={c['d_in']}, d_out={c['d_out']}, r={c['r']}, alpha={c['alpha']}, "
        f"bias={c['bias']}"
    )


def _show_dict(v):
    return repr(v)[:300]


# ---------------------------------------------------------------- __init__
def _init_type(kind):
    def make(rng):
        if kind == "stats":  # big enough to see Kaiming uniform's standard deviation
            return [
                dict(
                    seed=rng.randrange(10**6),
                    d_in=256,
                    d_out=64,
                    r=16,
                    alpha=32,
                    bias=True,
                )
            ]
        if kind in ("bad", "bad_message"):
            d_in, d_out = rng.randint(3, 12), rng.randint(3, 12)
            cases = [
                dict(seed=1, d_in=d_in, d_out=d_out, r=0, alpha=4, bias=True, bad=True),
                dict(
                    seed=2,
                    d_in=d_in,
                    d_out=d_out,
                    r=min(d_in, d_out) + rng.randint(1, 3),
                    alpha=4,
                    bias=True,
                    bad=True,
                ),
            ]
            if kind == "bad_message":  # the message names r and the allowed range
                cases = [dict(c, mention=True) for c in cases]
            return cases
        return [_layer_case(rng) for _ in range(3)]

    return make


INIT_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_case):
    _base = _lab05_base(_case)
    if _case.get("bad"):
        try:
            LoRALinear(_base, _case["r"], _case["alpha"])
            return {"raised": None}
        except Exception as _e:
            return {"raised": type(_e).__name__, "message": str(_e)[:300]}
    _layer = LoRALinear(_base, _case["r"], _case["alpha"])
    _A, _B, _x, _w = _lab05_adapters(_case)
    with _torch.no_grad():
        _diff = float((_layer(_x) - _base(_x)).abs().max())
    return {
        "A_shape": list(_layer.lora_A.shape),
        "B_shape": list(_layer.lora_B.shape),
        "B_zero": bool(_torch.all(_layer.lora_B == 0)),
        "A_absmax": float(_layer.lora_A.abs().max()),
        "A_std": float(_layer.lora_A.float().std())
        if _layer.lora_A.numel() > 1
        else 0.0,
        "scaling": float(_layer.scaling),
        "trainable": sorted(n for n, p in _layer.named_parameters() if p.requires_grad),
        "base_is_same": _layer.base is _base,
        "out_diff": _diff,
    }
"""
)


def init_expect(case):
    if case.get("bad"):
        if case.get("mention"):
            top = min(case["d_in"], case["d_out"])
            return {"raised": "ValueError", "mentions": [str(case["r"]), str(top)]}
        return {"raised": "ValueError"}
    k, d, r = case["d_in"], case["d_out"], case["r"]
    want = {
        "A_shape": [r, k],
        "B_shape": [d, r],
        "bound": 1 / math.sqrt(k),
        "scaling": case["alpha"] / r,
    }
    if r * k >= 1000:  # Kaiming uniform: std = bound / sqrt(3)
        want["A_std"] = want["bound"] / math.sqrt(3)
    return want


def init_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    if "raised" in want:
        return raised_naming(got, want)
    bound = want["bound"]
    checks = {
        "lora_A 的形状应为 (r, d_in)": got.get("A_shape") == want["A_shape"],
        "lora_B 的形状应为 (d_out, r)": got.get("B_shape") == want["B_shape"],
        "lora_B 应全为 0": got.get("B_zero") is True,
        "|lora_A| ≤ 1/sqrt(d_in) 且不全为 0": _num(got.get("A_absmax"))
        and 0 < got["A_absmax"] <= bound * (1 + 1e-6),
        "scaling 应为 alpha / r": _num(got.get("scaling"))
        and abs(got["scaling"] - want["scaling"]) < 1e-9,
        "只有 lora_A、lora_B 可训练（base 冻结）": got.get("trainable")
        == ["lora_A", "lora_B"],
        "self.base 应是传入的那一层": got.get("base_is_same") is True,
        "初始化时输出应与 base 完全相同": got.get("out_diff") == 0.0,
    }
    if "A_std" in want:
        checks["std(lora_A) 应符合 Kaiming 均匀初始化"] = (
            _num(got.get("A_std"))
            and abs(got["A_std"] - want["A_std"]) < 0.15 * want["A_std"]
        )
    return _verdict(checks)


INIT_TYPES = [
    CaseType(
        "layers",
        "随机形状的层",
        3,
        _init_type("layers"),
        fix="lora_A 形状 (r, d_in)，lora_B 形状 (d_out, r) 且为 0；scaling = alpha / "
        "r；base 的参数 requires_grad=False",
    ),
    CaseType(
        "stats",
        "lora_A 的初始化分布（256 维输入）",
        1,
        _init_type("stats"),
        fix="lora_A 用与 nn.Linear 默认相同的 Kaiming 均匀初始化（本实验第 1 节；"
        "自检检查它的标准差）",
    ),
    CaseType(
        "bad",
        "非法的 r（0 或大于 min(d_in, d_out)）：ValueError",
        1,
        _init_type("bad"),
        fix="r < 1 或 r > min(d_in, d_out) 时 raise ValueError",
    ),
    CaseType(
        "bad_message",
        "非法的 r：ValueError 的信息写出 r 与允许范围",
        1,
        _init_type("bad_message"),
        fix="ValueError 的信息写出收到的 r 与允许的范围 1 到 min(d_in, d_out)（本实验"
        "第 2 节），让用错的人一眼看出该改成多少",
    ),
]


# ---------------------------------------------------------------- forward
FORWARD_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_case):
    _p = [_case["dropout"]] if "dropout" in _case else []
    _layer = LoRALinear(_lab05_base(_case), _case["r"], _case["alpha"], *_p)
    _A, _B, _x, _w = _lab05_adapters(_case)
    with _torch.no_grad():
        _layer.lora_A.copy_(_A)
        _layer.lora_B.copy_(_B)
    _layer.train()
    _torch.manual_seed(_case["seed"])  # the dropout mask, drawn as peft draws it
    if _case.get("watch"):  # the forward's largest new tensor (coursekit.tensor_watch)
        from coursekit.tensor_watch import largest_new_tensor as _largest

        _out, _big = _largest(_layer, _x)
    else:
        _out = _layer(_x)
    (_out * _w).sum().backward()
    _res = {
        "out": _out.detach().flatten().tolist(),
        "gA": _layer.lora_A.grad.flatten().tolist(),
        "gB": _layer.lora_B.grad.flatten().tolist(),
    }
    if _case.get("watch"):
        _res["largest"] = [_big.numel, list(_big.shape), _big.op]
    return _res
"""
)


@_quiet
def forward_expect(case):
    import torch

    model, layer, x, w = _peft_layer(_ns(), case)
    model.train()
    # peft's lora.Linear draws one dropout mask, on the LoRA branch's input only
    # (lora_B(lora_A(lora_dropout(x)))): the same draw as the student's dropout(x)
    torch.manual_seed(case["seed"])
    out = model(x)
    (out * w).sum().backward()
    out_ = {
        "out": out.detach().flatten().tolist(),
        "gA": layer.lora_A["default"].weight.grad.flatten().tolist(),
        "gB": layer.lora_B["default"].weight.grad.flatten().tolist(),
    }
    if case.get("watch"):  # no tensor of the forward may be as large as d x k
        out_["limit"] = case["d_in"] * case["d_out"]
    return out_


def forward_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    checks = {
        "输出与 peft 不同": _close(got.get("out"), want["out"]),
        "lora_A 的梯度与 peft 不同": _close(got.get("gA"), want["gA"]),
        "lora_B 的梯度与 peft 不同": _close(got.get("gB"), want["gB"]),
    }
    if "limit" in want:
        big = got.get("largest")
        ok = isinstance(big, list) and len(big) == 3 and _num(big[0])
        shape = f"形状 {tuple(big[1])}（{big[2]} 的结果）" if ok else "d×k"
        checks[f"前向构造了一个{shape}的 d×k 大小的张量"] = ok and (
            big[0] < want["limit"]
        )
    return _verdict(checks)


def _watched(rng):
    """Layers whose d_in, d_out exceed the 6 tokens of the input and the rank, so no
    legitimate tensor of the forward is as large as d x k."""
    return [
        dict(
            _layer_case(rng, r=rng.randint(1, 4)),
            d_in=rng.randint(16, 24),
            d_out=rng.randint(16, 24),
            watch=True,
        )
        for _ in range(2)
    ]


FORWARD_TYPES = [
    CaseType(
        "bias",
        "base 有偏置",
        1,
        _layers(2, bias=True),
        fix="输出是 base 的输出加上 LoRA 分支乘以缩放 alpha / r；base 的偏置只加一次"
        "（自检的 peft_and_ours(32, 24, r=4, alpha=8) 是同一类输入）",
    ),
    CaseType(
        "no_bias",
        "base 无偏置",
        1,
        _layers(2, bias=False),
        fix="没有偏置的 base 也一样：base 的输出加上乘了缩放的 LoRA 分支",
    ),
    CaseType(
        "rank_one",
        "r = 1、非整数 alpha",
        1,
        _layers(2, r=1, alpha=3.5),
        fix="scaling = alpha / r 是浮点数，不要用整数除法",
    ),
    CaseType(
        "dropout",
        "dropout > 0（训练模式）",
        1,
        _layers(2, dropout=0.5),
        fix="dropout 只作用在 LoRA 支路的输入上：base(x) + B A dropout(x) · scaling，"
        "base 看到的是原始的 x（自检的 peft_and_ours(..., dropout=0.5) 是同一类输入）",
    ),
    CaseType(
        "low_rank",
        "不构造 d×k 的矩阵（前向里新分配的最大张量小于 d×k）",
        2,
        _watched,
        fix="先乘 A 再乘 B：(x Aᵀ) Bᵀ，不要先算 B @ A 或把它加到 W0 上——训练时 "
        "d×k 的 BA 从不出现（自检调用 coursekit.tensor_watch 查的就是这一条）",
    ),
]


# ---------------------------------------------------------------- merge
MERGE_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_case):
    _base = _lab05_base(_case)
    _w0 = _base.weight.detach().clone()
    _layer = LoRALinear(_base, _case["r"], _case["alpha"])
    _A, _B, _x, _w = _lab05_adapters(_case)
    with _torch.no_grad():
        _layer.lora_A.copy_(_A)
        _layer.lora_B.copy_(_B)
    _m = _layer.merge()
    return {
        "is_linear": isinstance(_m, _nn.Linear),
        "weight": _m.weight.detach().flatten().tolist(),
        "bias": _m.bias.detach().flatten().tolist()
        if getattr(_m, "bias", None) is not None
        else None,
        "base_untouched": bool(_torch.equal(_layer.base.weight, _w0)),
    }
"""
)


@_quiet
def merge_expect(case):
    model, layer, x, w = _peft_layer(_ns(), case)
    merged = model.merge_and_unload().proj
    return {
        "weight": merged.weight.detach().flatten().tolist(),
        "bias": merged.bias.detach().flatten().tolist()
        if merged.bias is not None
        else None,
    }


def merge_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    wb, gb = want["bias"], got.get("bias")
    return _verdict(
        {
            "应返回一个 nn.Linear": got.get("is_linear") is True,
            "合并后的权重与 peft merge_and_unload() 不同": _close(
                got.get("weight"), want["weight"]
            ),
            "偏置": (wb is None and gb is None) or (wb is not None and _close(gb, wb)),
            "self.base 不能被修改": got.get("base_untouched") is True,
        }
    )


MERGE_TYPES = [
    CaseType(
        "bias",
        "base 有偏置",
        1,
        _layers(2, bias=True),
        fix="新层的权重是 W 加上乘了缩放的 B·A（注意相乘的顺序与形状），偏置照抄；"
        "不要原地改 self.base",
    ),
    CaseType(
        "no_bias",
        "base 无偏置",
        1,
        _layers(2, bias=False),
        fix="base 没有偏置时新层也没有偏置（bias=False）",
    ),
]


# ---------------------------------------------------------------- inject_lora
TARGET_SETS = {
    "attention": [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"]],
    "mlp": [["o_proj", "down_proj"], ["gate_proj", "up_proj", "down_proj", "q_proj"]],
}


def _inject_type(kind):
    def make(rng):
        heads = rng.choice([2, 4])
        case = dict(
            seed=rng.randrange(10**6),
            hidden=heads * rng.choice([8, 12]),
            heads=heads,
            inter=rng.choice([40, 56, 72]),
            layers=rng.randint(1, 2),
            vocab=rng.choice([48, 64, 96]),
            targets=rng.choice(TARGET_SETS.get(kind, [["q_proj"]])),
            r=rng.choice([2, 4, 8]),
            alpha=rng.choice([4, 8, 16]),
        )
        if kind == "bad":  # a name that exists nowhere, and a typo of a real one
            return [
                dict(case, targets=t, layers=1, bad=True)
                for t in (["not_a_module"], ["q_projj", "v_prj"])
            ]
        return [case]

    return make


INJECT_PROBE = (
    BUILD_SRC
    + r"""
from trainmem.measuring.models import build_model as _build_model


def CASE(_case):
    _model = _build_model(_lab05_llama_cfg(_case), seed=_case["seed"])
    if _case.get("bad"):
        try:
            inject_lora(_model, _case["targets"], _case["r"], _case["alpha"])
            return {"raised": None}
        except Exception as _e:
            return {"raised": type(_e).__name__}
    _names = list(inject_lora(_model, _case["targets"], _case["r"], _case["alpha"]))
    _scaling = _case["alpha"] / _case["r"]

    def _reference_forward(x, _m):
        return _m.base(x) + (x @ _m.lora_A.T @ _m.lora_B.T) * _scaling

    for _n in _names:
        _mod = _model.get_submodule(_n)
        _lab05_fill_adapter(_n, _mod.lora_A, _mod.lora_B, _case["seed"])
        # inject_lora is graded on its own: the student's LoRALinear.forward (graded by
        # lora_forward) is replaced by the reference one, so a bug there costs points
        # in lora_forward only
        _mod.forward = lambda x, _m=_mod: _reference_forward(x, _m)
    _ids = _lab05_ids(_case)
    _out = _model(input_ids=_ids, labels=_ids)
    _out.loss.backward()
    return {
        "names": _names,
        "trainable": int(
            sum(p.numel() for p in _model.parameters() if p.requires_grad)
        ),
        "logits": _out.logits.detach().flatten().tolist(),
        "grads": {
            _n: [
                _model.get_submodule(_n).lora_A.grad.flatten().tolist(),
                _model.get_submodule(_n).lora_B.grad.flatten().tolist(),
            ]
            for _n in _names
        },
    }
"""
)


@_quiet
def inject_expect(case):
    if case.get("bad"):
        return {"raised": "ValueError"}
    from peft import LoraConfig, get_peft_model

    from trainmem.measuring.models import build_model

    ns = _ns()
    model = get_peft_model(
        build_model(ns["_lab05_llama_cfg"](case), seed=case["seed"]),
        LoraConfig(
            r=case["r"], lora_alpha=case["alpha"], target_modules=case["targets"]
        ),
    )
    inner = model.base_model.model
    names = [
        n
        for n, m in inner.named_modules()
        if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})
    ]
    for n in names:
        mod = inner.get_submodule(n)
        ns["_lab05_fill_adapter"](
            n, mod.lora_A["default"].weight, mod.lora_B["default"].weight, case["seed"]
        )
    ids = ns["_lab05_ids"](case)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return {
        "names": names,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "logits": out.logits.detach().flatten().tolist(),
        "grads": {
            n: [
                inner.get_submodule(n).lora_A["default"].weight.grad.flatten().tolist(),
                inner.get_submodule(n).lora_B["default"].weight.grad.flatten().tolist(),
            ]
            for n in names
        },
    }


def inject_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    if "raised" in want:
        return (
            got.get("raised") == "ValueError",
            f"目标一个都匹配不到时应抛出 ValueError，得到 {got.get('raised')}",
        )
    grads = got.get("grads") if isinstance(got.get("grads"), dict) else {}
    grads_ok = set(grads) == set(want["grads"]) and all(
        isinstance(grads[n], list)
        and len(grads[n]) == 2
        and _close(grads[n][0], w[0], 1e-4, 1e-6)
        and _close(grads[n][1], w[1], 1e-4, 1e-6)
        for n, w in want["grads"].items()
    )
    return _verdict(
        {
            "替换的模块（个数与顺序应与 peft 相同）": got.get("names") == want["names"],
            "可训练参数量（应与 peft 相同）": got.get("trainable") == want["trainable"],
            "logits": _close(got.get("logits"), want["logits"], 1e-4, 1e-5),
            "LoRA 的梯度": grads_ok,
        }
    )


def _show_llama(c):
    return (
        f"Llama hidden={c['hidden']}, layers={c['layers']}, targets={c['targets']}, "
        f"r={c['r']}, alpha={c['alpha']}"
    )


def _show_inject_value(v):
    if isinstance(v, dict) and "names" in v:
        return f"names={v['names']}, trainable={v.get('trainable')}"
    return repr(v)[:300]


INJECT_TYPES = [
    CaseType(
        "attention",
        "注意力投影（q/k/v/o_proj）",
        1,
        _inject_type("attention"),
        fix="遍历 model.named_modules()，名字的最后一段在 targets 里的 nn.Linear 换成 "
        "LoRALinear；"
        "先冻结整个模型",
    ),
    CaseType(
        "mlp",
        "含 MLP 投影（gate/up/down_proj）",
        1,
        _inject_type("mlp"),
        fix="按名字的最后一段匹配（down_proj 也在 MLP 里）；返回替换过的完整模块名",
    ),
    CaseType(
        "bad",
        "目标匹配不到任何模块：ValueError",
        1,
        _inject_type("bad"),
        fix="一个模块都没替换时 raise ValueError，说明哪些目标不存在",
    ),
]


QUESTIONS = [
    Question(
        "lora_init",
        points=2,
        cases=INIT_TYPES,
        expect=init_expect,
        compare=init_compare,
        probe=INIT_PROBE,
        show_input=_show_layer,
        show_value=_show_dict,
        description="LoRALinear.__init__：形状、B=0、A 为 Kaiming 均匀、"
        "scaling=alpha/r、冻结 base、非法 r 报 ValueError",
    ),
    Question(
        "lora_forward",
        points=3,
        cases=FORWARD_TYPES,
        expect=forward_expect,
        compare=forward_compare,
        probe=FORWARD_PROBE,
        show_input=_show_layer,
        description="LoRALinear.forward：输出与 A、B 的梯度与 peft 的 lora.Linear 一致"
        "（dropout 只在 LoRA 支路上），且不构造 d×k 的矩阵",
    ),
    Question(
        "lora_merge",
        points=2,
        cases=MERGE_TYPES,
        expect=merge_expect,
        compare=merge_compare,
        probe=MERGE_PROBE,
        show_input=_show_layer,
        description="LoRALinear.merge：新的 nn.Linear，权重与 peft merge_and_unload() "
        "一致，不改 base",
    ),
    Question(
        "inject_lora",
        points=3,
        cases=INJECT_TYPES,
        expect=inject_expect,
        compare=inject_compare,
        probe=INJECT_PROBE,
        show_input=_show_llama,
        show_value=_show_inject_value,
        description="inject_lora：在小 Llama 上替换目标层，可训练参数量、logits "
        "与梯度与 peft 一致；"
        "目标不存在时 ValueError",
    ),
]
