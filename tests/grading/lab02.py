"""Hidden tests for lab02 (dynamic loss scaling + fp32 master weights). Format:
tests/grading/README.md.

The reference scaler and step are written here and run in the grader's process.
"""

from __future__ import annotations

import math

from coursekit.grading import CaseType, Question
from coursekit.grading.checks import same_bool

NOTEBOOK = "lab02_loss_scaling.ipynb"
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 180
PROBE_TIMEOUT = 15


# ---------------------------------------------------------------- has_inf_or_nan
DTYPES = ["float16", "bfloat16", "float32"]
FMAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
}


def _finite_list(rng, dtype):
    vals = [
        rng.uniform(-1, 1) * 10 ** rng.randint(-6, 4) for _ in range(rng.randint(1, 8))
    ]
    if rng.random() < 0.5:
        # largest finite value
        vals[rng.randrange(len(vals))] = rng.choice([1, -1]) * FMAX[dtype]
    return [dtype, vals]


def _tensors(special):
    """Cases of 1-3 tensors, each dtype in turn; ``special`` is put into one tensor (or
    none)."""

    def make(rng):
        cases = []
        for i in range(12):
            case = [
                _finite_list(rng, rng.choice(DTYPES)) for _ in range(rng.randint(0, 2))
            ]
            bad = _finite_list(rng, DTYPES[i % 3])
            if special is not None:
                bad[1][rng.randrange(len(bad[1]))] = rng.choice(special)
            case.insert(rng.randint(0, len(case)), bad)
            cases.append(case)
        return cases + ([[]] if special is None else [])

    return make


INF_PROBE = """
import torch as _t
def CASE(case):
    return has_inf_or_nan([_t.tensor(v, dtype=getattr(_t, d)) for d, v in case])
"""


def _inf_expect(case):
    return any(not math.isfinite(x) for _, vals in case for x in vals)


def _show_tensors(case):
    return "[" + ", ".join(f"tensor({vals}, dtype=torch.{d})" for d, vals in case) + "]"


INF_TYPES = [
    CaseType(
        "finite",
        "全部有限（含各 dtype 的最大有限值、空列表）",
        2,
        _tensors(None),
        fix="有限值（包括 fp16 的 65504）不算溢出；空列表返回 False",
    ),
    CaseType(
        "inf",
        "某个张量含 ±inf（fp16/bf16/fp32 各 4 个）",
        1,
        _tensors([math.inf, -math.inf]),
        fix="torch.isfinite(t) 对 inf 为 False；每个张量、每种 dtype 都要检查",
    ),
    CaseType(
        "nan",
        "某个张量含 NaN（fp16/bf16/fp32 各 4 个）",
        1,
        _tensors([math.nan]),
        fix="NaN 与任何数比较都是 False（x > 65504 抓不到 NaN）；用 torch.isfinite 或 "
        "torch.isnan",
    ),
]


# ---------------------------------------------------------------- DynamicLossScaler
def ref_trace(init_scale, growth_factor, backoff_factor, growth_interval, flags):
    scale, tracker, out = float(init_scale), 0, []
    for f in flags:
        if f:
            scale *= backoff_factor
            tracker = 0
        else:
            tracker += 1
            if tracker == growth_interval:
                scale *= growth_factor
                tracker = 0
        out.append(scale)
    return out


def _scaler_case(rng, flags, **fixed):
    case = {
        "init_scale": 2.0 ** rng.randint(4, 24),
        "growth_factor": rng.choice([2.0, 4.0]),
        "backoff_factor": rng.choice([0.5, 0.25]),
        "growth_interval": rng.randint(1, 6),
    }
    case.update(fixed)
    case["flags"] = flags(case)
    return case


def _scaler_type(kind):
    def make(rng):
        if kind == "defaults":  # default arguments: growth only after 2000 clean steps
            return [
                {"defaults": True, "flags": [False] * n + extra}
                for n, extra in ((1999, []), (2000, [True]), (3, [True, True]))
            ]
        if kind == "growth":
            return [
                _scaler_case(
                    rng, lambda c: [False] * rng.randint(c["growth_interval"], 20)
                )
                for _ in range(4)
            ]
        if kind == "backoff":
            return [
                _scaler_case(rng, lambda c: [True] * rng.randint(1, 5))
                for _ in range(4)
            ]
        if kind == "reset":  # an overflow resets the count of clean steps
            return [
                _scaler_case(
                    rng,
                    lambda c: (
                        ([False] * (c["growth_interval"] - 1) + [True]) * 3
                        + [False] * c["growth_interval"]
                    ),
                    growth_interval=rng.randint(2, 6),
                )
                for _ in range(4)
            ]
        return [
            _scaler_case(
                rng, lambda c: [rng.random() < 0.3 for _ in range(rng.randint(10, 60))]
            )
            for _ in range(6)
        ]

    return make


SCALER_PROBE = """
def CASE(case):
    if case.get("defaults"):
        s = DynamicLossScaler()
    else:
        s = DynamicLossScaler(
            init_scale=case["init_scale"],
            growth_factor=case["growth_factor"],
            backoff_factor=case["backoff_factor"],
            growth_interval=case["growth_interval"],
        )
    trace = [s.scale]
    for f in case["flags"]:
        s.update(f)
        trace.append(s.scale)
    return trace
"""


def _scaler_expect(case):
    if case.get("defaults"):
        return [65536.0] + ref_trace(65536.0, 2.0, 0.5, 2000, case["flags"])
    return [case["init_scale"]] + ref_trace(
        case["init_scale"],
        case["growth_factor"],
        case["backoff_factor"],
        case["growth_interval"],
        case["flags"],
    )


def _scaler_compare(got, want):
    if not isinstance(got, list) or len(got) != len(want):
        return False, "scale 的个数不对（应为初值 + 每次 update 之后各一个）"
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(g, float) or g != w:
            where = f"第 {i} 次 update 之后的 scale" if i else "初始 scale"
            if not isinstance(g, float):
                return False, f"{where}应为 float，得到 {type(g).__name__}"
            prev = want[i - 1] if i else None
            what = (
                "应减半（这一步发现了 inf/NaN）"
                if i and w < prev
                else "应翻倍（连续 growth_interval 步没有 inf/NaN）"
                if i and w > prev
                else "应不变"
                if i
                else "应等于 init_scale"
            )
            return False, f"{where}{what}；你的是正确值的 {g / w:.3g} 倍"
    return True, ""


def _show_scaler(case):
    flags = "".join("T" if f else "F" for f in case["flags"])
    flags = (
        flags
        if len(flags) <= 40
        else f"{flags[:20]}…（共 {len(flags)} 步）…{flags[-10:]}"
    )
    args = (
        "默认参数"
        if case.get("defaults")
        else f"init_scale={case['init_scale']:g}, "
        f"growth_factor={case['growth_factor']:g}, "
        f"backoff_factor={case['backoff_factor']:g}, "
        f"growth_interval={case['growth_interval']}"
    )
    return f"DynamicLossScaler({args})，依次 update(found_inf)：{flags}（T=溢出）"


def _show_trace(v):
    return (
        str(v)
        if not isinstance(v, list) or len(v) <= 12
        else f"[… 最后 6 个：{v[-6:]}]（共 {len(v)} 个）"
    )


SCALER_TYPES = [
    CaseType(
        "defaults",
        "默认参数（2000 步后才增长）",
        1,
        _scaler_type("defaults"),
        fix="默认值 init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, "
        "growth_interval=2000；"
        "scale 用 float",
    ),
    CaseType(
        "growth",
        "连续正常步：每 growth_interval 步乘 growth_factor",
        1,
        _scaler_type("growth"),
        fix="连续正常步数达到 growth_interval 时乘 growth_factor，并把计数清零",
    ),
    CaseType(
        "backoff",
        "溢出：乘 backoff_factor",
        1,
        _scaler_type("backoff"),
        fix="found_inf 为真时 scale *= backoff_factor",
    ),
    CaseType(
        "reset",
        "溢出会清零正常步计数",
        1,
        _scaler_type("reset"),
        fix="溢出时也要把连续正常步数清零，否则下一次增长来得太早",
    ),
    CaseType(
        "mixed",
        "随机的溢出序列",
        1,
        _scaler_type("mixed"),
        fix="按规则逐步模拟：溢出 → 退避并清零；否则计数 +1，满 growth_interval "
        "就增长并清零",
    ),
]


# ----------------------------------------------------------------
# mixed_precision_sgd_step
def _fp16(x: float) -> float:
    import struct

    return (
        struct.unpack("<e", struct.pack("<e", x))[0]
        if abs(x) < 65504
        else math.copysign(math.inf, x)
    )


def _step_type(special):
    def make(rng):
        cases = []
        for _ in range(5):
            scale = 2.0 ** rng.randint(6, 16)
            shapes = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
            master = [[rng.gauss(0, 1) for _ in range(n)] for n in shapes]
            grads = [
                [_fp16(rng.gauss(0, 1e-3) * scale) for _ in range(n)] for n in shapes
            ]
            if special is not None:
                t = rng.randrange(len(grads))
                grads[t][rng.randrange(len(grads[t]))] = rng.choice(special)
            cases.append(
                {
                    "scale": scale,
                    "lr": rng.choice([0.1, 0.01, 1.0]),
                    "master": master,
                    "grads": grads,
                }
            )
        return cases

    return make


STEP_PROBE = """
import torch as _t
class _StubScaler:
    # update() changes the scale, so unscaling after update() gives a wrong step
    def __init__(self, scale):
        self.scale = scale
        self.calls = []
    def update(self, found_inf):
        self.calls.append(found_inf if isinstance(found_inf, bool) else repr(found_inf))
        self.scale = self.scale * (0.5 if found_inf else 2.0)
def CASE(case):
    master = [_t.tensor(m, dtype=_t.float32) for m in case["master"]]
    model = [m.half().requires_grad_() for m in master]
    for p, g in zip(model, case["grads"]):
        p.grad = _t.tensor(g, dtype=_t.float16)
    sc = _StubScaler(case["scale"])
    applied = mixed_precision_sgd_step(master, model, sc, case["lr"])
    return {"applied": applied if isinstance(applied, bool) else repr(applied),
            "master": [m.float().tolist() for m in master],
            "master_dtype": [str(m.dtype) for m in master],
            "model": [p.detach().float().tolist() for p in model],
            "model_dtype": [str(p.dtype) for p in model],
            "calls": sc.calls}
"""


def _close(a, b, rel):
    return (
        isinstance(a, list)
        and len(a) == len(b)
        and all(
            isinstance(x, float) and abs(x - y) <= rel * max(1e-6, abs(y))
            for x, y in zip(a, b)
        )
    )


def _step_expect(case):
    import torch

    overflow = any(not math.isfinite(x) for g in case["grads"] for x in g)
    m32 = [torch.tensor(m, dtype=torch.float32) for m in case["master"]]
    if not overflow:
        m32 = [
            m
            - case["lr"]
            * (torch.tensor(g, dtype=torch.float16).float() / case["scale"])
            for m, g in zip(m32, case["grads"])
        ]
    return {
        "applied": not overflow,
        "calls": [overflow],
        "master": [m.tolist() for m in m32],
        "model": [m.half().float().tolist() for m in m32],
    }


def _step_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    checks = [
        (
            got.get("applied") is want["applied"],
            "返回值（这一步有没有真的更新参数，bool）不对",
        ),
        (
            got.get("calls") == want["calls"],
            "scaler.update 应恰好调用一次（参数：这一步的梯度里有没有 inf/NaN）",
        ),
        (
            got.get("master_dtype") == ["torch.float32"] * len(want["master"]),
            "主权重必须保持 float32",
        ),
        (
            got.get("model_dtype") == ["torch.float16"] * len(want["model"]),
            "模型参数必须保持 float16",
        ),
        (
            isinstance(got.get("master"), list)
            and len(got["master"]) == len(want["master"])
            and all(_close(g, w, 1e-6) for g, w in zip(got["master"], want["master"])),
            "主权重应为 master - lr * grad.float() / scale（用本步、update 之前的 "
            "scale）"
            if want["applied"]
            else "溢出时主权重不能改变",
        ),
        (
            isinstance(got.get("model"), list)
            and len(got["model"]) == len(want["model"])
            and all(_close(g, w, 1e-3) for g, w in zip(got["model"], want["model"])),
            "更新后的主权重要拷回 FP16 参数",
        ),
    ]
    wrong = [why for ok, why in checks if not ok]
    return not wrong, "；".join(wrong)


def _show_step(case):
    return (
        f"scale={case['scale']:g}, lr={case['lr']:g}, master={case['master']}, "
        f"grads={case['grads']}"
    )


def _show_step_value(v):
    if not isinstance(v, dict):
        return repr(v)[:300]
    return ", ".join(f"{k}={v.get(k)!r}" for k in ("applied", "calls", "master"))[:400]


STEP_TYPES = [
    CaseType(
        "finite",
        "有限梯度：反缩放并更新",
        2,
        _step_type(None),
        fix="g = p.grad.float() / scaler.scale（先于 update）；m -= lr * g；"
        "p.copy_(m)；"
        "scaler.update(False)；返回 True",
    ),
    CaseType(
        "inf",
        "梯度含 inf：跳过这一步",
        1,
        _step_type([math.inf, -math.inf]),
        fix="任一梯度含 inf 时不更新任何参数，调用 scaler.update(True)，返回 False",
    ),
    CaseType(
        "nan",
        "梯度含 NaN：跳过这一步",
        1,
        _step_type([math.nan]),
        fix="NaN 也要跳步：用 has_inf_or_nan 检查全部梯度",
    ),
]


QUESTIONS = [
    Question(
        "has_inf_or_nan",
        points=2,
        cases=INF_TYPES,
        expect=_inf_expect,
        compare=same_bool,
        probe=INF_PROBE,
        show_input=_show_tensors,
        description="has_inf_or_nan：fp16/bf16/fp32 张量列表中的 inf/NaN（返回 bool）",
    ),
    Question(
        "dynamic_loss_scaler",
        points=4,
        cases=SCALER_TYPES,
        expect=_scaler_expect,
        compare=_scaler_compare,
        probe=SCALER_PROBE,
        show_input=_show_scaler,
        show_value=_show_trace,
        description="DynamicLossScaler：默认参数、退避、按 growth_interval 增长",
    ),
    Question(
        "master_weight_step",
        points=4,
        cases=STEP_TYPES,
        expect=_step_expect,
        compare=_step_compare,
        probe=STEP_PROBE,
        show_input=_show_step,
        show_value=_show_step_value,
        description="mixed_precision_sgd_step：溢出跳步、反缩放、FP32 主权重更新、拷回 "
        "FP16",
    ),
]
