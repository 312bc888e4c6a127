"""Hidden tests for lab06 (capstone: LoRA fine-tune with autocast + checkpointing + accumulation).

Format: tests/grading/README.md. Models are tiny Llamas with fresh shapes drawn here, built with
``trainmem.models.build_model(config, seed=...)`` on both sides (same seed → same weights); LoRA
weights and batches come from ``random.Random`` in :data:`BUILD_SRC`, which runs in the student's
kernel (probe) and in this process (check). The references (peft trainable counts, the big-batch
fp32 optimizer step, non-checkpointed gradients) are computed here.
"""
from __future__ import annotations

import math

from coursekit.grading import Question
from coursekit.grading.checks import close_floats, exec_source, quiet_warnings


_quiet = quiet_warnings

NOTEBOOK = "lab06_capstone_lora_finetune.ipynb"
CELL_TIMEOUT = 240
NOTEBOOK_TIMEOUT = 600
PROBE_TIMEOUT = 60

TARGET_SETS = [["q_proj", "v_proj"], ["q_proj", "k_proj", "v_proj", "o_proj"],
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
               ["o_proj", "down_proj", "up_proj"]]

BUILD_SRC = r'''
import random as _random
import torch as _torch


def _lab06_cfg(case):
    from trainmem.models import tiny_llama_config
    return tiny_llama_config(hidden_size=case["hidden"], intermediate_size=case["inter"],
                             num_hidden_layers=case["layers"], num_attention_heads=case["heads"],
                             num_key_value_heads=case["heads"], vocab_size=case["vocab"])


def _lab06_peft(case):
    """The reference LoRA model (not the student's make_lora_model): LoRA A and B filled from the case."""
    from peft import LoraConfig, get_peft_model
    from trainmem.models import build_model
    m = get_peft_model(build_model(_lab06_cfg(case), seed=case["seed"]),
                       LoraConfig(r=case["r"], lora_alpha=case["alpha"], target_modules=case["targets"],
                                  lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
    rng = _random.Random(case["seed"] + 5)
    with _torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad:
                p.copy_(_torch.tensor([rng.uniform(-0.2, 0.2) for _ in range(p.numel())]).reshape(p.shape))
    return m.train()


def _lab06_batches(case):
    rng = _random.Random(case["seed"] + 9)
    out = []
    for _ in range(case["accum"]):
        ids = _torch.tensor([[rng.randrange(case["vocab"]) for _ in range(case["seq"])] for _ in range(case["micro_bs"])])
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
    return {n: p.detach().flatten().tolist() for n, p in m.named_parameters() if p.requires_grad}
'''


def _ns() -> dict:
    return exec_source(BUILD_SRC)


def _close(got, want, rtol, atol) -> bool:
    return close_floats(got, want, rtol, atol)


def _case(rng, **extra):
    heads = rng.choice([2, 4])
    c = dict(seed=rng.randrange(10**6), hidden=heads * rng.choice([8, 12]), heads=heads,
             inter=rng.choice([40, 56, 72]), layers=rng.randint(1, 2), vocab=rng.choice([40, 64, 96]),
             targets=rng.choice(TARGET_SETS), r=rng.choice([2, 4, 8]), alpha=rng.choice([4, 8, 16, 32]))
    c.update(extra)
    return c


def _label(c):
    return f"Llama hidden={c['hidden']}, layers={c['layers']}, targets={c['targets']}, r={c['r']}, alpha={c['alpha']}"


# ---------------------------------------------------------------- make_lora_model
def _make_inputs(rng):
    return [_case(rng, dropout=rng.choice([0.0, 0.05, 0.1])) for _ in range(2)]


MAKE_PROBE = BUILD_SRC + r'''
from trainmem.models import build_model as _build_model
RESULT = []
for _c in INPUTS:
    _m = make_lora_model(_build_model(_lab06_cfg(_c), seed=_c["seed"]), _c["r"], _c["alpha"], _c["targets"], _c["dropout"])
    _pc = _m.peft_config["default"]
    RESULT.append({"class": type(_m).__name__,
                   "trainable": int(sum(p.numel() for p in _m.parameters() if p.requires_grad)),
                   "trainable_names_ok": all("lora_" in n for n, p in _m.named_parameters() if p.requires_grad),
                   "r": int(_pc.r), "alpha": float(_pc.lora_alpha), "dropout": float(_pc.lora_dropout),
                   "targets": sorted(_pc.target_modules), "task_type": str(getattr(_pc.task_type, "value", _pc.task_type))})
'''


@_quiet
def check_make(inputs, result):
    from trainmem.lora import lora_param_count_for_config

    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, f"expected {len(inputs)} results, got {type(result).__name__}"
    ns = _ns()
    score, msgs = 0.0, []
    for c, got in zip(inputs, result):
        if not isinstance(got, dict):
            msgs.append(f"{_label(c)}: no result")
            continue
        want = lora_param_count_for_config(ns["_lab06_cfg"](c), c["targets"], c["r"])
        checks = {
            "a PeftModel (PeftModelForCausalLM)": got.get("class") == "PeftModelForCausalLM",
            f"trainable parameters = {want}": got.get("trainable") == want,
            "only lora_ parameters trainable": got.get("trainable_names_ok") is True,
            "r / lora_alpha / lora_dropout": got.get("r") == c["r"] and got.get("alpha") == float(c["alpha"])
            and got.get("dropout") == c["dropout"],
            "target_modules": got.get("targets") == sorted(c["targets"]),
            "task_type CAUSAL_LM": got.get("task_type") == "CAUSAL_LM",
        }
        score += sum(checks.values()) / len(checks)
        wrong = [k for k, v in checks.items() if not v]
        if wrong:
            msgs.append(f"{_label(c)}: wrong " + ", ".join(wrong))
    return score / len(inputs), "all cases correct" if not msgs else " | ".join(msgs[:2])


# ---------------------------------------------------------------- enable_checkpointing
def _ckpt_inputs(rng):
    return _case(rng, layers=2, micro_bs=rng.randint(2, 4), seq=rng.randint(6, 12), accum=1)


CKPT_PROBE = BUILD_SRC + r'''
_c = INPUTS
_ids, _labels = _lab06_batches(_c)[0]
_m = _lab06_peft(_c)
_ret = enable_checkpointing(_m)
_m.train()
_box = []
_saved = _lab06_saved(lambda: _box.append(_m(input_ids=_ids, labels=_labels).loss), list(_m.parameters()))
_box[0].backward()
RESULT = {"returned_model": _ret is _m, "saved": _saved, "use_cache": bool(getattr(_m.config, "use_cache", True)),
          "grads": {n: (p.grad.flatten().tolist() if p.grad is not None else None)
                    for n, p in _m.named_parameters() if p.requires_grad}}
'''


@_quiet
def check_ckpt(c, got):
    ns = _ns()
    m = ns["_lab06_peft"](c)
    ids, labels = ns["_lab06_batches"](c)[0]
    box = []
    plain = ns["_lab06_saved"](lambda: box.append(m(input_ids=ids, labels=labels).loss), list(m.parameters()))
    box[0].backward()
    want = {n: p.grad.flatten().tolist() for n, p in m.named_parameters() if p.requires_grad}
    ref = ns["_lab06_peft"](c)
    ref.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}) \
        if hasattr(ref, "activation_checkpointing_enable") else \
        ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref.config.use_cache = False
    ref.train()
    ckpt = ns["_lab06_saved"](lambda: ref(input_ids=ids, labels=labels).loss, list(ref.parameters()))
    if not isinstance(got, dict):
        return 0.0, f"expected a dict, got {type(got).__name__}"
    grads = got.get("grads") if isinstance(got.get("grads"), dict) else {}
    saved = got.get("saved")
    checks = {
        f"saved-for-backward bytes ≈ checkpointed reference {ckpt} (plain: {plain}), got {saved}":
            isinstance(saved, int) and not isinstance(saved, bool) and abs(saved - ckpt) <= 0.1 * ckpt and saved < plain,
        "every LoRA parameter gets the same gradient as without checkpointing":
            set(grads) == set(want) and all(_close(grads[n], want[n], 1e-4, 1e-6) for n in want),
        "config.use_cache is False": got.get("use_cache") is False,
        "returns the model": got.get("returned_model") is True,
    }
    v = list(checks.values())
    frac = (2 + 2 * v[1] + v[2] + v[3]) / 6 if v[0] else 0.0   # nothing counts unless it really checkpoints
    wrong = [k for k, v in checks.items() if not v]
    return frac, (f"{_label(c)}: correct" if not wrong else f"{_label(c)}: wrong: " + "; ".join(wrong))


# ---------------------------------------------------------------- train_step
def _step_inputs(rng):
    accum = rng.randint(2, 4)
    return [_case(rng, micro_bs=rng.randint(1, 3), seq=rng.randint(5, 10), accum=accum, lr=0.5,
                  max_norm=1e6, mode="fp32"),                            # no clipping: catches a missing / k
            _case(rng, micro_bs=rng.randint(1, 3), seq=rng.randint(5, 10), accum=accum, lr=0.5,
                  max_norm=rng.choice([0.01, 0.05]), mode="fp32"),        # clipping active: after accumulation
            _case(rng, micro_bs=2, seq=6, accum=accum, lr=0.1, max_norm=1.0, mode="bf16")]


STEP_PROBE = BUILD_SRC + r'''
RESULT = []
for _c in INPUTS:
    _m = _lab06_peft(_c)
    _params = [p for p in _m.parameters() if p.requires_grad]
    _opt = _torch.optim.SGD(_params, lr=_c["lr"])
    _dtypes = []
    _lin = [mod for n, mod in _m.named_modules() if n.endswith("base_layer")][0]
    _h = _lin.register_forward_hook(lambda mod, inp, out: _dtypes.append(str(out.dtype)))
    _loss = train_step(_m, _opt, _lab06_batches(_c), amp_dtype=_torch.bfloat16 if _c["mode"] == "bf16" else None,
                       max_norm=_c["max_norm"])
    _h.remove()
    RESULT.append({"loss": float(_loss), "params": _lab06_trainable(_m), "dtypes": sorted(set(_dtypes)),
                   "param_dtypes": sorted({str(p.dtype) for p in _params}),
                   "grads_cleared": all(p.grad is None or not bool(p.grad.any()) for p in _params)})
'''


@_quiet
def check_step(inputs, result):
    import torch

    if not isinstance(result, list) or len(result) != len(inputs):
        return 0.0, f"expected {len(inputs)} results, got {type(result).__name__}"
    ns = _ns()
    score, msgs = 0.0, []
    weights = [3, 3, 2]   # fp32 equivalence without / with clipping, then the bf16 autocast run
    for c, got, w in zip(inputs, result, weights):
        label = f"{_label(c)}, {c['accum']} micro-batches of {c['micro_bs']}x{c['seq']}, {c['mode']}, max_norm={c['max_norm']:g}"
        if not isinstance(got, dict):
            msgs.append(f"{label}: no result")
            continue
        m = ns["_lab06_peft"](c)
        before = ns["_lab06_trainable"](m)
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.SGD(params, lr=c["lr"])
        batches = ns["_lab06_batches"](c)
        ids = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        loss = m(input_ids=ids, labels=labels).loss            # equal tokens per micro-batch: mean of means
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, c["max_norm"])
        opt.step()
        want = ns["_lab06_trainable"](m)
        gp = got.get("params") if isinstance(got.get("params"), dict) else {}
        if c["mode"] == "fp32":
            checks = {
                "LoRA parameters after the step equal the big-batch step (rtol=1e-4, atol=1e-6)":
                    set(gp) == set(want) and all(_close(gp[n], want[n], 1e-4, 1e-6) for n in want),
                f"returned loss = mean micro-batch loss ({loss.item():.5f})":
                    isinstance(got.get("loss"), (int, float)) and abs(got["loss"] - loss.item()) <= 1e-4 * max(1, abs(loss.item())),
                "gradients cleared after the step": got.get("grads_cleared") is True,
                "forward ran in fp32 (no autocast when amp_dtype=None)": got.get("dtypes") == ["torch.float32"],
            }
            v = list(checks.values())
            part = (6 + sum(v[1:])) / 9 if v[0] else 0.0
        else:
            moved = set(gp) == set(before) and any(
                isinstance(gp[n], list) and len(gp[n]) == len(before[n]) and
                any(abs(a - b) > 0 for a, b in zip(gp[n], before[n])) for n in before)
            checks = {
                "linear layers ran in bf16 under autocast": got.get("dtypes") == ["torch.bfloat16"],
                "trainable parameters stay fp32": got.get("param_dtypes") == ["torch.float32"],
                "finite loss": isinstance(got.get("loss"), (int, float)) and math.isfinite(got["loss"]),
                "parameters updated": moved,
                "gradients cleared after the step": got.get("grads_cleared") is True,
            }
            v = list(checks.values())
            part = sum(v) / len(v) if (v[0] and v[3]) else 0.0   # must run under bf16 and update
        score += w * part
        wrong = [k for k, v in checks.items() if not v]
        if wrong:
            msgs.append(f"{label}: wrong: " + "; ".join(wrong))
    return score / sum(weights), "all cases correct" if not msgs else " | ".join(msgs[:2])


QUESTIONS = [
    Question("make_lora_model", points=2, make_inputs=_make_inputs, probe=MAKE_PROBE, check=check_make,
             description="make_lora_model：LoraConfig + get_peft_model；可训练参数量、r/alpha/dropout/targets/task_type"),
    Question("enable_checkpointing", points=2, make_inputs=_ckpt_inputs, probe=CKPT_PROBE, check=check_ckpt,
             description="enable_checkpointing：非 reentrant 检查点（保存量 ≈ 参考），LoRA 梯度不变，use_cache=False"),
    Question("train_step", points=4, make_inputs=_step_inputs, probe=STEP_PROBE, check=check_step,
             description="train_step：fp32 下累积一步 == 整批一步（含裁剪）；bf16 autocast 下线性层为 bf16、"
                         "主权重 fp32、梯度清零"),
]
