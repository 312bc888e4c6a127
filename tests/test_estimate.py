"""trainmem.estimate: exact parameter counts (against transformers/peft on the meta
device), bytes-per-parameter conventions, and agreement with a real CPU measurement on
the tiny model."""

import json
from pathlib import Path

import pytest

from trainmem.estimate import (
    CATEGORIES,
    accelerate_rule_bytes,
    activation_bytes_per_layer,
    bytes_per_param,
    count_params,
    estimate,
    lora_trainable_params,
)
from trainmem.families import LLAMA_LINEARS


@pytest.mark.parametrize("name", ["tiny", "llama-7b", "qwen2.5-0.5b", "gpt2"])
def test_count_params_matches_transformers(name):
    from trainmem.measuring.models import build_model, get_config

    model = build_model(get_config(name), device="meta")
    assert count_params(name) == sum(p.numel() for p in model.parameters())


def test_lora_counts_match_peft_on_meta_llama7b():
    from peft import LoraConfig, get_peft_model

    from trainmem.measuring.models import build_model, get_config

    for targets, trainable in (
        (["q_proj", "v_proj"], 4_194_304),
        (["q_proj", "k_proj", "v_proj", "o_proj"], 8_388_608),
    ):
        model = build_model(get_config("llama-7b"), device="meta")
        model = get_peft_model(
            model, LoraConfig(r=8, lora_alpha=16, target_modules=targets)
        )
        n_train, n_all = model.get_nb_trainable_parameters()
        assert n_train == trainable == lora_trainable_params("llama-7b", 8, targets)
        assert n_all == count_params("llama-7b") + trainable
    assert count_params("llama-7b") + 4_194_304 == 6_742_609_920


def test_bytes_per_param_conventions():
    assert bytes_per_param("bf16-amp", "adamw") == 18  # torch AMP / HF
    assert bytes_per_param("bf16-amp", "adamw", convention="zero-paper") == 16
    assert bytes_per_param("fp32", "adamw") == 16
    assert bytes_per_param("bf16", "adamw") == 8
    assert bytes_per_param("fp32", "sgd") == 8
    assert accelerate_rule_bytes(1000, "fp32") == 16000
    assert accelerate_rule_bytes(1000, "bf16-amp") == 8000


def test_breakdown_sums_and_json():
    est = estimate("llama-7b", method="lora", precision="bf16-amp", batch=2, seq=256)
    assert set(est.breakdown) == set(CATEGORIES)
    assert sum(est.breakdown.values()) == est.total_bytes
    d = json.loads(est.to_json())
    assert d["total_bytes"] == est.total_bytes and set(d["breakdown"]) == set(
        CATEGORIES
    )
    assert "GiB" in est.table() and "GB" in est.table()


def test_model_states_full_fp32_adamw():
    # at the optimizer step: params 4 + grads 4 + m, v 8 + foreach sqrt(v) scratch 4
    # bytes/param
    est = estimate("llama-7b", method="full", precision="fp32", batch=1, seq=128)
    n = count_params("llama-7b")
    assert est.peak_phase == "optimizer"
    assert est.breakdown["gradients"] == 4 * n
    assert (
        est.breakdown["optimizer_states"] == 8 * n + 4 * 291
    )  # + one fp32 step per tensor


def test_activation_formula_fp32_sdpa():
    b, s, h, i, heads = 3, 40, 64, 172, 4
    expected = b * s * (24 * h + 8 * h + 8 * h + 16 * i + 8) + 4 * b * heads * s
    assert activation_bytes_per_layer("tiny", b, s, "fp32", "sdpa") == expected


def test_zero_partitions_per_gpu():
    one = estimate("llama-7b", precision="bf16-amp", zero=0, gpus=8)
    z3 = estimate("llama-7b", precision="bf16-amp", zero=3, gpus=8)
    assert z3.total_bytes < one.total_bytes / 4


@pytest.mark.parametrize(
    "method,checkpointing,precision",
    [
        ("full", False, "fp32"),
        ("full", True, "bf16-amp"),
        ("lora", False, "bf16-amp"),
        ("lora", True, "fp32"),
    ],
)
def test_estimate_agrees_with_cpu_measurement(method, checkpointing, precision):
    from trainmem.measuring.measure import measure

    kw = dict(
        method=method, precision=precision, batch=2, seq=24, checkpointing=checkpointing
    )
    est = estimate("tiny", **kw)
    meas = measure("tiny", device="cpu", **kw)
    tol = 0.02 if method == "full" else 0.03
    assert abs(est.total_bytes - meas.total_bytes) <= tol * meas.total_bytes
    assert (
        abs(est.activation_bytes - meas.activation_bytes)
        <= 0.03 * meas.activation_bytes
    )


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(model="nope"), "model must be one of"),
        (
            dict(method="lora", lora_rank=0),
            "lora_rank must be ≥ 1 and ≤ min(d_in, d_out)=64, got 0",
        ),
        (dict(method="lora", lora_rank=65), "lora_rank"),
        (
            dict(method="lora", lora_targets=("q_proj", "nope")),
            "unknown target module 'nope'",
        ),
        (dict(batch=0), "batch must be an integer ≥ 1"),
        (
            dict(precision="fp8"),
            "precision must be one of fp32, fp16-amp, bf16-amp, bf16",
        ),
    ],
)
def test_bad_input_names_argument(kwargs, needle):
    kwargs = {"model": "tiny", **kwargs}
    with pytest.raises(ValueError, match=None) as e:
        estimate(**kwargs)
    assert needle in str(e.value)


def test_malformed_config_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama", "hidden_size": ')
    with pytest.raises(ValueError, match="not valid JSON"):
        estimate(str(bad))
    nofield = tmp_path / "nofield.json"
    nofield.write_text('{"model_type": "llama", "vocab_size": 10}')
    with pytest.raises(ValueError, match="hidden_size must be a positive integer"):
        estimate(str(nofield))
    good = tmp_path / "cfg.json"
    good.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 256,
                "hidden_size": 64,
                "intermediate_size": 172,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
            }
        )
    )
    assert (
        estimate(str(good), batch=2, seq=16).total_bytes
        == estimate("tiny", batch=2, seq=16).total_bytes
    )


@pytest.mark.parametrize("precision", ["bf16-amp", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_model_states_match_zero_paper_formulas(precision, stage):
    """Per-GPU model states (at the optimizer step) = trainmem.zero's formulas,
    llama-7b.

    bf16-amp at zero >= 1 uses the ZeRO/DeepSpeed layout (2 + 2 + 12 bytes/param), at
    zero = 0 torch AMP's (fp32 params 4 + fp32 grads 4 + m, v 8 = 16 resident too); fp32
    is 4 + 4 + 8. Exact up to AdamW's per-tensor ``step`` scalars and the rotary buffers
    (< 2 KiB); stage 3 adds exactly the gathered (unsharded) decoder layers in the
    parameter dtype: one on one GPU, two (the prefetched next unit) on more; stage 0 on
    more than one GPU (DDP) adds its gradient buckets, 4 bytes a parameter."""
    from trainmem import zero
    from trainmem.estimate import model_shape

    s = model_shape("llama-7b")
    per_layer = (
        count_params("llama-7b") - s.vocab * s.hidden * 2 - s.hidden
    )  # untied, final norm
    per_layer //= s.layers
    wb = 4 if precision == "fp32" else 2
    kw = dict(weight_bytes=4, grad_bytes=4, k=8) if precision == "fp32" else {}
    for gpus in (1, 8, 64):
        e = estimate(
            "llama-7b", precision=precision, zero=stage, gpus=gpus, batch=1, seq=8
        )
        want = zero.per_gpu_memory(e.n_params, stage, gpus, **kw).model_states
        # FSDP on > 1 GPU: the computing unit and the prefetched next one
        units = 2 if gpus > 1 else 1
        gathered = units * wb * per_layer if stage == 3 else 0
        # zero=0 on > 1 GPU is torch DDP: its buckets copy every (fp32) gradient
        gathered += 4 * e.n_params if stage == 0 and gpus > 1 else 0
        assert 0 <= e.model_state_bytes - want - gathered < 2048, (
            gpus,
            e.model_state_bytes - want,
        )


def test_zero_example_bf16_amp_stage2_8_gpus():
    # the case that used to disagree: fp32 params were sharded as "master weights",
    # leaving no replicated 16-bit weights (12.55 GiB); the ZeRO paper's 2Ψ + 14Ψ/8 is
    # 23.53 GiB.
    from trainmem import zero

    e = estimate("llama-7b", precision="bf16-amp", zero=2, gpus=8)
    n = e.n_params
    assert (
        e.breakdown["weights"] >= 2 * n
        and e.breakdown["master_weights"] <= 4 * n // 8 + 2048
    )
    assert abs(e.model_state_bytes - zero.per_gpu_memory(n, 2, 8).model_states) < 2048


def test_zero_shards_the_optimizer_scratch():
    temps = [
        estimate("llama-7b", precision=p, zero=1, gpus=g, batch=1, seq=8).breakdown[
            "temporaries"
        ]
        for p in ("bf16-amp",)
        for g in (1, 8, 64)
    ]
    n = count_params("llama-7b")
    assert temps[0] > temps[1] > temps[2]
    assert (
        abs(temps[1] - 4 * n / 8) < 4096 and abs(temps[2] - 4 * n / 64) < 4096
    )  # fp32 sqrt(v)


def test_zero0_on_more_gpus_adds_only_ddp_buckets():
    """zero=0 keeps the single-GPU layout on any number of GPUs; DDP adds its gradient
    buckets (one more fp32 copy of every gradient), alive in every phase."""
    a, b = (
        json.loads(
            estimate(
                "llama-7b", precision="bf16-amp", zero=0, gpus=g, batch=1, seq=64
            ).to_json()
        )
        for g in (1, 8)
    )
    n = a["n_params"]
    a["options"].pop("gpus"), b["options"].pop("gpus")
    assert b["breakdown"].pop("gradients") - a["breakdown"].pop("gradients") == 4 * n
    assert all(b["phase_peaks"][k] - v == 4 * n for k, v in a["phase_peaks"].items())
    assert b.pop("total_bytes") - a.pop("total_bytes") == 4 * n
    a.pop("phase_peaks"), b.pop("phase_peaks")
    assert a == b


# --------------------------------------------------------------------------------------
# AdamW implementations, GQA presets, QLoRA layout, the Hugging Face entry point
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mistral-7b", "qwen2-7b", "qwen2-1.5b"])
def test_gqa_presets_count_params_match_transformers(name):
    from trainmem.estimate import model_shape
    from trainmem.measuring.models import build_model, get_config

    model = build_model(get_config(name), device="meta")
    assert count_params(name) == sum(p.numel() for p in model.parameters())
    s = model_shape(name)
    assert s.kv_heads < s.heads  # grouped-query attention
    assert model.model.layers[0].self_attn.k_proj.out_features == s.kv_dim


@pytest.mark.parametrize("impl", ["foreach", "fused", "for-loop"])
@pytest.mark.parametrize("precision", ["bf16-amp", "bf16"])
def test_optimizer_impl_agrees_with_cpu_measurement(impl, precision):
    from trainmem.measuring.measure import measure

    kw = dict(method="full", precision=precision, batch=1, seq=8, optimizer_impl=impl)
    est, meas = estimate("tiny", **kw), measure("tiny", device="cpu", **kw)
    assert abs(est.total_bytes - meas.total_bytes) <= 16
    assert est.peak_phase == meas.peak_phase
    assert est.options["optimizer_impl"] == impl


def test_optimizer_impl_scratch_by_hand_llama7b():
    """The optimizer-phase peak minus the fused one (no scratch) is each
    implementation's scratch: foreach = sqrt(exp_avg_sq) of every parameter at once (+
    the 4-byte step increment); for-loop = the largest ``denom_prev + sqrt + quotient``
    over torch's parameter order, which for llama-7b is the final norm's denom plus two
    copies of lm_head (fp32 states)."""
    kw = dict(method="full", precision="bf16-amp", batch=1, seq=8)
    peak = {
        impl: estimate("llama-7b", optimizer_impl=impl, **kw).phase_peaks["optimizer"]
        for impl in ("fused", "foreach", "for-loop")
    }
    n = count_params("llama-7b")
    assert peak["foreach"] - peak["fused"] == 4 * n + 4
    assert peak["for-loop"] - peak["fused"] == 4 * 4096 + 2 * (4 * 32000 * 4096)


def test_trainer_default_is_fused_and_plain_adamw_on_cuda_is_foreach():
    """The documented defaults, checked against the installed libraries' own code."""
    import torch
    from torch.optim.optimizer import _default_to_fused_or_foreach
    from transformers import TrainingArguments
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    from trainmem.estimate import HF_OPTIMS

    args = TrainingArguments("unused", use_cpu=True, report_to=[])
    assert HF_OPTIMS[str(args.optim.value)] == ("adamw", "fused")
    # torch.optim.AdamW(params) (foreach=None, fused=None) asks
    # _default_to_fused_or_foreach with use_fused=False: foreach on the foreach devices
    # (CUDA among them), the for-loop elsewhere
    assert "cuda" in _get_foreach_kernels_supported_devices()
    cpu = torch.zeros(4)
    assert _default_to_fused_or_foreach([cpu], differentiable=False) == (False, False)
    assert HF_OPTIMS["adamw_torch"] == ("adamw", "foreach")


def test_bf16_eager_checkpointing_row_matches_measurement():
    """Pure bf16, eager, checkpointing, 4 x 256 on h=256: was +7.1 % (one extra 16-bit
    b·heads·s·s tensor in softmax's backward)."""
    from trainmem.measuring.measure import measure
    from trainmem.measuring.models import get_config

    cfg = get_config(
        "tiny",
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        vocab_size=1000,
    )
    kw = dict(
        method="full",
        precision="bf16",
        attn="eager",
        checkpointing=True,
        batch=4,
        seq=256,
    )
    est, meas = estimate(cfg, **kw), measure(cfg, **kw)
    assert abs(est.total_bytes - meas.total_bytes) <= 16


@pytest.mark.parametrize("kv,batch", [(1, 1), (1, 2), (2, 2)])
def test_gqa_eager_lora_agrees_with_measurement(kv, batch):
    """repeat_kv is a view for one key/value head (and matmul copies it only when batch
    > 1)."""
    from trainmem.measuring.measure import measure
    from trainmem.measuring.models import get_config

    cfg = get_config(
        "tiny", hidden_size=96, num_attention_heads=6, num_key_value_heads=kv
    )
    kw = dict(
        method="lora",
        lora_rank=2,
        lora_targets=("k_proj", "v_proj", "down_proj"),
        precision="fp32",
        attn="eager",
        batch=batch,
        seq=24,
    )
    est, meas = estimate(cfg, **kw), measure(cfg, **kw)
    assert abs(est.total_bytes - meas.total_bytes) <= 16
    assert abs(est.activation_bytes - meas.activation_bytes) <= 16


@pytest.mark.parametrize(
    "kv,kw",
    [
        (4, dict(method="lora", precision="bf16")),
        (4, dict(method="lora", precision="bf16", checkpointing=True)),
        (2, dict(method="lora", precision="bf16-amp", checkpointing=True)),
        (
            1,
            dict(
                method="full",
                precision="bf16",
                checkpointing=True,
                checkpointing_mode="reentrant",
            ),
        ),
        (2, dict(method="full", precision="fp32", batch=1)),
    ],
)
def test_sdpa_math_path_agrees_with_measurement(kv, kw):
    """SDPA's math path (what bf16 attention runs below sm_80): the replay's
    ``attn="math"`` against the CPU measurement of the same model under
    ``sdpa_kernel(SDPBackend.MATH)`` — aten's composite is the same code on every
    device: fp32 copies of q, k, v alive to the op's end, the causal mask, GQA's
    repeated k and v, the copies matmul makes of the projections' interleaved
    layout, the fp32 scores and softmax. Peak and activations to a few bytes, also
    under both kinds of checkpointing (the recompute runs the path again)."""
    from trainmem.measuring.measure import measure
    from trainmem.measuring.models import get_config

    cfg = get_config("tiny", num_key_value_heads=kv)
    kw = dict(dict(batch=2, seq=64, attn="math"), **kw)
    est, meas = estimate(cfg, **kw), measure(cfg, **kw)
    assert abs(est.total_bytes - meas.total_bytes) <= 16
    assert abs(est.activation_bytes - meas.activation_bytes) <= 16
    # the math path holds more than the fused kernel at the same settings
    assert est.total_bytes > estimate(cfg, **dict(kw, attn="sdpa")).total_bytes


def test_qlora_base_weights_by_hand_llama7b():
    """bitsandbytes: only the decoder blocks' Linear weights are NF4 (4 bits + an 8-bit
    absmax per 64 weights + an fp32 constant per 256 blocks with double quantization);
    embeddings, norms and lm_head stay 16-bit. llama-7b: 6,476,005,376 quantized +
    262,410,240 16-bit parameters."""
    linear = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008)
    rest = 2 * 32000 * 4096 + (2 * 32 + 1) * 4096
    assert linear + rest == count_params("llama-7b")
    want = linear * 2113 // 4096 + 2 * rest  # 0.5 + 1/64 + 4/(64*256) = 2113/4096 B
    assert want == 3_865_591_808  # ≈ 3.87 GB
    e = estimate(
        "llama-7b",
        method="qlora",
        precision="bf16-amp",
        optimizer="sgd",
        batch=1,
        seq=8,
        kbit_prepare="none",
    )
    # each of the 224 4-bit weights also keeps its QuantState's tables: the NF4 code
    # (16 fp32) and, under double quantization, the offset (1 fp32) and the nested
    # 8-bit map (256 fp32)
    tables_dq, tables = 224 * (16 + 1 + 256) * 4, 224 * 16 * 4
    # model states at the step: base + 2 fp32 rotary buffers + LoRA fp32 params and fp32
    # grads
    assert e.model_state_bytes - 2 * 4 * 64 - 8 * e.n_trainable == want + tables_dq
    # peft's prepare_model_for_kbit_training casts the 16-bit rest to fp32
    prepared = estimate(
        "llama-7b", method="qlora", precision="bf16-amp", optimizer="sgd", seq=8
    )
    assert prepared.model_state_bytes - e.model_state_bytes == 2 * rest
    single = estimate(
        "llama-7b",
        method="qlora",
        precision="bf16-amp",
        optimizer="sgd",
        batch=1,
        seq=8,
        qlora_double_quant=False,
        kbit_prepare="none",
    )
    assert single.model_state_bytes - e.model_state_bytes == linear * (
        4 / 64 - 1 / 64 - 4 / 16384
    ) + (tables - tables_dq)


def test_estimate_modules_import_no_torch():
    """The estimator runs in the browser (Pyodide): standard library only at import
    time."""
    import subprocess
    import sys

    code = (
        "import sys, trainmem.estimate, trainmem.memory.step, "
        "trainmem.measuring.models, trainmem.cli, trainmem.config, trainmem.from_hf, "
        "trainmem.optimizers, trainmem.dtypes;"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') "
        "if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"


def test_estimate_from_hf_maps_trainer_arguments():
    from peft import LoraConfig
    from transformers import TrainingArguments

    from trainmem.estimate import estimate_from_hf, hf_options
    from trainmem.measuring.models import get_config

    cfg = get_config("qwen2-1.5b")
    args = TrainingArguments(
        "unused",
        use_cpu=True,
        report_to=[],
        bf16=True,
        gradient_checkpointing=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
    opts = hf_options(cfg, args, lora, seq=512)
    assert opts == dict(
        method="lora",
        precision="bf16-amp",
        optimizer="adamw",
        optimizer_impl="fused",
        batch=4,
        seq=512,
        grad_accum=2,
        checkpointing=True,
        # transformers 5's default (use_reentrant=False): the course's pinned release
        checkpointing_mode="non-reentrant",
        lora_rank=16,
        lora_alpha=32,
        lora_targets=LLAMA_LINEARS,
        # the config names no stored dtype: from_pretrained loads fp32, stated
        # because LoRA's default recipe is a 16-bit base
        load_dtype="fp32",
    )
    est = estimate_from_hf(cfg, args, lora, seq=512)
    assert est.total_bytes == estimate(cfg, **opts).total_bytes
    # the same from the JSON files a user has (TrainingArguments.to_dict(),
    # adapter_config.json)
    as_json = estimate_from_hf(
        cfg.to_dict(),
        json.loads(args.to_json_string()),
        json.loads(json.dumps(lora.to_dict(), default=list)),
        seq=512,
    )
    assert as_json.total_bytes == est.total_bytes
    # QLoRA from the quantization config; full fine-tuning without a peft config
    q = estimate_from_hf(
        cfg,
        args,
        lora,
        seq=512,
        quantization_config={"load_in_4bit": True, "bnb_4bit_use_double_quant": True},
    )
    assert q.options["method"] == "qlora" and q.total_bytes < est.total_bytes
    assert estimate_from_hf(cfg, args, None, seq=512).options["method"] == "full"


@pytest.mark.parametrize(
    "versions,kwargs,mode",
    [
        ("transformers=4.57.1", None, "reentrant"),
        ("transformers=5.0.0", None, "non-reentrant"),
        ("transformers=4.57.1", {"use_reentrant": False}, "non-reentrant"),
        ("transformers=5.24.0", {"use_reentrant": True}, "reentrant"),
    ],
)
def test_hf_checkpointing_form_follows_the_transformers_version(versions, kwargs, mode):
    """``gradient_checkpointing=True`` without ``use_reentrant`` is reentrant up to
    transformers 4.x and non-reentrant from 5.0.0; a given ``use_reentrant`` wins.
    The estimate follows it (reentrant keeps each layer's recomputed outputs until
    its backward is over, so it is never smaller)."""
    from trainmem.estimate import estimate_from_hf
    from trainmem.from_hf import hf_options

    args = {"gradient_checkpointing": True, "per_device_train_batch_size": 2}
    if kwargs is not None:
        args["gradient_checkpointing_kwargs"] = kwargs
    opts = hf_options("tiny", args, seq=64, versions=versions)
    assert opts["checkpointing"] and opts["checkpointing_mode"] == mode
    est = estimate_from_hf("tiny", args, seq=64, versions=versions)
    assert est.options["checkpointing_mode"] == mode


@pytest.mark.parametrize(
    "versions,optim",
    [
        ("transformers=4.53.0,torch=2.8.0", "adamw_torch"),
        ("transformers=4.54.0,torch=2.8.0", "adamw_torch_fused"),
        ("transformers=4.57.1,torch=2.7.1", "adamw_torch"),
        ("transformers=5.0.0,torch=2.13.0", "adamw_torch_fused"),
    ],
)
def test_hf_default_optim_follows_transformers_and_torch(versions, optim):
    """A TrainingArguments dict without ``optim`` gets the default of the versions it
    names: fused AdamW from transformers 4.54.0 when torch is 2.8 or newer."""
    from trainmem.from_hf import HF_OPTIMS, hf_options

    opts = hf_options("tiny", {}, seq=64, versions=versions)
    assert (opts["optimizer"], opts["optimizer_impl"]) == HF_OPTIMS[optim]


def test_estimate_from_hf_reads_deepspeed_and_fsdp(tmp_path):
    """TrainingArguments' ``deepspeed`` (a dict or the path of its JSON) sets ZeRO
    stage 2/3 under DeepSpeed, with the Trainer's 'auto' sizes when the config says
    'auto' and DeepSpeed's own when it leaves them out; ``fsdp`` sets FSDP's stage;
    the GPUs are the launcher's (an override)."""
    from trainmem.estimate import estimate_from_hf
    from trainmem.from_hf import hf_options

    keys = (
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
    )
    auto = {"zero_optimization": {"stage": 3, **dict.fromkeys(keys, "auto")}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(auto))
    base = {"max_length": 16, "bf16": True}
    cases = [
        (auto, dict(zero=3, zero_impl="deepspeed", deepspeed_sizes="hf-auto")),
        (str(path), dict(zero=3, zero_impl="deepspeed", deepspeed_sizes="hf-auto")),
        (
            {"zero_optimization": {"stage": 2}},
            dict(zero=2, zero_impl="deepspeed", deepspeed_sizes="defaults"),
        ),
        (
            {"zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8}},
            dict(zero=3, zero_impl="deepspeed", deepspeed_sizes="defaults"),
        ),
    ]
    for ds, want in cases:
        opts = hf_options("tiny", dict(base, deepspeed=ds))
        assert {k: opts[k] for k in want} == want, ds
    for fsdp, stage in (
        ("full_shard auto_wrap", 3),
        (["shard_grad_op"], 2),
        ("auto_wrap", 3),  # accelerate's default strategy
        (True, 3),  # transformers 5: FSDP2, reshard_after_forward defaults to True
    ):
        opts = hf_options("tiny", dict(base, fsdp=fsdp))
        assert (opts["zero"], opts["zero_impl"]) == (stage, "fsdp"), fsdp
    opts = hf_options(
        "tiny", dict(base, fsdp=True, fsdp_config={"reshard_after_forward": False})
    )
    assert opts["zero"] == 2
    assert "zero" not in hf_options("tiny", dict(base, fsdp=""))
    assert "zero" not in hf_options("tiny", dict(base, fsdp=["no_shard"]))
    est = estimate_from_hf("tiny", dict(base, deepspeed=auto), gpus=2)
    assert est.options["gpus"] == 2 and est.options["zero_impl"] == "deepspeed"


@pytest.mark.parametrize(
    "args,needle",
    [
        (
            {"max_length": 8, "deepspeed": {"zero_optimization": {"stage": 1}}},
            "stage 1 is not modelled",
        ),
        (
            {
                "max_length": 8,
                "deepspeed": {
                    "zero_optimization": {
                        "stage": 3,
                        "offload_param": {"device": "cpu"},
                    }
                },
            },
            "offloading is not modelled",
        ),
        (
            {
                "max_length": 8,
                "deepspeed": {
                    "zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}
                },
            },
            "reduce_bucket_size = 200000000.0",
        ),
        (
            {
                "max_length": 8,
                "deepspeed": {
                    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}
                },
            },
            "a mix is not modelled",
        ),
        (
            {
                "max_length": 8,
                "deepspeed": {"zero_optimization": {"stage": 3}},
                "fsdp": "full_shard",
            },
            "deepspeed and fsdp cannot both be set",
        ),
        ({"max_length": 8, "fsdp": "full_shard offload"}, "offload"),
        ({"optim": "galore_adamw"}, "optim must be one of adamw_torch_fused"),
        ({"bf16": True, "fp16": True}, "bf16 and fp16 cannot both be set"),
        ({}, "seq must be given"),
    ],
)
def test_estimate_from_hf_bad_input(args, needle):
    from trainmem.estimate import estimate_from_hf

    with pytest.raises(ValueError) as e:
        estimate_from_hf("tiny", args)
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "call,option",
    [
        (lambda: estimate("tiny", method="lora", lora_rank=0), "lora_rank"),
        (lambda: estimate("nope"), "model"),
        (lambda: estimate("tiny", optimizer_impl="fast"), "optimizer_impl"),
        (
            lambda: __import__("trainmem.estimate").estimate.estimate_from_hf(
                "tiny", {"optim": "galore_adamw"}, seq=8
            ),
            "training_args",
        ),
        (
            lambda: __import__("trainmem.estimate").estimate.estimate_from_hf(
                "tiny", None, {"r": 0}, seq=8
            ),
            "peft_config",
        ),
    ],
)
def test_errors_carry_the_option(call, option):
    from trainmem.estimate import OptionError

    with pytest.raises(OptionError) as e:
        call()
    assert e.value.option == option and isinstance(e.value, ValueError)


def test_step_config_is_validated_once_and_frozen():
    import dataclasses

    from trainmem.estimate import OptionError, StepConfig, estimate_step

    step = StepConfig(method="lora", lora_targets="q_proj, v_proj", batch=2, seq=32)
    assert step.lora_targets == ("q_proj", "v_proj")  # a string is a comma list
    with pytest.raises(dataclasses.FrozenInstanceError):
        step.batch = 4
    # the keyword front end and the StepConfig front end are the same estimate
    assert estimate_step("tiny", step) == estimate(
        "tiny", method="lora", lora_targets=("q_proj", "v_proj"), batch=2, seq=32
    )
    for field_name, bad in (
        ("method", "dora"),
        ("precision", "fp8"),
        ("optimizer", "adam"),
        ("optimizer_impl", "fast"),
        ("attn", "xformers"),
        ("lora_dtype", "int8"),
        ("batch", 0),
        ("seq", True),
        ("grad_accum", -1),
        ("gpus", 1.5),
        ("zero", 4),
    ):
        with pytest.raises(OptionError) as e:
            StepConfig(**{field_name: bad})
        assert e.value.option == field_name
        assert str(e.value).startswith(field_name) and repr(bad) in str(e.value)
    # targets and rank are checked against the model
    with pytest.raises(OptionError, match="unknown target module 'c_attn'"):
        estimate_step("tiny", StepConfig(method="lora", lora_targets=("c_attn",)))
    estimate_step("gpt2", StepConfig(method="lora", lora_targets=("c_attn",), seq=8))


def test_shape_is_frozen_and_validated():
    import dataclasses

    from trainmem.estimate import OptionError, model_shape

    shape = model_shape("tiny")
    with pytest.raises(dataclasses.FrozenInstanceError):
        shape.layers = 3
    with pytest.raises(OptionError, match="'tiny': heads must be a positive integer"):
        dataclasses.replace(shape, heads=0)
    with pytest.raises(OptionError, match="arch must be llama or gpt2"):
        dataclasses.replace(shape, arch="mamba")


def test_config_reader_names_the_file_and_the_problem(tmp_path):
    from trainmem.config import OptionError, load_model_config, read_json_object

    missing = str(tmp_path / "missing.json")
    with pytest.raises(OptionError) as e:
        load_model_config(missing)
    assert e.value.option == "model" and repr(missing) in str(e.value)
    assert "does not exist" in str(e.value)
    not_object = tmp_path / "list.json"
    not_object.write_text("[1, 2]")
    with pytest.raises(OptionError, match="must hold a JSON object, got list") as e:
        read_json_object(str(not_object), "peft_config")
    assert e.value.option == "peft_config" and str(not_object) in str(e.value)
    # a dict of config.json fields is read like the file
    fields = {"model_type": "llama", "vocab_size": 100, "hidden_size": 16}
    fields.update(intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    assert load_model_config(fields).hidden_size == 16


def test_estimates_equal_the_recorded_pre_refactor_values():
    """32 configurations across every option (all methods, precisions, optimizers,
    ZeRO stages, attention and optimizer implementations, checkpointing, accumulation),
    whose ``to_dict()`` was recorded from the estimator before its code was reorganised
    into ``trainmem.config`` / ``StepConfig``: the reorganisation changed no number.
    Rows re-recorded since: GPT-2 under QLoRA, whose closed form counted 0.55 B for
    every parameter and now counts NF4 for the decoder Linears only (see
    ``test_gpt2_qlora_counts_nf4_on_the_decoder_linears``); and the twelve rows with
    ZeRO >= 2 on more than one GPU, since FSDP's prefetched second unit and the
    unsharded gradient before reduce-scatter are modelled (tests/test_zero.py); and the
    QLoRA row under ZeRO-3 on 8 GPUs, since a 4-bit weight's absmax constants stay whole
    on every rank (bitsandbytes' quant_state; tests/test_zero.py); and the six rows
    with ZeRO-3 on 8 GPUs, since every frozen parameter is sharded too and FSDP's root
    unit (embeddings, final norm, lm_head) stays all-gathered from the forward to the
    end of backward (tests/test_zero.py); and the QLoRA row under autocast, since
    peft's LoRA on a 4-bit Linear casts its input to the adapters' fp32 only outside
    autocast and copies the base output (trainmem.kbit; the CPU measurement in
    tests/test_kbit.py); and every QLoRA row, since each 4-bit weight's code tables
    and offset (bitsandbytes' QuantState: 1,092 B under double quantization) are
    counted. The LoRA rows run with the load dtype the
    recorded estimator assumed, the precision's (fp32 under autocast): LoRA's default
    has since become a 16-bit base (``Precision.default_load``). The independent
    checks are the tests above (transformers' parameter counts, peft, the CPU
    measurement)."""
    from pathlib import Path

    rows = json.loads(
        (Path(__file__).parent / "data" / "estimate_golden.json").read_text()
    )
    assert len(rows) == 32
    # the options added since (KV cache, peft's k-bit preparation, ...) set to what
    # the recorded estimator did: no cache copy, the QLoRA base kept in 16 bit
    added = (
        "lora_dropout",
        "use_cache",
        "versions",
        "kbit_prepare",
        "checkpointing_mode",
        "framework",
        "zero_impl",
        "deepspeed_sizes",
        "load_dtype",
        "recipe",
    )
    for row in rows:
        result = estimate(
            **row["options"],
            **golden_load_dtype(row["options"]),
            use_cache="off",
            kbit_prepare="none",
        )
        result = result.to_dict()
        result["options"] = {
            k: v for k, v in result["options"].items() if k not in added
        }
        # the record of the attention backend (trainmem.sdpa), added since
        assert result.pop("attention")["kind"] == result["options"]["attn"]
        assert result == row["result"], row["options"]


def golden_load_dtype(options: dict) -> dict:
    """The load dtype the golden rows were recorded with, where LoRA's default has
    changed since: the precision's parameter dtype (fp32 under autocast)."""
    from trainmem.precisions import precision

    if options.get("method") != "lora":
        return {}
    return {"load_dtype": precision(options.get("precision", "bf16-amp")).params}


@pytest.mark.parametrize("double_quant", [True, False])
def test_gpt2_qlora_counts_nf4_on_the_decoder_linears(double_quant):
    """GPT-2's closed form holds the base model as the replay does: the Linears of the
    12 blocks (c_attn 768×2304, attn.c_proj 768×768, c_fc 768×3072, mlp.c_proj
    3072×768) in NF4, embeddings, biases and norms in 16 bit."""
    n_linear = 12 * (768 * 2304 + 768 * 768 + 768 * 3072 + 3072 * 768)
    per_weight = 0.5 + (1 / 64 + 4 / (64 * 256) if double_quant else 4 / 64)
    want = int(n_linear * per_weight) + 2 * (124_439_808 - n_linear)
    est = estimate(
        "gpt2",
        method="qlora",
        precision="bf16-amp",
        lora_targets=("c_attn",),
        qlora_double_quant=double_quant,
        seq=64,
    )
    assert est.n_params == 124_439_808
    assert est.breakdown["weights"] == want


# --------------------------------------------------------------------------------------
# the load dtype: a 16-bit base from a 16-bit checkpoint, fp32 adapters, autocast
# --------------------------------------------------------------------------------------
#: a small GQA Llama stored in bf16 (``benchmarks/estimate_identity.py`` replays it too)
_GQA_BF16_CONFIG = json.loads(
    (Path(__file__).parent / "data" / "llama_gqa_bf16.json").read_text()
)


@pytest.mark.parametrize(
    "kw",
    [
        # Trainer(bf16=True) + LoRA q,v on a bf16 checkpoint (transformers 5)
        dict(
            method="lora",
            precision="bf16-amp",
            load_dtype="bf16",
            lora_rank=16,
            batch=4,
            seq=64,
            optimizer_impl="fused",
        ),
        dict(
            method="lora",
            precision="bf16-amp",
            load_dtype="bf16",
            lora_rank=8,
            lora_targets=LLAMA_LINEARS,
            batch=2,
            seq=48,
            checkpointing=True,
        ),
        dict(
            method="full",
            precision="bf16-amp",
            load_dtype="bf16",
            batch=2,
            seq=32,
            optimizer_impl="for-loop",
        ),
        dict(method="lora", precision="fp16-amp", load_dtype="fp16", batch=2, seq=32),
        dict(method="lora", precision="fp32", load_dtype="bf16", batch=2, seq=32),
    ],
)
def test_load_dtype_agrees_with_cpu_measurement(tmp_path, kw):
    """Autocast over weights loaded in 16 bit (no weight copies, a 16-bit residual
    stream, peft's fp32 adapters with their input cast to fp32) replays to the byte
    in every category but the optimizer's 0-d scratch, as the fp32-load recipe
    does."""
    from trainmem.measuring.measure import measure

    path = tmp_path / "config.json"
    path.write_text(json.dumps(_GQA_BF16_CONFIG))
    est = estimate(str(path), use_cache="off", **kw)
    meas = measure(str(path), device="cpu", use_cache="off", **kw)
    assert est.peak_phase == meas.peak_phase
    for k in CATEGORIES:
        if k != "temporaries":
            assert est.breakdown[k] == meas.breakdown[k], k
    assert abs(est.total_bytes - meas.total_bytes) <= 16


def test_load_dtype_is_the_weights_dtype_not_autocasts():
    """bf16-amp over a bf16 load holds the 16-bit weights once (no autocast copies),
    the fp32 adapters as master weights; over the fp32 default, fp32 weights and
    their bf16 copies."""
    kw = dict(method="lora", precision="bf16-amp", batch=1, seq=64)
    fp32 = estimate("tiny", load_dtype="fp32", **kw)
    bf16 = estimate("tiny", load_dtype="bf16", **kw)
    assert (bf16.options["load_dtype"], fp32.options["load_dtype"]) == ("bf16", "fp32")
    assert bf16.breakdown["master_weights"] == fp32.breakdown["master_weights"] > 0
    assert bf16.breakdown["weights"] < fp32.breakdown["weights"] / 2
    assert bf16.total_bytes < fp32.total_bytes
    assert fp32.options["recipe"] == "fp32 base + fp32 adapters, autocast bf16"
    assert bf16.options["recipe"] == "bf16 base + fp32 adapters, autocast bf16"
    # LoRA's default under autocast is the 16-bit base (the recipe users run);
    # full fine-tuning's stays autocast over fp32 weights
    default = estimate("tiny", **kw)
    assert "load_dtype" not in default.options
    assert default.to_dict()["breakdown"] == bf16.breakdown
    assert default.options["recipe"] == bf16.options["recipe"]
    fp16 = estimate("tiny", **dict(kw, precision="fp16-amp"))
    assert fp16.options["recipe"] == "fp16 base + fp32 adapters, autocast fp16"
    full = estimate("tiny", **dict(kw, method="full"))
    assert full.options["recipe"] == "fp32 weights, autocast bf16"
    pure = estimate("tiny", **dict(kw, precision="bf16"))
    assert pure.options["recipe"] == "bf16 base + fp32 adapters, no autocast"
    with pytest.raises(ValueError, match="load_dtype must be one of"):
        estimate("tiny", load_dtype="int8")


@pytest.mark.parametrize(
    "transformers,field,want",
    [
        ("5.24.0", "dtype", "bf16"),
        ("5.24.0", "torch_dtype", "bf16"),
        ("5.0.0", "torch_dtype", "bf16"),
        ("4.57.1", "torch_dtype", "fp32"),  # 4.x loads fp32 whatever is stored
    ],
)
def test_hf_load_dtype_follows_the_config_and_transformers(transformers, field, want):
    """``from_pretrained`` without ``dtype`` loads the stored dtype from transformers
    5.0 (dtype="auto"), fp32 before; the config says what is stored."""
    from trainmem.from_hf import hf_options

    config = dict(_GQA_BF16_CONFIG)
    config.pop("torch_dtype")
    config[field] = "bfloat16"
    opts = hf_options(
        config,
        {"bf16": True},
        {"r": 8},
        seq=64,
        versions=f"transformers={transformers}",
    )
    assert opts["load_dtype"] == want
    plain = dict(_GQA_BF16_CONFIG)
    plain.pop("torch_dtype")
    # no stored dtype: fp32, stated (LoRA's default recipe would load 16 bit)
    assert hf_options(plain, {"bf16": True}, {"r": 8}, seq=64)["load_dtype"] == "fp32"
    assert "load_dtype" not in hf_options(
        plain, {"bf16": True}, {"r": 8}, seq=64, quantization_config={"load_in_4bit": 1}
    )
