"""--framework litgpt: LitGPT's fine-tuning step in the estimator, one test per
mechanism (each fails when that mechanism is dropped from the replay)."""

import dataclasses
import json
import math

import pytest

from trainmem.cli import main
from trainmem.config import OptionError, StepConfig, model_shape
from trainmem.dtypes import nf4_bytes_per_weight
from trainmem.estimate import estimate

LIT = dict(framework="litgpt", precision="bf16", optimizer="adamw")


def test_options_are_validated():
    with pytest.raises(OptionError) as e:
        StepConfig(framework="axolotl")
    assert e.value.option == "framework" and "hf, litgpt" in str(e.value)
    with pytest.raises(OptionError) as e:
        StepConfig(framework="litgpt", attn="eager")
    assert e.value.option == "attn"
    with pytest.raises(OptionError) as e:  # lora_mlp adapts fc_1, fc_2, proj together
        estimate("tiny", method="lora", lora_targets=("gate_proj",), **LIT)
    assert e.value.option == "lora_targets" and "fc_1" in str(e.value)
    with pytest.raises(OptionError) as e:
        estimate("gpt2", **LIT)
    assert e.value.option == "framework"
    with pytest.raises(OptionError):  # lm_head is a LitGPT target only
        estimate("tiny", method="lora", lora_targets=("lm_head",))


def test_lora_head_is_counted():
    shape = model_shape("tiny")
    base = estimate("tiny", method="lora", lora_rank=4, **LIT)
    head = estimate(
        "tiny",
        method="lora",
        lora_rank=4,
        lora_targets=("q_proj", "v_proj", "lm_head"),
        **LIT,
    )
    assert head.n_trainable - base.n_trainable == 4 * (shape.hidden + shape.vocab)


def test_one_dropout_for_the_fused_qkv():
    """LoRAQKVLinear applies one lora_dropout to the shared input: adapting q and v
    with p > 0 adds one bool mask per layer after the first (the dropped copy
    replaces the input that lora_A would save anyway); peft's separate q_proj and
    v_proj add two masks and two dropped copies."""
    b, s = 2, 64
    shape = model_shape("tiny")

    def held(fw, p):
        kw = dict(LIT, framework=fw)
        return estimate(
            "tiny", method="lora", batch=b, seq=s, lora_dropout=p, use_cache="off", **kw
        ).activation_bytes

    lit = held("litgpt", 0.05) - held("litgpt", 0.0)
    # layer 0's input needs no grad (frozen wte and norm): no mask is saved there
    assert lit == (shape.layers - 1) * b * s * shape.hidden * 1
    hf = held("hf", 0.05) - held("hf", 0.0)
    assert hf > lit


@pytest.mark.parametrize("b,s", [(1, 300), (3, 256)])
def test_chunked_fp32_cross_entropy(b, s):
    """model(input_ids, lm_head_chunk_size=128) + chunked_cross_entropy under
    bf16-true: Fabric's wrapper returns the bf16 lm_head chunks converted to the
    default dtype (HalfPrecision.convert_output), so at the end of the forward the
    fp32 logits chunks and each chunk's fp32 log-softmax are held: each extra
    vocabulary entry costs exactly that many fp32 values (bf16 would be half)."""
    config = model_shape("tiny")

    def held(vocab):
        shape = dataclasses.replace(config, vocab=vocab)
        return estimate(shape, method="lora", batch=b, seq=s, **LIT).activation_bytes

    # (the reshape copy of the sliced last chunk is not saved: it goes with the
    # function's locals)
    per_vocab = b * s + b * (s - 1)
    assert held(320) - held(256) == 64 * 4 * per_vocab


def test_full_finetune_head_is_not_chunked():
    """finetune/full.py calls model(input_ids): one lm_head over all tokens, and the
    loop's logits are one (b, s, vocab) tensor."""
    lora = estimate("tiny", method="lora", batch=2, seq=256, **LIT).to_dict()
    full = estimate("tiny", method="full", batch=2, seq=256, **LIT).to_dict()
    assert lora["options"]["framework"] == full["options"]["framework"] == "litgpt"
    # the held logits differ in layout only: same bytes in bf16
    assert full["activation_bytes"] > 0 and lora["activation_bytes"] > 0


def test_qlora_quantizes_every_linear_including_lm_head():
    """Fabric's BitsandbytesPrecision converts every nn.Linear: the fused attn, proj,
    the MLP and lm_head are NF4; wte and the norms stay bf16, the RoPE cos/sin
    buffers are fp32 (max_seq_length x head_dim), the adapters bf16."""
    shape = model_shape("tiny")
    s, r = 128, 4
    est = estimate(
        "tiny",
        method="qlora",
        seq=s,
        lora_rank=r,
        optimizer="sgd",
        qlora_double_quant=False,
        framework="litgpt",
        precision="bf16",
    )
    h, d, v = shape.hidden, shape.head_dim, shape.vocab
    q, kv = shape.heads * d, shape.kv_heads * d
    linears = [(q + 2 * kv) * h, q * h] + [h * shape.intermediate] * 3
    nf4 = nf4_bytes_per_weight(False)

    def packed(n):  # a bf16 weight of n values shrunk to NF4 (bytes, rounded up)
        return math.ceil(n * 2 * (nf4 / 2))

    adapters = shape.layers * (2 * r * h + (q + kv) * r)
    expected = (
        shape.layers * sum(packed(n) for n in linears)
        + packed(v * h)  # lm_head is 4-bit too
        + 2 * (v * h + (2 * shape.layers + 1) * h)  # wte and the norms in bf16
        + 2 * 4 * s * d  # cos and sin, fp32 (max_seq_length, head_dim)
        + 2 * adapters  # bf16 adapters
        + 2 * adapters  # and their bf16 gradients when the optimizer steps
    )
    assert est.model_state_bytes == expected


def test_qlora_saved_inputs_follow_bitsandbytes():
    """MatMul4Bit kept its input up to bitsandbytes 0.43.1 (LitGPT pinned 0.42.0)."""
    kw = dict(method="qlora", batch=2, seq=128, **LIT)
    old = estimate("tiny", versions="bitsandbytes=0.42.0", **kw).activation_bytes
    new = estimate("tiny", versions="bitsandbytes=0.45.0", **kw).activation_bytes
    assert old > new


def test_cli_framework(capsys):
    assert (
        main(
            [
                "estimate",
                "--model",
                "tiny",
                "--framework",
                "litgpt",
                "--precision",
                "bf16",
                "--method",
                "lora",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["framework"] == "litgpt"
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["estimate", "--framework", "axolotl"]))
    assert e.value.code == 2
    assert "--framework" in capsys.readouterr().err


def _retained_bytes(shape, batch, seq):
    """The previous micro-batch's inputs of the 4-bit Linears under q/v LoRA, bf16:
    block 0's fused attn input needs no grad (frozen embedding and norm); after the
    first adapter every Linear's input does (fc_1/fc_2 share one), lm_head's too."""
    h, inter, q_dim = shape.hidden, shape.intermediate, shape.heads * shape.head_dim
    per_block = h + q_dim + h + inter
    return 2 * batch * seq * (shape.layers * per_block - h + h)


def test_qlora_ctx_tensors_live_with_the_held_logits():
    """bitsandbytes 0.42.0 keeps the input in ``ctx.tensors`` (not
    save_for_backward), so the previous graph's inputs live while the loop's
    ``logits`` does: the forward peak grows by more than one copy of them."""
    shape = model_shape("tiny")
    kw = dict(method="qlora", batch=2, seq=128, grad_accum=2, **LIT)
    old = estimate("tiny", versions="bitsandbytes=0.42.0", **kw).phase_peaks
    new = estimate("tiny", versions="bitsandbytes=0.43.2", **kw).phase_peaks
    assert old["forward"] - new["forward"] > _retained_bytes(shape, 2, 128)


def test_validation_and_generation_phases():
    """validate: weights and states plus one unchunked head's logits, their reshaped
    copy and the log_softmax output; generate: a bf16 KV cache of (1, n_head, seq,
    head_dim) per block and a (seq, seq) bool mask."""
    shape = model_shape("tiny")
    b, s = 2, 128
    est = estimate("tiny", method="lora", batch=b, seq=s, **LIT)
    peaks = est.phase_peaks
    logits = 2 * b * s * shape.vocab
    assert peaks["validate"] >= est.model_state_bytes + 3 * logits * (s - 1) // s
    kv = 2 * shape.layers * 2 * shape.heads * s * shape.head_dim + s * s
    assert peaks["generate"] >= est.model_state_bytes + kv


def test_measure_refuses_litgpt():
    from trainmem.measuring.measure import measure

    with pytest.raises(OptionError) as e:
        measure("tiny", method="lora", framework="litgpt", precision="bf16")
    assert e.value.option == "framework" and "allowed for measure: hf" in str(e.value)


# --------------------------------------------------------------------------------------
# the LitGPT version a row ran (--versions litgpt=<release or commit>)
# --------------------------------------------------------------------------------------
def test_litgpt_versions_parse_and_key_behaviours():
    from trainmem.versions import (
        litgpt_loss_holds_graph,
        litgpt_rmsnorm_fp32,
        litgpt_rope_fp32,
        parse_versions,
    )

    old = parse_versions("litgpt=8641822b3249")
    new = parse_versions("litgpt=5895df10")
    release = parse_versions("litgpt=0.4.0")
    assert old["litgpt"] < new["litgpt"] <= release["litgpt"]
    assert not litgpt_rmsnorm_fp32(old) and litgpt_rmsnorm_fp32(new)
    assert not litgpt_rope_fp32(old) and litgpt_rope_fp32(release)
    assert litgpt_loss_holds_graph(old) and not litgpt_loss_holds_graph(new)
    for bad, needle in [
        ("litgpt=deadbeef", "not one the replay knows"),
        ("litgpt=0.1.0", "name a commit"),
        ("litgpt=main", "not a release or a commit"),
    ]:
        with pytest.raises(OptionError, match=needle) as e:
            StepConfig(framework="litgpt", versions=bad)
        assert e.value.option == "versions"


def test_rmsnorm_in_bf16_before_6178c7cc():
    """lit_gpt/rmsnorm.py@8641822 keeps ``x * x`` and ``x * rsqrt`` in bf16: each
    norm whose input requires grad saves the bf16 input (2 B) instead of the fp32
    upcast (4 B), and a bf16 ``rsqrt`` output (b·s, 2 B instead of 4 B); norm_1 of
    layer 0 reads the frozen embedding (nothing saved)."""
    b, s = 2, 64
    shape = model_shape("tiny")
    kw = dict(LIT, method="lora", batch=b, seq=s, use_cache="off")

    def act(commit):
        return estimate("tiny", versions=f"litgpt={commit}", **kw).activation_bytes

    norms_with_grad = 2 * shape.layers  # all but layer 0's norm_1, and ln_f
    per_norm = 2 * b * s * shape.hidden + 2 * b * s
    assert act("5895df10") - act("8641822") == norms_with_grad * per_norm


def test_paged_adamw_states_outside_the_allocator():
    """bitsandbytes' PagedAdamW keeps fp32 states; those of tensors from 1e5 elements
    are paged (managed memory, not in max_memory_allocated)."""
    from trainmem.optimizers import PAGED_MIN_NUMEL, optimizer

    spec = optimizer("paged_adamw")
    small = spec.states((8, 4096), "bf16")
    big = spec.states((32000, 8), "bf16")
    assert [(st.dtype, st.paged) for st in small] == [("fp32", False)] * 2
    assert 32000 * 8 >= PAGED_MIN_NUMEL and all(st.paged for st in big)
    # TinyLlama's shape: lm_head's lora_B (32000 x 32) and each fused qkv lora_A
    # (2·32 x 2048: q and v share one A) are paged; every other adapter is under 1e5
    # elements
    tinyllama = dict(
        model_type="llama", vocab_size=32000, hidden_size=2048,
        intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
        num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip
    kw = dict(LIT, method="lora", lora_rank=32, seq=16, use_cache="off")
    kw["lora_targets"] = ("q_proj", "v_proj", "lm_head")

    est = estimate(tinyllama, **dict(kw, optimizer="paged_adamw"))
    states = est.to_dict()["breakdown"]["optimizer_states"]
    # fp32 m and v of the unpaged adapters; no step tensor
    paged = 32000 * 32 + 22 * (2 * 32 * 2048)
    assert states == 2 * 4 * (est.n_trainable - paged)


def test_previous_seq_and_the_graph_loss_holds():
    """lit_gpt@8641822's ``loss`` holds the previous graph, and bitsandbytes 0.41.1
    keeps each 4-bit Linear's input in ``ctx.tensors``, until this micro-batch's
    cross-entropy: with a previous micro-batch the forward peaks higher;
    ``previous_seq=0`` (the first micro-batch) has none."""
    kw = dict(LIT, method="qlora", kbit_prepare="none", batch=2, seq=256)
    kw["use_cache"] = "off"

    def forward_peak(commit, prev):
        versions = f"bitsandbytes=0.41.1,litgpt={commit}"
        est = estimate("tiny", previous_seq=prev, versions=versions, **kw)
        return est.to_dict()["phase_peaks"]["forward"]

    assert forward_peak("8641822", None) > forward_peak("8641822", 0)
    with pytest.raises(OptionError) as e:
        StepConfig(previous_seq=128)
    assert e.value.option == "previous_seq"
    with pytest.raises(OptionError) as e:
        StepConfig(framework="litgpt", previous_seq=-1)
    assert e.value.option == "previous_seq"


def test_zero_pad_saves_index_copy_source():
    """``zero_pad``'s ``index_copy`` keeps its ``source`` for backward (torch's
    formula ``grad.index_select(dim, index).expand_as(source)`` needs the tensor):
    adapting q and v (padded to the fused width) saves one (B·T, 2·hidden) tensor
    per layer more than the bare padding would; with q, k and v there is no
    padding."""
    import torch

    src = torch.randn(6, 4, requires_grad=True) * 1
    out = torch.zeros(6, 8).index_copy(1, torch.tensor([0, 1, 4, 5]), src)
    assert out.grad_fn._saved_source.data_ptr() == src.data_ptr()

    b, s = 2, 64
    shape = model_shape("tiny")
    kw = dict(LIT, method="lora", batch=b, seq=s, use_cache="off", lora_dropout=0.0)

    def act(targets):
        return estimate("tiny", lora_targets=targets, **kw).activation_bytes

    qv, qkv = act(("q_proj", "v_proj")), act(("q_proj", "k_proj", "v_proj"))
    r, h = 8, shape.hidden  # the default rank
    per_layer = (
        b * s * 2 * h * 2  # index_copy's source: (B·T, 2·hidden) bf16
        + 2 * h * 8  # and its int64 index
        - b * s * r * 2  # conv1d's saved input has r rows less (2r vs 3r)
    )
    assert qv - qkv == shape.layers * per_layer


@pytest.mark.parametrize("groups,v_is_fused", [(1, True), (2, False), (4, True)])
def test_multi_query_attention_views_and_old_refusal(monkeypatch, groups, v_is_fused):
    """One kv group (MQA): ``reshape`` of q and of the expanded k and v merges a
    size-1 dim, so they stay views of the fused output (SDPA keeps it alive) — no
    copies as with 1 < groups < heads; lit_gpt before 50b1974b did not expand k and
    v at all, which is refused."""
    from trainmem.memory import litgpt

    b, s, heads, hs = 2, 64, 4, 16
    cfg = dict(
        model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=172,
        num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=groups,
        max_position_embeddings=256, tie_word_embeddings=False,
    )  # fmt: skip
    handed = []
    real_sdpa = litgpt.sdpa

    def spy(sim, q, k, v):
        handed.append(v.buffer.nbytes)
        return real_sdpa(sim, q, k, v)

    monkeypatch.setattr(litgpt, "sdpa", spy)
    kw = dict(LIT, method="lora", batch=b, seq=s, use_cache="off")
    estimate(cfg, **kw)
    fused = b * s * (heads + 2 * groups) * hs * 2  # the fused qkv output, bf16
    copy = b * heads * s * hs * 2  # v expanded and reshaped into its own tensor
    assert handed and set(handed) == {fused if v_is_fused else copy}
    if groups > 1:
        return
    with pytest.raises(OptionError, match="50b1974b") as e:
        estimate(cfg, versions="litgpt=8641822", **kw)
    assert e.value.option == "versions"


def test_previous_seq_is_the_first_micro_batch_only():
    """``previous_seq`` sets what came before the step's *first* micro-batch; the
    second one follows a micro-batch of ``seq`` tokens, whose bitsandbytes
    ``ctx.tensors`` (0.41.1) the loop's ``loss`` still holds at 8641822."""
    kw = dict(LIT, method="qlora", kbit_prepare="none", batch=1, seq=256)
    kw.update(use_cache="off", versions="bitsandbytes=0.41.1,litgpt=8641822")

    def forward_peak(accum):
        est = estimate("tiny", previous_seq=0, grad_accum=accum, **kw)
        return est.to_dict()["phase_peaks"]["forward"]

    assert forward_peak(2) > forward_peak(1)
