"""Hidden tests for lab06 (capstone: a LoRA fine-tune planned to fit a memory budget;
token-weighted accumulation, dtype by compute capability, prediction vs measurement).

Format: tests/grading/README.md. Models are tiny Llamas with fresh shapes drawn here,
built with ``trainmem.measuring.models.build_model(config, seed=...)`` on both sides
(same seed → same weights); LoRA weights and batches come from ``random.Random`` in
:data:`BUILD_SRC`, which runs in the student's kernel (probe) and in this process
(check). The references (peft trainable counts, the big-batch fp32 optimizer step,
non-checkpointed gradients, ``trainmem.estimate`` of a plan) are computed here.

The student's written answer ``GAP_ANSWER`` is not scored: the ``plan`` question's
feedback message carries it verbatim, so the instructor reads it on the feedback page.
"""

from __future__ import annotations

import functools
import json
import math

from coursekit.grading import CaseType, Question
from coursekit.grading.checks import close_floats, exec_source, quiet_warnings

_quiet = quiet_warnings

NOTEBOOK = "lab06_capstone_lora_finetune.ipynb"
CELL_TIMEOUT = 240
NOTEBOOK_TIMEOUT = 600
PROBE_TIMEOUT = 60

TARGET_SETS = [
    ["q_proj", "v_proj"],
    ["q_proj", "k_proj", "v_proj", "o_proj"],
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ["o_proj", "down_proj", "up_proj"],
]

BUILD_SRC = r'''
import random as _random
import torch as _torch


def _lab06_cfg(case):
    from trainmem.measuring.models import tiny_llama_config

    return tiny_llama_config(
        hidden_size=case["hidden"],
        intermediate_size=case["inter"],
        num_hidden_layers=case["layers"],
        num_attention_heads=case["heads"],
        num_key_value_heads=case["heads"],
        vocab_size=case["vocab"],
    )


def _lab06_peft(case):
    """The reference LoRA model (not the student's make_lora_model): LoRA A and B
    filled from the case."""
    from peft import LoraConfig, get_peft_model
    from trainmem.measuring.models import build_model

    m = get_peft_model(
        build_model(_lab06_cfg(case), seed=case["seed"]),
        LoraConfig(
            r=case["r"],
            lora_alpha=case["alpha"],
            target_modules=case["targets"],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    rng = _random.Random(case["seed"] + 5)
    with _torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad:
                p.copy_(
                    _torch.tensor(
                        [rng.uniform(-0.2, 0.2) for _ in range(p.numel())]
                    ).reshape(p.shape)
                )
    return m.train()


def _lab06_batches(case):
    rng = _random.Random(case["seed"] + 9)
    out = []
    for _ in range(case["accum"]):
        ids = _torch.tensor(
            [
                [rng.randrange(case["vocab"]) for _ in range(case["seq"])]
                for _ in range(case["micro_bs"])
            ]
        )
        labels = ids.clone()
        labels[:, 0] = -100
        if case.get("pad"):  # right padding: each row keeps 3..seq tokens
            for row in range(case["micro_bs"]):
                keep = rng.randint(3, case["seq"])
                ids[row, keep:] = 0
                labels[row, keep:] = -100
        out.append((ids, labels))
    return out


def _lab06_saved(fn, exclude):
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with _torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return int(sum(seen.values()))


def _lab06_trainable(m):
    return {
        n: p.detach().flatten().tolist()
        for n, p in m.named_parameters()
        if p.requires_grad
    }
'''


_NS: dict = {}


def _ns() -> dict:
    """The builders, run once in this process (the same source the probe runs in the
    kernel)."""
    if not _NS:
        _NS.update(exec_source(BUILD_SRC))
    return _NS


def _close(got, want, rtol, atol) -> bool:
    return close_floats(got, want, rtol, atol)


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _verdict(checks: dict) -> tuple[bool, str]:
    wrong = [k for k, ok in checks.items() if not ok]
    return not wrong, ("不对的是：" + "、".join(wrong)) if wrong else ""


def _case(rng, **extra):
    heads = rng.choice([2, 4])
    c = dict(
        seed=rng.randrange(10**6),
        hidden=heads * rng.choice([8, 12]),
        heads=heads,
        inter=rng.choice([40, 56, 72]),
        layers=rng.randint(1, 2),
        vocab=rng.choice([40, 64, 96]),
        targets=rng.choice(TARGET_SETS),
        r=rng.choice([2, 4, 8]),
        alpha=rng.choice([4, 8, 16, 32]),
    )
    c.update(extra)
    return c


def _label(c):
    extra = (
        f"，{c['accum']} 个 {c['micro_bs']}×{c['seq']} 的 micro-batch，{c['mode']}，"
        f"max_norm={c['max_norm']:g}"
        if "mode" in c
        else ""
    )
    return (
        f"Llama hidden={c['hidden']}, layers={c['layers']}, targets={c['targets']}, "
        f"r={c['r']}, "
        f"alpha={c['alpha']}{extra}"
    )


def _show_value(v):
    return repr(v)[:300] if not isinstance(v, dict) else "（见上面的说明）"


# ---------------------------------------------------------------- make_lora_model
def _make_type(targets):
    return lambda rng: [
        _case(rng, targets=t, dropout=rng.choice([0.0, 0.05, 0.1]))
        for t in rng.sample(targets, 2)
    ]


MAKE_PROBE = (
    BUILD_SRC
    + r"""
from trainmem.measuring.models import build_model as _build_model


def CASE(_c):
    _m = make_lora_model(
        _build_model(_lab06_cfg(_c), seed=_c["seed"]),
        _c["r"],
        _c["alpha"],
        _c["targets"],
        _c["dropout"],
    )
    _pc = _m.peft_config["default"]
    return {
        "class": type(_m).__name__,
        "trainable": int(sum(p.numel() for p in _m.parameters() if p.requires_grad)),
        "trainable_names_ok": all(
            "lora_" in n for n, p in _m.named_parameters() if p.requires_grad
        ),
        "r": int(_pc.r),
        "alpha": float(_pc.lora_alpha),
        "dropout": float(_pc.lora_dropout),
        "targets": sorted(_pc.target_modules),
        "task_type": str(getattr(_pc.task_type, "value", _pc.task_type)),
        # the Llama's linear layers have no biases: which biases train is seen only
        # in the configuration
        "bias": str(_pc.bias),
    }
"""
)


@_quiet
def make_expect(c):
    from trainmem.demos.lora import lora_param_count_for_config

    return {
        "trainable": lora_param_count_for_config(
            _ns()["_lab06_cfg"](c), c["targets"], c["r"]
        ),
        "r": c["r"],
        "alpha": float(c["alpha"]),
        "dropout": c["dropout"],
        "targets": sorted(c["targets"]),
    }


def make_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    return _verdict(
        {
            "应返回 PeftModelForCausalLM": got.get("class") == "PeftModelForCausalLM",
            "可训练参数量应为 Σ r·(d_in + d_out)（只在目标模块上）": got.get(
                "trainable"
            )
            == want["trainable"],
            "只有 lora_ 参数可训练": got.get("trainable_names_ok") is True,
            "r / lora_alpha / lora_dropout": got.get("r") == want["r"]
            and got.get("alpha") == want["alpha"]
            and got.get("dropout") == want["dropout"],
            "target_modules": got.get("targets") == want["targets"],
            "task_type 应为 CAUSAL_LM": got.get("task_type") == "CAUSAL_LM",
            'bias 应为 "none"（不训练偏置）': got.get("bias") == "none",
        }
    )


MAKE_TYPES = [
    CaseType(
        "attention",
        "只有注意力投影",
        1,
        _make_type(TARGET_SETS[:2]),
        fix="把秩、缩放分子、目标模块与 dropout 都交给 LoRA 配置（字段名见第 6 章），"
        "不训练偏置、任务类型是因果语言模型，再用 peft 包装",
    ),
    CaseType(
        "mlp",
        "含 MLP 投影",
        1,
        _make_type(TARGET_SETS[2:]),
        fix="target_modules 原样传给 LoraConfig（包括 gate/up/down_proj）",
    ),
]


# ---------------------------------------------------------------- enable_checkpointing
def _ckpt_type(layers):
    return lambda rng: [
        _case(
            rng,
            layers=layers,
            micro_bs=rng.randint(2, 4),
            seq=rng.randint(6, 12),
            accum=1,
        )
    ]


CKPT_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_c):
    _ids, _labels = _lab06_batches(_c)[0]
    _m = _lab06_peft(_c)
    _ret = enable_checkpointing(_m)
    # transformers 5 hooks the embedding output to require grad when checkpointing is
    # switched on; older versions (and peft models built before it) do not. Without
    # that hook only non-reentrant checkpointing reaches the LoRA weights, which is
    # why the lab requires it: take the hook off, as on those versions.
    for _mod in _m.modules():
        if getattr(_mod, "_require_grads_hook", None) is not None:
            _mod.disable_input_require_grads()
    _m.train()
    _box = []
    import warnings as _warnings

    with _warnings.catch_warnings():
        _warnings.simplefilter("ignore")
        _saved = _lab06_saved(
            lambda: _box.append(_m(input_ids=_ids, labels=_labels).loss),
            list(_m.parameters()),
        )
        if _box[0].requires_grad:
            _box[0].backward()
    return {
        "returned_model": _ret is _m,
        "saved": _saved,
        "use_cache": bool(getattr(_m.config, "use_cache", True)),
        "grads": {
            n: (p.grad.flatten().tolist() if p.grad is not None else None)
            for n, p in _m.named_parameters()
            if p.requires_grad
        },
    }
"""
)


@_quiet
def ckpt_expect(c):
    ns = _ns()
    m = ns["_lab06_peft"](c)
    ids, labels = ns["_lab06_batches"](c)[0]
    box = []
    plain = ns["_lab06_saved"](
        lambda: box.append(m(input_ids=ids, labels=labels).loss), list(m.parameters())
    )
    box[0].backward()
    grads = {
        n: p.grad.flatten().tolist() for n, p in m.named_parameters() if p.requires_grad
    }
    ref = ns["_lab06_peft"](c)
    kw = {"use_reentrant": False}
    if hasattr(ref, "activation_checkpointing_enable"):
        ref.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    ref.config.use_cache = False
    ref.train()
    ckpt = ns["_lab06_saved"](
        lambda: ref(input_ids=ids, labels=labels).loss, list(ref.parameters())
    )
    return {"grads": grads, "plain": plain, "ckpt": ckpt}


def ckpt_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    grads = got.get("grads") if isinstance(got.get("grads"), dict) else {}
    saved, ckpt, plain = got.get("saved"), want["ckpt"], want["plain"]
    saved_label = "保存给反向的字节数没有降到检查点的水平" + (
        f"（是参考检查点的 {saved / ckpt:.0%}，不用检查点时约为 {plain / ckpt:.0%}）"
        if _num(saved)
        else ""
    )
    no_grad = set(grads) == set(want["grads"]) and all(grads[n] is None for n in grads)
    grads_label = (
        "LoRA 参数一个梯度都没有：reentrant 检查点在冻结的嵌入层之后断开了计算图"
        "（旧版 transformers 不会替你挂输入求导的钩子）"
        if no_grad
        else "LoRA 参数的梯度与不用检查点时不同"
    )
    return _verdict(
        {
            saved_label: _num(saved)
            and abs(saved - ckpt) <= 0.1 * ckpt
            and saved < plain,
            grads_label: set(grads) == set(want["grads"])
            and all(
                grads[n] is not None and _close(grads[n], w, 1e-4, 1e-6)
                for n, w in want["grads"].items()
            ),
            "config.use_cache 应为 False": got.get("use_cache") is False,
            "应返回传入的模型": got.get("returned_model") is True,
        }
    )


CKPT_TYPES = [
    CaseType(
        "one_layer",
        "1 层的小 Llama",
        1,
        _ckpt_type(1),
        fix="以非 reentrant 的方式打开检查点（transformers 新旧两个方法名都要照顾），"
        "关闭 KV cache，返回传入的模型；本实验第 10 节误区 1 的单元演示了 reentrant "
        "为什么让 LoRA 拿不到梯度",
    ),
    CaseType(
        "two_layers",
        "2 层的小 Llama",
        1,
        _ckpt_type(2),
        fix="非 reentrant 检查点下，冻结的嵌入层输出不需要梯度也能反传到 LoRA 参数；"
        "reentrant 的不能（误区 1）",
    ),
]


# ---------------------------------------------------------------- choose_precision
AMPERE_AND_LATER = [[8, 0], [8, 6], [8, 7], [8, 9], [9, 0], [10, 0], [12, 0]]
BEFORE_AMPERE = [[7, 5], [7, 0], [7, 2], [6, 1], [6, 0]]


def choose_expect(cap):
    if cap is None or tuple(cap) >= (8, 0):
        return {"base_dtype": "bf16", "grad_scaler": False}
    return {"base_dtype": "fp16", "grad_scaler": True}


def _show_cap(cap):
    return "CPU（None）" if cap is None else f"计算能力 {tuple(cap)}"


CHOOSE_TYPES = [
    CaseType(
        "ampere",
        "Ampere 及以后（sm_80 起）",
        1,
        lambda rng: rng.sample(AMPERE_AND_LATER, 3),
        fix="计算能力 ≥ (8, 0) 有原生 bf16：bf16 底座，不要 GradScaler",
    ),
    CaseType(
        "before_ampere",
        "Ampere 之前（T4、V100 …）",
        2,
        lambda rng: rng.sample(BEFORE_AMPERE, 3),
        fix="计算能力 < (8, 0) 没有原生 bf16（T4 的 is_bf16_supported() 是模拟）："
        "fp16 底座 + GradScaler",
    ),
    CaseType(
        "cpu",
        "CPU（capability=None）",
        1,
        lambda rng: [None, None],
        fix="CPU 原生支持 bf16 autocast：bf16，不要 GradScaler",
    ),
]


# ---------------------------------------------------------------- train_step
def _step_type(mode, pad=True):
    def make(rng):
        accum = rng.randint(2, 4)
        if mode in ("bf16", "fp16"):
            return [
                _case(
                    rng,
                    micro_bs=2,
                    seq=rng.randint(6, 9),
                    accum=accum,
                    lr=0.1 if mode == "bf16" else 0.5,
                    max_norm=1.0 if mode == "bf16" else rng.choice([0.01, 0.05]),
                    mode=mode,
                    pad=True,
                )
            ]
        max_norm = 1e6 if mode == "no_clip" else rng.choice([0.01, 0.05])
        return [
            _case(
                rng,
                micro_bs=rng.randint(2, 3),
                seq=rng.randint(6, 10),
                accum=accum,
                lr=0.5,
                max_norm=max_norm,
                mode="fp32",
                pad=pad,
            )
        ]

    return make


STEP_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_c):
    _m = _lab06_peft(_c)
    _params = [p for p in _m.parameters() if p.requires_grad]
    _opt = _torch.optim.SGD(_params, lr=_c["lr"])
    _dtypes = []
    _lin = [mod for n, mod in _m.named_modules() if n.endswith("base_layer")][0]
    _h = _lin.register_forward_hook(
        lambda mod, inp, out: _dtypes.append(str(out.dtype))
    )
    _amp = {"bf16": _torch.bfloat16, "fp16": _torch.float16}.get(_c["mode"])
    _scaler = (
        _torch.amp.GradScaler("cpu", init_scale=2.0**12)
        if _c["mode"] == "fp16"
        else None
    )
    _loss = train_step(
        _m,
        _opt,
        _lab06_batches(_c),
        amp_dtype=_amp,
        scaler=_scaler,
        max_norm=_c["max_norm"],
    )
    _h.remove()
    return {
        "loss": float(_loss),
        "params": _lab06_trainable(_m),
        "dtypes": sorted(set(_dtypes)),
        "param_dtypes": sorted({str(p.dtype) for p in _params}),
        "grads_cleared": all(p.grad is None or not bool(p.grad.any()) for p in _params),
    }
"""
)


@_quiet
def step_expect(c):
    import torch

    ns = _ns()
    m = ns["_lab06_peft"](c)
    before = ns["_lab06_trainable"](m)
    params = [p for p in m.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=c["lr"])
    batches = ns["_lab06_batches"](c)
    # one big batch: its loss is the mean over all valid tokens = the token-weighted
    # accumulation of the micro-batches
    loss = m(
        input_ids=torch.cat([b[0] for b in batches]),
        labels=torch.cat([b[1] for b in batches]),
    ).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, c["max_norm"])
    opt.step()
    return {
        "mode": c["mode"],
        "loss": loss.item(),
        "params": ns["_lab06_trainable"](m),
        "before": before,
    }


def _update_error(got: dict, want: dict, before: dict) -> float:
    """|got - want| / |want - before| over all trainable values (inf if malformed)."""
    num = den = 0.0
    for n, w in want.items():
        g, b = got.get(n), before[n]
        if not isinstance(g, list) or len(g) != len(w) or not all(map(_num, g)):
            return math.inf
        num += sum((x - y) ** 2 for x, y in zip(g, w))
        den += sum((y - z) ** 2 for y, z in zip(w, b))
    return math.sqrt(num / den) if den > 0 else math.inf


def step_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    gp = got.get("params") if isinstance(got.get("params"), dict) else {}
    common = {"训练后梯度应清零": got.get("grads_cleared") is True}
    loss = want["loss"]
    loss_ok = _num(got.get("loss")) and abs(got["loss"] - loss) <= 1e-4 * max(
        1, abs(loss)
    )
    if want["mode"] == "fp32":
        return _verdict(
            {
                "一步之后的 LoRA 参数应与整批一步相同（rtol=1e-4, atol=1e-6）": set(gp)
                == set(want["params"])
                and all(
                    _close(gp[n], w, 1e-4, 1e-6) for n, w in want["params"].items()
                ),
                f"返回的 loss 应为整步每个有效 token 的平均（{loss:.5f}）": loss_ok,
                "amp_dtype=None 时前向应为 fp32（不用 autocast）": got.get("dtypes")
                == ["torch.float32"],
                **common,
            }
        )
    if want["mode"] == "fp16":
        err = _update_error(gp, want["params"], want["before"])
        return _verdict(
            {
                "fp16 + GradScaler 的一步应与 fp32 整批一步在 5% 内相同（先 unscale_ "
                f"再裁剪；更新量的相对误差 {err:.2g}）": err < 0.05,
                "autocast 下线性层应以 fp16 运行": got.get("dtypes")
                == ["torch.float16"],
                "可训练参数应保持 fp32": got.get("param_dtypes") == ["torch.float32"],
                **common,
            }
        )
    before = want["before"]
    moved = set(gp) == set(before) and any(
        isinstance(gp[n], list)
        and len(gp[n]) == len(before[n])
        and any(a != b for a, b in zip(gp[n], before[n]))
        for n in before
    )
    return _verdict(
        {
            "autocast 下线性层应以 bf16 运行": got.get("dtypes") == ["torch.bfloat16"],
            "可训练参数应保持 fp32": got.get("param_dtypes") == ["torch.float32"],
            "loss 应为有限数": _num(got.get("loss")) and math.isfinite(got["loss"]),
            "参数应被更新": moved,
            **common,
        }
    )


TOKEN_FIX = (
    "每个 micro-batch 的 .loss 是它自己有效 token 的平均：乘以它的有效 token 数 ÷ "
    "整步的有效 token 总数（labels[:, 1:] != -100）再 backward，而不是除以 k"
)
STEP_TYPES = [
    CaseType(
        "padded",
        "fp32、不裁剪、micro-batch 的有效 token 数不同",
        3,
        _step_type("no_clip"),
        fix=TOKEN_FIX,
    ),
    CaseType(
        "no_padding",
        "fp32、不裁剪、没有填充（每个 micro-batch 的 token 数相同）",
        1,
        _step_type("no_clip", pad=False),
        fix="全部 micro-batch 累积完再 optimizer.step()，最后 zero_grad",
    ),
    CaseType(
        "clip",
        "fp32、有填充、裁剪生效：在累积之后裁剪",
        2,
        _step_type("clip"),
        fix="clip_grad_norm_(params, max_norm) 要在全部 micro-batch 累积之后、step "
        "之前调用一次",
    ),
    CaseType(
        "bf16",
        "bf16 autocast",
        1,
        _step_type("bf16"),
        fix="amp_dtype 给出时前向（含损失）在 autocast 里算，反向不必；参数不要转成 "
        "16 位，它们是主权重",
    ),
    CaseType(
        "fp16_scaler",
        "fp16 autocast + GradScaler、裁剪生效",
        1,
        _step_type("fp16"),
        fix="有 scaler 时反向缩放后的损失；累积完先反缩放再裁剪（误区 3），更新与"
        "更新缩放因子都经由 scaler",
    ),
]


# ---------------------------------------------------------------- plan (+ GAP_ANSWER)
PLAN_KEYS = {
    "precision",
    "batch",
    "grad_accum",
    "checkpointing",
    "lora_rank",
    "lora_targets",
}
ALL_TARGETS = set(TARGET_SETS[2])
BUDGETS = {
    "cpu": {"budget": 1_000_000, "effective_batch": 16, "seq": 12},
    "gpu": {
        "model": "qwen2.5-0.5b",
        "budget": 14 * 2**30,
        "effective_batch": 32,
        "seq": 512,
        "capability": [7, 5],
    },
}

PLAN_PROBE = r"""
def _get(name):
    v = globals().get(name)
    try:
        import json as _json

        _json.dumps(v)
        return v
    except Exception:
        return repr(v)[:200]


RESULT = {
    "cpu_plan": _get("CPU_PLAN"),
    "gpu_plan": _get("GPU_PLAN"),
    "cpu_pred": _get("PREDICTED_PEAK_CPU"),
    "gpu_pred": _get("PREDICTED_PEAK_GPU"),
    "cpu_measured": _get("MEASURED_PEAK_CPU"),
    "answer": globals().get("GAP_ANSWER") if isinstance(
        globals().get("GAP_ANSWER"), str
    ) else None,
}
"""


def _plan_load_dtype(precision):
    """The frozen base's load dtype of a plan, as the lab's plan table and its
    ``build_for_plan`` run it: fp32 for ``fp32`` and the AMP plans (the estimator's
    LoRA default under autocast is a 16-bit base), the 16-bit base for ``bf16``
    (bf16 and fp16 have the same bytes)."""
    return None if precision == "bf16" else "fp32"


def _plan_options(plan, seq) -> dict:
    """The estimator's (and the measurement's) options of a valid plan."""
    return dict(
        method="lora",
        seq=seq,
        lora_alpha=2 * plan["lora_rank"],
        load_dtype=_plan_load_dtype(plan["precision"]),
        **plan,
    )


@functools.lru_cache(maxsize=32)
def _measured_cpu_peak(plan_json: str, seq: int) -> int:
    """The peak of one step of the CPU plan, measured (``trainmem.measuring.measure``:
    the reference loop's tensors on the CPU, tracked storage by storage) on the
    synthetic task's model: the number a prediction is graded against. A few seconds;
    plans repeat across submissions, so each is measured once per grading process."""
    from trainmem.demos.synthetic_task import task_config
    from trainmem.measuring.measure import measure

    plan = json.loads(plan_json)
    return measure(task_config(), **_plan_options(plan, seq)).total_bytes


def _plan_estimate(model, plan, seq):
    """``(peak bytes, None)`` of a valid plan, or ``(None, why)``."""
    from trainmem.estimate import estimate

    if not isinstance(plan, dict) or set(plan) != PLAN_KEYS:
        return None, f"计划应是键为 {sorted(PLAN_KEYS)} 的字典"
    targets = plan["lora_targets"]
    if not isinstance(targets, list) or not targets or not set(targets) <= ALL_TARGETS:
        return None, "lora_targets 应是 TARGETS 的非空子集（列表）"
    ints = [plan[k] for k in ("batch", "grad_accum", "lora_rank")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in ints):
        return None, "batch、grad_accum、lora_rank 应是正整数"
    if not isinstance(plan["checkpointing"], bool):
        return None, "checkpointing 应是 bool"
    if plan["precision"] not in ("fp32", "bf16-amp", "fp16-amp", "bf16"):
        return None, "precision 应是 fp32、bf16-amp、fp16-amp、bf16 之一"
    try:
        est = estimate(model, **_plan_options(plan, seq))
    except Exception as e:  # the estimator's own check of the options
        return None, f"trainmem.estimate 拒绝了这个计划：{e}"
    return est.total_bytes, None


def plan_inputs(rng):
    return BUDGETS


# A plan that does not fit earns nothing for its prediction either: the budget is what
# the capstone teaches. Shares: plan fits, then the prediction's closeness.
FIT_SHARE = 0.35
PRED_SHARE = 0.15
PRED_FULL, PRED_ZERO = 0.10, 0.50  # |prediction / peak - 1|: full credit .. nothing


def prediction_share(pred, peak) -> float:
    """1 within PRED_FULL of ``peak``, 0 beyond PRED_ZERO, linear in between."""
    if not _num(pred) or pred <= 0:
        return 0.0
    off = abs(pred / peak - 1)
    return max(0.0, min(1.0, (PRED_ZERO - off) / (PRED_ZERO - PRED_FULL)))


@_quiet
def plan_check(inputs, result):
    if not isinstance(result, dict):
        return 0.0, "没有找到 CPU_PLAN / GPU_PLAN"
    from trainmem.demos.synthetic_task import task_config

    lines, share = [], 0.0
    for key, pred_key, model in (
        ("cpu_plan", "cpu_pred", task_config()),
        ("gpu_plan", "gpu_pred", inputs["gpu"]["model"]),
    ):
        req = inputs[key[:3]]
        plan, name = result.get(key), key.upper()
        pred_name = f"PREDICTED_PEAK_{key[:3].upper()}"
        peak, why = _plan_estimate(model, plan, req["seq"])
        if peak is None:
            lines.append(f"✗ {name}：{why}（{pred_name} 因此不评）")
            continue
        eff = plan["batch"] * plan["grad_accum"]
        ok_eff = eff == req["effective_batch"]
        ok_dtype = key == "cpu_plan" or plan["precision"] != "bf16-amp"
        fits = peak <= req["budget"] and ok_eff and ok_dtype
        share += FIT_SHARE * fits
        lines.append(
            f"{'✓' if fits else '✗'} {name}：估算峰值 {peak:,d} 字节"
            f"（预算的 {peak / req['budget']:.0%}），预算 {req['budget']:,d}；"
            f"有效 batch {eff}（要求 {req['effective_batch']}）"
            + ("" if ok_dtype else "；T4 没有原生 bf16，不能用 bf16-amp")
        )
        pred = result.get(pred_key)
        if not fits:
            lines.append(
                f"✗ {pred_name}：计划没有放进要求，预测不计分"
                "（先让计划放进预算，再预测它）"
            )
            continue
        # The peak the plan really has: the CPU plan measured (the reference loop on
        # the CPU, _measured_cpu_peak); the grader has no GPU, so the GPU plan's is
        # the estimate. The estimator's number is shown after, for comparison.
        if key == "cpu_plan":
            target = _measured_cpu_peak(json.dumps(plan, sort_keys=True), req["seq"])
            what = "这个计划在 CPU 上实测的峰值（评分器用参考训练循环测得）"
        else:
            target = peak
            what = "这个计划的 trainmem.estimate（评分器没有 GPU，以估算代替实测）"
        got = prediction_share(pred, target)
        share += PRED_SHARE * got
        off = f"，相差 {pred / target - 1:+.1%}" if _num(pred) and pred > 0 else ""
        lines.append(
            f"{'✓' if got == 1 else '✗'} {pred_name} = {pred!r:.40}：{what} "
            f"{target:,d}{off}（{PRED_FULL:.0%} 以内满分，超过 {PRED_ZERO:.0%} "
            f"不得分；得 {got:.0%}）"
            + (
                f"；trainmem.estimate 给出 {peak:,d}（{peak / target - 1:+.2%}）"
                if key == "cpu_plan"
                else ""
            )
        )
    measured = result.get("cpu_measured")
    lines.append(
        f"（不计分）你记下的 CPU 实测峰值 MEASURED_PEAK_CPU = {measured!r:.40}"
    )
    answer = result.get("answer")
    lines.append(
        "（不计分，供老师阅读）GAP_ANSWER："
        + (
            answer.strip()[:2000]
            if isinstance(answer, str) and answer.strip()
            else "未作答（把回答赋给第 8 节的变量 GAP_ANSWER）"
        )
    )
    return round(share, 4), "\n".join(lines)


# ---------------------------------------------------------------- step_peak
PEAK_TOLERANCE = 0.08


def _peak_type(checkpointing):
    def make(rng):
        out = []
        for _ in range(2):
            c = _case(
                rng,
                micro_bs=rng.randint(2, 4),
                seq=rng.randint(8, 12),
                accum=rng.randint(2, 3),
                pad=True,
            )
            c["precision"] = (
                "bf16" if checkpointing else rng.choice(["fp32", "bf16-amp"])
            )
            c["checkpointing"] = checkpointing
            out.append(c)
        return out

    return make


PEAK_PROBE = (
    BUILD_SRC
    + r"""
def CASE(_c):
    from peft import LoraConfig, get_peft_model
    from trainmem.measuring.models import build_model
    from trainmem.measuring.tracker import MemoryTracker

    _m = build_model(_lab06_cfg(_c), seed=_c["seed"])
    if _c["precision"] == "bf16":
        _m = _m.to(_torch.bfloat16)
    _m = get_peft_model(
        _m,
        LoraConfig(
            r=_c["r"],
            lora_alpha=2 * _c["r"],
            target_modules=_c["targets"],
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        ),
    )
    if _c["checkpointing"]:
        _m.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        _m.config.use_cache = False
    _m.train()
    _params = [p for p in _m.parameters() if p.requires_grad]
    _opt = _torch.optim.AdamW(_params, lr=1e-3, foreach=True)
    _amp = _torch.bfloat16 if _c["precision"] == "bf16-amp" else None
    train_step(_m, _opt, _lab06_batches(_c), amp_dtype=_amp)  # AdamW states exist
    _batches = _lab06_batches({**_c, "seed": _c["seed"] + 1})
    _tr = MemoryTracker()
    for _t in [*_m.parameters(), *_m.buffers()]:
        _tr.register(_t)
    for _st in _opt.state.values():
        for _t in _st.values():
            if _torch.is_tensor(_t):
                _tr.register(_t)
    for _a, _b in _batches:
        _tr.register(_a)
        _tr.register(_b)
    with _tr:
        train_step(_m, _opt, _batches, amp_dtype=_amp)
    return int(_tr.peak)
"""
)


@_quiet
def peak_expect(c):
    from trainmem.estimate import estimate

    return estimate(
        _ns()["_lab06_cfg"](c),
        method="lora",
        precision=c["precision"],
        load_dtype=_plan_load_dtype(c["precision"]),
        batch=c["micro_bs"],
        seq=c["seq"],
        grad_accum=c["accum"],
        checkpointing=c["checkpointing"],
        lora_rank=c["r"],
        lora_alpha=2 * c["r"],
        lora_targets=c["targets"],
    ).total_bytes


def peak_compare(got, want):
    if not _num(got) or got <= 0:
        return False, "没有测到峰值"
    gap = got / want - 1
    return abs(gap) <= PEAK_TOLERANCE, (
        f"实测峰值比估算 {'高' if gap > 0 else '低'} {abs(gap):.1%}"
        f"（容差 {PEAK_TOLERANCE:.0%}）"
    )


def _peak_label(c):
    return (
        f"{_label(c)}；{c['accum']} 个 {c['micro_bs']}×{c['seq']} 的 micro-batch，"
        f"precision={c['precision']}，checkpointing={c['checkpointing']}"
    )


PEAK_TYPES = [
    CaseType(
        "accumulate",
        "不用检查点、累积 2–3 个 micro-batch",
        2,
        _peak_type(False),
        fix="每个 micro-batch 算完损失立刻 backward，让它的计算图（激活）随之释放；"
        "不要把 k 个损失加起来最后一起反向",
    ),
    CaseType(
        "checkpointed",
        "16 位底座 + 检查点",
        1,
        _peak_type(True),
        fix="train_step 里不要保留多余的张量（例如每个 micro-batch 的 logits 或损失"
        "的计算图）",
    ),
]


QUESTIONS = [
    Question(
        "make_lora_model",
        points=2,
        cases=MAKE_TYPES,
        expect=make_expect,
        compare=make_compare,
        probe=MAKE_PROBE,
        show_input=_label,
        show_value=_show_value,
        description="make_lora_model：LoraConfig + get_peft_model；可训练参数量、"
        "r/alpha/dropout/targets/task_type",
    ),
    Question(
        "enable_checkpointing",
        points=2,
        cases=CKPT_TYPES,
        expect=ckpt_expect,
        compare=ckpt_compare,
        probe=CKPT_PROBE,
        show_input=_label,
        show_value=_show_value,
        description="enable_checkpointing：非 reentrant 检查点（保存量 ≈ 参考），LoRA "
        "梯度不变，use_cache=False",
    ),
    Question(
        "choose_precision",
        points=2,
        cases=CHOOSE_TYPES,
        expect=choose_expect,
        probe="CASE = choose_precision",
        show_input=_show_cap,
        description="choose_precision：按计算能力选 bf16，或 fp16 + GradScaler",
    ),
    Question(
        "train_step",
        points=4,
        cases=STEP_TYPES,
        expect=step_expect,
        compare=step_compare,
        probe=STEP_PROBE,
        show_input=_label,
        show_value=_show_value,
        description="train_step：按 token 加权的累积一步 == 整批一步（有填充、"
        "含裁剪）；bf16 autocast 下线性层为 bf16、主权重 fp32；fp16 先反缩放再裁剪；"
        "梯度清零",
    ),
    Question(
        "plan",
        points=3,
        make_inputs=plan_inputs,
        probe=PLAN_PROBE,
        check=plan_check,
        description="CPU_PLAN 与 GPU_PLAN 在要求的有效 batch 下放进预算"
        f"（各 {FIT_SHARE:.0%}）；放得进的计划，你写下的预测与峰值越近越好"
        f"（各 {PRED_SHARE:.0%}）；"
        "GAP_ANSWER 原样列出，不计分",
    ),
    Question(
        "step_peak",
        points=2,
        cases=PEAK_TYPES,
        expect=peak_expect,
        compare=peak_compare,
        probe=PEAK_PROBE,
        show_input=_peak_label,
        description="train_step 在新计划下的实测峰值（张量级记账）与 trainmem.estimate "
        f"相差不超过 {PEAK_TOLERANCE:.0%}",
        timeout=180,
    ),
]
