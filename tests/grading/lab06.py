"""Hidden tests for lab06 (capstone: LoRA fine-tune with autocast + checkpointing +
accumulation).

Format: tests/grading/README.md. Models are tiny Llamas with fresh shapes drawn here,
built with ``trainmem.models.build_model(config, seed=...)`` on both sides (same seed →
same weights); LoRA weights and batches come from ``random.Random`` in
:data:`BUILD_SRC`, which runs in the student's kernel (probe) and in this process
(check). The references (peft trainable counts, the big-batch fp32 optimizer step,
non-checkpointed gradients) are computed here.
"""

from __future__ import annotations

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
    from trainmem.models import tiny_llama_config

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
    from trainmem.models import build_model

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
from trainmem.models import build_model as _build_model


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
    }
"""
)


@_quiet
def make_expect(c):
    from trainmem.lora import lora_param_count_for_config

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
            f"可训练参数量应为 {want['trainable']}": got.get("trainable")
            == want["trainable"],
            "只有 lora_ 参数可训练": got.get("trainable_names_ok") is True,
            "r / lora_alpha / lora_dropout": got.get("r") == want["r"]
            and got.get("alpha") == want["alpha"]
            and got.get("dropout") == want["dropout"],
            "target_modules": got.get("targets") == want["targets"],
            "task_type 应为 CAUSAL_LM": got.get("task_type") == "CAUSAL_LM",
        }
    )


MAKE_TYPES = [
    CaseType(
        "attention",
        "只有注意力投影",
        1,
        _make_type(TARGET_SETS[:2]),
        fix="LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, "
        "lora_dropout=dropout, "
        'bias="none", task_type="CAUSAL_LM")，再 get_peft_model(model, config)',
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
    _m.train()
    _box = []
    _saved = _lab06_saved(
        lambda: _box.append(_m(input_ids=_ids, labels=_labels).loss),
        list(_m.parameters()),
    )
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
    saved_label = (
        f"保存给反向的字节数应 ≈ 参考检查点的 {ckpt}（不用检查点：{plain}），"
        f"得到 {saved}"
    )
    return _verdict(
        {
            saved_label: _num(saved)
            and abs(saved - ckpt) <= 0.1 * ckpt
            and saved < plain,
            "每个 LoRA 参数的梯度应与不用检查点时相同": set(grads) == set(want["grads"])
            and all(_close(grads[n], w, 1e-4, 1e-6) for n, w in want["grads"].items()),
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
        fix="model.gradient_checkpointing_enable("
        'gradient_checkpointing_kwargs={"use_reentrant": False})；'
        "model.config.use_cache = False；返回 model",
    ),
    CaseType(
        "two_layers",
        "2 层的小 Llama",
        1,
        _ckpt_type(2),
        fix="非 reentrant 检查点下冻结的嵌入层输出不需要梯度也能反传到 LoRA 参数",
    ),
]


# ---------------------------------------------------------------- train_step
def _step_type(mode):
    def make(rng):
        accum = rng.randint(2, 4)
        if mode == "bf16":
            return [
                _case(
                    rng,
                    micro_bs=2,
                    seq=6,
                    accum=accum,
                    lr=0.1,
                    max_norm=1.0,
                    mode="bf16",
                )
            ]
        max_norm = 1e6 if mode == "no_clip" else rng.choice([0.01, 0.05])
        return [
            _case(
                rng,
                micro_bs=rng.randint(1, 3),
                seq=rng.randint(5, 10),
                accum=accum,
                lr=0.5,
                max_norm=max_norm,
                mode="fp32",
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
    _loss = train_step(
        _m,
        _opt,
        _lab06_batches(_c),
        amp_dtype=_torch.bfloat16 if _c["mode"] == "bf16" else None,
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
    loss = m(
        input_ids=torch.cat([b[0] for b in batches]),
        labels=torch.cat([b[1] for b in batches]),
    ).loss
    loss.backward()  # equal tokens per micro-batch: mean of means
    torch.nn.utils.clip_grad_norm_(params, c["max_norm"])
    opt.step()
    return {
        "mode": c["mode"],
        "loss": loss.item(),
        "params": ns["_lab06_trainable"](m),
        "before": before,
    }


def step_compare(got, want):
    if not isinstance(got, dict):
        return False, "没有结果"
    gp = got.get("params") if isinstance(got.get("params"), dict) else {}
    common = {"训练后梯度应清零": got.get("grads_cleared") is True}
    if want["mode"] == "fp32":
        loss = want["loss"]
        return _verdict(
            {
                "一步之后的 LoRA 参数应与整批一步相同（rtol=1e-4, atol=1e-6）": set(gp)
                == set(want["params"])
                and all(
                    _close(gp[n], w, 1e-4, 1e-6) for n, w in want["params"].items()
                ),
                f"返回的 loss 应为各 micro-batch loss 的平均（{loss:.5f}）": _num(
                    got.get("loss")
                )
                and abs(got["loss"] - loss) <= 1e-4 * max(1, abs(loss)),
                "amp_dtype=None 时前向应为 fp32（不用 autocast）": got.get("dtypes")
                == ["torch.float32"],
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


STEP_TYPES = [
    CaseType(
        "no_clip",
        "fp32、不裁剪：累积一步 = 整批一步",
        3,
        _step_type("no_clip"),
        fix="每个 micro-batch 的 loss / k 再 backward；全部累积完再 optimizer.step()，"
        "最后 zero_grad",
    ),
    CaseType(
        "clip",
        "fp32、裁剪生效：在累积之后裁剪",
        3,
        _step_type("clip"),
        fix="clip_grad_norm_(params, max_norm) 要在全部 micro-batch 累积之后、step "
        "之前调用一次",
    ),
    CaseType(
        "bf16",
        "bf16 autocast",
        2,
        _step_type("bf16"),
        fix="with torch.autocast(device_type, dtype=amp_dtype)：只包前向与 loss；"
        "参数保持 fp32",
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
        "train_step",
        points=4,
        cases=STEP_TYPES,
        expect=step_expect,
        compare=step_compare,
        probe=STEP_PROBE,
        show_input=_label,
        show_value=_show_value,
        description="train_step：fp32 下累积一步 == 整批一步（含裁剪）；bf16 autocast "
        "下线性层为 bf16、"
        "主权重 fp32、梯度清零",
    ),
]
