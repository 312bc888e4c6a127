"""Hidden tests for lab03 (memory estimator checked against measurement). Format:
tests/grading/README.md.

References are computed here, in the grader's process: the Llama parameter formula
(checked against transformers in tests/test_labs.py), the bytes-per-parameter table, and
the exact bytes of the small models the probe builds (derived from the layer shapes, not
from the student's kernel).
"""

from __future__ import annotations

from coursekit.grading import CaseType, Question
from coursekit.grading.checks import raised_naming

NOTEBOOK = "lab03_memory_estimator.ipynb"
CELL_TIMEOUT = 90
NOTEBOOK_TIMEOUT = 240
PROBE_TIMEOUT = 20

BYTES = {
    "fp32": (4, 4, 0, 4),
    "amp": (4, 4, 0, 4),
    "fp16_master": (2, 2, 4, 4),
    "bf16": (2, 2, 0, 2),
}
N_STATES = {"adamw": 2, "sgd_momentum": 1, "sgd": 0}


def ref_count_params(cfg: dict) -> int:
    V, h, inter = cfg["vocab_size"], cfg["hidden_size"], cfg["intermediate_size"]
    L, n, k = (
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
    )
    d = h // n
    per_layer = 2 * h * h + 2 * h * k * d + 3 * h * inter + 2 * h
    return (
        V * h
        + L * per_layer
        + h
        + (0 if cfg.get("tie_word_embeddings", False) else V * h)
    )


def random_llama_cfg(rng, kind: str = "any") -> dict:
    """A random Llama config; ``kind``: "mha" (k = n), "gqa" (k < n), "tied", or
    "any"."""
    n = (
        rng.choice([2, 4, 8, 16, 32, 64])
        if kind == "gqa"
        else rng.choice([1, 2, 4, 8, 16, 32, 64])
    )
    ks = [x for x in (1, 2, 4, 8, n) if n % x == 0]
    k = {"mha": n, "gqa": rng.choice([x for x in ks if x < n] or [1])}.get(
        kind, rng.choice(ks)
    )
    tied = kind == "tied" or (kind == "any" and rng.random() < 0.4)
    return {
        "vocab_size": rng.randint(100, 160000),
        "hidden_size": n * rng.choice([8, 16, 64, 128]),
        "intermediate_size": rng.randint(16, 30000),
        "num_hidden_layers": rng.randint(1, 96),
        "num_attention_heads": n,
        "num_key_value_heads": k,
        "tie_word_embeddings": tied,
    }


def _configs(kind):
    return lambda rng: [random_llama_cfg(rng, kind) for _ in range(8)]


def _int_compare(got, want):
    return isinstance(got, int) and not isinstance(got, bool) and got == want


def _show_cfg(cfg):
    short = {
        "vocab_size": "V",
        "hidden_size": "h",
        "intermediate_size": "I",
        "num_hidden_layers": "L",
        "num_attention_heads": "n",
        "num_key_value_heads": "k",
        "tie_word_embeddings": "tied",
    }
    return ", ".join(f"{short[k]}={v}" for k, v in cfg.items())


COUNT_TYPES = [
    CaseType(
        "mha",
        "多头注意力（k = n），不共享嵌入",
        1,
        lambda rng: [
            dict(random_llama_cfg(rng, "mha"), tie_word_embeddings=False)
            for _ in range(8)
        ],
        fix="每层：W_q、W_o 各 h·h，W_k、W_v 各 h·k·d，MLP 3·h·I，两个 RMSNorm 2h；"
        "再加嵌入 V·h、"
        "最后的 norm h 与 lm_head V·h",
    ),
    CaseType(
        "gqa",
        "分组查询注意力（k < n）",
        1,
        lambda rng: [
            dict(random_llama_cfg(rng, "gqa"), tie_word_embeddings=False)
            for _ in range(8)
        ],
        fix="GQA 时 W_k、W_v 的输出维度是 k·d（d = h / n），不是 h",
    ),
    CaseType(
        "tied",
        "共享嵌入（tie_word_embeddings=True，k = n）",
        1,
        # multi-head attention only: a GQA mistake must not show up here, under a fix
        # that talks about the embeddings
        lambda rng: [
            dict(random_llama_cfg(rng, "mha"), tie_word_embeddings=True)
            for _ in range(8)
        ],
        fix="tie_word_embeddings 为真时 lm_head 与嵌入共享同一个矩阵，不另计 V·h",
    ),
]

COUNT_PROBE = """
def CASE(cfg):
    return count_params(cfg)
"""


# ---------------------------------------------------------------- static_memory
def _mem_cases(precisions, optimizers=tuple(sorted(N_STATES))):
    def make(rng):
        return [[rng.randint(1, 10**11), p, o] for p in precisions for o in optimizers]

    return make


def _bad_names(rng):
    return [
        [1000, "fp8", "adamw"],
        [rng.randint(1, 10**9), "FP32", "sgd"],
        [1000, "fp32", "adam8bit"],
        [rng.randint(1, 10**9), "bf16", "Adam"],
        [10, "float16", "nope"],
    ]


def _bad_names_message(rng):
    """The bad names again, as ``{"args": ..., "mention": True}``: the message must
    list the allowed values of the name that is wrong."""
    return [{"args": c, "mention": True} for c in _bad_names(rng)]


def mem_expect(case):
    if isinstance(case, dict):  # the message's case type
        _, p, o = case["args"]
        allowed = sorted(BYTES) if p not in BYTES else sorted(N_STATES)
        return {"raised": "ValueError", "mentions": allowed}
    n, p, o = case
    if p not in BYTES or o not in N_STATES:
        return "ValueError"
    w, g, m, s = BYTES[p]
    d = {
        "weights": w * n,
        "grads": g * n,
        "master": m * n,
        "optimizer": N_STATES[o] * s * n,
    }
    d["total"] = sum(d.values())
    return d


def _mem_compare(got, want):
    if isinstance(want, dict) and "raised" in want:
        return raised_naming(got, want)
    if want == "ValueError":
        return got == "ValueError", "名字不在表里时要抛 ValueError"
    if not isinstance(got, dict):
        return False, ""
    wrong = [k for k in want if not _int_compare(got.get(k), want[k])]
    return not wrong, (
        "这些项不对（要求整数字节）：" + "、".join(wrong)
    ) if wrong else ""


MEM_PROBE = """
def CASE(case):
    if isinstance(case, dict):  # a bad name: the exception and its message
        try:
            static_memory(*case["args"])
            return {"raised": None}
        except Exception as e:
            return {"raised": type(e).__name__, "message": str(e)[:300]}
    try:
        r = static_memory(*case)
    except ValueError:
        return "ValueError"
    return {k: r[k] for k in ("weights", "grads", "master", "optimizer", "total")}
"""

MEM_TYPES = [
    CaseType(
        "fp32_amp",
        "precision = fp32 / amp",
        1,
        _mem_cases(["fp32", "amp"]),
        fix="fp32 与 amp 每个参数：权重 4、梯度 4、无主权重、每个优化器状态 4 字节",
    ),
    CaseType(
        "fp16_master",
        "precision = fp16_master",
        1,
        _mem_cases(["fp16_master"]),
        fix="fp16_master：权重 2、梯度 2、FP32 主权重 4、每个优化器状态 4 "
        "字节（状态跟主权重同精度）",
    ),
    CaseType(
        "bf16",
        "precision = bf16",
        1,
        _mem_cases(["bf16"]),
        fix="纯 bf16：权重、梯度、每个优化器状态都是 2 字节，没有主权重",
    ),
    CaseType(
        "bad_name",
        "不合法的 precision / optimizer 名字",
        1,
        _bad_names,
        fix="precision 或 optimizer 不在表里时 raise ValueError（名字区分大小写）",
    ),
    CaseType(
        "bad_name_message",
        "不合法的名字：ValueError 的信息列出允许的取值",
        1,
        _bad_names_message,
        fix="ValueError 的信息里列出错的那个参数允许的全部取值（本实验第 2 节："
        "precision 错列出四种精度，optimizer 错列出三种优化器）",
    ),
]


# ---------------------------------------------------------------- measure_static
def _measure_type(kind):
    def make(rng):
        cases = []
        for j in range(3):
            dims = [rng.randint(1, 24) for _ in range(rng.randint(2, 4))]
            layers = [
                [dims[i], dims[i + 1], rng.random() < 0.6] for i in range(len(dims) - 1)
            ]
            case = {
                "layers": layers,
                "frozen": [],
                "dtype": "float32",
                "opt": ["adamw", "sgd_momentum", "sgd"][j],
                "step": True,
            }
            if kind == "no_step":
                case["step"] = False
            elif kind == "adamw":
                case["opt"] = "adamw"
            elif kind == "frozen":
                layers.append([dims[-1], rng.randint(1, 24), True])
                case["frozen"] = sorted(
                    rng.sample(range(len(layers)), rng.randint(1, len(layers) - 1))
                )
            elif kind == "bf16":
                case["dtype"] = "bfloat16"
            cases.append(case)
        return cases

    return make


MEASURE_PROBE = """
import torch as _t


def CASE(case):
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
        opt = _t.optim.SGD(
            params, lr=1e-3, momentum=0.9 if case["opt"] == "sgd_momentum" else 0.0
        )
    if case["step"]:
        model(_t.randn(2, case["layers"][0][0], dtype=dt)).float().sum().backward()
        opt.step()
    r = measure_static(model, opt)
    return {k: r[k] for k in ("weights", "grads", "optimizer")}
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
    opt = {
        "adamw": 2 * n_train * elt + 4 * n_tensors,
        "sgd_momentum": n_train * elt,
        "sgd": 0,
    }[case["opt"]]
    return {"weights": weights, "grads": n_train * elt, "optimizer": opt}


def _measure_compare(got, want):
    if not isinstance(got, dict):
        return False, ""
    wrong = [k for k in want if not _int_compare(got.get(k), want[k])]
    return not wrong, (
        "这些项不对（要求整数字节）：" + "、".join(wrong)
    ) if wrong else ""


def _show_model(case):
    layers = ", ".join(f"Linear({i}, {o}, bias={b})" for i, o, b in case["layers"])
    return (
        f"Sequential({layers})，dtype={case['dtype']}，冻结层 "
        f"{case['frozen'] or '无'}，"
        f"优化器 {case['opt']}，{'已' if case['step'] else '未'} step"
    )


MEASURE_TYPES = [
    CaseType(
        "no_step",
        "还没有 step：梯度为 None、优化器状态为空",
        1,
        _measure_type("no_step"),
        fix="p.grad 为 None 时不计；optimizer.state 在第一次 step 之前是空的",
    ),
    CaseType(
        "adamw",
        "AdamW 一步之后（含标量 step 张量）",
        1,
        _measure_type("adamw"),
        fix="AdamW 的状态里除了 exp_avg、exp_avg_sq，还有一个标量张量 step（4 字节）："
        "所有张量都要计",
    ),
    CaseType(
        "sgd",
        "SGD（有/无 momentum）一步之后",
        1,
        _measure_type("sgd"),
        fix="SGD 带 momentum 时每个参数有一个 momentum_buffer；无 momentum "
        "时状态里可能是 None，要跳过",
    ),
    CaseType(
        "frozen",
        "部分层冻结（requires_grad=False）",
        1,
        _measure_type("frozen"),
        fix="冻结的参数仍算权重，但没有梯度，也不在优化器里",
    ),
    CaseType(
        "bf16",
        "bf16 模型",
        1,
        _measure_type("bf16"),
        fix="字节数 = numel() * element_size()，bf16 每个元素 2 字节",
    ),
]


QUESTIONS = [
    Question(
        "count_params",
        points=3,
        cases=COUNT_TYPES,
        expect=ref_count_params,
        compare=_int_compare,
        probe=COUNT_PROBE,
        show_input=_show_cfg,
        description="count_params：Llama 参数量（MHA、GQA、共享嵌入）",
    ),
    Question(
        "static_memory",
        points=3,
        cases=MEM_TYPES,
        expect=mem_expect,
        compare=_mem_compare,
        probe=MEM_PROBE,
        description="static_memory：四种精度 × 三种优化器的字节数；非法名字抛 "
        "ValueError",
    ),
    Question(
        "measure_static",
        points=4,
        cases=MEASURE_TYPES,
        expect=ref_measure,
        compare=_measure_compare,
        probe=MEASURE_PROBE,
        show_input=_show_model,
        description="measure_static：逐张量测量权重/梯度/优化器状态（冻结层、bf16、未 "
        "step、AdamW 的 step）",
    ),
]
