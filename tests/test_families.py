"""The recorded model families (trainmem/data/families/*.json, replayed by
trainmem.memory.traced): each estimate within 1 % of the CPU measurement of the same
step at a shape the traces were not recorded at, the data files consistent with the
registry and the installed transformers, and the variants nobody recorded refused by
name. The three-shape table is benchmarks/family_table.py."""

from __future__ import annotations

import json
from importlib.metadata import version

import pytest

from trainmem.config import OptionError, StepConfig
from trainmem.estimate import estimate
from trainmem.families import FAMILIES, MODEL_TYPES, model_shape, transformers_config
from trainmem.memory import traced

TRACED = [m.name for m in MODEL_TYPES.values() if m.fields]
RUNS = (("full", "fp32"), ("lora", "bf16-amp"), ("lora", "fp32"), ("full", "bf16-amp"))
#: a tiny shape that is none of the probes' (trainmem.measuring.family_trace.PROBES)
TINY = dict(v=150, h=48, i=120, L=2, a=4, k=2, d=12, b=2, s=20)


def _config(name: str) -> dict:
    mt = MODEL_TYPES[name]
    gqa, tied = mt.regimes[0]
    sizes = dict(TINY, k=TINY["k"] if gqa else TINY["a"])
    if "d" not in mt.fields:
        sizes["h"] = sizes["a"] * sizes["d"]
    fields = {"model_type": name}
    for symbol, field in mt.fields.items():
        if symbol == "tied":
            fields[field] = tied
        elif symbol in sizes:
            fields[field] = sizes[symbol]
    fields.update(mt.probe_fields)
    return transformers_config(fields, f"{name}-tiny")


def test_every_recorded_family_has_its_data_file():
    """One data file per registry entry, with every step the generator records
    (trainmem.measuring.family_trace.RECORDED in each of the entry's regimes, LoRA
    on every linear layer under the family's own names), recorded with the
    transformers and peft this environment pins: a version bump without a
    regenerated file fails here."""
    pytest.importorskip("torch")
    from trainmem.measuring.family_trace import (
        RECORDED,
        all_linear_targets,
        attention_targets,
        recorded_steps,
        regimes,
    )

    assert {"gpt2", "qwen3", "gemma3_text", "phi3", "olmo2"} <= set(TRACED)
    for name in TRACED:
        data = traced.load(name)
        assert data["model_type"] == name
        assert data["transformers"] == version("transformers")
        assert data["peft"] == version("peft")
        mt = MODEL_TYPES[name]
        want = set()
        for r in regimes(mt):
            structure = traced.structure(name, r)
            every = all_linear_targets(structure)
            assert set(every) == set(model_shape(_config(name)).linear_shapes())
            attention = attention_targets(structure)
            assert attention == model_shape(_config(name)).attention_linears()
            assert set(attention) < set(every)
            steps = recorded_steps(mt, every, attention)
            want |= {traced.variant_key(s, r) for s in steps}
        assert len(want) == len(RECORDED) * len(regimes(mt))
        assert set(data["variants"]) == want, name
        assert FAMILIES[name].replay == "traced"


#: the recipes recorded besides the four (method, precision) pairs, each checked on
#: one family against the CPU measurement at a shape not recorded (benchmarks/
#: family_table.py --recipes checks every family)
RECIPES = {
    "ckpt-lora": dict(method="lora", precision="bf16-amp", checkpointing=True),
    "ckpt-full-fp32": dict(method="full", precision="fp32", checkpointing=True),
    "load-bf16-full": dict(method="full", precision="bf16-amp", load_dtype="bf16"),
    "load-fp32-lora": dict(method="lora", precision="bf16-amp", load_dtype="fp32"),
    "pure-bf16-lora": dict(method="lora", precision="bf16"),
    "all-linear-ckpt": dict(
        method="lora", precision="bf16-amp", checkpointing=True, all_linear=True
    ),
    "lora-dropout": dict(method="lora", precision="bf16-amp", lora_dropout=0.05),
    "fp16-lora": dict(method="lora", precision="fp16-amp"),
    "usual-lora": dict(
        method="lora",
        precision="bf16-amp",
        checkpointing=True,
        lora_dropout=0.05,
        all_linear=True,
    ),
    "attention-lora": dict(
        method="lora",
        precision="bf16-amp",
        checkpointing=True,
        lora_dropout=0.05,
        attention=True,
    ),
    "usual-lora-fp16": dict(
        method="lora",
        precision="fp16-amp",
        checkpointing=True,
        lora_dropout=0.1,
        all_linear=True,
    ),
}


@pytest.mark.parametrize(
    "name, recipe",
    [(n, r) for n, r in zip(TRACED * 2, RECIPES)],
)
def test_a_reader_recipe_is_within_one_percent_of_the_cpu_measurement(name, recipe):
    """transformers 5's 16-bit load, 4.x's fp32 load, pure bf16, checkpointing, LoRA
    on every linear layer and LoRA dropout replay a recorded family's step as the CPU
    measures it; ``trainmem hf`` states the load dtype, and the stated default finds
    the same trace."""
    from trainmem.measuring.measure import measure

    opts = dict(RECIPES[recipe])
    shape = model_shape(_config(name))
    targets = MODEL_TYPES[name].lora_default
    if opts.pop("all_linear", False):
        targets = tuple(shape.linear_shapes())
    if opts.pop("attention", False):
        targets = shape.attention_linears()
    opts.update(
        batch=TINY["b"],
        seq=TINY["s"],
        lora_targets=targets,
        lora_rank=4,
        attn=MODEL_TYPES[name].attn or "sdpa",
    )
    est = estimate(_config(name), kernels="cpu", **opts)
    got = measure(_config(name), **opts)
    assert abs(est.total_bytes / got.total_bytes - 1) < 0.01, (
        est.total_bytes,
        got.total_bytes,
    )
    from trainmem.decisions import decide

    dtypes = decide(shape, StepConfig(**opts)).dtypes
    load, adapters = traced.step_dtypes(StepConfig(**opts))
    assert load == dtypes.load
    assert opts["method"] == "full" or adapters == dtypes.adapters
    stated = dict(opts, load_dtype=dtypes.load)
    assert estimate(_config(name), kernels="cpu", **stated).total_bytes == (
        est.total_bytes
    )


@pytest.mark.parametrize("name", TRACED)
def test_estimate_within_one_percent_of_the_cpu_measurement(name):
    from trainmem.measuring.measure import measure

    method, precision = RUNS[TRACED.index(name) % len(RUNS)]
    opts = dict(
        method=method,
        precision=precision,
        batch=TINY["b"],
        seq=TINY["s"],
        lora_targets=MODEL_TYPES[name].lora_default,
        lora_rank=4,
        kernels="cpu",  # CPU's dropout and SDPA, as measured
        attn=MODEL_TYPES[name].attn or "sdpa",
    )
    est = estimate(_config(name), **opts)
    opts.pop("kernels")
    got = measure(_config(name), **opts)
    assert est.n_trainable == got.n_trainable
    if method == "full":
        assert est.n_params == got.n_params
    assert abs(est.total_bytes / got.total_bytes - 1) < 0.01, (
        est.total_bytes,
        got.total_bytes,
    )


def _noise_events(kernels: str):
    from trainmem.decisions import decide
    from trainmem.memory.accounting import Simulator
    from trainmem.config import StepConfig

    shape = model_shape("gpt2")
    step = StepConfig(method="full", precision="fp32", batch=2, seq=16, kernels=kernels)
    model, _ = traced.build(Simulator(), shape, decide(shape, step))
    return shape, [e for e in model.events if e[0] == "a" and e[5] == "n"]


def test_gpt2_under_cuda_kernels_keeps_bool_masks_and_no_attention_probabilities():
    """GPT-2's dropouts (0.1 each): on CPU, ATen's ``_dropout_impl`` keeps an fp32
    noise tensor for the embeddings', every layer's attention output and MLP output,
    and SDPA's math path (no CPU kernel takes dropout) one of the attention
    probabilities (b x heads x s x s); under CUDA's kernels ``native_dropout`` keeps a
    bool mask and the fused SDPA kernel applies the attention dropout itself."""
    b, s = 2, 16
    shape, cpu = _noise_events("cpu")
    h, heads, layers = shape.hidden, shape.heads, shape.layers
    assert sorted(e[2] for e in cpu) == sorted(
        [4 * b * s * h] * (1 + 2 * layers) + [4 * b * heads * s * s] * layers
    )
    _, cuda = _noise_events("cuda")
    # the replay turns each into one byte an element (traced._apply)
    assert sorted(e[2] for e in cuda) == [4 * b * s * h] * (1 + 2 * layers)
    opts = dict(method="full", precision="fp32", batch=b, seq=s)
    on_cuda = estimate("gpt2", **opts).activation_bytes
    assert on_cuda < estimate("gpt2", kernels="cpu", **opts).activation_bytes


def test_a_variant_not_recorded_is_refused_by_name():
    with pytest.raises(OptionError, match="ckpt=reentrant.*not recorded"):
        estimate(_config("qwen3"), checkpointing=True, checkpointing_mode="reentrant")
    with pytest.raises(OptionError, match="qlora"):
        estimate(_config("gemma3_text"), method="qlora")


def test_linear_layers_come_from_the_trace():
    shape = model_shape(_config("phi3"))
    lin = shape.linear_shapes()
    h, a, d, i = shape.hidden, shape.heads, shape.head_dim, shape.intermediate
    assert lin["qkv_proj"] == (h, (a + 2 * shape.kv_heads) * d)
    assert lin["gate_up_proj"] == (h, 2 * i)
    assert set(model_shape("gpt2").linear_shapes()) == {
        "c_attn",
        "attn.c_proj",
        "c_fc",
        "mlp.c_proj",
    }


def test_size_expressions_allow_only_arithmetic_on_the_symbols():
    assert traced.evaluate("(a+2*k)*d", dict(a=4, k=2, d=8)) == 64
    for bad in ("__import__('os')", "x*2", "h/2", "h**2"):
        with pytest.raises(ValueError):
            traced.evaluate(bad, dict(h=4))


def test_data_files_are_plain_json():
    for name in TRACED:
        with open(traced.os.path.join(traced.DATA_DIR, f"{name}.json")) as f:
            assert json.load(f)["model_type"] == name


@pytest.mark.parametrize("name", TRACED)
def test_a_config_file_reads_the_same_without_transformers(name):
    """The in-page calculator reads a pasted config.json with the defaults
    :data:`MODEL_TYPES` gives each class's fields; transformers' class gives the same
    shape (a file naming only the required fields)."""
    from trainmem.families import plain_config, shape_of_config

    mt = MODEL_TYPES[name]
    sizes = dict(v=50304, h=256, i=688, L=4, a=8)
    fields = {"model_type": name}
    for symbol, value in sizes.items():
        if symbol != "i" or "i" not in mt.derived:
            fields[mt.fields[symbol]] = value
    want = shape_of_config(transformers_config(fields, "config.json"))
    assert shape_of_config(plain_config(fields, "config.json")) == want


def test_a_stored_trace_is_what_the_generator_records_now():
    """One variant (OLMo 2, full fine-tuning, fp32) recorded afresh from the installed
    transformers equals the stored one: the data files are the generator's output,
    not edited by hand (``python -m trainmem.measuring.family_trace --check``
    compares all)."""
    pytest.importorskip("torch")
    from trainmem.config import StepConfig
    from trainmem.measuring.family_trace import record_variant, regimes

    mt = MODEL_TYPES["olmo2"]
    step = StepConfig(method="full", precision="fp32", optimizer="adamw")
    regime = regimes(mt)[0]
    fresh = json.loads(json.dumps(record_variant(mt, step, regime)))
    assert fresh == traced.load("olmo2")["variants"][traced.variant_key(step, regime)]


@pytest.mark.parametrize("name", ["phi3", "gpt2"])
def test_a_trainer_run_of_a_recorded_family_is_estimated_not_refused(name):
    """``trainmem hf`` on a recorded family: a bf16 checkpoint under transformers 5
    (``from_pretrained`` loads it in bf16, stated as the load dtype), Trainer's bf16
    autocast, checkpointing and ``target_modules="all-linear"`` -- peft's names for
    that family (Phi-3's ``qkv_proj``, GPT-2's ``c_attn``), not Llama's -- find the
    recorded trace, and equal the same step written as options."""
    from trainmem.estimate import estimate_from_hf
    from trainmem.from_hf import hf_options

    config = dict(_config(name).to_dict(), torch_dtype="bfloat16", dtype="bfloat16")
    args = dict(bf16=True, gradient_checkpointing=True, per_device_train_batch_size=2)
    peft = dict(r=4, lora_alpha=8, target_modules="all-linear")
    opts = hf_options(config, args, peft, seq=TINY["s"])
    every = set(model_shape(_config(name)).linear_shapes())
    assert set(opts["lora_targets"]) == every
    assert opts["load_dtype"] == "bf16" and opts["checkpointing"]
    got = estimate_from_hf(config, args, peft, seq=TINY["s"])
    assert got.exact  # the traced replay ran, not a closed form
    assert got.total_bytes == estimate(_config(name), **opts).total_bytes


def test_a_family_without_sdpa_names_the_attention_it_runs():
    """transformers' Gemma 2 has no SDPA path (``_supports_sdpa = False``: its
    softcapping): asked for sdpa, the estimate replays eager attention and says so."""
    est = estimate(_config("gemma2"), method="lora", batch=2, seq=20)
    assert est.attention["kind"] == "eager"
    assert "no SDPA path" in est.attention["reason"]
    eager = estimate(_config("gemma2"), method="lora", batch=2, seq=20, attn="eager")
    assert eager.total_bytes == est.total_bytes
