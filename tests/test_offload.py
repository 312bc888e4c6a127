"""Activation offloading (TRL's activation_offloading): the replay's rules
(trainmem.memory.offload) against the CPU measurement with host-copy hooks
(trainmem.measuring.offload), and what stays on the device."""

from __future__ import annotations

import pytest

from trainmem.config import OptionError
from trainmem.estimate import estimate
from trainmem.from_hf import hf_options

TINY = dict(
    vocab_size=2048,
    hidden_size=64,
    intermediate_size=172,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
CASES = [
    dict(seq=128, batch=2),
    dict(seq=128, batch=2, precision="fp32"),
    dict(seq=96, batch=2, method="lora"),
    dict(seq=64, objective="dpo", reference="precomputed"),
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: str(sorted(o.items())))
def test_offload_agrees_with_cpu_measurement(options):
    from transformers import LlamaConfig

    from trainmem.measuring.measure import measure

    cfg = LlamaConfig(**TINY)
    est = estimate(cfg, activation_offload=True, **options)
    got = measure(cfg, activation_offload=True, **options)
    assert est.peak_phase == got.peak_phase
    assert est.total_bytes == pytest.approx(got.total_bytes, rel=1e-4)
    # model states exactly; a saved *output* (log_softmax's) keeps its device storage
    # in torch until its node unpacks it, where the replay frees it and restores a
    # copy: the same bytes at the peak, filed as activations there, temporaries here
    for k in ("weights", "gradients", "optimizer_states", "master_weights"):
        assert est.breakdown[k] == got.breakdown[k], k
    flow = ("activations", "temporaries")
    assert sum(est.breakdown[k] for k in flow) == pytest.approx(
        sum(got.breakdown[k] for k in flow), rel=1e-4
    )


def test_what_stays_on_the_device():
    """Offloaded, the activations at the end of the forward are what stays: the
    batch; every storage saved twice (the second pack keeps the tensor itself): RoPE's
    cos and sin, each RMSNorm's input (the residual stream: twice a layer and once
    before lm_head) and its rsqrt; lm_head's input (saved inside the output layer)."""
    b, s, hidden, layers, head_dim = 4, 512, 64, 2, 16
    opts = dict(model="tiny", seq=s, batch=b, precision="fp32", method="lora")
    base = estimate(**opts)
    off = estimate(**opts, activation_offload=True)
    ids = 2 * b * s * 8  # input ids and labels
    rope = 2 * s * head_dim * 4
    residual = (2 * layers + 2) * b * s * hidden * 4
    rsqrt = 2 * layers * b * s * 4
    assert off.activation_bytes == pytest.approx(ids + rope + residual + rsqrt, abs=64)
    assert off.activation_bytes < base.activation_bytes / 3
    assert off.total_bytes < base.total_bytes


def test_refused_and_read_from_trl():
    with pytest.raises(OptionError) as e:
        estimate("tiny", activation_offload=True, checkpointing=True)
    assert e.value.option == "activation_offload"
    opts = hf_options("tiny", dict(max_length=64, activation_offloading=True))
    assert opts["activation_offload"] is True
    liger = hf_options(
        "tiny",
        dict(max_length=64, per_device_train_batch_size=2, use_liger_kernel=True),
    )
    # Liger's chunk: next power of two of rows / ceil(vocab / hidden), at most rows
    assert liger["loss_impl"] == "chunked" and liger["loss_chunk"] == 32
