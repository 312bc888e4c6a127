"""Hidden tests for lab03 (memory estimator checked against measurement). Format: tests/grading/README.md.

References are computed here, in the grader's process: the Llama parameter formula (checked against
transformers in tests/test_labs.py), the bytes-per-parameter table, and the exact bytes of the small
models the probe builds (derived from the layer shapes, not from the student's kernel).
"""
from __future__ import annotations

from coursekit.grading import Question

NOTEBOOK = "lab03_memory_estimator.ipynb"
CELL_TIMEOUT = 90
NOTEBOOK_TIMEOUT = 240
PROBE_TIMEOUT = 20

BYTES = {"fp32": (4, 4, 0, 4), "amp": (4, 4, 0, 4), "fp16_master": (2, 2, 4, 4), "bf16": (2, 2, 0, 2)}
N_STATES = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}


def ref_count_params(cfg: dict) -> int:
    V, h, I = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    L, n, k = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // n
    per_layer = 2 * h * h + 2 * h * k * d + 3 * h * I + 2 * h
    return V * h + L * per_layer + h + (0 if cfg.get("tie_word_embeddings", False) else V * h)


def random_llama_cfg(rng) -> dict:
    n = rng.choice([1, 2, 4, 8, 16, 32, 64])
    k = rng.choice([x for x in (1, 2, 4, 8, n) if n % x == 0])
    return {"vocab_size": rng.randint(100, 160000), "hidden_size": n * rng.choice([8, 16, 64, 128]),
            "intermediate_size": rng.randint(16, 30000), "num_hidden_layers": rng.randint(1, 96),
            "num_attention_heads": n, "num_key_value_heads": k, "tie_word_embeddings": rng.random() < 0.4}


def _count_inputs(rng):
    return [random_llama_cfg(rng) for _ in range(25)]


def _count_check(inputs, result):
    want = [ref_count_params(c) for c in inputs]
    if not isinstance(result, list) or len(result) != len(want):
        return 0.0, "expected one int per config"
    bad = [i for i, (w, g) in enumerate(zip(want, result)) if g != w]
    if not bad:
        return 1.0, f"all {len(want)} configs correct (GQA and tied embeddings included)"
    i = bad[0]
    return 1 - len(bad) / len(want), f"{len(bad)} of {len(want)} wrong; e.g. {inputs[i]}: got {result[i]}, expected {want[i]}"


def _mem_inputs(rng):
    cases = [[rng.randint(1, 10**11), rng.choice(sorted(BYTES)), rng.choice(sorted(N_STATES))] for _ in range(20)]
    return cases + [[1000, "fp8", "adamw"], [1000, "fp32", "adam8bit"]]


MEM_PROBE = """
RESULT = []
for n, precision, optimizer in INPUTS:
    try:
        r = static_memory(n, precision, optimizer)
        RESULT.append({k: int(r[k]) for k in ("weights", "grads", "master", "optimizer", "total")})
    except ValueError as e:
        RESULT.append("ValueError")
    except Exception as e:
        RESULT.append(type(e).__name__)
"""


def _mem_check(inputs, result):
    want = []
    for n, p, o in inputs:
        if p not in BYTES or o not in N_STATES:
            want.append("ValueError")
            continue
        w, g, m, s = BYTES[p]
        d = {"weights": w * n, "grads": g * n, "master": m * n, "optimizer": N_STATES[o] * s * n}
        d["total"] = sum(d.values())
        want.append(d)
    if not isinstance(result, list) or len(result) != len(want):
        return 0.0, "expected one result per case"
    bad = [i for i, (w, g) in enumerate(zip(want, result)) if g != w]
    if not bad:
        return 1.0, f"all {len(want)} cases correct (bad names raise ValueError)"
    i = bad[0]
    return 1 - len(bad) / len(want), f"{len(bad)} of {len(want)} wrong; e.g. {inputs[i]}: got {result[i]}, expected {want[i]}"


def _measure_inputs(rng):
    cases = []
    for j in range(8):
        dims = [rng.randint(1, 24) for _ in range(rng.randint(2, 4))]
        layers = [[dims[i], dims[i + 1], rng.random() < 0.6] for i in range(len(dims) - 1)]
        frozen = [i for i in range(len(layers) - 1) if rng.random() < 0.3]
        cases.append({"layers": layers, "frozen": frozen, "dtype": rng.choice(["float32", "bfloat16"]),
                      "opt": ["adamw", "sgd_momentum", "sgd"][j % 3], "step": j != 4})
    return cases


MEASURE_PROBE = """
import torch as _t
RESULT = []
for case in INPUTS:
    _t.manual_seed(0)
    dt = getattr(_t, case["dtype"])
    layers = [_t.nn.Linear(i, o, bias=b, dtype=dt) for i, o, b in case["layers"]]
    model = _t.nn.Sequential(*layers)
    for idx in case["frozen"]:
        for p in layers[idx].parameters():
            p.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    if case["opt"] == "adamw":
        opt = _t.optim.AdamW(params, lr=1e-3)
    else:
        opt = _t.optim.SGD(params, lr=1e-3, momentum=0.9 if case["opt"] == "sgd_momentum" else 0.0)
    if case["step"]:
        model(_t.randn(2, case["layers"][0][0], dtype=dt)).float().sum().backward()
        opt.step()
    r = measure_static(model, opt)
    RESULT.append({k: int(r[k]) for k in ("weights", "grads", "optimizer")})
"""


def ref_measure(case) -> dict:
    elt = 4 if case["dtype"] == "float32" else 2
    sizes = [(i * o, o if b else 0) for i, o, b in case["layers"]]
    weights = sum(w + b for w, b in sizes) * elt
    train = [(w, b) for j, (w, b) in enumerate(sizes) if j not in case["frozen"]]
    n_train = sum(w + b for w, b in train)
    n_tensors = sum(1 + (b > 0) for w, b in train)
    if not case["step"]:
        return {"weights": weights, "grads": 0, "optimizer": 0}
    opt = {"adamw": 2 * n_train * elt + 4 * n_tensors, "sgd_momentum": n_train * elt, "sgd": 0}[case["opt"]]
    return {"weights": weights, "grads": n_train * elt, "optimizer": opt}


def _measure_check(inputs, result):
    want = [ref_measure(c) for c in inputs]
    if not isinstance(result, list) or len(result) != len(want):
        return 0.0, "expected one dict per model"
    bad = [i for i, (w, g) in enumerate(zip(want, result)) if g != w]
    if not bad:
        return 1.0, f"all {len(want)} models measured exactly (frozen layers, bf16, no-step case included)"
    i = bad[0]
    return 1 - len(bad) / len(want), f"{len(bad)} of {len(want)} wrong; e.g. {inputs[i]}: got {result[i]}, expected {want[i]}"


QUESTIONS = [
    Question("count_params", points=3, make_inputs=_count_inputs, check=_count_check,
             probe="RESULT = [int(count_params(c)) for c in INPUTS]",
             description="count_params：Llama 参数量（GQA、共享嵌入）"),
    Question("static_memory", points=3, make_inputs=_mem_inputs, probe=MEM_PROBE, check=_mem_check,
             description="static_memory：四种精度 × 三种优化器的字节数；非法名字抛 ValueError"),
    Question("measure_static", points=4, make_inputs=_measure_inputs, probe=MEASURE_PROBE, check=_measure_check,
             description="measure_static：逐张量测量权重/梯度/优化器状态（冻结层、bf16、未 step）"),
]
