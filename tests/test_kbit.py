"""QLoRA's dtype flow (trainmem.kbit): the decisions per option, the replay against a
real CPU step with bitsandbytes' CPU backend, and the two QLoRA rows recorded on an
H200."""

import pytest

from trainmem.config import StepConfig
from trainmem.decisions import decide
from trainmem.estimate import estimate
from trainmem.families import model_shape

ALL7 = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _flow(**kw):
    step = StepConfig(method="qlora", **kw)
    return decide(model_shape("tiny"), step).kbit


@pytest.mark.parametrize(
    "kw,load,base",
    [
        (dict(), "bf16", "fp32"),  # prepare_model_for_kbit_training upcasts
        (dict(kbit_prepare="none"), "bf16", "bf16"),
        (dict(precision="fp16-amp"), "fp16", "fp32"),
        (dict(load_dtype="fp32", kbit_prepare="none"), "fp32", "fp32"),
        (dict(framework="litgpt", lora_targets=("q_proj",)), "bf16", "bf16"),
    ],
)
def test_kbit_flow_dtypes(kw, load, base):
    flow = _flow(**kw)
    assert (flow.load, flow.base) == (load, base)
    assert flow.output_in_input_dtype and flow.clones_base_output
    assert flow.prepared == (base == "fp32" and load != "fp32")


def test_kbit_flow_by_version_and_kernels():
    assert not _flow().saves_input  # bitsandbytes >= 0.43.2 keeps (None, B)
    assert _flow(versions="bitsandbytes=0.43.1").saves_input
    assert _flow().lora_sees_autocast
    # torch.is_autocast_enabled() without a device asks CUDA's autocast
    assert not _flow(kernels="cpu").lora_sees_autocast
    assert decide(model_shape("tiny"), StepConfig(method="lora")).kbit is None


def test_prepared_residual_stream_is_fp32_in_the_replay():
    """peft's preparation makes the residual stream fp32 and bitsandbytes casts the
    4-bit Linear's output back to it: the MLP's activations double (gate, up, silu
    saved in fp32) against the unprepared base, under autocast."""
    kw = dict(method="qlora", batch=2, seq=64, lora_targets=ALL7, use_cache="off")
    prepared = estimate("tiny", kbit_prepare="peft", **kw)
    plain = estimate("tiny", kbit_prepare="none", **kw)
    assert prepared.activation_bytes > plain.activation_bytes
    tokens, inter = 2 * 64, 172
    # per layer: gate, up and silu's output in fp32 instead of bf16 (+6 B/elt), the
    # product no longer saved (-2 B/elt: down_proj's lora_A saves a bf16 copy made by
    # autocast instead), ... at least the MLP's 4 B per intermediate element
    assert prepared.activation_bytes - plain.activation_bytes >= 2 * 4 * tokens * inter


CPU_SHAPES = [
    pytest.param(dict(batch=2, seq=64), id="b2-s64"),
    pytest.param(dict(batch=2, seq=96), id="b2-s96", marks=pytest.mark.slow),
    pytest.param(
        dict(batch=3, seq=32, intermediate_size=256),
        id="b3-s32-i256",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize("shape", CPU_SHAPES)
@pytest.mark.parametrize(
    "kw",
    [
        dict(kbit_prepare="peft", checkpointing=False),
        dict(kbit_prepare="none", checkpointing=True),
    ],
    ids=["prepared", "none-ckpt"],
)
def test_qlora_agrees_with_cpu_measurement(shape, kw):
    """A real step of a tiny Llama loaded 4-bit by from_pretrained with bitsandbytes'
    CPU backend, against the replay at ``kernels="cpu"``: every category to a few
    bytes (the scalar loss; each 4-bit weight's absmax rounded up per tensor where the
    estimate counts a fractional byte per weight)."""
    pytest.importorskip("bitsandbytes")
    from trainmem.measuring.measure import measure
    from trainmem.measuring.models import get_config

    shape = dict(shape)
    batch, seq = shape.pop("batch"), shape.pop("seq")
    cfg = get_config("tiny", **shape)
    opts = dict(
        method="qlora",
        precision="bf16-amp",
        batch=batch,
        seq=seq,
        lora_rank=8,
        lora_targets=ALL7,
        **kw,
    )
    meas = measure(cfg, **opts)
    est = estimate(cfg, kernels="cpu", **opts)
    assert meas.peak_phase == est.peak_phase
    for k, v in meas.breakdown.items():
        assert abs(est.breakdown[k] - v) <= 64, (k, v, est.breakdown[k])
    assert abs(est.activation_bytes - meas.activation_bytes) <= 64


# max_memory_allocated of steps 2-3 recorded on an NVIDIA H200 (sm_90; torch 2.11.0,
# transformers 5.24.0, peft 0.21.2, bitsandbytes 0.50.2): TinyLlama-1.1B shapes,
# NF4 + double quant, LoRA r=16 alpha=32 on the seven projections, autocast bf16,
# AdamW, batch 4 x 1024, no checkpointing; with and without
# prepare_model_for_kbit_training
H200_ROWS = {"peft": 14_283_797_504, "none": 9_738_822_656}
TINYLLAMA = dict(
    model_type="llama",
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    vocab_size=32000,
    tie_word_embeddings=False,
)


@pytest.mark.slow
@pytest.mark.parametrize("prepare", sorted(H200_ROWS))
def test_h200_qlora_rows_within_one_percent(prepare):
    est = estimate(
        TINYLLAMA,
        method="qlora",
        precision="bf16-amp",
        batch=4,
        seq=1024,
        lora_rank=16,
        lora_alpha=32,
        lora_targets=ALL7,
        kbit_prepare=prepare,
        gpu="H100-80GB",  # the same sm_90 allocator and cuBLAS workspaces
        versions="torch=2.11.0,transformers=5.24.0,peft=0.21.2,bitsandbytes=0.50.2",
    )
    measured = H200_ROWS[prepare]
    assert abs(est.device["gpu_allocated_bytes"] / measured - 1) < 0.01
