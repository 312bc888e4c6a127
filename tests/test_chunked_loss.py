"""The chunked (fused linear) cross-entropy: the same loss and gradients as lm_head +
cross_entropy, and its replay against the CPU measurement of the same step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainmem.measuring.chunked_loss import ChunkedLinearCrossEntropy, shifted_targets
from trainmem.config import OptionError
from trainmem.estimate import estimate


def test_same_loss_and_gradients_as_cross_entropy():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (3, 11))
    h = torch.randn(33, 16, dtype=torch.float32, requires_grad=True)
    w = torch.randn(50, 16, dtype=torch.float32, requires_grad=True)
    targets = shifted_targets(ids)
    loss = ChunkedLinearCrossEntropy.apply(h, w, targets, 7)
    gh, gw = torch.autograd.grad(loss, (h, w))
    ref = F.cross_entropy(h @ w.t(), targets, ignore_index=-100)
    rh, rw = torch.autograd.grad(ref, (h, w))
    assert torch.allclose(loss, ref, atol=1e-5)
    assert torch.allclose(gh, rh, atol=1e-5) and torch.allclose(gw, rw, atol=1e-5)


TINY = dict(
    model_type="llama",
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
    dict(seq=128, batch=2, loss_chunk=64),
    dict(seq=128, batch=2, loss_chunk=100, method="lora"),
    dict(seq=256, batch=1, loss_chunk=96, precision="fp32", checkpointing=True),
    dict(seq=256, batch=1, loss_chunk=96, precision="bf16", optimizer_impl="fused"),
]


@pytest.mark.parametrize("options", CASES, ids=lambda o: str(sorted(o.items())))
def test_chunked_loss_agrees_with_cpu_measurement(options):
    from transformers import LlamaConfig

    from trainmem.measuring.measure import measure

    cfg = LlamaConfig(**{k: v for k, v in TINY.items() if k != "model_type"})
    est = estimate(cfg, loss_impl="chunked", **options)
    got = measure(cfg, loss_impl="chunked", **options)
    assert est.total_bytes == pytest.approx(got.total_bytes, rel=1e-4)
    assert est.activation_bytes == got.activation_bytes
    assert est.phase_peaks["forward"] == pytest.approx(
        got.phase_peaks["forward"], rel=1e-4
    )


def test_logits_leave_the_activations():
    """At a 152k vocabulary the standard loss keeps the fp32 log-softmax of every token
    for backward (4 bytes x vocab a token); the chunked loss keeps none of it, only the
    bf16 copy of the hidden states (2 bytes x hidden a token) and a float or two."""
    opts = dict(model="qwen2.5-0.5b", seq=2048, method="lora")
    std = estimate(**opts)
    chunked = estimate(**opts, loss_impl="chunked")
    per_token = 4 * 151936
    saved = std.activation_bytes - chunked.activation_bytes
    assert 2048 * (per_token - 2 * 896 - 16) < saved < 2048 * per_token
    assert chunked.total_bytes < std.total_bytes


def test_refused_where_not_replayed():
    with pytest.raises(OptionError) as e:
        estimate("gpt2", loss_impl="chunked")
    assert e.value.option == "loss_impl"
    with pytest.raises(OptionError) as e:
        estimate("tiny", loss_impl="chunked", objective="dpo")
    assert e.value.option == "loss_impl"
    with pytest.raises(OptionError) as e:
        estimate("tiny", loss_impl="chunked", loss_chunk=0)
    assert e.value.option == "loss_chunk"
