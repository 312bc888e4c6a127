"""trainmem.sdpa: SDPA's backend selection as torch does it (each rule of the table is
needed), transformers' enable_gqa / repeat_kv choice, torch's own CPU choice, and the
estimate on the backend chosen (the recorded H200 fp32 GQA run)."""

from __future__ import annotations

import pytest

from trainmem import sdpa
from trainmem.sdpa import RULES, Call, hf_call, select_backend

T4, V100, A100, L4, H100, B200 = (7, 5), (7, 0), (8, 0), (8, 9), (9, 0), (10, 0)
GQA = dict(heads=32, kv_heads=4, head_dim=64)
MHA = dict(heads=32, kv_heads=32, head_dim=64)


def _call(dtype="bf16", shape=MHA, **kw):
    return Call(dtype=dtype, **shape, **kw)


#: for each rule (backend, device, name): a call, card and torch version that this
#: rule — and no other rule of that backend — turns down
ONLY_THIS_RULE = {
    ("flash", "cuda", "check_for_attn_mask"): (_call(mask=True), A100, (2, 11)),
    ("flash", "cuda", "check_head_dim_size_flash"): (
        _call(shape=dict(heads=8, kv_heads=8, head_dim=512)),
        A100,
        (2, 11),
    ),
    ("flash", "cuda", "check_flash_attention_hardware_support"): (
        _call("fp16"),
        T4,
        (2, 11),
    ),
    (
        "flash",
        "cuda",
        "check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89",
    ): (_call(shape=dict(heads=8, kv_heads=8, head_dim=200)), L4, (2, 11)),
    ("flash", "cuda", "check_flash_causal_non_square_seqlens"): (
        _call(seq_q=128, seq_k=512),
        A100,
        (2, 11),
    ),
    ("flash", "cuda", "check_dtypes_low_precision"): (_call("fp32"), A100, (2, 11)),
    ("flash", "cuda", "check_batch_size_and_num_heads_dense<true>"): (
        _call(shape=dict(heads=32, kv_heads=5, head_dim=64), enable_gqa=True),
        A100,
        (2, 11),
    ),
    ("flash", "cuda", "check_batch_size_and_num_heads_dense"): (
        _call(shape=GQA, enable_gqa=True),
        A100,
        (2, 4),
    ),
    ("efficient", "cuda", "check_mem_efficient_hardware_support"): (
        _call("fp16"),
        B200,
        (2, 6),
    ),
    ("efficient", "cuda", "check_head_dim_size_mem_efficient"): (
        _call("fp32", shape=dict(heads=8, kv_heads=8, head_dim=66)),
        A100,
        (2, 11),
    ),
    ("efficient", "cuda", "check_batch_size_and_num_heads_dense<false>"): (
        _call("fp32", shape=GQA, enable_gqa=True),
        H100,
        (2, 11),
    ),
    ("efficient", "cuda", "less_than_sm80_mem_efficient_dtypes"): (
        _call("bf16"),
        T4,
        (2, 11),
    ),
    ("cudnn", "cuda", "check_dtypes_low_precision"): (_call("fp32"), H100, (2, 11)),
    ("cudnn", "cuda", "check_cudnn_hardware_support"): (_call("fp16"), T4, (2, 11)),
    ("cudnn", "cuda", "check_cudnn_dropout"): (_call(dropout=0.1), H100, (2, 11)),
    ("cudnn", "cuda", "check_batch_size_and_num_heads_dense<true>"): (
        _call(shape=dict(heads=32, kv_heads=5, head_dim=64), enable_gqa=True),
        H100,
        (2, 11),
    ),
    ("cudnn", "cuda", "check_cudnn_tensor_shapes"): (
        _call(shape=dict(heads=8, kv_heads=8, head_dim=256)),
        H100,
        (2, 11),
    ),
    ("flash", "cpu", "check_for_dropout"): (_call(dropout=0.1), None, (2, 13)),
    ("flash", "cpu", "check_batch_size_and_num_heads_dense<true>"): (
        _call(shape=dict(heads=32, kv_heads=5, head_dim=64), enable_gqa=True),
        None,
        (2, 13),
    ),
    ("flash", "cpu", "check_batch_size_and_num_heads_dense"): (
        _call(shape=GQA, enable_gqa=True),
        None,
        (2, 4),
    ),
}


def _key(rule):
    return (rule.backend, rule.device, rule.name)


def test_every_rule_has_a_case():
    assert sorted(ONLY_THIS_RULE) == sorted(_key(r) for r in RULES)


@pytest.mark.parametrize("key", sorted(ONLY_THIS_RULE), ids=lambda k: "/".join(k))
def test_each_rule_is_needed(key, monkeypatch):
    """The rule turns its case down, and without the rule the backend takes it: a
    rule removed from the table changes a selection."""
    backend, device, name = key
    call, cap, torch = ONLY_THIS_RULE[key]
    refused = sdpa.check(backend, call, device, cap, torch)
    assert refused is not None and refused[0] == name
    kept = tuple(r for r in RULES if _key(r) != key)
    monkeypatch.setattr(sdpa, "RULES", kept)
    assert sdpa.check(backend, call, device, cap, torch) is None


@pytest.mark.parametrize(
    "dtype,shape,gqa,cap,torch,want",
    [
        # the recorded H200 run: fp32 + enable_gqa: no fused kernel takes it
        ("fp32", GQA, True, H100, (2, 11, 0), "math"),
        ("fp32", MHA, False, H100, (2, 11, 0), "efficient"),
        ("fp32", GQA, True, T4, (2, 11, 0), "math"),
        # bf16 below sm_80: flash needs sm_80, memory-efficient takes fp16/fp32 there
        ("bf16", MHA, False, T4, (2, 11, 0), "math"),
        ("bf16", MHA, False, V100, (2, 4, 1), "math"),
        # fp16 on a T4: memory-efficient, unless enable_gqa (it has no GQA)
        ("fp16", MHA, False, T4, (2, 11, 0), "efficient"),
        ("fp16", GQA, True, T4, (2, 11, 0), "math"),
        # bf16 GQA from sm_80: flash; cuDNN first on sm_90 when torch prefers it
        ("bf16", GQA, True, A100, (2, 11, 0), "flash"),
        ("bf16", GQA, True, L4, (2, 11, 0), "flash"),
        ("bf16", GQA, True, H100, (2, 10, 0), "flash"),
        ("bf16", GQA, True, H100, (2, 11, 0), "cudnn"),
        ("bf16", GQA, True, H100, (2, 5, 0), "cudnn"),
        ("bf16", GQA, True, H100, (2, 5, 1), "flash"),
        # B200 (sm_100): neither fused kernel's range reaches it before 2.7
        ("bf16", MHA, False, B200, (2, 6, 0), "math"),
        ("bf16", GQA, True, B200, (2, 7, 0), "flash"),
        ("bf16", GQA, True, B200, (2, 11, 0), "cudnn"),
    ],
)
def test_cuda_selection(dtype, shape, gqa, cap, torch, want):
    choice = select_backend(_call(dtype, shape, enable_gqa=gqa), cap, torch)
    assert choice.backend == want, choice.reason


def test_the_reason_names_each_refusal():
    choice = select_backend(_call("fp32", GQA, enable_gqa=True), H100, (2, 11, 0))
    assert [b for b, _, _ in choice.rejected] == ["cudnn", "flash", "efficient"]
    assert "check_batch_size_and_num_heads_dense<false>" in choice.reason


def test_cpu_selection_is_torchs_own():
    """The CPU rules against torch's own choice (``torch._fused_sdp_choice``, the
    installed CPU build) for every dtype, GQA or not, mask or not, dropout or not."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend

    names = {int(SDPBackend.FLASH_ATTENTION): "flash", int(SDPBackend.MATH): "math"}
    version = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for name, dt in dtypes.items():
        for kv, gqa in ((4, True), (8, False), (4, False), (1, True)):
            for mask in (False, True):
                for dropout in (0.0, 0.25):
                    q = torch.zeros(2, 8, 16, 32, dtype=dt, requires_grad=True)
                    k = torch.zeros(2, kv, 16, 32, dtype=dt)
                    m = torch.zeros(16, 16, dtype=dt) if mask else None
                    got = torch._fused_sdp_choice(
                        q, k, k, m, dropout, not mask, enable_gqa=gqa
                    )
                    call = Call(
                        dtype=name,
                        heads=8,
                        kv_heads=kv,
                        head_dim=32,
                        seq_q=16,
                        seq_k=16,
                        enable_gqa=gqa,
                        mask=mask,
                        is_causal=not mask,
                        dropout=dropout,
                    )
                    want = select_backend(call, None, version).backend
                    assert names[int(got)] == want, (name, kv, gqa, mask, dropout)


def test_transformers_gqa_choice_matches_the_installed_use_gqa_in_sdpa():
    """hf_call's enable_gqa / repeat_kv against the installed transformers'
    ``use_gqa_in_sdpa`` (5.24: no mask and a head dim up to 256)."""
    torch = pytest.importorskip("torch")
    import transformers
    from transformers.integrations import sdpa_attention

    from trainmem.versions import parse_versions

    versions = parse_versions(
        f"transformers={transformers.__version__},torch={torch.__version__}"
    )
    for head_dim in (64, 256, 264):
        for mask in (False, True):
            key = torch.zeros(1, 2, 4, head_dim)
            m = torch.zeros(1, 1, 4, 4) if mask else None
            want = sdpa_attention.use_gqa_in_sdpa(m, key, key)
            call, repeats = hf_call("bf16", 8, 2, head_dim, 4, versions, mask=mask)
            assert call.enable_gqa == want and repeats == (not want)


@pytest.mark.parametrize(
    "transformers,torch,mask,head_dim,gqa",
    [
        ((4, 53), (2, 7), False, 64, False),  # before use_gqa_in_sdpa: repeat_kv
        ((4, 54), (2, 7), False, 64, True),
        ((4, 57), (2, 4), False, 64, False),  # enable_gqa is torch 2.5's
        ((4, 57), (2, 9), True, 64, False),  # a mask: repeat_kv
        ((4, 57), (2, 9), False, 512, True),
        ((5, 24), (2, 11), False, 512, False),  # 5.24: head dim up to 256
    ],
)
def test_transformers_passes_enable_gqa_by_version(
    transformers, torch, mask, head_dim, gqa
):
    assert sdpa.hf_passes_gqa(mask, head_dim, transformers, torch) == gqa


def test_bad_call_is_a_clear_error():
    with pytest.raises(ValueError, match="dtype must be"):
        Call(dtype="fp8", heads=2, kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="kv_heads must be a positive int"):
        Call(dtype="fp32", heads=2, kv_heads=0, head_dim=8)


# --------------------------------------------------------------------------------------
# the estimate on the chosen backend
# --------------------------------------------------------------------------------------


def test_recorded_h200_fp32_gqa_run_is_estimated_on_the_math_path():
    """The recorded H200 run (TinyLlama full fine-tuning in fp32, 4 x 512, SDPA, torch
    2.11 / transformers 5.24): no fused kernel takes fp32 with enable_gqa, so SDPA runs
    its math path; the estimate on that path is within 1 % of max_memory_allocated
    (on the fused kernels' replay it was 11 % below)."""
    from coursekit.gpu_runs import load_run, recorded_models, recorded_steps
    from trainmem.estimate import estimate

    run = load_run()
    row = recorded_steps()["tl-full-fp32"]
    job = row["job"]
    assert run["capability"] == [9, 0] and job["attn"] == "sdpa"
    est = estimate(
        recorded_models()[job["model"]],
        gpu="H200",
        method=job["method"],
        precision=job["precision"],
        batch=job["batch"],
        seq=job["seq"],
        attn=job["attn"],
        versions="torch=2.11.0,transformers=5.24.0",
    )
    assert est.attention["sdpa_backend"] == "math"
    # max_memory_allocated counts whole blocks: the allocator replay's peak
    assert abs(est.to_dict()["gpu_allocated_bytes"] / row["step_peak"] - 1) < 0.01
    assert [n["code"] for n in est.device["notes"]] == ["sdpa-math"]
    assert "check_batch_size_and_num_heads_dense" in est.device["notes"][0]["message"]


def test_efficient_kernel_pads_its_logsumexp():
    """fp32 without GQA on an A100 runs the memory-efficient kernel, whose saved
    logsumexp is padded to 32 queries: the same step as the flash-kernel replay
    (CPU), plus that padding in every layer."""
    from trainmem.estimate import estimate

    kw = dict(model="tiny", method="full", precision="fp32", batch=2, seq=40)
    on_a100 = estimate(**kw, gpu="A100-80GB")
    cpu = estimate(**kw)
    assert on_a100.attention["sdpa_backend"] == "efficient"
    assert cpu.attention["sdpa_backend"] == "flash"
    pad = 2 * 4 * (64 - 40) * 4  # batch x heads x padded queries x fp32, per layer
    assert on_a100.activation_bytes - cpu.activation_bytes == 2 * pad


def test_repeat_kv_path_agrees_with_cpu_measurement():
    """Where transformers repeat_kv-s instead of passing enable_gqa (5.24: a head dim
    over 256), SDPA saves the repeated key and value: the replay against the CPU
    measurement (torch's CPU flash kernel takes any head dim)."""
    pytest.importorskip("torch")
    from trainmem.config import StepConfig
    from trainmem.decisions import decide
    from trainmem.estimate import estimate
    from trainmem.families import model_shape
    from trainmem.measuring.measure import measure
    from trainmem.measuring.models import get_config

    cfg = get_config("tiny", num_key_value_heads=2, head_dim=264)
    kw = dict(method="lora", precision="fp32", batch=2, seq=16)
    est, meas = estimate(cfg, **kw), measure(cfg, **kw)
    assert abs(est.total_bytes - meas.total_bytes) <= 16
    assert abs(est.activation_bytes - meas.activation_bytes) <= 16
    step = StepConfig.from_options(kw)
    assert decide(model_shape(cfg), step).sdpa_repeats_kv
