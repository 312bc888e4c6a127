"""The Llama / Qwen2 / Mistral decoder as ``transformers`` runs it, op by op, and its
parameters (including peft's LoRA adapters) as the measured model holds them."""

from __future__ import annotations

from dataclasses import dataclass, field

from .accounting import SimTensor, Simulator, new, view
from .autograd import AccumulateGrad, checkpoint, param, record
from .sharded import gathered
from .ops import (
    _promote,
    add,
    add_scalar,
    bmm,
    cast,
    clone,
    clone_contig,
    dropout,
    embedding,
    linear,
    log_softmax,
    mean_last,
    mul,
    mul_scalar,
    narrow,
    nll_loss,
    pow2,
    repeat_kv,
    rotate_half,
    rsqrt,
    sdpa,
    sdpa_math,
    silu,
    softmax_fp32,
)


# --------------------------------------------------------------------------------------
# the model's parameters
# --------------------------------------------------------------------------------------
@dataclass
class Linear:
    """One ``nn.Linear`` (``w``: ``(d_out, d_in)``, optional bias ``b``), with peft's
    LoRA adapter (``A``: ``(r, d_in)``, ``B``: ``(d_out, r)``) when it is a target;
    ``quantized``: QLoRA's NF4 base weight (dequantized at every use)."""

    w: SimTensor
    b: SimTensor | None = None
    A: SimTensor | None = None
    B: SimTensor | None = None
    quantized: bool = False
    # bitsandbytes < 0.43.2: MatMul4Bit keeps its input for backward
    saves_input: bool = False
    # QLoRA (trainmem.kbit.KbitFlow): bnb_4bit_compute_dtype, which the input is
    # cast to (peft's k-bit preparation leaves an fp32 residual stream); whether the
    # output is cast back to the input's dtype; whether peft's LoRA layer on it casts
    # its input to the adapters' dtype only outside autocast, and clones the base
    # layer's output
    compute: str | None = None
    output_cast: bool = False
    lora_sees_autocast: bool = False
    clones_base_output: bool = False
    # peft's lora_dropout > 0, and whose kernels run it ("cuda" / "cpu")
    dropout: bool = False
    kernels: str = "cuda"

    def tensors(self) -> list[SimTensor]:
        """Its tensors in torch's parameter order (weight, bias, lora_A, lora_B)."""
        return [t for t in (self.w, self.b, self.A, self.B) if t is not None]


@dataclass
class Layer:
    """One decoder layer: its Linear layers by module name (q, k, v, o, gate, up, down:
    torch's module order) and the two RMSNorm weights."""

    linears: dict[str, Linear]
    input_layernorm: SimTensor
    post_attention_layernorm: SimTensor

    def tensors(self) -> list[SimTensor]:
        """Its tensors in torch's parameter order."""
        return [t for lin in self.linears.values() for t in lin.tensors()] + [
            self.input_layernorm,
            self.post_attention_layernorm,
        ]


@dataclass
class Model:
    """The parameters and buffers of the causal LM as the measured model holds them
    (``lm_head`` is ``embed`` when the embeddings are tied)."""

    embed: SimTensor
    layers: list[Layer]
    norm: SimTensor
    lm_head: SimTensor
    buffers: list[SimTensor] = field(default_factory=list)  # RoPE's inv_freq, twice
    # QLoRA: each 4-bit weight's code tables and offset (dtypes.nf4_state_tables)
    quant_tables: list[SimTensor] = field(default_factory=list)

    def parameters(self) -> list[SimTensor]:
        """Every parameter once, in torch's order (a tied ``lm_head`` is not
        repeated)."""
        out = [self.embed] + [t for layer in self.layers for t in layer.tensors()]
        out.append(self.norm)
        if self.lm_head is not self.embed:
            out.append(self.lm_head)
        return out


# --------------------------------------------------------------------------------------
# Llama / Qwen2 decoder (transformers' modeling_llama.py, op by op)
# --------------------------------------------------------------------------------------
def rmsnorm(sim: Simulator, x: SimTensor, w: SimTensor) -> SimTensor:
    xf = cast(sim, x, "fp32")  # hidden_states.to(torch.float32)
    var = mean_last(sim, pow2(sim, xf))
    r = rsqrt(sim, add_scalar(sim, var))
    del var
    xn = mul(sim, xf, r)
    del xf, r
    return mul(sim, w, cast(sim, xn, x.dtype))  # weight * hidden_states.to(input_dtype)


def lora_linear(sim: Simulator, x: SimTensor, lin: Linear) -> SimTensor:
    """peft ``lora.Linear.forward``: base(x) + lora_B(lora_A(x.to(A.dtype))) *
    scaling."""
    if lin.quantized and lin.A is not None:
        return _lora_on_4bit(sim, x, lin)
    result = linear(
        sim,
        x,
        lin.w,
        lin.b,
        quant=lin.quantized,
        quant_compute=lin.compute,
        quant_saves_input=lin.saves_input,
        quant_output_cast=lin.output_cast,
    )
    if lin.A is None or sim.adapters_off:
        # peft's disable_adapter(): the base layer's output only (TRL's reference)
        return result
    result_dtype = result.dtype
    # x = self._cast_input_dtype(x, lora_A.weight.dtype): lives to the end
    x = cast(sim, x, lin.A.dtype)
    # lora_B(lora_A(dropout(x))): peft's nn.Dropout for lora_dropout > 0 (one per
    # adapted module, so q/k/v each make their own mask and dropped copy); the dropped
    # copy is a temporary of the expression, gone once lora_A has run, while the
    # cast x stays (a recompute under checkpointing peaks here)
    dropped = dropout(sim, x, lin.kernels) if lin.dropout else x
    h = linear(sim, dropped, lin.A)
    del dropped
    h2 = linear(sim, h, lin.B)
    del h
    h3 = mul_scalar(sim, h2)
    del h2
    result = add(sim, result, h3)
    del h3
    return cast(sim, result, result_dtype)


def _lora_on_4bit(sim: Simulator, x: SimTensor, lin: Linear) -> SimTensor:
    """peft ``lora/bnb.py`` ``Linear4bit.forward``: ``result = self.base_layer(x)``
    (bitsandbytes' 4-bit Linear, :func:`.ops.linear`); ``result = result.clone()``;
    only where ``torch.is_autocast_enabled()`` is False — outside autocast, or always
    when it is the CPU's (the call without a device type asks CUDA's) — ``x`` is cast
    to the adapters' dtype and their output back to ``result``'s; then ``result +
    output`` (:mod:`trainmem.kbit`)."""
    result = linear(
        sim,
        x,
        lin.w,
        lin.b,
        quant=True,
        quant_compute=lin.compute,
        quant_saves_input=lin.saves_input,
        quant_output_cast=lin.output_cast,
    )
    if lin.clones_base_output:
        base_out = result
        result = clone(sim, base_out)
        del base_out
    convert = sim.autocast is None or not lin.lora_sees_autocast
    expected = result.dtype
    if convert:
        x = cast(sim, x, lin.A.dtype)  # lives to the end of forward
    dropped = dropout(sim, x, lin.kernels) if lin.dropout else x  # as lora_linear
    h = linear(sim, dropped, lin.A)
    del dropped
    h2 = linear(sim, h, lin.B)
    del h
    output = mul_scalar(sim, h2)
    del h2
    if convert:
        output = cast(sim, output, expected)
    out = add(sim, result, output)
    del result  # ``result = result + output`` drops the old result first,
    del output  # then the local ``output`` goes when forward returns
    return out


def attention(
    sim: Simulator,
    x: SimTensor,
    layer: Layer,
    cos: SimTensor,
    sin: SimTensor,
    cfg: dict,
    mask: SimTensor | None,
) -> SimTensor:
    b, s, _ = x.shape
    a, kv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q = lora_linear(sim, x, layer.linears["q_proj"])
    k = lora_linear(sim, x, layer.linears["k_proj"])
    v = lora_linear(sim, x, layer.linears["v_proj"])
    q = view(q, (b, a, s, d), "bshd")
    k = view(k, (b, kv, s, d), "bshd")
    v = view(v, (b, kv, s, d), "bshd")
    qe = add(sim, mul(sim, q, cos), mul(sim, rotate_half(sim, q), sin))
    ke = add(sim, mul(sim, k, cos), mul(sim, rotate_half(sim, k), sin))
    del q, k
    if cfg.get("kv_cache") is not None:
        # past_key_values.update(k, v, layer_idx): DynamicLayer torch.cat's them onto
        # its empty initial tensors, so the cache holds (and returns) new K and V that
        # live until the model output is dropped
        ke = clone_contig(sim, ke)
        if cfg.get("kv_cache_values_as_keys") and v.dtype != ke.dtype:
            v = _cat_promoted(sim, v, _promote(ke.dtype, v.dtype))
        else:
            v = clone_contig(sim, v)
        cfg["kv_cache"] += [ke, v]
    if cfg["attn"] == "eager":
        ke = repeat_kv(sim, ke, a)
        v = repeat_kv(sim, v, a)
        kt = view(ke, (b, a, d, s), {"bhsd": "t"}.get(ke.layout, ke.layout))
        w = bmm(sim, qe, kt, (b, a, s, s))
        del qe, ke, kt
        w = mul_scalar(sim, w)
        if mask is not None:
            w = add(sim, w, mask)
        p = softmax_fp32(sim, w)
        del w
        p = cast(sim, p, _q_dtype(sim, layer, cos))
        o = bmm(sim, p, v, (b, a, s, d))
        del p, v
        o = clone_contig(
            sim, view(o, (b, s, a, d), "t")
        )  # transpose(1, 2).contiguous()
    elif cfg["attn"] == "math":
        if cfg.get("sdpa_repeats_kv"):
            ke, v = repeat_kv(sim, ke, a), repeat_kv(sim, v, a)
        o = sdpa_math(sim, qe, ke, v, mask=mask)
        del qe, ke, v
        # transpose(1, 2).contiguous(): the math path's output is (b, heads, s, d)
        o = clone_contig(sim, view(o, (b, s, a, d), "t"))
    elif cfg.get("context_parallel", 1) > 1:
        # the sequence sharded over ranks: ring attention (trainmem.memory.ring)
        from .ring import ring_sdpa

        o = ring_sdpa(sim, qe, ke, v, cfg["context_parallel"])
        del qe, ke, v
    else:
        if cfg.get("sdpa_repeats_kv"):
            # transformers' repeat_kv (no enable_gqa): SDPA saves the copies
            ke, v = repeat_kv(sim, ke, a), repeat_kv(sim, v, a)
        o = sdpa(
            sim,
            qe,
            ke,
            v,
            lse_align=cfg.get("lse_align", 1),
            mask=mask,
            mask_align=cfg.get("mask_align", 1),
        )
        del qe, ke, v
    o = view(o, (b, s, a * d))
    return lora_linear(sim, o, layer.linears["o_proj"])


def _cat_promoted(sim: Simulator, v: SimTensor, dtype: str) -> SimTensor:
    """``torch.cat([empty, v])`` with an empty tensor of another dtype: a contiguous
    copy of ``v`` in the promoted ``dtype``; backward narrows the gradient and casts
    it back to ``v``'s dtype."""
    out = new(sim, v.shape, dtype, layout="bhsd")
    shape, v_dtype = v.shape, v.dtype
    record(sim, out, [v], [], lambda node, g: [new(sim, shape, v_dtype)])
    return out


def causal_mask(sim: Simulator, b: int, s: int) -> SimTensor:
    """The ``(b, 1, s, s)`` bool causal mask transformers builds for SDPA when it
    cannot pass ``is_causal`` (:func:`trainmem.versions.hf_materializes_causal_mask`),
    op by op as measured on transformers 4.57.1: ``find_packed_sequence_indices``
    (``diff`` of the position ids with a prepended column, ``!= 1``, ``cumsum``), then
    ``sdpa_mask_recent_torch``'s vmapped index functions (the causal ``(s, s)``
    comparison, then the packed-sequence equality over ``(b, s, s)``). The mask stays
    alive until the decoder's forward returns."""
    first = new(sim, (b, 1), "i64")  # position_ids[:, :1] - 1
    prepended = new(sim, (b, s + 1), "i64")  # torch.diff's cat
    diff = new(sim, (b, s), "i64")
    del prepended
    ne = new(sim, (b, s), "u8")  # torch.bool: one byte an element
    packed = new(sim, (b, s), "i64")  # cumsum: the packed-sequence index
    del ne, first, diff
    kv_arange = new(sim, (s,), "i64")
    batch_arange = new(sim, (b,), "i64")
    head_arange = new(sim, (1,), "i64")
    ones = new(sim, (s,), "u8")
    le = new(sim, (s, s), "u8")
    causal = new(sim, (s, s), "u8")
    del le, ones
    rows_q = new(sim, (b, s), "i64")  # packed[batch, q_idx]
    rows_kv = new(sim, (b, s), "i64")  # packed[batch, kv_idx]
    eq = new(sim, (b, s, s), "u8")
    del rows_q, rows_kv
    mask = new(sim, (b, 1, s, s), "u8")
    del eq, causal, kv_arange, batch_arange, head_arange, packed
    return mask


def _q_dtype(sim, layer: Layer, cos: SimTensor):
    """dtype of query_states after RoPE (the eager softmax is cast back to it)."""
    linear_dtype = sim.autocast or layer.linears["q_proj"].w.dtype
    return _promote(linear_dtype, cos.dtype)


def mlp(sim: Simulator, x: SimTensor, layer: Layer) -> SimTensor:
    # down_proj(act_fn(gate_proj(x)) * up_proj(x)): Python evaluates the left operand
    # first, so silu's output exists while up_proj runs
    g = lora_linear(sim, x, layer.linears["gate_proj"])
    a = silu(sim, g)
    del g
    u = lora_linear(sim, x, layer.linears["up_proj"])
    h = mul(sim, a, u)
    del a, u
    return lora_linear(sim, h, layer.linears["down_proj"])


def decoder_layer(
    sim: Simulator,
    h: SimTensor,
    cos: SimTensor,
    sin: SimTensor,
    layer: Layer,
    cfg: dict,
    mask,
) -> SimTensor:
    residual = h
    x = rmsnorm(sim, h, layer.input_layernorm)
    x = attention(sim, x, layer, cos, sin, cfg, mask)
    h = add(sim, residual, x)
    del x, residual
    residual = h
    x = rmsnorm(sim, h, layer.post_attention_layernorm)
    x = mlp(sim, x, layer)
    return add(sim, residual, x)


def llama_loss(
    sim: Simulator, model: Model, ids: SimTensor, labels: SimTensor, cfg: dict
) -> SimTensor:
    b, s = ids.shape
    h = embedding(sim, ids, gathered(sim, model.embed))
    if cfg["checkpointing"] and not h.requires_grad:
        # transformers' gradient_checkpointing_enable() calls
        # enable_input_require_grads(): the (frozen) embedding output is made a leaf
        # that requires grad, so layer 0 is checkpointed and back-propagated like the
        # others (its gradient is computed and dropped).
        h.requires_grad = True
        h.grad_accumulator = AccumulateGrad(h)
        h.grad_accumulator.discard = True
        h.grad_accumulator.param = None  # (no reference cycle: h is freed as usual)
    dtype = h.dtype
    d = cfg["head_dim"]
    # rotary embedding (computed once per forward, in fp32, then cast to the activation
    # dtype)
    pos = new(sim, (1, s), "i64")
    mask = causal_mask(sim, b, s) if cfg.get("causal_mask") else None
    freqs = new(sim, (1, s, d // 2), "fp32")
    emb = new(sim, (1, s, d), "fp32")
    del freqs
    cos = cast(sim, new(sim, (1, 1, s, d), "fp32"), dtype)
    sin = cast(sim, new(sim, (1, 1, s, d), "fp32"), dtype)
    del emb
    if cfg["attn"] == "eager":
        mask = new(sim, (b, 1, s, s), dtype)
    if not cfg["checkpointing"]:
        del pos
    else:
        pos = view(pos, pos.shape)  # position_ids: kept by every checkpointed layer
    for layer in model.layers:
        if cfg["checkpointing"]:
            h = checkpoint(
                sim,
                lambda h_, c_, s_, p_, layer=layer, m_=mask: decoder_layer(
                    sim, h_, c_, s_, layer, cfg, m_
                ),
                h,
                cos,
                sin,
                pos,
                reentrant=cfg.get("reentrant", False),
            )
        else:
            h = decoder_layer(sim, h, cos, sin, layer, cfg, mask)
    del cos, sin
    if cfg["checkpointing"]:
        del pos
    if sim.sharded:
        # the layers a sharding keeps gathered from their forward until their
        # backward (DeepSpeed ZeRO-3: shard_deepspeed._deepspeed_kept), held from here
        sim.sharded.after_layers(sim)
    h = rmsnorm(sim, h, model.norm)
    del mask  # LlamaModel.forward returns here
    if cfg.get("loss_chunk"):
        # the chunked cross-entropy in place of lm_head + cross_entropy
        from .chunked import chunked_loss

        if cfg.get("kv_cache") is not None:
            # the decoder's output (and its cache) is dropped before the loss
            cfg["kv_cache"] = []
        held = [h]  # handed over: the loss drops the uncast hidden states
        del h
        return chunked_loss(sim, held, gathered(sim, model.lm_head), cfg)
    keep = cfg.get("logits_to_keep")
    if keep:
        # hidden_states[:, -logits_to_keep:, :]: a view the lm_head saves (so the
        # whole last hidden state stays), slice_backward's zeros in backward
        h = narrow(sim, h, (b, keep, h.shape[-1]))
    # activation offloading pauses inside lm_head (trainmem.memory.offload)
    offload, sim.offload = sim.offload, None
    logits = linear(sim, h, gathered(sim, model.lm_head))
    sim.offload = offload
    if cfg.get("return_logits"):
        # labels=None: the model output's logits, as the loss of an objective reads
        # them (trainmem.memory.preference)
        del h
        if cfg.get("kv_cache") is not None and not cfg.get("keep_cache"):
            cfg["kv_cache"] = []
        return logits
    # (h, the model output's last_hidden_state, lives until the causal-LM forward
    # returns) ForCausalLMLoss: logits.float(); pad+shift labels; cross_entropy =
    # log_softmax + nll_loss
    form = cfg.get("loss_form", "pad")
    if form != "pad":
        # transformers < 4.49: logits.float() and logits[..., :-1, :].contiguous()
        # (trainmem.versions.loss_form); before 4.46 the 16-bit logits are rebound
        # away at once
        lf = cast(sim, logits, "fp32")
        if form == "per-model":
            del logits
            logits = None
        vocab = lf.shape[-1]
        shifted = clone_contig(sim, narrow(sim, lf, (b, s - 1, vocab)))
        target = new(sim, (b, s - 1), "i64")  # labels[..., 1:].contiguous()
        logp = log_softmax(sim, view(shifted, (b * (s - 1), vocab)))
        loss = nll_loss(sim, logp, target)
        del logp, target, shifted, lf, logits, h
        if cfg.get("kv_cache") is not None:
            cfg["kv_cache"] = []  # the output (and its past_key_values) is dropped
        return loss
    lf = cast(sim, logits, "fp32")
    padded = new(
        sim, (b, s + 1), "i64"
    )  # the padded labels live until the loss returns
    target = new(sim, (b * s,), "i64")
    logp = log_softmax(sim, view(lf, (b * s, lf.shape[-1])))
    del lf
    loss = nll_loss(sim, logp, target)
    del logp, target, padded, logits, h
    if cfg.get("kv_cache") is not None:
        cfg["kv_cache"] = []  # the output (and its past_key_values) is dropped
    return loss


def build_params(
    sim: Simulator,
    shape,
    *,
    method: str,
    lora_rank: int,
    lora_targets,
    dtypes,
    rope_buffers: int = 2,
) -> Model:
    """Parameters (and buffers) as the measured model holds them.

    ``dtypes``: the step's :class:`trainmem.decisions.Dtypes` — ``base`` for the base
    parameters (under the ZeRO/DeepSpeed mixed-precision layout every parameter,
    buffer and adapter is in ``module``'s 16-bit dtype, ``model.bfloat16()``, and the
    fp32 master copy lives in the optimizer, added by :func:`simulate_step`; under
    QLoRA the 16-bit or fp32 embeddings, norms and ``lm_head``, the decoder Linear
    weights quantized afterwards by :func:`simulate_step`), ``buffers``, ``adapters``.
    Under autocast a trainable fp32 parameter is also the master copy (category
    ``master_weights``)."""
    base_param_dtype = dtypes.base
    amp = dtypes.autocast is not None
    full = method == "full"

    def make_param(param_shape, trainable, dtype=base_param_dtype):
        category = (
            "master_weights" if (amp and trainable and dtype == "fp32") else "weights"
        )
        return param(sim, param_shape, dtype, trainable, category)

    h = shape.hidden
    embed = make_param((shape.vocab, h), full)
    # rotary buffers: inv_freq and original_inv_freq, head_dim/2 floats each
    # (``rope_buffers``: one storage up to transformers 4.57, versions.rope_buffers)
    buffer_dtype = dtypes.buffers
    buffers = [
        new(sim, (shape.head_dim // 2,), buffer_dtype, category="weights")
        for _ in range(rope_buffers)
    ]
    adapter_dtype = dtypes.adapters
    adapter_category = (
        "master_weights" if (amp and adapter_dtype == "fp32") else "weights"
    )
    layers = []
    lin_shapes = shape.linear_shapes()
    for _ in range(shape.layers):
        linears = {}
        # linear_shapes() lists q, k, v, o, gate, up, down: torch's module order
        for name, (d_in, d_out) in lin_shapes.items():
            lin = Linear(make_param((d_out, d_in), full))
            if name in ("q_proj", "k_proj", "v_proj"):
                has_bias = shape.qkv_bias
            else:
                has_bias = shape.o_bias if name == "o_proj" else shape.mlp_bias
            if has_bias:
                lin.b = make_param((d_out,), full)
            if method != "full" and name in lora_targets:
                lin.A = param(
                    sim, (lora_rank, d_in), adapter_dtype, True, adapter_category
                )
                lin.B = param(
                    sim, (d_out, lora_rank), adapter_dtype, True, adapter_category
                )
            linears[name] = lin
        layers.append(Layer(linears, make_param((h,), full), make_param((h,), full)))
    norm = make_param((h,), full)
    lm_head = embed if shape.tied else make_param((shape.vocab, h), full)
    return Model(embed, layers, norm, lm_head, buffers)


def trainable_params(model: Model) -> list[SimTensor]:
    """The parameters that require grad, in torch's order."""
    return [p for p in model.parameters() if p.requires_grad]
