"""Byte-identity harness: the estimator's full output on a fixed set of rows, recorded
before a refactoring and compared after it.

    python benchmarks/estimate_identity.py record [FILE]    # write the rows' outputs
    python benchmarks/estimate_identity.py compare [FILE]   # rows compared, identical

The rows: the golden estimates of ``tests/data/estimate_golden.json`` (as
``tests/test_estimate.py`` runs them), every published GPU row
(``coursekit.published.row_options``, with its GPU: reserved and device bytes, notes),
``trainmem hf`` on a few Trainer setups, and a deterministic spread of step options —
every method x precision x optimizer x checkpointing x attention x ZeRO stage/impl x
framework, over several families and with or without a GPU preset. A row whose
options are refused records the error (class, option, message), so a changed check
shows too. Each output is the estimate's ``to_dict()`` (every term, the peak, the
phase peaks, reserved, device, notes) plus the model-state bytes.

FILE defaults to ``benchmarks/results/estimate_identity.json``. A change that alters
estimates on purpose re-records the file in its own commit and says why.
"""

from __future__ import annotations

import itertools
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainmem.config import OptionError  # noqa: E402
from trainmem.estimate import estimate, estimate_from_hf  # noqa: E402

DEFAULT = ROOT / "benchmarks" / "results" / "estimate_identity.json"

#: the golden rows were recorded before these options existed (tests/test_estimate.py)
GOLDEN_ADDED = dict(use_cache="off", kbit_prepare="none")


def _output(est) -> dict:
    out = est.to_dict()
    out["model_state_bytes"] = int(est.model_state_bytes)
    return out


def _run(fn) -> dict:
    try:
        return {"ok": _output(fn())}
    except OptionError as e:
        return {"error": [type(e).__name__, e.option, str(e)]}
    except (ValueError, NotImplementedError) as e:
        return {"error": [type(e).__name__, None, str(e)]}


def golden_rows():
    rows = json.loads((ROOT / "tests" / "data" / "estimate_golden.json").read_text())
    for i, row in enumerate(rows):
        opts = dict(row["options"], **GOLDEN_ADDED)
        yield f"golden/{i}", (lambda o=opts: estimate(**o))


def published_rows():
    from coursekit.published import load, row_options
    from trainmem.families import model_shape

    for row in load()["rows"]:
        opts = row_options(row)
        shape = model_shape(row["model"])
        yield f"published/{row['id']}", (lambda s=shape, o=opts: estimate(s, **o))


def hf_rows():
    setups = [
        ("tiny", {"bf16": True, "per_device_train_batch_size": 2}, {"r": 8}, 64),
        (
            "qwen2.5-0.5b",
            {"bf16": True, "gradient_checkpointing": True},
            {"r": 16, "target_modules": "all-linear"},
            256,
        ),
        ("tiny", {"fp16": True, "optim": "adamw_torch"}, None, 128),
        ("tiny", {"bf16": True, "optim": "adamw_8bit"}, {"r": 4}, 32),
    ]
    for i, (model, args, peft, seq) in enumerate(setups):
        yield (
            f"hf/{i}",
            lambda m=model, a=args, p=peft, s=seq: estimate_from_hf(
                m, a, p, seq=s, versions="transformers=5.0.0"
            ),
        )
    # a bf16 checkpoint's config under transformers 4.x (fp32 load) and 5.x (stored)
    bf16_config = json.loads(
        (ROOT / "tests" / "data" / "llama_gqa_bf16.json").read_text()
    )
    for t in ("4.57.1", "5.24.0"):
        yield (
            f"hf/bf16-config/{t}",
            lambda t=t: estimate_from_hf(
                bf16_config,
                {"bf16": True, "per_device_train_batch_size": 4},
                {"r": 16},
                seq=128,
                versions=f"transformers={t}",
            ),
        )
    quant = {"load_in_4bit": True, "bnb_4bit_use_double_quant": True}
    yield (
        "hf/qlora",
        lambda: estimate_from_hf(
            "tiny", {"bf16": True}, {"r": 8}, seq=64, quantization_config=quant
        ),
    )


#: small shapes of several families, so the spread replays quickly
MODELS = [
    "tiny",
    {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 320,
        "tie_word_embeddings": True,
    },
    {
        "model_type": "mistral",
        "hidden_size": 96,
        "intermediate_size": 200,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 1,
        "vocab_size": 500,
    },
    "gpt2",
]
AXES = dict(
    method=["full", "lora", "qlora"],
    precision=["fp32", "fp16-amp", "bf16-amp", "bf16"],
    optimizer=["adamw", "adamw8bit", "sgd", "sgd-momentum", "lion", "adafactor"],
    checkpointing=[False, True],
    attn=["sdpa", "eager", "flash", "math"],
    zero=[
        (0, 1, "fsdp"),
        (0, 2, "fsdp"),
        (1, 2, "fsdp"),
        (2, 4, "fsdp"),
        (3, 4, "fsdp"),
        (2, 2, "deepspeed"),
        (3, 8, "deepspeed"),
    ],
    framework=["hf", "hf", "hf", "litgpt"],  # litgpt refuses many options
)
GPU_CHOICES = [None, None, "T4", "A100-80GB", "H100-80GB", "RTX4090"]


def spread_rows(n: int = 500, seed: int = 40):
    from trainmem.families import model_shape

    rng = random.Random(seed)
    shapes = [model_shape(m) for m in MODELS]
    keys = list(AXES)
    combos = list(itertools.product(*(range(len(AXES[k])) for k in keys)))
    rng.shuffle(combos)
    for i, combo in enumerate(combos[:n]):
        opts = {k: AXES[k][j] for k, j in zip(keys, combo)}
        zero, gpus, impl = opts.pop("zero")
        opts.update(zero=zero, gpus=gpus, zero_impl=impl)
        opts.update(
            batch=rng.choice([1, 2, 3]),
            seq=rng.choice([16, 48, 64]),
            grad_accum=rng.choice([1, 1, 2]),
            lora_rank=rng.choice([2, 4]),
            lora_targets=rng.choice(
                [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj")]
            ),
            lora_dropout=rng.choice([0.0, 0.0, 0.1]),
            use_cache=rng.choice([None, "on", "off"]),
            kbit_prepare=rng.choice(["peft", "none"]),
            checkpointing_mode=rng.choice(["non-reentrant", "reentrant"]),
            versions=rng.choice(
                [None, "transformers=4.45.0,peft=0.13.2", "transformers=5.0.0"]
            ),
        )
        shape = shapes[i % len(shapes)]
        if shape.arch == "gpt2" and opts["method"] != "full":
            opts["lora_targets"] = ("c_attn",)
        gpu = GPU_CHOICES[(i // len(shapes)) % len(GPU_CHOICES)]
        yield (
            f"spread/{i}/{shape.arch}/{json.dumps(opts, sort_keys=True)}/{gpu}",
            lambda s=shape, o=opts, g=gpu: estimate(s, gpu=g, **o),
        )


def default_rows():
    yield (
        "defaults/llama-7b",
        lambda: estimate("llama-7b"),
    )
    yield "defaults/tiny-gpu", lambda: estimate("tiny", gpu="T4")


def all_rows():
    yield from golden_rows()
    yield from default_rows()
    yield from hf_rows()
    yield from spread_rows()
    yield from published_rows()


def record(path: Path) -> None:
    out = {}
    t0 = time.time()
    for name, fn in all_rows():
        out[name] = _run(fn)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, sort_keys=True, indent=0) + "\n")
    errors = sum("error" in v for v in out.values())
    print(
        f"recorded {len(out)} rows ({errors} refused) to {path} in "
        f"{time.time() - t0:.0f} s"
    )


def compare(path: Path) -> int:
    before = json.loads(path.read_text())
    compared = identical = 0
    differ = []
    for name, fn in all_rows():
        if name not in before:
            print(f"new row (not in the record): {name}")
            continue
        compared += 1
        now = json.loads(json.dumps(_run(fn), sort_keys=True))
        if now == before[name]:
            identical += 1
        else:
            differ.append((name, before[name], now))
    for name, was, now in differ[:10]:
        print(
            f"DIFFERS {name}\n  before: {json.dumps(was)[:600]}\n  now:    "
            f"{json.dumps(now)[:600]}"
        )
    print(f"rows compared {compared}, rows identical {identical}")
    return 0 if compared == identical == len(before) else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("record", "compare"):
        print(__doc__)
        return 2
    path = Path(argv[1]) if len(argv) > 1 else DEFAULT
    if argv[0] == "record":
        record(path)
        return 0
    return compare(path)


if __name__ == "__main__":
    sys.exit(main())
