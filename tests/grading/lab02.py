"""Hidden tests for lab02 (dynamic loss scaling + fp32 master weights). Format: tests/grading/README.md.

The reference scaler and step are written here and run in the grader's process.
"""
from __future__ import annotations

import math

from coursekit.grading import Question

NOTEBOOK = "lab02_loss_scaling.ipynb"
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 180
PROBE_TIMEOUT = 15


# ---------------------------------------------------------------- has_inf_or_nan
def _inf_inputs(rng):
    cases = []
    for _ in range(40):
        tensors = []
        for _ in range(rng.randint(0, 4)):
            dtype = rng.choice(["float16", "float32", "bfloat16"])
            vals = [rng.uniform(-70000, 70000) if dtype != "float16" else rng.uniform(-65504, 65504)
                    for _ in range(rng.randint(1, 12))]
            if rng.random() < 0.25:
                vals[rng.randrange(len(vals))] = rng.choice([math.inf, -math.inf, math.nan])
            tensors.append([dtype, vals])
        cases.append(tensors)
    cases.append([])
    cases.append([["float16", [65504.0, -65504.0]]])
    return cases


INF_PROBE = """
import torch as _t
RESULT = [has_inf_or_nan([_t.tensor(v, dtype=getattr(_t, d)) for d, v in case]) for case in INPUTS]
RESULT = [r if isinstance(r, bool) else bool(r) for r in RESULT]
"""


def _inf_check(inputs, result):
    want = [any(not math.isfinite(x) for _, vals in case for x in vals) for case in inputs]
    if not isinstance(result, list) or len(result) != len(want):
        return 0.0, "expected one bool per case"
    bad = [i for i, (w, g) in enumerate(zip(want, result)) if g is not w]
    if not bad:
        return 1.0, f"all {len(want)} cases correct"
    return 1 - len(bad) / len(want), f"{len(bad)} of {len(want)} wrong; e.g. tensors {inputs[bad[0]]} → expected {want[bad[0]]}"


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


def _scaler_inputs(rng):
    cases = []
    for _ in range(12):
        cases.append({"init_scale": 2.0 ** rng.randint(4, 24), "growth_factor": rng.choice([2.0, 4.0]),
                      "backoff_factor": rng.choice([0.5, 0.25]), "growth_interval": rng.randint(1, 6),
                      "flags": [rng.random() < 0.3 for _ in range(rng.randint(10, 60))]})
    cases.append({"defaults": True, "flags": [False] * 5 + [True]})
    return cases


SCALER_PROBE = """
RESULT = []
for case in INPUTS:
    if case.get("defaults"):
        s = DynamicLossScaler()
    else:
        s = DynamicLossScaler(init_scale=case["init_scale"], growth_factor=case["growth_factor"],
                              backoff_factor=case["backoff_factor"], growth_interval=case["growth_interval"])
    trace = [float(s.scale)]
    for f in case["flags"]:
        s.update(f)
        trace.append(float(s.scale))
    RESULT.append(trace)
"""


def _scaler_check(inputs, result):
    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, "expected one trace per case"
    good = 0
    first_bad = None
    for case, got in zip(inputs, result):
        if case.get("defaults"):
            want = [65536.0] + ref_trace(65536.0, 2.0, 0.5, 2000, case["flags"])
        else:
            want = [case["init_scale"]] + ref_trace(case["init_scale"], case["growth_factor"], case["backoff_factor"],
                                                    case["growth_interval"], case["flags"])
        if got == want:
            good += 1
        elif first_bad is None:
            first_bad = (case, got, want)
    if first_bad is None:
        return 1.0, f"all {len(inputs)} scale traces correct (defaults included)"
    case, got, want = first_bad
    return good / len(inputs), (f"{len(inputs) - good} of {len(inputs)} traces wrong; e.g. {case}: "
                                f"got {str(got)[:300]}, expected {str(want)[:300]}")


# ---------------------------------------------------------------- mixed_precision_sgd_step
def _fp16(x: float) -> float:
    import struct

    return struct.unpack("<e", struct.pack("<e", x))[0] if abs(x) < 65504 else math.copysign(math.inf, x)


def _step_inputs(rng):
    cases = []
    for k in range(14):
        scale = 2.0 ** rng.randint(6, 16)
        shapes = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        master = [[rng.gauss(0, 1) for _ in range(n)] for n in shapes]
        grads = [[_fp16(rng.gauss(0, 1e-3) * scale) for _ in range(n)] for n in shapes]
        if k % 4 == 3:
            t = rng.randrange(len(grads))
            grads[t][rng.randrange(len(grads[t]))] = rng.choice([math.inf, math.nan])
        cases.append({"scale": scale, "lr": rng.choice([0.1, 0.01, 1.0]), "master": master, "grads": grads})
    return cases


STEP_PROBE = """
import torch as _t
class _StubScaler:
    def __init__(self, scale):
        self.scale = scale
        self.calls = []
    def update(self, found_inf):
        self.calls.append(bool(found_inf))
RESULT = []
for case in INPUTS:
    master = [_t.tensor(m, dtype=_t.float32) for m in case["master"]]
    model = [m.half().requires_grad_() for m in master]
    for p, g in zip(model, case["grads"]):
        p.grad = _t.tensor(g, dtype=_t.float16)
    sc = _StubScaler(case["scale"])
    applied = mixed_precision_sgd_step(master, model, sc, case["lr"])
    RESULT.append({"applied": applied if isinstance(applied, bool) else repr(applied),
                   "master": [m.float().tolist() for m in master],
                   "master_dtype": [str(m.dtype) for m in master],
                   "model": [p.detach().float().tolist() for p in model],
                   "model_dtype": [str(p.dtype) for p in model],
                   "calls": sc.calls})
"""


def _close(a, b, rel):
    return all(abs(x - y) <= rel * max(1e-6, abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


def _step_check(inputs, result):
    import torch

    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, "expected one result per case"
    good, why = 0, ""
    for case, got in zip(inputs, result):
        overflow = any(not math.isfinite(x) for g in case["grads"] for x in g)
        m32 = [torch.tensor(m, dtype=torch.float32) for m in case["master"]]
        if not overflow:
            m32 = [m - case["lr"] * (torch.tensor(g, dtype=torch.float16).float() / case["scale"])
                   for m, g in zip(m32, case["grads"])]
        want_master = [m.tolist() for m in m32]
        want_model = [m.half().float().tolist() for m in m32]
        try:
            ok = (got["applied"] is (not overflow) and got["calls"] == [overflow]
                  and all(d == "torch.float32" for d in got["master_dtype"])
                  and all(d == "torch.float16" for d in got["model_dtype"])
                  and all(_close(g, w, 1e-6) for g, w in zip(got["master"], want_master))
                  and all(_close(g, w, 1e-3) for g, w in zip(got["model"], want_model))
                  and len(got["master"]) == len(want_master))
        except (KeyError, TypeError):
            ok = False
        if ok:
            good += 1
        elif not why:
            why = (f"e.g. scale={case['scale']}, lr={case['lr']}, overflow={overflow}: expected applied={not overflow}, "
                   f"scaler.update calls [{overflow}], master {str(want_master)[:200]}; got {str(got)[:400]}")
    if good == len(inputs):
        return 1.0, f"all {len(inputs)} steps correct (overflow steps skipped)"
    return good / len(inputs), f"{len(inputs) - good} of {len(inputs)} steps wrong; {why}"


QUESTIONS = [
    Question("has_inf_or_nan", points=2, make_inputs=_inf_inputs, probe=INF_PROBE, check=_inf_check,
             description="has_inf_or_nan：fp16/bf16/fp32 张量列表中的 inf/NaN"),
    Question("dynamic_loss_scaler", points=4, make_inputs=_scaler_inputs, probe=SCALER_PROBE, check=_scaler_check,
             description="DynamicLossScaler：默认参数、退避、按 growth_interval 增长"),
    Question("master_weight_step", points=4, make_inputs=_step_inputs, probe=STEP_PROBE, check=_step_check,
             description="mixed_precision_sgd_step：溢出跳步、反缩放、FP32 主权重更新、拷回 FP16"),
]
