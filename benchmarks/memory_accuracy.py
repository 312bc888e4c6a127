"""Estimator vs two measurements: peak and activation memory of one training step.

Part 1, a fixed grid: the tiny Llama measured on real CPU tensors and the Llama-7B shape
measured under FakeTensorMode (per-layer extrapolation from 2 and 3 layers; one row is
also run at full depth to time it). For every row: ``trainmem.estimate`` vs
``trainmem.measuring.measure`` (peak and activations held for backward at the end of the
forward pass), torch's own ``MemTracker`` on the CPU rows
(``trainmem.measuring.measure.measure_memtracker``), and the rule of ``accelerate
estimate-memory`` (16 B/param fp32, 8 B/param half/mixed precision, Adam, no
activations; applied to the whole model, as the tool does) for comparison.

Part 2, a random grid: ``--n`` tiny Llama-family configurations drawn with a fixed seed
across every option (Llama/Qwen2/Mistral, GQA, tied embeddings, odd widths, explicit
head_dim, the three AdamW implementations and SGD, fp32/fp16-amp/bf16-amp/bf16,
eager/SDPA, checkpointing, LoRA targets and ranks, gradient accumulation), each
estimated and measured twice on CPU.

    python benchmarks/memory_accuracy.py           # prints the markdown report
    python benchmarks/memory_accuracy.py --out benchmarks/results/memory_accuracy.md
    python benchmarks/memory_accuracy.py --quick   # 12 random rows, no 7B rows
    python benchmarks/memory_accuracy.py --cuda    # adds a CUDA column (tiny rows)

Targets: fixed grid |peak error| ≤ 2 % (full) / 3 % (LoRA), |activation error| ≤ 3 %;
random grid |peak error| ≤ 1 % against both measurements, every row."""

from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from collections import defaultdict

import torch

from trainmem.dtypes import GiB, MiB
from trainmem.estimate import (
    OPTIMIZER_IMPLS,
    PRECISIONS,
    accelerate_rule_bytes,
    count_params,
    estimate,
    model_shape,
)
from trainmem.families import LLAMA_LINEARS
from trainmem.measuring.measure import measure, measure_memtracker

ALL = LLAMA_LINEARS
QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")

# (model, device, method, precision, attn, checkpointing, batch, seq, lora targets,
# AdamW impl)
GRID = [
    ("tiny", "cpu", "full", "fp32", "sdpa", False, 2, 64, None, "foreach"),
    ("tiny", "cpu", "full", "fp32", "eager", False, 2, 64, None, "foreach"),
    ("tiny", "cpu", "full", "bf16-amp", "sdpa", False, 4, 128, None, "foreach"),
    ("tiny", "cpu", "full", "bf16", "eager", False, 4, 128, None, "foreach"),
    ("tiny", "cpu", "full", "fp32", "sdpa", True, 4, 128, None, "foreach"),
    ("tiny", "cpu", "full", "bf16-amp", "eager", True, 2, 64, None, "foreach"),
    ("tiny", "cpu", "full", "bf16", "sdpa", True, 1, 256, None, "foreach"),
    ("tiny", "cpu", "full", "bf16-amp", "sdpa", False, 8, 32, None, "foreach"),
    ("tiny", "cpu", "full", "bf16", "eager", True, 4, 256, None, "foreach"),
    ("tiny", "cpu", "full", "fp16-amp", "eager", False, 2, 64, None, "fused"),
    ("tiny", "cpu", "full", "bf16-amp", "sdpa", False, 1, 32, None, "for-loop"),
    ("tiny", "cpu", "lora", "fp32", "sdpa", False, 2, 64, None, "foreach"),
    ("tiny", "cpu", "lora", "bf16-amp", "sdpa", False, 4, 128, None, "foreach"),
    ("tiny", "cpu", "lora", "bf16", "eager", False, 2, 64, None, "foreach"),
    ("tiny", "cpu", "lora", "bf16-amp", "eager", True, 4, 128, None, "foreach"),
    ("tiny", "cpu", "lora", "fp32", "sdpa", True, 8, 32, None, "foreach"),
    ("tiny", "cpu", "lora", "bf16-amp", "sdpa", True, 2, 64, ALL, "foreach"),
    ("tiny", "cpu", "lora", "fp16-amp", "sdpa", True, 2, 64, ALL, "fused"),
    ("llama-7b", "fake", "full", "bf16-amp", "sdpa", False, 1, 512, None, "foreach"),
    ("llama-7b", "fake", "full", "bf16-amp", "eager", False, 1, 512, None, "for-loop"),
    ("llama-7b", "fake", "full", "bf16-amp", "eager", False, 1, 512, None, "fused"),
    ("llama-7b", "fake", "full", "bf16", "sdpa", False, 8, 2048, None, "foreach"),
    ("llama-7b", "fake", "full", "bf16-amp", "eager", False, 2, 2048, None, "foreach"),
    ("llama-7b", "fake", "full", "fp32", "eager", False, 1, 256, None, "foreach"),
    ("llama-7b", "fake", "full", "bf16-amp", "sdpa", True, 4, 1024, None, "foreach"),
    ("llama-7b", "fake", "full", "bf16", "eager", True, 2, 512, None, "foreach"),
    ("llama-7b", "fake", "full", "fp32", "sdpa", True, 1, 512, None, "foreach"),
    ("llama-7b", "fake", "lora", "bf16-amp", "sdpa", False, 4, 512, None, "foreach"),
    ("llama-7b", "fake", "lora", "bf16-amp", "eager", False, 1, 1024, None, "foreach"),
    ("llama-7b", "fake", "lora", "bf16", "sdpa", True, 8, 512, None, "foreach"),
    ("llama-7b", "fake", "lora", "fp32", "sdpa", False, 2, 256, None, "foreach"),
    ("llama-7b", "fake", "lora", "bf16-amp", "sdpa", True, 8, 2048, QKVO, "foreach"),
    ("llama-7b", "fake", "lora", "bf16", "eager", True, 4, 512, None, "foreach"),
]


def fmt(n: int, unit: str) -> str:
    return f"{n / MiB:,.3f} MiB" if unit == "MiB" else f"{n / GiB:,.3f} GiB"


def rel(a: int, b: int) -> float:
    return (a - b) / b * 100.0


def _targets_label(targets) -> str:
    if targets is None or tuple(targets) == ("q_proj", "v_proj"):
        return "qv"
    if tuple(targets) == ALL:
        return "all"
    if tuple(targets) == QKVO:
        return "qkvo"
    return ",".join(t.split("_")[0] for t in targets)


def fixed_grid(cuda: bool, quick: bool) -> tuple[list[str], list[str]]:
    lines = []
    head = (
        "| # | model (device) | method | precision | attn | ckpt | b×s | AdamW "
        "| estimate | measured | peak err | MemTracker | est. vs MemTracker "
        "| est. act | meas. act "
        "| act err | peak in | accelerate rule | rule err |"
    )
    if cuda:
        head += " cuda max_allocated | cuda max_reserved | est. vs cuda |"
    lines.append(head)
    lines.append("|" + "---|" * (head.count("|") - 1))
    worst = {"full": (0.0, None), "lora": (0.0, None)}
    worst_act = (0.0, None)
    ok = True
    for i, (model, dev, method, prec, attn, ck, b, s, targets, impl) in enumerate(
        GRID, 1
    ):
        if quick and dev == "fake":
            continue
        kw = dict(
            method=method,
            precision=prec,
            attn=attn,
            checkpointing=ck,
            batch=b,
            seq=s,
            optimizer_impl=impl,
        )
        if targets:
            kw["lora_targets"] = targets
        est = estimate(model, **kw)
        meas = measure(model, device=dev, **kw)
        e_peak = rel(est.total_bytes, meas.total_bytes)
        e_act = rel(est.activation_bytes, meas.activation_bytes)
        rule = accelerate_rule_bytes(count_params(model), prec)
        e_rule = rel(rule, meas.total_bytes)
        tol = 2.0 if method == "full" else 3.0
        ok &= abs(e_peak) <= tol and abs(e_act) <= 3.0
        if abs(e_peak) >= abs(worst[method][0]):
            worst[method] = (e_peak, i)
        if abs(e_act) >= abs(worst_act[0]):
            worst_act = (e_act, i)
        u = "MiB" if model == "tiny" else "GiB"
        if dev == "cpu":
            mt = measure_memtracker(model, **kw)
            mt_cells = f"{fmt(mt, u)} | {rel(est.total_bytes, mt):+.3f}%"
        else:
            mt_cells = "– | –"
        tg = "" if method == "full" else f" r=8 {_targets_label(targets)}"
        row = (
            f"| {i} | {model} "
            f"({dev}{', extrap.' if meas.extrapolated_from_layers else ''}) "
            f"| {method}{tg} | {prec} | {attn} | {'on' if ck else 'off'} | {b}×{s} "
            f"| {impl} "
            f"| {fmt(est.total_bytes, u)} | {fmt(meas.total_bytes, u)} "
            f"| {e_peak:+.3f}% "
            f"| {mt_cells} | {fmt(est.activation_bytes, u)} "
            f"| {fmt(meas.activation_bytes, u)} "
            f"| {e_act:+.3f}% | {meas.peak_phase} | {fmt(rule, u)} | {e_rule:+.1f}% |"
        )
        if cuda:
            if model == "tiny" and torch.cuda.is_available():
                mc = measure(model, device="cuda", **kw)
                alloc, reserved = (
                    mc.cuda["max_memory_allocated"],
                    mc.cuda["max_memory_reserved"],
                )
                row += (
                    f" {fmt(alloc, u)} | {fmt(reserved, u)} "
                    f"| {rel(est.total_bytes, alloc):+.2f}% |"
                )
            else:
                row += " – | – | – |"
        lines.append(row)
        print(f"fixed row {i} done ({meas.seconds:.1f} s)", file=sys.stderr)
    notes = [
        "- Worst peak error, full fine-tuning: "
        f"{worst['full'][0]:+.4f}% (row {worst['full'][1]}); "
        f"LoRA: {worst['lora'][0]:+.4f}% (row {worst['lora'][1]}). "
        "Worst activation error: "
        f"{worst_act[0]:+.4f}% (row {worst_act[1]}).",
        "- All rows within the targets (peak ≤ 2 % full / 3 % LoRA, "
        "activations ≤ 3 %): "
        f"{'yes' if ok else 'NO'}.",
    ]
    return lines, notes


# --------------------------------------------------------------------------------------
# the random grid
# --------------------------------------------------------------------------------------
ARCHS = ("llama", "qwen2", "mistral")
PER_HEAD = (
    10,
    14,
    18,
    20,
    26,
    32,
)  # hidden = heads × one of these: odd widths, q_dim ≠ hidden
INTERMEDIATE = (36, 100, 130, 172, 250)
VOCABS = (97, 131, 256, 509)
SEQS = (8, 16, 24, 33, 48, 64)
OPTIMIZERS = (
    ("adamw", "foreach"),
    ("adamw", "fused"),
    ("adamw", "for-loop"),
    ("sgd", "foreach"),
    ("sgd-momentum", "for-loop"),
)


def random_configs(n: int, seed: int = 16) -> list[dict]:
    """``n`` tiny configurations, drawn from ``random.Random(seed)``. The categorical
    options that decide the memory layout (precision × AdamW implementation × method)
    are cycled so that every combination appears; the shapes and the rest are drawn at
    random."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        heads = rng.choice((2, 3, 4, 6))
        kv = rng.choice([d for d in (1, 2, 3, 4, 6) if heads % d == 0])
        head_dim = rng.choice((8, 12, 16))
        hidden = heads * rng.choice(PER_HEAD + (head_dim,))
        model = dict(
            arch=rng.choice(ARCHS),
            vocab_size=rng.choice(VOCABS),
            hidden_size=hidden,
            intermediate_size=rng.choice(INTERMEDIATE),
            num_hidden_layers=rng.choice((1, 2, 3)),
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            tie_word_embeddings=rng.random() < 0.4,
        )
        precision = PRECISIONS[k % 4]
        optimizer, impl = (
            OPTIMIZERS[rng.randrange(len(OPTIMIZERS))]
            if k % 4 == 3
            else ("adamw", OPTIMIZER_IMPLS[(k // 4) % 3])
        )
        method = ("full", "lora")[(k // 12) % 2]
        opts = dict(
            method=method,
            precision=precision,
            optimizer=optimizer,
            optimizer_impl=impl,
            attn=rng.choice(("sdpa", "eager")),
            checkpointing=rng.random() < 0.5,
            batch=rng.choice((1, 2, 3)),
            seq=rng.choice(SEQS),
            grad_accum=rng.choice((1, 1, 2, 3)),
        )
        if method == "lora":
            targets = tuple(t for t in ALL if rng.random() < 0.45) or (
                "q_proj",
                "v_proj",
            )
            opts["lora_targets"] = targets
            width = min(
                hidden, heads * head_dim, kv * head_dim, model["intermediate_size"]
            )
            opts["lora_rank"] = min(rng.choice((1, 2, 4, 8, 16)), width)
        out.append(dict(id=k + 1, model=model, options=opts))
    return out


def hf_config(model: dict, name: str):
    fields = dict(model)
    arch = fields.pop("arch")
    if arch == "qwen2":
        from transformers import Qwen2Config as C
    elif arch == "mistral":
        from transformers import MistralConfig as C

        fields["sliding_window"] = None
    else:
        from transformers import LlamaConfig as C
    cfg = C(**fields)
    cfg.name_or_path = name
    return cfg


def _model_label(m: dict) -> str:
    gqa = f"{m['num_attention_heads']}/{m['num_key_value_heads']}"
    return (
        f"{m['arch']} h{m['hidden_size']} i{m['intermediate_size']} "
        f"L{m['num_hidden_layers']} "
        f"a/kv {gqa} d{m['head_dim']} V{m['vocab_size']}"
        f"{' tied' if m['tie_word_embeddings'] else ''}"
    )


def _options_label(o: dict) -> str:
    parts = [o["method"]]
    if o["method"] == "lora":
        parts.append(f"r={o['lora_rank']} {_targets_label(o['lora_targets'])}")
    parts += [
        o["precision"],
        o["attn"],
        "ckpt" if o["checkpointing"] else "",
        f"{o['optimizer']}/{o['optimizer_impl']}"
        if o["optimizer"] == "adamw"
        else o["optimizer"],
        f"{o['batch']}×{o['seq']}",
        f"acc {o['grad_accum']}" if o["grad_accum"] > 1 else "",
    ]
    return " ".join(p for p in parts if p)


def random_grid(n: int, seed: int) -> dict:
    rows = []
    for c in random_configs(n, seed):
        cfg = hf_config(c["model"], f"rand{c['id']}")
        o = c["options"]
        t0 = time.perf_counter()
        est = estimate(cfg, **o)
        meas = measure(cfg, device="cpu", **o)
        mt = measure_memtracker(cfg, **o)
        shape = model_shape(cfg)
        leaf_bytes = 0
        if o["method"] == "lora" and o["checkpointing"]:
            # the frozen embedding's output made a leaf by gradient checkpointing, and
            # its .grad
            item = 2 if o["precision"] == "bf16" else 4
            leaf_bytes = 2 * o["batch"] * o["seq"] * shape.hidden * item
        rows.append(
            dict(
                c,
                est=est.total_bytes,
                meas=meas.total_bytes,
                mt=mt,
                peak_phase=meas.peak_phase,
                leaf_bytes=leaf_bytes,
                e_meas=rel(est.total_bytes, meas.total_bytes),
                e_mt=rel(est.total_bytes, mt),
                mt_meas=rel(mt, meas.total_bytes),
            )
        )
        print(
            f"random row {c['id']} done ({time.perf_counter() - t0:.1f} s)",
            file=sys.stderr,
        )
    return dict(rows=rows, seed=seed)


def random_report(res: dict) -> list[str]:
    rows = res["rows"]
    out = []
    worst_meas = max(rows, key=lambda r: abs(r["e_meas"]))
    worst_mt = max(rows, key=lambda r: abs(r["e_mt"]))
    n_ok = sum(abs(r["e_meas"]) <= 1.0 and abs(r["e_mt"]) <= 1.0 for r in rows)
    out += [
        f"{len(rows)} configurations, `random.Random({res['seed']})`. Errors are "
        "(estimate − measurement) / measurement.",
        "",
        "- Worst |estimate − trainmem.measuring.measure|: "
        f"{worst_meas['e_meas']:+.4f}% (row "
        f"{worst_meas['id']}); worst |estimate − MemTracker|: {worst_mt['e_mt']:+.4f}% "
        f"(row {worst_mt['id']}).",
        f"- Rows within 1 % of both measurements: {n_ok} of {len(rows)}.",
        f"- Rows where the two measurements differ by more than 0.5 %: "
        f"{sum(abs(r['mt_meas']) > 0.5 for r in rows)}; by more than 0 bytes: "
        f"{sum(r['mt'] != r['meas'] for r in rows)}.",
        "",
    ]
    # coverage and worst error per option value
    groups: dict[str, dict] = defaultdict(lambda: {"n": 0, "worst": 0.0})
    for r in rows:
        o, m = r["options"], r["model"]
        keys = [
            f"precision={o['precision']}",
            f"method={o['method']}",
            f"attn={o['attn']}",
            f"checkpointing={'on' if o['checkpointing'] else 'off'}",
            f"optimizer={o['optimizer']}"
            + (f"/{o['optimizer_impl']}" if o["optimizer"] == "adamw" else ""),
            f"grad_accum={o['grad_accum']}",
            f"arch={m['arch']}",
            "GQA="
            + ("yes" if m["num_key_value_heads"] < m["num_attention_heads"] else "no"),
            f"tied={'yes' if m['tie_word_embeddings'] else 'no'}",
            "q_dim≠hidden="
            + (
                "yes"
                if m["num_attention_heads"] * m["head_dim"] != m["hidden_size"]
                else "no"
            ),
        ]
        if o["method"] == "lora":
            keys += [
                f"lora_rank={o['lora_rank']}",
                f"lora_targets={_targets_label(o['lora_targets'])}",
            ]
        err = max(abs(r["e_meas"]), abs(r["e_mt"]))
        for k in keys:
            groups[k]["n"] += 1
            groups[k]["worst"] = max(groups[k]["worst"], err)
    out += [
        "Worst rows (by |estimate − trainmem.measuring.measure|):",
        "",
        "| # | model | options | estimate − measure (bytes) | error | peak in |",
        "|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: -abs(r["e_meas"]))[:5]:
        out.append(
            f"| {r['id']} | {_model_label(r['model'])} "
            f"| {_options_label(r['options'])} "
            f"| {r['est'] - r['meas']:+,} | {r['e_meas']:+.4f}% | {r['peak_phase']} |"
        )
    out += ["", WORST_WHY, ""]
    out += [
        "| option | rows | worst \\|error\\| vs either measurement |",
        "|---|---|---|",
    ]
    for k in sorted(groups):
        out.append(f"| {k} | {groups[k]['n']} | {groups[k]['worst']:.4f}% |")
    out += [
        "",
        "Every row (bytes):",
        "",
        "| # | model | options | estimate | trainmem.measuring.measure | MemTracker "
        "| est. vs measure "
        "| est. vs MemTracker | MemTracker vs measure | peak in |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['id']} | {_model_label(r['model'])} "
            f"| {_options_label(r['options'])} "
            f"| {r['est']:,} | {r['meas']:,} | {r['mt']:,} | {r['e_meas']:+.4f}% "
            f"| {r['e_mt']:+.4f}% | {r['mt_meas']:+.4f}% | {r['peak_phase']} |"
        )
    return out


def timing_rows() -> list[str]:
    # timing of the 7B fake measurement, each in a fresh process (FakeTensorMode caches
    # shapes within a process, so a second run in the same process would look faster
    # than it is)
    timing = {}
    for flag in ("", "--no-extrapolate"):
        cmd = [
            sys.executable,
            "-m",
            "trainmem",
            "measure",
            "--model",
            "llama-7b",
            "--device",
            "fake",
            "--method",
            "full",
            "--precision",
            "bf16-amp",
            "--batch",
            "1",
            "--seq",
            "512",
            "--json",
        ]
        res = json.loads(
            subprocess.run(
                cmd + ([flag] if flag else []),
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )
        timing[flag or "extrapolate"] = res
    t_ext = timing["extrapolate"]["seconds"]
    t_full = timing["--no-extrapolate"]["seconds"]
    ext_total = timing["extrapolate"]["total_bytes"]
    full_total = timing["--no-extrapolate"]["total_bytes"]
    return [
        "- 7B-shape fake-tensor measurement (full, bf16-amp, 1×512): "
        f"{t_ext:.1f} s with per-layer "
        "extrapolation (2 and 3 layers, extended linearly), "
        f"{t_full:.1f} s running all 32 layers; "
        f"same peak: {'yes' if ext_total == full_total else 'no'} "
        f"({ext_total:,} vs {full_total:,} bytes); each timed in a fresh process."
    ]


WORST_WHY = """\
Why the worst rows are off. The largest remaining gaps are in backward under fp16-amp
with one key/value head, SDPA and gradient accumulation: the estimate is short by the
size of two fp16 `b × heads × s × head_dim` tensors plus 16 bytes. Both measurements
agree on these rows, so the gap is in the replay; the tensors are not located yet (a
suspect is a layout copy of SDPA's gradients with grouped-query attention). The next
ones have their peak in the forward pass of small LoRA models, where a few hundred to a
thousand bytes of transient tensors differ; the step's peak of any realistic size is
elsewhere (backward or the optimizer step).
"""


RECONCILE = """\
## The two measurements, reconciled

Both measurements are `TorchDispatchMode`s that add up `untyped_storage().nbytes()` of
every live storage and keep the running maximum: the quantity the CUDA caching allocator
reports as `torch.cuda.max_memory_allocated()` (the sum of the live blocks; on a GPU
each block is also rounded up to a multiple of 512 bytes, which MemTracker applies to
CUDA tensors only and neither applies on CPU). They were written independently
(`trainmem.measuring.tracker.MemoryTracker`; torch's
`torch.distributed._tools.mem_tracker.MemTracker`). Where they differed, one of them was
measuring a different program from the plain training loop whose `max_memory_allocated`
the estimate predicts; that side was fixed.

1. **LoRA + activation checkpointing: MemTracker was higher by 2·b·s·h·4 bytes per
   earlier forward.** Reported case: h=192, i=512, 3 layers, 4 heads, tied, vocab 500,
   bf16-amp, SDPA, 2 × 128, LoRA r=8 on q,v, checkpointing — MemTracker over two tracked
   steps 10,227,192 B, `trainmem.measuring.measure` 9,833,976 B; the difference, 393,216
   B, is exactly 2 × (2·128·192·4). With a frozen embedding,
   `gradient_checkpointing_enable()` makes the embedding output a leaf that requires
   grad (`enable_input_require_grads`). MemTracker's `ModTracker` calls
   `register_multi_grad_hook(inputs, fn)` (mode "all") on every module's inputs; that
   hook's closure holds the `grad_fn`/`AccumulateGrad` node of each input and is itself
   stored on those nodes — a reference cycle through C++ objects that `gc.collect()`
   cannot free. The nodes, the leaf and its `.grad` (fp32 here) therefore outlive every
   forward under MemTracker: a leak of 2·b·s·h·4 bytes per micro-batch, visible in the
   next micro-batch or step. A plain loop frees both at the end of backward, so the
   allocator of the real loop sees `trainmem.measuring.measure`'s number: **MemTracker
   was the wrong side.** Fix (`trainmem.measuring.measure.measure_memtracker`): the
   module hooks are registered in mode "any", which holds no node (they only tell
   MemTracker which module backward is in, not how many bytes are live), and a fresh
   tracker watches step 2 only. MemTracker also refuses to hook frozen parameters
   (`register_hook` raises); those are marked as hooked already. After the fix the two
   agree within a few bytes on every row.
2. **fp16-amp: both measurements lacked the optimizer states at the peak.** GradScaler's
   initial scale (2^16) overflows fp16 gradients of these tiny models, so it skipped
   `optimizer.step()` in the warm-up step and the states were created only inside the
   measured step. That is a measurement of the first steps of a run, not of the steady
   state the estimate describes; both measurements now repeat warm-up steps until the
   optimizer holds its states.
3. **What remains** (the "MemTracker vs measure" column): −8 bytes under fp16-amp —
   GradScaler's `_scale` and `_growth_tracker` (4 bytes each) are created in step 1,
   which MemTracker does not watch, and are not among the objects given to
   `track_external` — and 0 bytes elsewhere.

Where the estimate itself was wrong, the random grid showed it and the replay was
corrected (each is now a unit test in `tests/test_estimate.py`):

- `softmax(x, dtype=float32)` of 16-bit scores (eager attention) is two autograd nodes
  in ATen (`x.to(float32)`, then `_softmax`), so the fp32 score gradient is converted
  back to 16 bit only after `_softmax`'s saved output and incoming gradient are
  released: pure bf16, eager, checkpointing, 4 × 256, h=256, 8 heads — +7.1 % before, 4
  bytes now (fixed-grid row 9).
- GQA with one key/value head: `repeat_kv` is then a view (stride 0), and `matmul`
  copies an operand only when its batch and head dimensions cannot be merged by a view
  (batch > 1 for such a view, or the projection's interleaved layout with batch > 1);
  the backward of `repeat_kv` sums the expanded gradient back to the key/value heads
  (LoRA on k,v,o,… with 6/1 heads: +4.3 % before).
- `down_proj(act_fn(gate_proj(x)) * up_proj(x))`: silu's output exists while `up_proj`
  runs.
- Non-reentrant checkpointing recomputes a layer when a saved tensor is first unpacked
  (its backward nodes that saved nothing run before), and the recompute stops *before*
  the kernel of its last node when that node saved only inputs (autograd packs saved
  inputs before the kernel runs): LoRA on q,v,gate,up,down, pure bf16, checkpointing —
  −2.4 % before.
"""


def run(cuda: bool = False, quick: bool = False, n: int = 120, seed: int = 16) -> str:
    torch.set_num_threads(2)
    fixed, fixed_notes = fixed_grid(cuda, quick)
    rnd = random_grid(12 if quick else n, seed)
    out = [
        "# Memory estimator vs measurement",
        "",
        "Generated by `python benchmarks/memory_accuracy.py` "
        f"(torch {torch.__version__}, "
        f"Python {platform.python_version()}, "
        f"{torch.get_num_threads()} CPU threads). "
        "Bytes per training step "
        "(2nd of two steps: forward, backward, optimizer step); "
        "MiB = 2^20, GiB = 2^30 bytes. *measured* = `trainmem.measuring.measure` "
        "(tensor-level, real CPU "
        "tensors or FakeTensorMode); *MemTracker* = torch's "
        "`torch.distributed._tools.mem_tracker.MemTracker` on the same CPU step "
        "(`trainmem.measuring.measure.measure_memtracker`). "
        "*act* = bytes held for backward at the end "
        "of the forward pass. *AdamW* = torch's implementation (`--optimizer-impl`). "
        "*accelerate rule* = `accelerate estimate-memory`'s training figure "
        "(16 B/param fp32, "
        "8 B/param mixed/half, no activations), over the whole model.",
        "",
        "## Fixed grid",
        "",
        *fixed,
        "",
        *fixed_notes,
    ]
    if not quick:
        out += timing_rows()
    out += [
        "- CUDA column: "
        + (
            "included."
            if cuda
            else "not run in this table (no GPU on the "
            "machine that produced it); `--cuda` adds `max_memory_allocated` "
            "and `max_memory_reserved` for the tiny rows."
        ),
        "",
        "## Random grid",
        "",
        *random_report(rnd),
        "",
        RECONCILE,
    ]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the report to this markdown file")
    ap.add_argument(
        "--cuda",
        action="store_true",
        help="add CUDA max_memory_allocated/reserved columns",
    )
    ap.add_argument(
        "--quick", action="store_true", help="12 random rows and no 7B rows"
    )
    ap.add_argument(
        "--n", type=int, default=120, help="random configurations (default 120)"
    )
    ap.add_argument(
        "--seed", type=int, default=16, help="seed of the random grid (default 16)"
    )
    args = ap.parse_args(argv)
    report = run(cuda=args.cuda, quick=args.quick, n=args.n, seed=args.seed)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(report)


if __name__ == "__main__":
    main()
