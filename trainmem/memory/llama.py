"""The Llama / Qwen2 / Mistral decoder as ``transformers`` runs it, op by op, and its parameters
(including peft's LoRA adapters) as the measured model holds them."""

from __future__ import annotations

from .accounting import T, Sim, new, view
from .autograd import AccGrad, checkpoint, param
from .ops import (
    _promote,
    add,
    add_scalar,
    bmm,
    cast,
    clone_contig,
    embedding,
    linear,
    log_softmax,
    mean_last,
    mul,
    mul_scalar,
    nll_loss,
    pow2,
    repeat_kv,
    rotate_half,
    rsqrt,
    sdpa,
    silu,
    softmax_fp32,
)


# ----------------------------------------------------------------------------------------------
# Llama / Qwen2 decoder (transformers' modeling_llama.py, op by op)
# ----------------------------------------------------------------------------------------------
def rmsnorm(sim: Sim, x: T, w: T) -> T:
    xf = cast(sim, x, "fp32")  # hidden_states.to(torch.float32)
    var = mean_last(sim, pow2(sim, xf))
    r = rsqrt(sim, add_scalar(sim, var))
    del var
    xn = mul(sim, xf, r)
    del xf, r
    return mul(sim, w, cast(sim, xn, x.dt))  # weight * hidden_states.to(input_dtype)


def lora_linear(sim: Sim, x: T, lin: dict) -> T:
    """peft ``lora.Linear.forward``: base(x) + lora_B(lora_A(x.to(A.dtype))) * scaling."""
    result = linear(sim, x, lin["w"], lin.get("b"), quant=lin.get("q", False))
    if "A" not in lin:
        return result
    rdt = result.dt
    x = cast(
        sim, x, lin["A"].dt
    )  # x = self._cast_input_dtype(x, ...): lives to the end
    h = linear(sim, x, lin["A"])
    h2 = linear(sim, h, lin["B"])
    del h
    h3 = mul_scalar(sim, h2)
    del h2
    result = add(sim, result, h3)
    del h3
    return cast(sim, result, rdt)


def attention(sim: Sim, x: T, L: dict, cos: T, sin: T, cfg: dict, mask: T | None) -> T:
    b, s, _ = x.shape
    a, kv, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q = lora_linear(sim, x, L["q_proj"])
    k = lora_linear(sim, x, L["k_proj"])
    v = lora_linear(sim, x, L["v_proj"])
    q = view(q, (b, a, s, d), "bshd")
    k = view(k, (b, kv, s, d), "bshd")
    v = view(v, (b, kv, s, d), "bshd")
    qe = add(sim, mul(sim, q, cos), mul(sim, rotate_half(sim, q), sin))
    ke = add(sim, mul(sim, k, cos), mul(sim, rotate_half(sim, k), sin))
    del q, k
    if cfg["attn"] == "eager":
        ke = repeat_kv(sim, ke, a)
        v = repeat_kv(sim, v, a)
        kt = view(ke, (b, a, d, s), {"bhsd": "t"}.get(ke.phys, ke.phys))
        w = bmm(sim, qe, kt, (b, a, s, s))
        del qe, ke, kt
        w = mul_scalar(sim, w)
        if mask is not None:
            w = add(sim, w, mask)
        p = softmax_fp32(sim, w)
        del w
        p = cast(sim, p, _q_dtype(sim, x, L))
        o = bmm(sim, p, v, (b, a, s, d))
        del p, v
        o = clone_contig(
            sim, view(o, (b, s, a, d), "t")
        )  # transpose(1, 2).contiguous()
    else:
        o = sdpa(sim, qe, ke, v)
        del qe, ke, v
    o = view(o, (b, s, a * d))
    return lora_linear(sim, o, L["o_proj"])


def _q_dtype(sim, x, L):
    """dtype of query_states after RoPE (the eager softmax is cast back to it)."""
    lin_dt = sim.autocast or L["q_proj"]["w"].dt
    return _promote(lin_dt, L["_cos_dt"])


def mlp(sim: Sim, x: T, L: dict) -> T:
    # down_proj(act_fn(gate_proj(x)) * up_proj(x)): Python evaluates the left operand first, so
    # silu's output exists while up_proj runs
    g = lora_linear(sim, x, L["gate_proj"])
    a = silu(sim, g)
    del g
    u = lora_linear(sim, x, L["up_proj"])
    h = mul(sim, a, u)
    del a, u
    return lora_linear(sim, h, L["down_proj"])


def decoder_layer(sim: Sim, h: T, cos: T, sin: T, L: dict, cfg: dict, mask) -> T:
    residual = h
    x = rmsnorm(sim, h, L["input_layernorm"])
    x = attention(sim, x, L, cos, sin, cfg, mask)
    h = add(sim, residual, x)
    del x, residual
    residual = h
    x = rmsnorm(sim, h, L["post_attention_layernorm"])
    x = mlp(sim, x, L)
    return add(sim, residual, x)


def llama_loss(sim: Sim, M: dict, ids: T, labels: T, cfg: dict) -> T:
    b, s = ids.shape
    h = embedding(sim, ids, M["embed"])
    if cfg["checkpointing"] and not h.rg:
        # transformers' gradient_checkpointing_enable() calls enable_input_require_grads(): the
        # (frozen) embedding output is made a leaf that requires grad, so layer 0 is checkpointed
        # and back-propagated like the others (its gradient is computed and dropped).
        h.rg = True
        h.acc = AccGrad(h)
        h.acc.sink = True
        h.acc.param = None  # (no reference cycle: h is freed as usual)
    dt = h.dt
    d = cfg["head_dim"]
    # rotary embedding (computed once per forward, in fp32, then cast to the activation dtype)
    pos = new(sim, (1, s), "i64")
    freqs = new(sim, (1, s, d // 2), "fp32")
    emb = new(sim, (1, s, d), "fp32")
    del freqs
    cos = cast(sim, new(sim, (1, 1, s, d), "fp32"), dt)
    sin = cast(sim, new(sim, (1, 1, s, d), "fp32"), dt)
    del emb
    for L in M["layers"]:
        L["_cos_dt"] = cos.dt
    mask = None
    if cfg["attn"] == "eager":
        mask = new(sim, (b, 1, s, s), dt)
    if not cfg["checkpointing"]:
        del pos
    else:
        pos = view(pos, pos.shape)  # position_ids: kept by every checkpointed layer
    for L in M["layers"]:
        if cfg["checkpointing"]:
            h = checkpoint(
                sim,
                lambda h_, c_, s_, p_, L=L, m_=mask: decoder_layer(
                    sim, h_, c_, s_, L, cfg, m_
                ),
                h,
                cos,
                sin,
                pos,
            )
        else:
            h = decoder_layer(sim, h, cos, sin, L, cfg, mask)
    del cos, sin
    if cfg["checkpointing"]:
        del pos
    h = rmsnorm(sim, h, M["norm"])
    del mask  # LlamaModel.forward returns here
    logits = linear(sim, h, M["lm_head"])
    # (h, the model output's last_hidden_state, lives until the causal-LM forward returns)
    # ForCausalLMLoss: logits.float(); pad+shift labels; cross_entropy = log_softmax + nll_loss
    lf = cast(sim, logits, "fp32")
    padded = new(
        sim, (b, s + 1), "i64"
    )  # the padded labels live until the loss returns
    target = new(sim, (b * s,), "i64")
    logp = log_softmax(sim, view(lf, (b * s, lf.shape[-1])))
    del lf
    loss = nll_loss(sim, logp, target)
    del logp, target, padded, logits, h
    return loss


def build_params(
    sim: Sim,
    shape,
    *,
    method: str,
    precision: str,
    lora_rank: int,
    lora_targets,
    lora_dtype: str | None,
    param_dtype: str | None = None,
    base_dtype: str | None = None,
) -> dict:
    """Parameters (and buffers) as the measured model holds them.

    ``param_dtype`` (``"bf16"``/``"fp16"``) overrides the dtype of every parameter, buffer and
    LoRA adapter: the ZeRO/DeepSpeed mixed-precision layout, where the module itself is cast to the
    low precision (``model.bfloat16()``) and the fp32 master copy lives in the optimizer (added by
    :func:`simulate_step`, category ``master_weights``); all parameters are then ``weights``.
    ``base_dtype`` overrides the dtype of the (frozen) base model only, not of the adapters: QLoRA's
    16-bit embeddings, norms and ``lm_head`` (the decoder Linear weights are then quantized by
    :func:`simulate_step`)."""
    pdt = param_dtype or base_dtype or ("bf16" if precision == "bf16" else "fp32")
    amp = precision in ("fp16-amp", "bf16-amp") and param_dtype is None
    full = method == "full"

    def P(shp, trainable, dt=pdt):
        cat = "master_weights" if (amp and trainable and dt == "fp32") else "weights"
        return param(sim, shp, dt, trainable, cat)

    h = shape.hidden
    M = {"embed": P((shape.vocab, h), full)}
    # rotary buffers: inv_freq and original_inv_freq (head_dim/2 floats each)
    buf_dt = param_dtype or ("bf16" if precision == "bf16" else "fp32")
    M["_buffers"] = [
        new(sim, (shape.head_dim // 2,), buf_dt, cat="weights") for _ in range(2)
    ]
    ldt = (
        param_dtype or lora_dtype or "fp32"
    )  # peft upcasts adapters to fp32 by default
    layers = []
    lin_shapes = shape.linear_shapes()
    for _ in range(shape.layers):
        L = {}  # in torch's parameter order: self_attn, mlp, the two norms
        for name in (
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ):
            d_in, d_out = lin_shapes[name]
            lin = {"w": P((d_out, d_in), full)}
            if name in ("q_proj", "k_proj", "v_proj"):
                has_bias = shape.qkv_bias
            else:
                has_bias = shape.o_bias if name == "o_proj" else shape.mlp_bias
            if has_bias:
                lin["b"] = P((d_out,), full)
            if method != "full" and name in lora_targets:
                lin["A"] = param(
                    sim,
                    (lora_rank, d_in),
                    ldt,
                    True,
                    "master_weights" if (amp and ldt == "fp32") else "weights",
                )
                lin["B"] = param(
                    sim,
                    (d_out, lora_rank),
                    ldt,
                    True,
                    "master_weights" if (amp and ldt == "fp32") else "weights",
                )
            L[name] = lin
        L["input_layernorm"] = P((h,), full)
        L["post_attention_layernorm"] = P((h,), full)
        layers.append(L)
    M["layers"] = layers
    M["norm"] = P((h,), full)
    M["lm_head"] = M["embed"] if shape.tied else P((shape.vocab, h), full)
    return M


def trainable_params(M: dict) -> list[T]:
    out, seen = [], set()

    def walk(o):
        if isinstance(o, T):
            if o.rg and id(o) not in seen:
                seen.add(id(o))
                out.append(o)
        elif isinstance(o, dict):
            for k, v in o.items():
                if not k.startswith("_"):
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(M)
    return out
