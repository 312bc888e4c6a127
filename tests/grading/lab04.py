"""Hidden tests for lab04 (gradient accumulation + activation checkpointing). Format: tests/grading/README.md.

Every case is built from plain numbers drawn here (``make_inputs``): weights come from a
``random.Random`` inside :data:`BUILD_SRC`, which runs both in the student's kernel (the probe) and
in this process (the check), so model, data and the reference never depend on torch's RNG or on the
lab's own code. References are computed here: the big-batch gradient, autograd's saved tensors
(counted with our own ``saved_tensors_hooks``), plain block outputs/gradients.
"""
from __future__ import annotations


from coursekit.grading import Question
from coursekit.grading.checks import close_floats, exec_source

NOTEBOOK = "lab04_accumulation_checkpointing.ipynb"
CELL_TIMEOUT = 60
NOTEBOOK_TIMEOUT = 240
PROBE_TIMEOUT = 30

RTOL, ATOL = 1e-5, 1e-6  # the tolerance stated in the lab (fp32, only the summation order differs)

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
    m = _nn.Sequential(_nn.Linear(case["d_in"], case["d_hidden"]), _nn.Tanh(),
                       _nn.Linear(case["d_hidden"], case["n_classes"]))
    return _lab04_fill(m, case["seed"])


def _lab04_data(case):
    rng = _random.Random(case["seed"] + 1)
    x = _torch.tensor([[rng.gauss(0, 1) for _ in range(case["d_in"])] for _ in range(case["n"])])
    y = _torch.tensor([rng.randrange(case["n_classes"]) for _ in range(case["n"])])
    return x, y


def _lab04_blocks(case):
    d = case["d"]
    blocks = _nn.ModuleList(
        _nn.Sequential(_nn.LayerNorm(d), _nn.Linear(d, 2 * d), _nn.GELU(), _nn.Linear(2 * d, d))
        for _ in range(case["n_blocks"]))
    return _lab04_fill(blocks, case["seed"])


def _lab04_x(case):
    rng = _random.Random(case["seed"] + 7)
    return _torch.tensor([[rng.gauss(0, 1) for _ in range(case["d"])] for _ in range(case["batch"])])


def _lab04_grads(model):
    return {n: (p.grad.detach().flatten().tolist() if p.grad is not None else None)
            for n, p in model.named_parameters()}


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
        mlp = _lab04_fill(_nn.Sequential(_nn.Linear(d_in, d_out), _nn.Tanh(), _nn.Linear(d_out, d_in)), case["seed"])
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


def _ns() -> dict:
    return exec_source(BUILD_SRC)


def _close(got, want, rtol=RTOL, atol=ATOL) -> bool:
    return close_floats(got, want, rtol, atol)


def _grads_match(got: dict, want: dict) -> tuple[bool, str]:
    if not isinstance(got, dict) or set(got) != set(want):
        return False, f"expected gradients for parameters {sorted(want)}, got {type(got).__name__}"
    for name, w in want.items():
        if not _close(got[name], w):
            return False, f"gradient of {name} differs from the big-batch gradient beyond rtol={RTOL}, atol={ATOL}"
    return True, ""


def _ref_full_grads(ns, case):
    import torch

    model = ns["_lab04_mlp"](case)
    x, y = ns["_lab04_data"](case)
    torch.nn.CrossEntropyLoss()(model(x), y).backward()
    return ns["_lab04_grads"](model)


# ---------------------------------------------------------------- accumulate_grads
def _accum_inputs(rng):
    cases = []
    for _ in range(4):
        accum = rng.choice([2, 3, 4, 5])
        cases.append(dict(seed=rng.randrange(10**6), d_in=rng.randint(3, 10), d_hidden=rng.randint(4, 16),
                          n_classes=rng.randint(2, 6), n=accum * rng.randint(1, 5), accum=accum, bad=False))
    accum = rng.choice([3, 4, 5])
    cases.append(dict(seed=rng.randrange(10**6), d_in=4, d_hidden=6, n_classes=3,
                      n=accum * rng.randint(2, 4) + 1, accum=accum, bad=True))
    return cases


ACCUM_PROBE = BUILD_SRC + r'''
RESULT = []
for _case in INPUTS:
    _model = _lab04_mlp(_case)
    _x, _y = _lab04_data(_case)
    _sizes = []
    _model.register_forward_pre_hook(lambda _m, _a: _sizes.append(int(_a[0].shape[0])))
    _loss = _nn.CrossEntropyLoss()
    if _case["bad"]:
        try:
            accumulate_grads(_model, _loss, _x, _y, _case["accum"])
            RESULT.append({"raised": None})
        except Exception as _e:
            RESULT.append({"raised": type(_e).__name__})
        continue
    accumulate_grads(_model, _loss, _x, _y, _case["accum"])          # a first call leaves grads behind
    _ret = accumulate_grads(_model, _loss, _x, _y, _case["accum"])   # the second must start from zero
    RESULT.append({"sizes": _sizes,
                   "returned": {k: v.detach().flatten().tolist() for k, v in dict(_ret).items()},
                   "dot_grad": _lab04_grads(_model)})
'''


def _check_accum(inputs, result, sizes_of):
    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, f"expected {len(inputs)} results, got {type(result).__name__}"
    ns = _ns()
    score, msgs, bad_ok, good_full = 0.0, [], 0, 0
    for case, got in zip(inputs, result):
        label = f"N={case['n']}, {'accum' if 'accum' in case else 'micro_batch_size'}={case.get('accum', case.get('mbs'))}"
        if not isinstance(got, dict):
            msgs.append(f"{label}: no result")
            continue
        if case["bad"]:
            if got.get("raised") == "ValueError":
                bad_ok += 1
            else:
                msgs.append(f"{label}: expected ValueError, got {got.get('raised')}")
            continue
        want = _ref_full_grads(ns, case)
        ok_ret, why = _grads_match(got.get("returned"), want)
        ok_dot, why_dot = _grads_match(got.get("dot_grad"), want)
        want_sizes = sizes_of(case) * 2
        ok_sizes = got.get("sizes") == want_sizes
        # the micro-batch loop is the exercise: right gradients from one big batch earn little
        part = (0.6 * ok_ret + 0.4 * ok_dot) if ok_sizes else 0.2 * ok_ret
        good_full += part == 1
        score += part
        if part < 1:
            msgs.append(f"{label}: " + "; ".join(
                m for m in [why if not ok_ret else "", ("(.grad) " + why_dot) if not ok_dot else "",
                            f"model saw micro-batch sizes {got.get('sizes')} over two calls, expected {want_sizes}"
                            if not ok_sizes else ""] if m))
    if good_full:        # raising ValueError only counts for a function that also computes something right
        score += bad_ok
    elif bad_ok:
        msgs.append("ValueError cases not counted: no valid case was fully correct")
    frac = score / len(inputs)
    return frac, "all cases correct" if not msgs else " | ".join(msgs[:3])


def check_accumulate(inputs, result):
    return _check_accum(inputs, result, lambda c: [c["n"] // c["accum"]] * c["accum"])


# ---------------------------------------------------------------- accumulate_grads_weighted
def _weighted_inputs(rng):
    cases = []
    for _ in range(4):
        mbs = rng.randint(2, 6)
        n = mbs * rng.randint(1, 4) + rng.randint(1, mbs - 1)      # never a multiple: last chunk smaller
        cases.append(dict(seed=rng.randrange(10**6), d_in=rng.randint(3, 10), d_hidden=rng.randint(4, 16),
                          n_classes=rng.randint(2, 6), n=n, mbs=mbs, bad=False))
    cases.append(dict(seed=rng.randrange(10**6), d_in=4, d_hidden=6, n_classes=3, n=12, mbs=4, bad=False))
    cases.append(dict(seed=rng.randrange(10**6), d_in=4, d_hidden=6, n_classes=3, n=9, mbs=0, bad=True))
    return cases


WEIGHTED_PROBE = ACCUM_PROBE.replace("accumulate_grads(", "accumulate_grads_weighted(").replace(
    '_case["accum"]', '_case["mbs"]')


def check_weighted(inputs, result):
    def sizes(c):
        full, rest = divmod(c["n"], c["mbs"])
        return [c["mbs"]] * full + ([rest] if rest else [])
    return _check_accum(inputs, result, sizes)


# ---------------------------------------------------------------- saved_activation_bytes
KINDS = ["linear_nograd_input", "linear_grad_input", "linear_no_exclude", "mlp_tanh", "no_grad", "shared_view"]


def _saved_inputs(rng):
    return [dict(kind=k, seed=rng.randrange(10**6), batch=rng.randint(2, 9), d_in=rng.randint(3, 12),
                 d_out=rng.randint(3, 12)) for k in KINDS]


SAVED_PROBE = BUILD_SRC + r'''
RESULT = []
for _case in INPUTS:
    _fn, _excl = _lab04_saved_cases(_case)
    RESULT.append(int(saved_activation_bytes(_fn, exclude=_excl)))
'''


def check_saved(inputs, result):
    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, f"expected {len(inputs)} integers, got {type(result).__name__}"
    ns = _ns()
    bad = []
    for case, got in zip(inputs, result):
        fn, excl = ns["_lab04_saved_cases"](case)
        want = ns["_lab04_saved"](fn, excl)
        if got != want:
            bad.append(f"{case['kind']} (B={case['batch']}, d_in={case['d_in']}, d_out={case['d_out']}): "
                       f"got {got}, expected {want} bytes")
    return 1 - len(bad) / len(inputs), "all cases correct" if not bad else "; ".join(bad[:2])


# ---------------------------------------------------------------- run_blocks
def _blocks_inputs(rng):
    return [dict(seed=rng.randrange(10**6), n_blocks=rng.randint(2, 5), d=rng.choice([4, 6, 8, 12]),
                 batch=rng.randint(2, 6), x_requires_grad=flag) for flag in (True, False)]


BLOCKS_PROBE = BUILD_SRC + r'''
RESULT = []
for _case in INPUTS:
    _entry = {}
    for _ck in (False, True):
        _blocks = _lab04_blocks(_case)
        _count = [0]
        for _b in _blocks:
            _b.register_forward_pre_hook(lambda *_a: _count.__setitem__(0, _count[0] + 1))
        _x = _lab04_x(_case).requires_grad_(_case["x_requires_grad"])
        _params = list(_blocks.parameters())
        _out_box = []
        _saved = _lab04_saved(lambda: _out_box.append(run_blocks(_blocks, _x, _ck)), exclude=_params)
        _out = _out_box[0]
        if _out.requires_grad:
            _out.pow(2).mean().backward()
        _entry[str(_ck)] = {"out": _out.detach().flatten().tolist(), "saved": _saved, "forwards": _count[0],
                            "x_grad": _x.grad.flatten().tolist() if _x.grad is not None else None,
                            "grads": _lab04_grads(_blocks)}
    RESULT.append(_entry)
'''


def check_blocks(inputs, result):
    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, f"expected {len(inputs)} results, got {type(result).__name__}"
    ns = _ns()
    score, msgs = 0.0, []
    for case, got in zip(inputs, result):
        blocks = ns["_lab04_blocks"](case)
        x = ns["_lab04_x"](case).requires_grad_(case["x_requires_grad"])
        params = list(blocks.parameters())
        box = []
        plain_saved = ns["_lab04_saved"](lambda: box.append(_plain(blocks, x)), params)
        out = box[0]
        out.pow(2).mean().backward()
        want_out = out.detach().flatten().tolist()
        want_grads = ns["_lab04_grads"](blocks)
        want_xg = x.grad.flatten().tolist() if x.grad is not None else None
        L, B, d = case["n_blocks"], case["batch"], case["d"]
        label = f"{L} blocks, d={d}, B={B}, x.requires_grad={case['x_requires_grad']}"
        if not isinstance(got, dict):
            msgs.append(f"{label}: no result")
            continue
        for ck, want_saved, want_fw in (("False", plain_saved, L), ("True", L * B * d * 4, 2 * L)):
            g = got.get(ck)
            if not isinstance(g, dict):
                msgs.append(f"{label}, checkpointing={ck}: no result")
                continue
            checks = {
                "output": _close(g.get("out"), want_out, 1e-5, 1e-6),
                "parameter gradients": _grads_match(g.get("grads"), want_grads)[0],
                "input gradient": (g.get("x_grad") is None and want_xg is None) or
                                  (want_xg is not None and _close(g.get("x_grad"), want_xg, 1e-5, 1e-6)),
                f"saved bytes (expected {want_saved})": g.get("saved") == want_saved,
                f"block forwards (expected {want_fw})": g.get("forwards") == want_fw,
            }
            v = list(checks.values())
            if ck == "False":      # plain run: a quarter of the case
                score += 0.25 * all(v)
            else:                  # checkpointed run: same numbers (1/4), and really checkpointed (3/4)
                score += 0.75 * (0.25 * all(v[:3]) + 0.75 * (v[3] and v[4]))
            wrong = [k for k, ok in checks.items() if not ok]
            if wrong:
                msgs.append(f"{label}, checkpointing={ck}: wrong " + ", ".join(wrong)
                            + (f" (got saved={g.get('saved')}, forwards={g.get('forwards')})" if ck == "True" else ""))
    return score / len(inputs), "all cases correct" if not msgs else " | ".join(msgs[:3])


def _plain(blocks, x):
    h = x
    for b in blocks:
        h = b(h)
    return h


QUESTIONS = [
    Question("accumulate_grads", points=3, make_inputs=_accum_inputs, probe=ACCUM_PROBE,
             check=check_accumulate,
             description="accumulate_grads：loss/accum 的累积循环，梯度与整批一致（rtol=1e-5, atol=1e-6），"
                         "先清零、按 micro-batch 前向、不整除时 ValueError"),
    Question("accumulate_grads_weighted", points=2, make_inputs=_weighted_inputs, probe=WEIGHTED_PROBE,
             check=check_weighted,
             description="accumulate_grads_weighted：最后一块更小时按 n_j/N 加权，梯度与整批一致；"
                         "micro_batch_size<1 时 ValueError"),
    Question("saved_activation_bytes", points=2, make_inputs=_saved_inputs, probe=SAVED_PROBE,
             check=check_saved,
             description="saved_activation_bytes：saved_tensors_hooks 计数，同一存储只计一次，排除 exclude 的存储"),
    Question("run_blocks", points=3, make_inputs=_blocks_inputs, probe=BLOCKS_PROBE, check=check_blocks,
             description="run_blocks：checkpoint(..., use_reentrant=False) 包装每个 block；输出与梯度不变，"
                         "只保存 block 输入，每个 block 重算一次（输入不需要梯度时参数仍有梯度）"),
]
