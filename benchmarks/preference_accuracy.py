"""DPO and GRPO: the estimator against the CPU measurement of the same step, and the
Llama-3-8B-shaped estimates with their breakdown.

Part 1: a tiny Llama (vocabulary 2,048, so the logits are a visible share) at three
shapes per objective, each step estimated (``trainmem.estimate``, the replay of
``trainmem.memory.preference``) and measured on real CPU tensors
(``trainmem.measuring.measure``, the hand-written losses of
``trainmem.measuring.preference_losses``).
Part 2: Llama-3-8B (``trainmem.reference.LLAMA3_8B``) estimated (not measured: 8B
parameters do not fit this machine), bytes by category at the peak and the peak of
each phase.

    python benchmarks/preference_accuracy.py
    python benchmarks/preference_accuracy.py \
        --out benchmarks/results/preference_accuracy.md

Target: |peak error| <= 1 % on every tiny row."""

from __future__ import annotations

import argparse
import sys
import time

from trainmem.dtypes import GiB
from trainmem.estimate import estimate
from trainmem.measuring.measure import measure
from trainmem.reference import LLAMA3_8B

TINY = dict(
    model_type="llama",
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)

DPO_ROWS = [
    dict(objective="dpo", batch=1, seq=64),
    dict(objective="dpo", batch=2, seq=128, method="lora", reference="adapter"),
    dict(objective="dpo", batch=2, seq=96, reference="precomputed", checkpointing=True),
]
GRPO_ROWS = [
    dict(objective="grpo", batch=4, group_size=4, seq=32, max_completion_length=32),
    dict(
        objective="grpo",
        batch=4,
        group_size=2,
        seq=16,
        max_completion_length=96,
        reference="copy",
    ),
    dict(
        objective="grpo",
        batch=8,
        group_size=8,
        seq=32,
        max_completion_length=64,
        method="lora",
        reference="adapter",
        checkpointing=True,
    ),
]
BIG_ROWS = [
    dict(objective="sft", batch=2, seq=2048),
    dict(objective="dpo", batch=1, seq=2048),
    dict(objective="dpo", batch=1, seq=2048, reference="precomputed"),
    dict(objective="dpo", batch=1, seq=2048, method="lora", checkpointing=True),
    dict(
        objective="grpo",
        batch=8,
        group_size=8,
        seq=512,
        max_completion_length=1024,
        method="lora",
        checkpointing=True,
    ),
    dict(
        objective="grpo",
        batch=8,
        group_size=8,
        seq=512,
        max_completion_length=1024,
        method="lora",
        reference="adapter",
        checkpointing=True,
    ),
]
COMMON = dict(precision="bf16-amp", optimizer_impl="fused")


def _tiny_config():
    from transformers import LlamaConfig

    fields = {k: v for k, v in TINY.items() if k != "model_type"}
    return LlamaConfig(**fields)


def _label(o: dict) -> str:
    skip = {"objective"}
    return ", ".join(f"{k}={v}" for k, v in o.items() if k not in skip)


def tiny_table(rows) -> tuple[list[str], float]:
    cfg = _tiny_config()
    out = [
        "| options | estimate (B) | measured (B) | error | peak in (est / meas) |",
        "|---|---:|---:|---:|---|",
    ]
    worst = 0.0
    for o in rows:
        est = estimate(cfg, **COMMON, **o)
        got = measure(cfg, **COMMON, **o)
        err = est.total_bytes / got.total_bytes - 1
        worst = max(worst, abs(err))
        out.append(
            f"| {_label(o)} | {est.total_bytes:,} | {got.total_bytes:,} | "
            f"{err:+.3%} | {est.peak_phase} / {got.peak_phase} |"
        )
    return out, worst


def big_table() -> list[str]:
    cats = ("weights", "gradients", "optimizer_states", "master_weights")
    cats += ("activations", "temporaries")
    head = "| objective | options | " + " | ".join(cats) + " | peak | peak in |"
    out = [head, "|" + "---|" * (len(cats) + 4)]
    phases = []
    for o in BIG_ROWS:
        est = estimate(LLAMA3_8B, **COMMON, **o)
        cells = " | ".join(f"{est.breakdown[c] / GiB:.2f}" for c in cats)
        out.append(
            f"| {o['objective']} | {_label(o)} | {cells} | "
            f"{est.total_bytes / GiB:.2f} | {est.peak_phase} |"
        )
        peaks = ", ".join(f"{k} {v / GiB:.2f}" for k, v in est.phase_peaks.items())
        phases.append(f"- {o['objective']}, {_label(o)}: {peaks}")
    return out + ["", "Peak of each phase (GiB):", ""] + phases


def report() -> str:
    started = time.perf_counter()
    dpo, dpo_worst = tiny_table(DPO_ROWS)
    grpo, grpo_worst = tiny_table(GRPO_ROWS)
    lines = [
        "# DPO and GRPO: estimate vs CPU measurement",
        "",
        f"Common options: {COMMON}; tiny Llama {TINY}.",
        "",
        "## DPO (batch = preference pairs; 2 x batch sequences)",
        "",
        *dpo,
        "",
        "## GRPO (batch = completions; seq = prompt tokens)",
        "",
        *grpo,
        "",
        f"Worst |error|: DPO {dpo_worst:.3%}, GRPO {grpo_worst:.3%} (target 1 %).",
        "",
        "## Llama-3-8B shape, estimated (GiB at the peak)",
        "",
        *big_table(),
        "",
        f"({time.perf_counter() - started:.0f} s)",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    text = report()
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
