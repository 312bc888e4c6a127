"""The estimator on the transformers installed here, against the CPU measurement of the
same step: the rows whose memory depends on the transformers version (no KV cache in
the forward — checkpointing, ``use_cache`` off, DPO and GRPO — where 4.53.1 to 4.57.x
hand SDPA a materialised causal mask: ``trainmem.versions.
hf_materializes_causal_mask``).

Each row is estimated with ``versions=`` the libraries installed
(``trainmem.versions.installed``) and measured (``trainmem.measuring.measure``); a
second column estimates with the course's pinned versions, which is what a comparison
that forgets the versions prints.

    python benchmarks/version_rows.py                     # print the table
    .venv-floor/bin/python benchmarks/version_rows.py \
        --record tests/data/version_rows.json

``--record`` writes the measured rows with the versions they were measured on;
``tests/test_version_rows.py`` replays them against the estimator on any machine
(record them on the floor environment, ``make floor-venv``: transformers 4.57.1).
Exits 1 when a row is off by more than 0.1 %."""

from __future__ import annotations

import argparse
import json
import sys
import warnings

from trainmem.estimate import estimate
from trainmem.families import transformers_config
from trainmem.measuring.measure import measure
from trainmem.versions import installed

TINY = dict(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
ROWS = (
    dict(batch=3, seq=120, precision="bf16-amp"),
    dict(batch=3, seq=120, precision="bf16-amp", use_cache="off"),
    dict(batch=3, seq=50, precision="fp32", use_cache="off"),
    dict(batch=2, seq=64, precision="bf16-amp", checkpointing=True),
    dict(batch=3, seq=100, precision="bf16-amp", checkpointing=True, method="lora"),
    dict(
        batch=2,
        seq=64,
        precision="bf16-amp",
        checkpointing=True,
        checkpointing_mode="reentrant",
    ),
    dict(batch=1, seq=64, precision="bf16-amp", objective="dpo"),
    dict(batch=2, seq=96, precision="bf16-amp", objective="dpo", method="lora"),
    dict(
        batch=4,
        seq=32,
        precision="bf16-amp",
        objective="grpo",
        group_size=4,
        max_completion_length=32,
    ),
    dict(batch=3, seq=120, precision="bf16-amp", use_cache="off", attn="math"),
)
TOLERANCE = 0.001


def run() -> list[dict]:
    here = installed()
    config = transformers_config(TINY, "tiny")
    rows = []
    for o in ROWS:
        got = measure(config, **o).total_bytes
        rows.append(
            dict(
                options=o,
                measured=got,
                estimate=estimate(config, versions=here, **o).total_bytes,
                pinned=estimate(config, **o).total_bytes,
            )
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/version_rows.py")
    parser.add_argument("--record", metavar="FILE", help="write the measured rows")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    here = installed()
    rows = run()
    print(f"CPU, {', '.join(f'{k} {v}' for k, v in here.items())}; bytes\n")
    print("| options | measured | estimate (these versions) | error | pinned | error |")
    print("|---|---:|---:|---:|---:|---:|")
    worst = 0.0
    for r in rows:
        err = r["estimate"] / r["measured"] - 1
        pinned = r["pinned"] / r["measured"] - 1
        worst = max(worst, abs(err))
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items())
        print(
            f"| {opts} | {r['measured']:,} | {r['estimate']:,} | {err:+.3%} "
            f"| {r['pinned']:,} | {pinned:+.3%} |"
        )
    print(f"\nworst |error| with these versions: {worst:.3%}")
    if args.record:
        data = dict(
            versions=here,
            model=TINY,
            rows=[dict(options=r["options"], measured=r["measured"]) for r in rows],
        )
        with open(args.record, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
