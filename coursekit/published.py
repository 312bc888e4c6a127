"""The estimator against published real-GPU measurements (the rows, their comparison
and the report of ``benchmarks/published_gpu.py``, for the book's cells too).

Every row of ``coursekit/data/published_gpu.json`` (package data: a pip-only install, as
on Colab, has it) is one training run somebody else ran on a GPU and published with its
conditions: its source (repository, path, commit), the model's ``config.json`` fields,
the framework, precision, LoRA settings, quantization, micro-batch, the sequence length
the run reached, checkpointing, attention, loss, optimizer, and the metric (peak
allocated, peak reserved, peak active, what ``nvidia-smi`` showed, or a documented
out-of-memory) with its unit (GB = 10**9 B, GiB = 2**30 B).

For each row :func:`compare` asks :func:`trainmem.estimate.estimate` with the options
that describe that run (:func:`row_options`; nothing is tuned per row: each option is a
condition the source states) and gives estimate vs published and the signed error
(estimate / published - 1: negative = the estimate is under); :func:`report` adds the
median and the worst |error| per metric. Out-of-memory rows compare ``fits`` on the
row's GPU.

    python benchmarks/published_gpu.py
    python benchmarks/published_gpu.py --out benchmarks/results/published_gpu.md

Rows whose longest batch the source does not publish (``seq`` null) are estimated at the
cap the source's code truncates to (``seq_bound``) and reported in their own group,
outside the medians."""

from __future__ import annotations

import argparse
import fcntl
import functools
import hashlib
import inspect
import json
import os
import pickle
import statistics
from importlib import resources
from pathlib import Path

from trainmem.estimate import estimate
from trainmem.families import model_shape
from trainmem.from_hf import run_options

#: the rows and their sources, shipped inside the package
DATA = resources.files("coursekit") / "data" / "published_gpu.json"
UNITS = {"GB": 10**9, "GiB": 2**30, "B": 1}


def load() -> dict:
    """The JSON: ``sources`` (repository, path, commit, metric note) and ``rows``."""
    return json.loads(DATA.read_text(encoding="utf-8"))


def published_results(ids=None) -> tuple[dict, list[dict], list[dict]]:
    """``(data, rows, results)``: the JSON (sources and rows) and, per row (only the
    rows named in ``ids`` when given), the benchmark's comparison (``id``, ``kind``,
    ``published``, ``estimate``, ``error`` or, for documented out-of-memory runs,
    ``ok``)."""
    data = load()
    rows = data["rows"]
    if ids is not None:
        unknown = set(ids) - {r["id"] for r in rows}
        if unknown:
            raise KeyError(f"no published row {sorted(unknown)}")
    chosen = rows if ids is None else [r for r in rows if r["id"] in set(ids)]
    return data, rows, compare(chosen)


#: a folder where the estimates of rows are shared between processes (``make test``
#: sets it: the benchmark's test and the chapters that show rows, in the main and the
#: floor pass, then replay each row's step once); unset, each process computes its own
SHARED_ENV = "COURSE_ESTIMATE_CACHE"


@functools.lru_cache(maxsize=None)
def _estimate_json(model: str, options: str):
    # the model's Shape always comes from its config here, with the transformers this
    # process has (the floor pass's older one too); only the replay of the step, which
    # depends on the Shape, the options and trainmem's code alone, is shared
    shape = model_shape(json.loads(model))
    folder = os.environ.get(SHARED_ENV)
    if not folder:
        return estimate(shape, **json.loads(options))
    key = hashlib.sha256(
        "\n".join([_code_version(), repr(shape), options]).encode()
    ).hexdigest()[:40]
    path = Path(folder) / f"{key}.pickle"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process computing it: wait
        if path.exists():
            return pickle.loads(path.read_bytes())
        est = estimate(shape, **json.loads(options))
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(est))
        os.replace(tmp, path)
        return est


@functools.lru_cache(maxsize=None)
def _code_version() -> str:
    """A digest of the estimator's code (every module of trainmem)."""
    import trainmem

    h = hashlib.sha256()
    for f in sorted(Path(trainmem.__file__).parent.rglob("*.py")):
        h.update(f.as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _cached(model, **options):
    """``estimate(model, **options)``, computed once per process for the same
    arguments (a chapter shows a row's comparison and its three numbers), and once
    per test run where :data:`SHARED_ENV` names a folder."""
    return _estimate_json(
        json.dumps(model, sort_keys=True), json.dumps(options, sort_keys=True)
    )


def row_estimate(row: dict):
    """The estimator's :class:`~trainmem.estimate.MemoryEstimate` of one row, with the
    options the benchmark derives from its conditions."""
    return _cached(row["model"], **row_options(row))


def _supported() -> set[str]:
    return set(inspect.signature(estimate).parameters)


def row_options(row: dict) -> dict:
    """The estimator's options for one published run, each read from a condition the
    source states (see the JSON's ``conditions``; :func:`trainmem.from_hf.run_options`
    reads them), with the row's GPU."""
    opts = run_options(row["conditions"], row.get("devices", 1))
    opts["gpu"] = row["gpu"]
    supported = _supported()
    return {k: v for k, v in opts.items() if k in supported}


def _interval(row: dict):
    """LitGPT rows whose previous micro-batch's length is not published
    (``previous_seq`` null): the estimate with no previous micro-batch (the first
    iteration, the longest example, alone: ``grad_accum=1``, since every later
    micro-batch of a replayed step follows one of ``seq`` tokens) and with one of the
    same length, as (shortest, longest) assumption; ``None`` for every other row."""
    c = row["conditions"]
    if "previous_seq" not in c or c["previous_seq"] is not None:
        return None
    opts = dict(row_options(row), grad_accum=1)
    low = _cached(row["model"], **opts, previous_seq=0).to_dict()
    return low["gpu_allocated_bytes"]


def compare(rows: list[dict]) -> list[dict]:
    out = []
    for row in rows:
        est = row_estimate(row)
        m = row["metric"]
        source = row["source"]
        if row.get("commit"):  # an earlier run of the source, read at its own commit
            source += f"@{row['commit'][:9]}"
        rec = {"id": row["id"], "source": source, "kind": m["kind"]}
        rec["method"] = row["conditions"]["method"]
        if row["conditions"]["seq"] is None:
            rec["kind"] = m["kind"] + " (longest batch not published: at its cap)"
        d = est.to_dict()
        if m["kind"] == "oom":
            rec.update(published="OOM", estimate=d["fits"], unit="")
            rec["ok"] = d["fits"] is False
            rec["device_bytes"] = d["device_bytes"]
            rec["shown"] = _gb(d["device_bytes"])
        else:
            # allocated: max_memory_allocated counts whole blocks (512 B rounding,
            # unsplit remainders) and the cuBLAS workspaces: the allocator replay's
            # peak; active: the same blocks; reserved: the replay's segments
            # nvidia-smi: reserved + CUDA context + NCCL (device_bytes)
            key = {
                "allocated": "gpu_allocated_bytes",
                "active": "gpu_allocated_bytes",
                "nvidia-smi": "device_bytes",
            }
            value = d[key.get(m["kind"], "reserved_bytes")]
            published = m["value"] * UNITS[m["unit"]]
            rec.update(
                published=published,
                estimate=value,
                unit=m["unit"],
                error=value / published - 1,
            )
            low = _interval(row) if m["kind"] == "allocated" else None
            if low is not None:
                rec["low"] = low
                rec["low_error"] = low / published - 1
                rec["inside"] = low <= published <= value
        out.append(rec)
    return out


def _gb(n):
    return f"{n / 1e9:.2f} GB"


def _fmt(n, unit):
    if unit == "GiB":
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 1e9:.2f} GB"


def _versions_section(rows: list[dict], results: list[dict]) -> list[str]:
    """The rows that are one configuration run with several library versions (ids
    ``name`` and ``name@date``), published vs estimate per version."""
    by_id = {r["id"]: r for r in rows}
    groups: dict[str, list] = {}
    for res in results:
        groups.setdefault(res["id"].split("@")[0], []).append(res)
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return []
    lines = [
        "",
        "## Same configuration, other versions",
        "",
        "| configuration | versions | published | estimate | error |",
        "|---|---|---:|---:|---:|",
    ]
    for name, rs in groups.items():
        rs = sorted(rs, key=lambda r: by_id[r["id"]]["conditions"]["versions"])
        for r in rs:
            versions = by_id[r["id"]]["conditions"]["versions"].replace(",", ", ")
            lines.append(
                f"| {name} | {versions} | {_fmt(r['published'], r['unit'])} | "
                f"{_fmt(r['estimate'], r['unit'])} | {r['error']:+.1%} |"
            )
    return lines


def report(rows: list[dict], results: list[dict]) -> str:
    data = load()
    lines = [
        "# Estimator vs published GPU measurements",
        "",
        f"{len(rows)} rows from {len({r['source'] for r in rows})} published sources "
        "(`coursekit/data/published_gpu.json` holds each run's conditions). Error = "
        "estimate / published − 1 (negative: the estimate is under). Generated by "
        "`python benchmarks/published_gpu.py --out "
        "benchmarks/results/published_gpu.md`.",
        "",
        "## Sources",
        "",
    ]
    for key, s in data["sources"].items():
        lines.append(
            f"- **{key}**: `{s['repository']}` `{s['path']}` at `{s['commit'][:12]}`; "
            f"metric: {s['metric_note']}."
        )
    lines += [
        "",
        "A row whose source reads `source@commit` is an earlier run of the same "
        "configuration, read from the result file at that commit (its library "
        "versions are the ones that file records).",
    ]
    lines += [
        "",
        "## Rows",
        "",
        "| row | source | metric | published | estimate | error |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in results:
        if r["kind"] == "oom":
            verdict = "fits" if r["estimate"] else "does not fit"
            ok = "right" if r["ok"] else "WRONG"
            lines.append(
                f"| {r['id']} | {r['source']} | documented OOM | OOM | {verdict} "
                f"({r['shown']}) | {ok} |"
            )
        elif "low" in r:
            inside = "inside: within" if r["inside"] else "outside"
            lines.append(
                f"| {r['id']} | {r['source']} | {r['kind']} | "
                f"{_fmt(r['published'], r['unit'])} | {_fmt(r['low'], r['unit'])} .. "
                f"{_fmt(r['estimate'], r['unit'])} | {r['low_error']:+.1%} .. "
                f"{r['error']:+.1%} (interval, published {inside}) |"
            )
        else:
            lines.append(
                f"| {r['id']} | {r['source']} | {r['kind']} | "
                f"{_fmt(r['published'], r['unit'])} | {_fmt(r['estimate'], r['unit'])} "
                f"| {r['error']:+.1%} |"
            )
    lines += [
        "",
        "## Per metric",
        "",
        "| metric | rows | median error | median |error| | worst |error| |",
        "|---|---:|---:|---:|---:|",
    ]
    kinds: dict[str, list] = {}
    for r in results:
        kinds.setdefault(r["kind"], []).append(r)
    for r in results:
        if r["kind"] != "oom":
            kinds.setdefault(f"{r['kind']} · {r['method']}", []).append(r)
    for kind, rs in kinds.items():
        if kind == "oom":
            right = sum(r["ok"] for r in rs)
            lines.append(
                f"| documented OOM (fit answer right) | {len(rs)} | "
                f"{right}/{len(rs)} right | | |"
            )
            continue
        errs = [r["error"] for r in rs]
        worst = max(errs, key=abs)
        lines.append(
            f"| {kind} | {len(rs)} | {statistics.median(errs):+.1%} | "
            f"{statistics.median(abs(e) for e in errs):.1%} | {worst:+.1%} |"
        )
    lines += _versions_section(rows, results)
    lines += ["", "## What each row is estimated with", "", NOTES]
    return "\n".join(lines) + "\n"


NOTES = """\
Every row is estimated with the options its source states (`row_options`): pure bf16
(`bf16-true`, or a model loaded in bf16 without autocast; the two peft pages' Trainer
`bf16=True` under FSDP/DeepSpeed is `bf16-amp`, whose ZeRO layout keeps fp32 master
copies of the adapters and computes with 16-bit ones), LoRA rank/alpha/dropout/
targets, NF4 with or without double quantization, torch AdamW (foreach), no
checkpointing, SDPA, FSDP full sharding over the stated GPUs (`zero=3`: of a 4-bit
weight only the packed data is sharded and all-gathered; its absmax constants stay
whole on every rank, a `quant_state` attribute of the `Linear4bit` module —
bitsandbytes' `fix_4bit_weight_quant_state_from_module`, 0.43.0+; the root unit —
embeddings, final norm, `lm_head` — stays all-gathered from the forward to the end
of backward, torch's `_post_forward_reshard` skipping the root), the stated
library versions (bitsandbytes 0.41.1 for the resource tables: each 4-bit Linear's
input is saved), the row's GPU preset (allocated rows compare the allocator replay's
`max_memory_allocated`, which adds 512 B rounding, unsplit blocks and the cuBLAS
workspaces; OOM rows compare `fits`).

LitGPT rows run with `framework="litgpt"` (`trainmem.memory.litgpt`: the fused `qkv`
with `LoRAQKVLinear` — one dropout on the shared input, `conv1d`, `zero_pad` —, fp32
RMSNorm, fp32 RoPE buffers, `lm_head` in 128-token chunks, each returned in fp32 by
Fabric's wrapper (`_FabricModule.forward` calls the precision plugin's
`convert_output`, a cast to `torch.get_default_dtype()`) and a cross-entropy per fp32
chunk (`finetune/full.py`: one unchunked head, 128-row chunks), the loop's fp32
`logits` alive into the next forward, every Linear incl. `lm_head` 4-bit under
QLoRA), with bitsandbytes 0.42.0 (LitGPT's pin) for the config hub and each yaml's
global batch as gradient accumulation. Mechanisms not modelled that these rows may
still miss:

- modelled besides the step (LitGPT never resets the peak counter): the previous
  graph's bitsandbytes `ctx.tensors` inputs alive with the loop's `logits` (0.42.0
  stores them as a ctx attribute, not `save_for_backward`), `validate` (unchunked
  head, fp32 logits and cross-entropy) and `generate_example`'s KV cache as their
  own phases; both phases stay below the training step on every row.
- LitGPT is keyed on the code each row ran (`litgpt=5895df10` for the config hub,
  `litgpt=8641822` for the resource tables, `trainmem/versions.py`): before 6178c7cc
  RMSNorm runs in bf16 (it saves the bf16 input, not an fp32 copy) and the RoPE cache
  is fp16; before bbf982aa the loop's `loss` holds the previous graph (and its
  bitsandbytes `ctx.tensors`) until the next cross-entropy.
- QLoRA rows run `bnb.optim.PagedAdamW` (finetune/lora.py at both commits): fp32
  states, those of tensors from 1e5 elements in CUDA managed memory, outside
  `max_memory_allocated` (bitsandbytes `Optimizer8bit.get_state_buffer`); LoRA's A
  and B matrices are all under 1e5 elements here, so every state stays in the
  allocator, in fp32.
- Resource tables: lit_gpt@8641822 runs the longest example at iteration 0 only;
  the length of the micro-batch before a later one is not published, so those rows
  show an interval: the first micro-batch alone, with no previous one (shortest
  assumption) .. a step of micro-batches of the same length (longest); a row
  counts as within when the published value lies inside it. The medians use the
  longest assumption.
- Checked against LitGPT's own code (`benchmarks/litgpt_cpu_check.py`): `lit_gpt/`
  at 8641822 and `litgpt/` at 5895df10, run on CPU with a 2-layer config (LoRA on
  q/v, q/k/v, q/k; dropout 0 and 0.05; MHA, GQA, MQA; batch 1 and 2), give the
  replay's forward and backward peaks to within 4 B, and 2 KB at batch 2 (the
  targets' reshape). That found `zero_pad`'s `index_copy`, whose backward keeps
  its `source` (a `(B·T, 2·hidden)` tensor per layer when q and v are adapted),
  and MQA's views of the fused output.
- Not modelled: quantise-on-load copies (one fp16 weight at a time on the GPU, below
  the training step's peak); `flash_attn` (8641822 calls it when installed: the same
  saved q, k, v, output and log-sum-exp as SDPA's flash kernel); cuBLAS/cuDNN
  workspaces of `conv1d`; what the CUDA kernels of torch 2.1 keep that the CPU
  kernels do not (the CPU check above runs today's torch). Not verified on a GPU here.
- torchtune: its own decoder and loss; the packed row has no compile, no chunked
  cross-entropy and no checkpointing, the closest to what is modelled.
- peft method comparison: every example is truncated to `max_seq_length` 768
  (`tokenizer.model_max_length`), and `data.py` ties its 1,300-character filter to that
  768-token limit, so the rows are estimated at 768 tokens; the length the longest batch
  reached is still not recorded by the run, so they form their own group, outside the
  other medians. Their metric is `max_memory_reserved()` over the whole run less the
  2 MiB segment of `init_accelerator`, covering evaluation (generation at batch 51 with
  a static cache, lower than the training step for these configurations) and
  `empty_cache()` every 10 steps. The `@commit` rows are the same configurations run
  with earlier library versions (see "Same configuration, other versions"): the
  published LoRA figures barely move, while full fine-tuning's grows with the torch
  version and the estimate's does not; what changed there is not identified.
- peft FSDP-QLoRA and DeepSpeed-QLoRA pages: the versions are the first releases meeting
  the pages' minimums, and the FSDP page does not name its GPU; the figures are compared
  with `device_bytes` (reserved + CUDA context + NCCL's ring buffers, as many channels
  as NCCL runs between A100s on NVSwitch — neither page says how its cards are
  connected, the A100 presets are the SXM boards —, in one communicator under FSDP and
  two under DeepSpeed, whose optimizer runs on a clone of the world group that
  `zero.Init` partitions the parameters on). The DeepSpeed row runs
  `zero_impl="deepspeed"` (`trainmem.deepspeed`): the gradient bucket of
  `reduce_bucket_size` elements that ZeRO-3 allocates with its optimizer and keeps (at
  DeepSpeed's default size: accelerate builds the config from its yaml without sizes),
  parameters gathered module by module (a checkpointed layer's through its backward,
  plus the prefetch bucket; embeddings for their forward, `lm_head` from its forward to
  its backward) instead of FSDP's units and root, and parameters under
  `stage3_param_persistence_threshold` whole. Which parameters DeepSpeed keeps gathered
  after the forward (`stage3_max_reuse_distance` over its recorded trace), which it
  never partitions, and its bucket were checked against DeepSpeed 0.16.4 on CPU
  (`benchmarks/deepspeed_cpu_check.py`: 16 cases, full fine-tuning and LoRA, three
  checkpointing forms, four reuse distances, all the same). The kernels loaded during
  the step and FSDP's flat-parameter padding are not in `device_bytes`.

Sources read and left out (conditions not pinned, so no row):

- ms-swift `docs/source_en/LLM/Benchmark.md` (A100, torch 2.1.1, bitsandbytes
  0.41.3.post2; "GPU Memory (GiB)" is `max_memory_reserved()` / 1024**3 through the
  trainer's `get_max_cuda_memory`): transformers and peft versions are not stated, the
  qwen/chatglm/baichuan rows are remote-code architectures, and for the llama-layout
  rows (Yi-6B, OpenBuddy-Zephyr) which attention path `use_flash_attn` reached and how
  long the kept examples were (examples over `max_length` are dropped) are not recorded;
  the table is not monotonic in `max_length` (Baichuan2-7B: 18.18 GiB at 512, 17.45 at
  1024).
- Unsloth's benchmark page (Hugging Face + FA2 longest context per VRAM size for
  Llama 3.1 8B QLoRA r = 32): no library versions, checkpointing or loss form.
"""


def main(argv=None):
    p = argparse.ArgumentParser(
        description="The estimator against published real-GPU measurements"
    )
    p.add_argument("--out", help="write the markdown report here")
    args = p.parse_args(argv)
    rows = load()["rows"]
    text = report(rows, compare(rows))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
