"""The family table: every decoder family the estimator knows, at three shapes, full
fine-tuning and LoRA, fp32 and bf16 autocast — the estimate
(:func:`trainmem.estimate.estimate`) next to the CPU measurement of the same step
(:func:`trainmem.measuring.measure.measure`, the peak of the tracked storages), measured
in the same run, and their ratio.

Llama, Mistral and Qwen2 are estimated by the Llama replay (:mod:`trainmem.memory.
llama`); every other family by the replay of its recorded trace
(:mod:`trainmem.memory.traced`, ``trainmem/data/families/<model_type>.json``). The
shapes are not the probe shapes the traces were recorded at.

    python benchmarks/family_table.py [model_type ...] [--quick]

``--quick``: the first shape only; ``--all-runs``: the four (method, precision)
pairs at every shape, not only at the first. A second table runs, at the second
shape, every recipe the traces record beyond those four
(``trainmem.measuring.family_trace.RECORDED``: 16-bit and fp32 loads, pure bf16,
checkpointing, LoRA on every linear layer, LoRA dropout); ``--no-recipes`` leaves it
out. Prints a Markdown table; exits 1 when a
ratio is off by more than 1 %.
"""

from __future__ import annotations

import argparse
import sys
import time

from trainmem.estimate import estimate
from trainmem.families import MODEL_TYPES, model_shape, transformers_config
from trainmem.measuring.measure import measure

#: config field names of the sizes (Llama-style; GPT-2 its own)
LLAMA_STYLE = dict(
    v="vocab_size",
    h="hidden_size",
    i="intermediate_size",
    L="num_hidden_layers",
    a="num_attention_heads",
    k="num_key_value_heads",
    d="head_dim",
)
GPT2_STYLE = dict(v="vocab_size", h="n_embd", i="n_inner", L="n_layer", a="n_head")

#: the Llama-replay model types whose config class takes head_dim
SET_HEAD_DIM = ("llama", "mistral")
#: three shapes per family: (vocab, hidden, intermediate, layers, heads, kv heads,
#: head dim, batch, seq); kv heads = heads for a family recorded without GQA
SHAPES = (
    dict(v=320, h=64, i=176, L=2, a=4, k=2, d=16, b=2, s=40),
    dict(v=500, h=96, i=256, L=3, a=6, k=2, d=12, b=3, s=24),
    dict(v=1000, h=128, i=320, L=5, a=8, k=4, d=20, b=2, s=64),
)
FAMILIES = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gemma3_text",
    "phi3",
    "gpt2",
    "olmo2",
)
RUNS = (("full", "fp32"), ("lora", "fp32"), ("full", "bf16-amp"), ("lora", "bf16-amp"))


def config_of(name: str, shape: dict, gqa: bool, tied: bool) -> dict:
    """A ``config.json``'s fields of model type ``name`` at ``shape``."""
    mt = MODEL_TYPES[name]
    style = GPT2_STYLE if name == "gpt2" else LLAMA_STYLE
    sizes = dict(shape)
    if not gqa:
        sizes["k"] = sizes["a"]
    fields = {"model_type": name}
    for symbol, field in style.items():
        if symbol == "d" and "d" not in mt.fields and name not in SET_HEAD_DIM:
            continue  # the class derives head_dim = hidden // heads
        fields[field] = sizes[symbol]
    if name != "gpt2":
        fields["tie_word_embeddings"] = tied
    fields.update(mt.probe_fields)
    return fields


def regime(name: str) -> tuple[bool, bool]:
    """The family's first recorded regime (GQA, tied); Llama-family: GQA, untied."""
    mt = MODEL_TYPES[name]
    return mt.regimes[0]


def rows(names, shapes, every_run_at_each_shape: bool = False):
    """At the first shape every (method, precision); at the others full fine-tuning
    in fp32 and LoRA under bf16 autocast (``every_run_at_each_shape``: all four)."""
    for name in names:
        gqa, tied = regime(name)
        for n, shape in enumerate(shapes, 1):
            fields = config_of(name, shape, gqa, tied)
            runs = RUNS if n == 1 or every_run_at_each_shape else RUNS[::3]
            for method, prec in runs:
                opts = dict(
                    method=method,
                    precision=prec,
                    batch=shape["b"],
                    seq=shape["s"],
                    lora_targets=MODEL_TYPES[name].lora_default,
                    # a family without an SDPA path runs its own
                    attn=MODEL_TYPES[name].attn or "sdpa",
                )
                started = time.perf_counter()
                config = transformers_config(fields, f"{name}-{n}")
                # GPT-2's dropouts keep a float noise tensor on CPU (kernels "cpu")
                est = estimate(config, kernels="cpu", **opts).total_bytes
                got = measure(config, **opts).total_bytes
                yield (
                    name,
                    n,
                    shape,
                    method,
                    prec,
                    est,
                    got,
                    time.perf_counter() - started,
                )


def recipe_text(options: dict) -> str:
    return ", ".join(
        f"{k}={v}" for k, v in options.items() if k not in ("method", "precision")
    )


def recipe_rows(names, shape):
    """Every recorded recipe beyond the four (method, precision) pairs, for each
    family at ``shape``: (family, method, precision, recipe, estimate, measured)."""
    from trainmem.measuring.family_trace import ALL_LINEAR, ATTENTION, RECORDED

    for name in names:
        gqa, tied = regime(name)
        config = transformers_config(config_of(name, shape, gqa, tied), f"{name}-r")
        model = model_shape(config)
        every = tuple(model.linear_shapes())
        attention = model.attention_linears()
        for options in RECORDED[4:]:
            opts = dict(options)
            targets = opts.pop("lora_targets", MODEL_TYPES[name].lora_default)
            opts.update(
                batch=shape["b"],
                seq=shape["s"],
                lora_targets={ALL_LINEAR: every, ATTENTION: attention}.get(
                    targets, targets
                ),
                attn=MODEL_TYPES[name].attn or "sdpa",
            )
            est = estimate(config, kernels="cpu", **opts).total_bytes
            got = measure(config, **opts).total_bytes
            yield name, options["method"], options["precision"], options, est, got


#: GPT-2 124M (transformers' GPT2Config defaults, dropout 0.1), full fine-tuning in
#: fp32, AdamW, batch 8 x 1024, a plain PyTorch loop on an NVIDIA H200 (sm_90; torch
#: 2.11, transformers 5.24): steps 2-3 as recorded (bytes)
H200_GPT2 = dict(
    max_memory_allocated=15_777_756_160,
    max_memory_reserved=16_523_460_608,
    nvidia_smi=17_301_504_000,
)


def gpt2_on_h200() -> None:
    """The recorded H200 row next to the estimate on the sm_90 preset (H100-80GB: the
    same compute capability and caching allocator)."""
    est = estimate(
        "gpt2",
        method="full",
        precision="fp32",
        optimizer="adamw",
        batch=8,
        seq=1024,
        gpu="H100-80GB",
    )
    print(
        "\n| GPT-2 124M, full fp32, 8 × 1024 | H200 measured (B) | estimate (B) "
        "| ratio |"
    )
    print("|---|---:|---:|---:|")
    for label, got, want in (
        ("peak allocated", H200_GPT2["max_memory_allocated"], est.total_bytes),
        ("peak reserved", H200_GPT2["max_memory_reserved"], est.reserved_bytes),
        ("process (nvidia-smi)", H200_GPT2["nvidia_smi"], est.device_bytes),
    ):
        print(f"| {label} | {got:,} | {want:,} | {want / got:.4f} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("families", nargs="*", default=list(FAMILIES))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--all-runs", action="store_true")
    parser.add_argument("--no-recipes", action="store_true")
    args = parser.parse_args(argv)
    shapes = SHAPES[:1] if args.quick else SHAPES
    print(
        "| family | shape (h/i/L/a/kv/b×s) | method | precision | estimate (B) "
        "| CPU measured (B) | estimate / measured |"
    )
    print("|---|---|---|---|---:|---:|---:|")
    worst = 0.0
    table = rows(args.families, shapes, args.all_runs)
    for name, n, sh, method, prec, est, got, _ in table:
        gqa, _tied = regime(name)
        kv = sh["k"] if gqa else sh["a"]
        ratio = est / got
        worst = max(worst, abs(ratio - 1))
        print(
            f"| {name} | {n}: {sh['h']}/{sh['i']}/{sh['L']}/{sh['a']}/{kv}/"
            f"{sh['b']}×{sh['s']} | {method} | {prec} | {est:,} | {got:,} | "
            f"{ratio:.4f} |",
            flush=True,
        )
    if not args.no_recipes:
        sh = SHAPES[1]
        print(
            f"\nRecipes at shape 2 ({sh['h']}/{sh['i']}/{sh['L']}/{sh['a']}/kv/"
            f"{sh['b']}×{sh['s']}):\n"
        )
        print(
            "| family | method | precision | recipe | estimate (B) "
            "| CPU measured (B) | estimate / measured |"
        )
        print("|---|---|---|---|---:|---:|---:|")
        for name, method, prec, options, est, got in recipe_rows(args.families, sh):
            ratio = est / got
            worst = max(worst, abs(ratio - 1))
            print(
                f"| {name} | {method} | {prec} | {recipe_text(options)} | {est:,} "
                f"| {got:,} | {ratio:.4f} |",
                flush=True,
            )
    print(f"\nlargest deviation: {worst:.2%}")
    if "gpt2" in args.families:
        gpt2_on_h200()
    return 0 if worst <= 0.01 else 1


if __name__ == "__main__":
    sys.exit(main())
