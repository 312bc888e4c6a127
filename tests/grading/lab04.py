"""Hidden tests for lab04 (gradient accumulation + activation checkpointing). Format:
tests/grading/README.md.

Every case is built from plain numbers drawn here (``make_inputs``): weights come from a
``random.Random`` inside :data:`BUILD_SRC`, which runs both in the student's kernel (the
probe) and in this process (the check), so model, data and the reference never depend on
torch's RNG or on the lab's own code. References are computed here: the big-batch
gradient, autograd's saved tensors (counted with our own ``saved_tensors_hooks``), plain
block outputs/gradients.
"""

from __future__ import annotations

from coursekit.grading import CaseType, Question
from coursekit.grading.checks import close_floats, exec_source, raised_naming

NOTEBOOK = "lab04_accumulation_checkpointing.ipynb"
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 240
PROBE_TIMEOUT = 30

# the tolerance stated in the lab (fp32, only the summation order differs)
RTOL, ATOL = (
    1e-5,
    1e-6,
)

# Builders shared by the probe (student's kernel) and the checks (this process).
BUILD_SRC = r'''
import random as _random
import torch as _torch
import torch.nn as _nn


def _lab04_fill(module, seed):
    rng = _random.Random(seed)
    with _torch.no_grad():
        for p in module.parameters():
            vals = [rng.uniform(-0.5, 0.5) for _ in range(p.numel())]
            p.copy_(_torch.tensor(vals, dtype=_torch.float32).reshape(p.shape))
    return module


def _lab04_mlp(case):
    m = _nn.Sequential(
        _nn.Linear(case["d_in"], case["d_hidden"]),
        _nn.Tanh(),
        _nn.Linear(case["d_hidden"], case["n_classes"]),
    )
    return _lab04_fill(m, case["seed"])


def _lab04_data(case):
    rng = _random.Random(case["seed"] + 1)
    x = _torch.tensor(
        [[rng.gauss(0, 1) for _ in range(case["d_in"])] for _ in range(case["n"])]
    )
    y = _torch.tensor([rng.randrange(case["n_classes"]) for _ in range(case["n"])])
    return x, y


def _lab04_blocks(case):
    d = case["d"]
    blocks = _nn.ModuleList(
        _nn.Sequential(
            _nn.LayerNorm(d), _nn.Linear(d, 2 * d), _nn.GELU(), _nn.Linear(2 * d, d)
        )
        for _ in range(case["n_blocks"])
    )
    return _lab04_fill(blocks, case["seed"])


def _lab04_x(case):
    rng = _random.Random(case["seed"] + 7)
    return _torch.tensor(
        [[rng.gauss(0, 1) for _ in range(case["d"])] for _ in range(case["batch"])]
    )


def _lab04_grads(model):
    return {
        n: (p.grad.detach().flatten().tolist() if p.grad is not None else None)
        for n, p in model.named_parameters()
    }


def _lab04_saved(fn, exclude=()):
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with _torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return int(sum(seen.values()))


def _lab04_saved_cases(case):
    """fn factories for saved_activation_bytes: (fn, exclude) per kind."""
    g = _random.Random(case["seed"])
    B, d_in, d_out = case["batch"], case["d_in"], case["d_out"]
    lin = _lab04_fill(_nn.Linear(d_in, d_out), case["seed"])
    x = _torch.tensor([[g.gauss(0, 1) for _ in range(d_in)] for _ in range(B)])
    kind = case["kind"]
    if kind == "linear_nograd_input":
        return (lambda: lin(x)), list(lin.parameters())
    if kind == "linear_grad_input":
        xr = x.clone().requires_grad_(True)
        return (lambda: lin(xr)), list(lin.parameters())
    if kind == "linear_no_exclude":
        xr = x.clone().requires_grad_(True)
        return (lambda: lin(xr)), []
    if kind == "mlp_tanh":
        mlp = _lab04_fill(
            _nn.Sequential(
                _nn.Linear(d_in, d_out), _nn.Tanh(), _nn.Linear(d_out, d_in)
            ),
            case["seed"],
        )
        return (lambda: mlp(x)), list(mlp.parameters())
    if kind == "no_grad":

        def f():
            with _torch.no_grad():
                return lin(x)

        return f, list(lin.parameters())
    if kind == "shared_view":
        xr = x.clone().requires_grad_(True)
        return (lambda: (xr * xr.t().t()).sum()), []
    raise ValueError(kind)
'''


_NS: dict = {}


def _ns() -> dict:
    """The builders, run once in this process (the same source the probe runs in the
    kernel)."""
    if not _NS:
        _NS.update(exec_source(BUILD_SRC))
    return _NS


def _close(got, want, rtol=RTOL, atol=ATOL) -> bool:
    return close_floats(got, want, rtol, atol)


def _grads_match(got, want: dict) -> bool:
    return (
        isinstance(got, dict)
        and set(got) == set(want)
        and all(
            (w is None and got[n] is None) or (w is not None and _close(got[n], w))
            for n, w in want.items()
        )
    )


TOL = f"（rtol={RTOL}, atol={ATOL}）"


# ----------------------------------------------------------------
# accumulate_grads(_weighted)
def _mlp_case(rng, n, **extra):
    return dict(
        seed=rng.randrange(10**6),
        d_in=rng.randint(3, 10),
        d_hidden=rng.randint(4, 16),
        n_classes=rng.randint(2, 6),
        n=n,
        **extra,
    )


def _mentioned(cases, kind):
    """The bad cases of a ``*_message`` case type: their message is graded too."""
    return (
        [dict(c, mention=True) for c in cases] if kind.endswith("_message") else cases
    )


def _accum_type(kind):
    def make(rng):
        if kind in ("bad", "bad_message"):
            # N not a multiple of accum; accum < 1 (0, or one dividing N)
            cases = [
                _mlp_case(rng, a * rng.randint(2, 4) + 1, accum=a, bad=True)
                for a in (3, 4)
            ] + [
                _mlp_case(rng, 2 * rng.randint(2, 8), accum=a, bad=True)
                for a in (0, -2)
            ]
            return _mentioned(cases, kind)
        return [
            _mlp_case(rng, a * rng.randint(1, 5), accum=a, bad=False)
            for a in (rng.choice([2, 3, 4, 5]) for _ in range(4))
        ]

    return make


def _weighted_type(kind):
    def make(rng):
        if kind in ("bad", "bad_message"):
            return _mentioned(
                [_mlp_case(rng, 9, mbs=m, bad=True) for m in (0, -1)], kind
            )
        cases = []
        for _ in range(4 if kind == "uneven" else 2):
            mbs = rng.randint(2, 6)
            n = mbs * rng.randint(1, 4) + (
                rng.randint(1, mbs - 1) if kind == "uneven" else 0
            )
            cases.append(_mlp_case(rng, n, mbs=mbs, bad=False))
        return cases

    return make


ACCUM_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_case):
    _model = _lab04_mlp(_case)
    _x, _y = _lab04_data(_case)
    _sizes = []
    _model.register_forward_pre_hook(lambda _m, _a: _sizes.append(int(_a[0].shape[0])))
    _loss = _nn.CrossEntropyLoss()
    if _case["bad"]:
        try:
            accumulate_grads(_model, _loss, _x, _y, _case["accum"])
            return {"raised": None}
        except Exception as _e:
            return {"raised": type(_e).__name__, "message": str(_e)[:300]}
    accumulate_grads(
        _model, _loss, _x, _y, _case["accum"]
    )  # a first call leaves grads behind
    _ret = accumulate_grads(
        _model, _loss, _x, _y, _case["accum"]
    )  # the second must start from zero
    return {
        "sizes": _sizes,
        "returned": {k: v.detach().flatten().tolist() for k, v in dict(_ret).items()},
        "dot_grad": _lab04_grads(_model),
    }
"""
)

WEIGHTED_PROBE = ACCUM_PROBE.replace(
    "accumulate_grads(", "accumulate_grads_weighted("
).replace('_case["accum"]', '_case["mbs"]')


def _sizes(case) -> list[int]:
    if "accum" in case:
        return [case["n"] // case["accum"]] * case["accum"]
    full, rest = divmod(case["n"], case["mbs"])
    return [case["mbs"]] * full + ([rest] if rest else [])


def accum_expect(case):
    if case["bad"]:
        want = {"raised": "ValueError"}
        if case.get("mention"):  # what the lab says the message names
            want["mentions"] = (
                [str(case["accum"]), str(case["n"])]
                if "accum" in case
                else ["micro_batch_size", str(case["mbs"])]
            )
        return want
    import torch

    ns = _ns()
    model = ns["_lab04_mlp"](case)
    x, y = ns["_lab04_data"](case)
    torch.nn.CrossEntropyLoss()(model(x), y).backward()
    return {"grads": ns["_lab04_grads"](model), "sizes": _sizes(case) * 2}


def accum_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    if "raised" in want:
        return raised_naming(got, want)
    wrong = []
    if not _grads_match(got.get("returned"), want["grads"]):
        wrong.append("返回的 {name: grad} 与整批梯度不一致" + TOL)
    if not _grads_match(got.get("dot_grad"), want["grads"]):
        wrong.append("参数的 .grad 与整批梯度不一致（第二次调用要先清零）")
    if got.get("sizes") != want["sizes"]:
        wrong.append(
            "两次调用中模型看到的 micro-batch 大小不对（每个 micro-batch 的序列数应"
            "不超过 micro_bs，合起来正好是整批）"
        )
    return not wrong, "；".join(wrong)


def _show_mlp(case):
    k = (
        f"accum={case['accum']}"
        if "accum" in case
        else f"micro_batch_size={case['mbs']}"
    )
    mlp = f"MLP({case['d_in']}→{case['d_hidden']}→{case['n_classes']})"
    return f"{mlp}，N={case['n']}，{k}"


def _show_result(v):
    if isinstance(v, dict) and "sizes" in v:
        return f"micro-batch 大小 {v['sizes']}（梯度见上面的说明）"
    return repr(v)[:300]


ACCUM_TYPES = [
    CaseType(
        "divisible",
        "N 能被 accum 整除：梯度与整批一致",
        3,
        _accum_type("ok"),
        fix="先 model.zero_grad()；把 (x, y) 切成 accum 块，每块 loss / accum 再 "
        "backward",
    ),
    CaseType(
        "bad",
        "N 不能被 accum 整除，或 accum < 1：ValueError",
        1,
        _accum_type("bad"),
        fix="accum < 1 或 N % accum != 0 时 raise ValueError（在任何计算之前；"
        "N % 0 抛的是 ZeroDivisionError，负的 accum 也可能整除 N）",
    ),
    CaseType(
        "bad_message",
        "ValueError 的信息写出 accum 与 N",
        1,
        _accum_type("bad_message"),
        fix="ValueError 的信息里写出收到的 accum 与样本数 N（本实验练习 1 的要求）",
    ),
]
WEIGHTED_TYPES = [
    CaseType(
        "uneven",
        "最后一块更小：按 n_j / N 加权",
        2,
        _weighted_type("uneven"),
        fix="每块的平均 loss 乘以 n_j / N 再 backward，最后一块更小时权重也更小",
    ),
    CaseType(
        "even",
        "N 是 micro_batch_size 的整数倍",
        1,
        _weighted_type("even"),
        fix="整除时每块权重都是 micro_batch_size / N",
    ),
    CaseType(
        "bad",
        "micro_batch_size < 1：ValueError",
        1,
        _weighted_type("bad"),
        fix="micro_batch_size < 1 时 raise ValueError",
    ),
    CaseType(
        "bad_message",
        "ValueError 的信息写出参数名 micro_batch_size 与取值",
        1,
        _weighted_type("bad_message"),
        fix="ValueError 的信息里写出参数名 micro_batch_size 与收到的值（本实验练习 2 "
        "的要求）",
    ),
]


# ----------------------------------------------------------------
# saved_activation_bytes
KINDS = {
    "linear_nograd_input": "Linear，输入不需要梯度",
    "linear_grad_input": "Linear，输入需要梯度",
    "linear_no_exclude": "Linear，exclude 为空（参数也计入）",
    "mlp_tanh": "Linear-Tanh-Linear",
    "no_grad": "torch.no_grad() 下（什么都不保存）",
    "shared_view": "同一存储的两个视图（只计一次）",
}
KIND_FIX = {
    "linear_nograd_input": (
        "用 torch.autograd.graph.saved_tensors_hooks 记录 pack 收到的张量；按存储去重"
    ),
    "linear_grad_input": "输入需要梯度时 autograd 也保存权重：exclude 里的存储不计",
    "linear_no_exclude": "exclude 为空时参数的存储也要计入",
    "mlp_tanh": "每个被保存的存储都计一次：Linear 的输入、tanh 的输出……",
    "no_grad": "no_grad 下 pack 不会被调用，结果应为 0",
    "shared_view": (
        "同一存储（t.untyped_storage().data_ptr() 相同）只计一次，"
        "字节数用 untyped_storage().nbytes()"
    ),
}


def _saved_type(kind):
    return lambda rng: [
        dict(
            kind=kind,
            seed=rng.randrange(10**6),
            batch=rng.randint(2, 9),
            d_in=rng.randint(3, 12),
            d_out=rng.randint(3, 12),
        )
        for _ in range(2)
    ]


SAVED_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_case):
    _fn, _excl = _lab04_saved_cases(_case)
    return saved_activation_bytes(_fn, exclude=_excl)
"""
)


def saved_expect(case):
    fn, excl = _ns()["_lab04_saved_cases"](case)
    return _ns()["_lab04_saved"](fn, excl)


def _int_equal(got, want):
    return isinstance(got, int) and not isinstance(got, bool) and got == want


SAVED_TYPES = [
    CaseType(k, label, 1, _saved_type(k), fix=KIND_FIX[k]) for k, label in KINDS.items()
]


# ---------------------------------------------------------------- run_blocks
def _blocks_type(ck, x_grad):
    return lambda rng: [
        dict(
            seed=rng.randrange(10**6),
            n_blocks=rng.randint(2, 5),
            d=rng.choice([4, 6, 8, 12]),
            batch=rng.randint(2, 6),
            x_requires_grad=x_grad,
            ck=ck,
        )
        for _ in range(2)
    ]


BLOCKS_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_case):
    _blocks = _lab04_blocks(_case)
    _count = [0]
    for _b in _blocks:
        _b.register_forward_pre_hook(lambda *_a: _count.__setitem__(0, _count[0] + 1))
    _x = _lab04_x(_case).requires_grad_(_case["x_requires_grad"])
    _params = list(_blocks.parameters())
    _out_box = []
    _saved = _lab04_saved(
        lambda: _out_box.append(run_blocks(_blocks, _x, _case["ck"])), exclude=_params
    )
    _out = _out_box[0]
    if _out.requires_grad:
        _out.pow(2).mean().backward()
    _forwards = _count[0]
    return {
        "out": _out.detach().flatten().tolist(),
        "saved": _saved,
        "forwards": _forwards,
        "x_grad": _x.grad.flatten().tolist() if _x.grad is not None else None,
        "grads": _lab04_grads(_blocks),
        "autograd_grad": _lab04_autograd_grad(_blocks, _case),
    }
"""
)
# torch.autograd.grad through the blocks (a fresh input that needs a gradient): the
# non-reentrant checkpoint supports it; the reentrant one raises in backward ("When
# use_reentrant=True, torch.utils.checkpoint is incompatible with .grad()", torch's
# CheckpointFunction.backward). True when it gives every parameter a gradient.
BLOCKS_PROBE += r"""
def _lab04_autograd_grad(_blocks, _case):
    import torch as _t
    _x = _lab04_x(_case).requires_grad_(True)
    _params = list(_blocks.parameters())
    try:
        _g = _t.autograd.grad(
            run_blocks(_blocks, _x, _case["ck"]).pow(2).mean(), _params,
            allow_unused=True,
        )
    except Exception:
        return False
    return all(g is not None for g in _g)
"""


def blocks_expect(case):
    ns = _ns()
    blocks = ns["_lab04_blocks"](case)
    x = ns["_lab04_x"](case).requires_grad_(case["x_requires_grad"])
    box = []
    plain_saved = ns["_lab04_saved"](
        lambda: box.append(_plain(blocks, x)), list(blocks.parameters())
    )
    box[0].pow(2).mean().backward()
    L, B, d = case["n_blocks"], case["batch"], case["d"]
    return {
        "out": box[0].detach().flatten().tolist(),
        "grads": ns["_lab04_grads"](blocks),
        "x_grad": x.grad.flatten().tolist() if x.grad is not None else None,
        "saved": L * B * d * 4 if case["ck"] else plain_saved,
        "forwards": 2 * L if case["ck"] else L,
        "autograd_grad": True,
    }


def _ratio(got, want) -> str:
    """``got`` relative to the reference, without the reference's value."""
    if not isinstance(got, (int, float)) or isinstance(got, bool):
        return "（没有得到数）"
    if not want:
        return "（应为 0）"
    return f"（是参考的 {got / want:.0%}）"


def blocks_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    xg, wxg = got.get("x_grad"), want["x_grad"]
    saved_label = "保存给反向的字节数" + _ratio(got.get("saved"), want["saved"])
    forwards_label = "block 前向次数" + _ratio(got.get("forwards"), want["forwards"])
    checks = {
        "输出": _close(got.get("out"), want["out"]),
        "参数梯度": _grads_match(got.get("grads"), want["grads"]),
        "输入的梯度": (xg is None and wxg is None)
        or (wxg is not None and _close(xg, wxg)),
        saved_label: _int_equal(got.get("saved"), want["saved"]),
        forwards_label: got.get("forwards") == want["forwards"],
        "torch.autograd.grad 能求出参数梯度（非 reentrant 检查点）": got.get(
            "autograd_grad"
        )
        is want["autograd_grad"],
    }
    wrong = [k for k, ok in checks.items() if not ok]
    return not wrong, ("不对的是：" + "、".join(wrong)) if wrong else ""


def _show_blocks(c):
    return (
        f"{c['n_blocks']} 个 block，d={c['d']}，batch={c['batch']}，"
        f"x.requires_grad={c['x_requires_grad']}，"
        f"checkpointing={c['ck']}"
    )


def _show_blocks_value(v):
    return (
        f"saved={v.get('saved')}, forwards={v.get('forwards')}"
        if isinstance(v, dict)
        else repr(v)[:200]
    )


def _plain(blocks, x):
    h = x
    for b in blocks:
        h = b(h)
    return h


BLOCKS_TYPES = [
    CaseType(
        "plain",
        "不用检查点",
        1,
        _blocks_type(False, True),
        fix="checkpointing=False 时依次 h = block(h)",
    ),
    CaseType(
        "checkpointed",
        "检查点：同样的输出与梯度，只保存每个 block 的输入、每个 block 重算一次",
        3,
        _blocks_type(True, True),
        fix="checkpointing=True 时每个 block 都交给 torch.utils.checkpoint 的非 "
        "reentrant 检查点去调用（本实验第 4 节）；reentrant 版本不支持 "
        "torch.autograd.grad",
    ),
    CaseType(
        "input_no_grad",
        "检查点，输入不需要梯度：参数仍有梯度",
        1,
        _blocks_type(True, False),
        fix="use_reentrant=False 时输入不需要梯度参数也有梯度（reentrant "
        "版本会丢掉它们）",
    ),
]


QUESTIONS = [
    Question(
        "accumulate_grads",
        points=3,
        cases=ACCUM_TYPES,
        expect=accum_expect,
        compare=accum_compare,
        probe=ACCUM_PROBE,
        show_input=_show_mlp,
        show_value=_show_result,
        description="accumulate_grads：loss/accum 的累积循环，"
        "梯度与整批一致（rtol=1e-5, atol=1e-6），"
        "先清零、按 micro-batch 前向、不整除或 accum<1 时 ValueError",
    ),
    Question(
        "accumulate_grads_weighted",
        points=2,
        cases=WEIGHTED_TYPES,
        expect=accum_expect,
        compare=accum_compare,
        probe=WEIGHTED_PROBE,
        show_input=_show_mlp,
        show_value=_show_result,
        description="accumulate_grads_weighted：最后一块更小时按 n_j/N 加权，"
        "梯度与整批一致；"
        "micro_batch_size<1 时 ValueError",
    ),
    Question(
        "saved_activation_bytes",
        points=2,
        cases=SAVED_TYPES,
        expect=saved_expect,
        compare=_int_equal,
        probe=SAVED_PROBE,
        description="saved_activation_bytes：saved_tensors_hooks 计数，"
        "同一存储只计一次，排除 exclude 的存储",
    ),
    Question(
        "run_blocks",
        points=3,
        cases=BLOCKS_TYPES,
        expect=blocks_expect,
        compare=blocks_compare,
        probe=BLOCKS_PROBE,
        show_input=_show_blocks,
        show_value=_show_blocks_value,
        description="run_blocks：checkpoint(..., use_reentrant=False) 包装每个 block；"
        "输出与梯度不变（backward 与 torch.autograd.grad 都可用），"
        "只保存 block 输入，每个 block 重算一次（输入不需要梯度时参数仍有梯度）",
    ),
]
