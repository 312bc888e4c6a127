"""LitGPT's GPT (Llama-family configs) and its fine-tuning step, op by op, as
``litgpt finetune lora`` / ``finetune full`` run it.

Read from LitGPT at the commits the published rows cite (``litgpt/model.py``,
``litgpt/lora.py``, ``litgpt/utils.py``, ``litgpt/finetune/lora.py`` at
Lightning-AI/litgpt@5895df10, April 2024, the config-hub benchmark table; the same
mechanisms in ``lit_gpt/`` at @8641822, the resource tables) and from Lightning
Fabric's ``plugins/precision/bitsandbytes.py`` (lightning 2.3). What differs from the
Hugging Face stack (:mod:`.llama`):

* one fused ``attn`` Linear (``(n_head + 2·n_query_groups)·head_size`` outputs) whose
  output is viewed as ``(B, n_query_groups, q_per_kv + 2, T, hs)`` and split; the
  ``reshape`` to ``(B, heads, T, hs)`` copies q (and k, v after ``expand`` when
  ``n_query_groups < n_head``; with MHA they stay views of the fused output, which
  SDPA then keeps alive); RoPE with fp32 ``cos``/``sin`` buffers (``x * cos`` is fp32,
  cast back by ``roped.to(x.dtype)``) and a ``torch.cat`` copy of the roped q and k;
* ``LoRAQKVLinear``: one ``lora_A`` of ``r·(enabled q/k/v)`` rows on *one*
  ``lora_dropout(x)`` (a single mask and dropped copy for q, k and v), ``lora_B`` via
  ``conv1d`` (split by q/k/v under GQA, then ``cat``), ``zero_pad`` to the fused width
  when not all of q, k, v are adapted (``new_zeros`` + ``index_copy``, out of place),
  then ``* scaling`` and ``pretrained + lora`` at the fused width;
* ``RMSNorm``: ``x.float()``, ``x * x``, ``x * rsqrt(...)`` in fp32, ``.to(dtype)``
  then ``* weight``;
* ``model(input_ids, lm_head_chunk_size=128)``: ``lm_head`` on 128-token chunks
  (``x.split(128, dim=1)``), the last chunk sliced ``[..., :-1, :]``, and
  ``chunked_cross_entropy``: a cross-entropy per chunk in the logits' dtype,
  ``reduction="none"``, ``cat`` and ``sum``; the logits are fp32 by then: Fabric's
  wrapper converts the module's outputs to the default dtype (:func:`fabric_output`);
  the loop's ``logits`` list lives until the next micro-batch's forward rebinds it;
* QLoRA: Fabric's ``BitsandbytesPrecision`` replaces *every* ``nn.Linear`` (the fused
  ``attn``, ``proj``, the MLP and ``lm_head``) by a 4-bit Linear quantised from fp16
  (``weight.to(torch.half)``: ``dequantize_4bit`` returns fp16, cast to the input's
  dtype); embeddings and norms stay in the bf16 the module was built in, the adapters
  too; no k-bit preparation.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..versions import litgpt_rope_fp32
from .accounting import SimTensor, Simulator, new, view
from .autograd import checkpoint, param, record
from .ops import (
    add,
    cast,
    clone_contig,
    dropout,
    embedding,
    linear,
    log_softmax,
    mean_last,
    mul,
    mul_scalar,
    narrow,
    neg,
    nll_loss,
    rsqrt,
    sdpa,
    silu,
)

#: the LitGPT module names of the HF-named LoRA targets (litgpt/lora.py: lora_query,
#: lora_key, lora_value on the fused attn; lora_projection; lora_mlp; lora_head)
QKV = ("q_proj", "k_proj", "v_proj")
MLP = (("fc_1", "gate_proj"), ("fc_2", "up_proj"), ("proj", "down_proj"))
#: finetune/lora.py and finetune/full.py: ``model(input_ids, lm_head_chunk_size=128)``
LM_HEAD_CHUNK = 128


@dataclass
class LitLinear:
    """A LitGPT ``LoRALinear`` (``r == 0``: a plain Linear); ``quantized``: the 4-bit
    Linear of ``BitsandbytesPrecision``."""

    w: SimTensor
    A: SimTensor | None = None
    B: SimTensor | None = None
    quantized: bool = False
    saves_input: bool = False
    dropout: bool = False
    kernels: str = "cuda"
    #: LoRAQKVLinear: widths of the adapted q / k / v parts (``qkv_shapes``)
    qkv_shapes: tuple[int, ...] = ()
    #: LoRAQKVLinear: lora_B is applied per part (GQA) rather than as one grouped conv
    split_conv: bool = False

    def tensors(self) -> list[SimTensor]:
        return [t for t in (self.w, self.A, self.B) if t is not None]


@dataclass
class LitBlock:
    norm_1: SimTensor
    attn: LitLinear
    proj: LitLinear
    norm_2: SimTensor
    mlp: dict[str, LitLinear]

    @property
    def linears(self) -> dict[str, LitLinear]:
        """Its Linear layers by LitGPT module name, in module order."""
        out = {"attn.attn": self.attn, "attn.proj": self.proj}
        out.update((f"mlp.{name}", lin) for name, lin in self.mlp.items())
        return out

    def tensors(self) -> list[SimTensor]:
        out = [self.norm_1, *self.attn.tensors(), *self.proj.tensors(), self.norm_2]
        for lin in self.mlp.values():
            out += lin.tensors()
        return out


@dataclass
class LitGPT:
    """LitGPT's ``GPT``: ``lm_head`` is created first, then ``wte``, the blocks and
    ``ln_f`` (its parameter order); ``cos``/``sin`` are the RoPE buffers."""

    lm_head: LitLinear
    wte: SimTensor
    blocks: list[LitBlock]
    ln_f: SimTensor
    buffers: list[SimTensor] = field(default_factory=list)

    def parameters(self) -> list[SimTensor]:
        out = self.lm_head.tensors() + [self.wte]
        for block in self.blocks:
            out += block.tensors()
        return out + [self.ln_f]

    @property
    def layers(self) -> list[LitBlock]:
        return self.blocks

    def linears(self) -> list[LitLinear]:
        """Every Linear, ``lm_head`` included (what ``BitsandbytesPrecision``
        converts)."""
        return [lin for b in self.blocks for lin in b.linears.values()] + [self.lm_head]


def build_params(sim: Simulator, shape, dec):
    """LitGPT's parameters (and RoPE buffers) for ``step``: the base in the module's
    dtype (``bf16`` for ``bf16``-true, fp32 otherwise), the adapters in the same dtype
    unless ``lora_dtype`` says otherwise (LitGPT creates them inside the module), and
    only ``lora_`` parameters trainable (``mark_only_lora_as_trainable``)."""
    step, dtypes = dec.options, dec.dtypes
    full = step.method == "full"
    amp = dtypes.autocast is not None
    # under QLoRA BitsandbytesPrecision builds the module under its dtype context
    base_dtype = dtypes.base
    adapter_dtype = dtypes.adapters or base_dtype
    targets = set(step.lora_targets) if not full else set()
    r = step.lora_rank

    def make(shape_, trainable, dtype=base_dtype):
        category = (
            "master_weights" if (amp and trainable and dtype == "fp32") else "weights"
        )
        return param(sim, shape_, dtype, trainable, category)

    def adapter(shape_):
        category = "master_weights" if amp and adapter_dtype == "fp32" else "weights"
        return param(sim, shape_, adapter_dtype, True, category)

    def lora_linear(d_in, d_out, adapted):
        lin = LitLinear(make((d_out, d_in), full))
        if adapted:
            lin.A = adapter((r, d_in))
            lin.B = adapter((d_out, r))
        return lin

    h, d = shape.hidden, shape.head_dim
    q_dim, kv_dim = shape.heads * d, shape.kv_heads * d
    lm_head = lora_linear(h, shape.vocab, "lm_head" in targets)
    wte = make((shape.vocab, h), full)
    blocks = []
    for _ in range(shape.layers):
        norm_1 = make((h,), full)
        attn = LitLinear(make((q_dim + 2 * kv_dim, h), full))
        parts = tuple(
            width
            for name, width in zip(QKV, (q_dim, kv_dim, kv_dim))
            if name in targets
        )
        if parts:
            attn.A = adapter((r * len(parts), h))
            attn.B = adapter((sum(parts), r))
            attn.qkv_shapes = parts
            attn.split_conv = shape.heads != shape.kv_heads
        proj = lora_linear(q_dim, h, "o_proj" in targets)
        norm_2 = make((h,), full)
        lora_mlp = "gate_proj" in targets
        mlp = {
            "fc_1": lora_linear(h, shape.intermediate, lora_mlp),
            "fc_2": lora_linear(h, shape.intermediate, lora_mlp),
            "proj": lora_linear(shape.intermediate, h, lora_mlp),
        }
        blocks.append(LitBlock(norm_1, attn, proj, norm_2, mlp))
    ln_f = make((h,), full)
    # GPT.max_seq_length = min(longest, max_seq_length) rebuilds the RoPE cache after
    # setup: build_rope_cache returns fp32 cos and sin of (max_seq_length, rope_n_elem)
    # (fp16 before 6178c7cc: trainmem.versions.litgpt_rope_fp32)
    rope_dtype = "fp32" if litgpt_rope_fp32(dec.versions) else "fp16"
    buffers = [
        new(sim, (step.seq, d), rope_dtype, category="weights") for _ in ("cos", "sin")
    ]
    model = LitGPT(lm_head, wte, blocks, ln_f, buffers)
    return model


def trainable_params(model: LitGPT) -> list[SimTensor]:
    return [p for p in model.parameters() if p.requires_grad]


# --------------------------------------------------------------------------------------
# ops that only LitGPT's graph has
# --------------------------------------------------------------------------------------
def _cat(sim: Simulator, parts: list[SimTensor], shape) -> SimTensor:
    """``torch.cat``: a new tensor; backward hands each input a narrow view of the
    gradient."""
    dtype = parts[0].dtype
    out = new(sim, shape, dtype)
    shapes = [p.shape for p in parts]
    needs = [p.requires_grad for p in parts]

    def backward_fn(node, g):
        return [view(g, s) if n else None for s, n in zip(shapes, needs)]

    record(sim, out, list(parts), [], backward_fn)
    return out


def _expand_copy(sim: Simulator, x: SimTensor, shape) -> SimTensor:
    """``x.expand(...)`` then ``reshape``: a copy at the expanded size; backward sums
    the expanded gradient back to ``x``'s shape."""
    out = new(sim, shape, x.dtype)
    x_shape, dtype = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, x_shape, dtype)])
    return out


def _conv1d(sim: Simulator, x: SimTensor, w: SimTensor, out_shape) -> SimTensor:
    """``F.conv1d`` with a width-1 kernel: saves its input and weight; backward gives
    the input's and the weight's gradients."""
    out = new(sim, out_shape, x.dtype)
    x_shape, w_shape, dtype = x.shape, w.shape, x.dtype
    x_needs, w_needs = x.requires_grad, w.requires_grad
    saved = []
    if w_needs:
        saved.append(x)
    if x_needs:
        saved.append(w)

    def backward_fn(node, g):
        gw = new(sim, w_shape, w.dtype) if w_needs else None
        gx = new(sim, x_shape, dtype) if x_needs else None
        return [gx, gw]

    record(sim, out, [x, w], saved, backward_fn)
    return out


def _index_copy(sim: Simulator, zeros: SimTensor, src: SimTensor, index) -> SimTensor:
    """``zeros.index_copy(1, index, src)`` (out of place): a new tensor of ``zeros``'
    shape. ``IndexCopyBackward0`` saves the index *and* ``source``: torch's
    ``derivatives.yaml`` writes ``source``'s gradient as
    ``grad.index_select(dim, index).expand_as(source)``, and ``expand_as`` needs the
    tensor, not only its sizes (``grad_fn._saved_source`` in every torch 2.x)."""
    out = new(sim, zeros.shape, src.dtype)
    src_shape, dtype = src.shape, src.dtype
    saved = [index, src] if src.requires_grad else [index]
    record(sim, out, [src], saved, lambda node, g: [new(sim, src_shape, dtype)])
    return out


def _cross_entropy_none(sim: Simulator, logits: SimTensor, target: SimTensor):
    """``F.cross_entropy(logits, target, reduction="none")`` on 16-bit logits:
    ``log_softmax`` in the logits' dtype (it saves its output) and ``nll_loss`` with
    one loss per row (saves the target and ``total_weight``)."""
    logp = log_softmax(sim, logits)
    return nll_loss(sim, logp, target, reduction="none")


def _sum_all(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, (), x.dtype)
    shape, dtype = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dtype)])
    return out


# --------------------------------------------------------------------------------------
# the forward, op by op
# --------------------------------------------------------------------------------------
def _base(sim: Simulator, x: SimTensor, lin: LitLinear, keep=None) -> SimTensor:
    """``self.linear(x)``: a plain Linear, or the 4-bit one (bitsandbytes'
    ``MatMul4Bit``: ``F.dequantize_4bit`` to fp16 — the dtype Fabric quantised from —
    then ``.to(x.dtype)``, both transient; it keeps ``(A, B)`` for backward up to
    0.43.1).

    ``keep``: bitsandbytes 0.42.0 ``autograd/_functions.py`` ``MatMul4Bit.forward``
    stores the input as a plain attribute, ``ctx.tensors = (A, B)``, not through
    ``ctx.save_for_backward``: autograd's ``release_variables`` after backward frees
    saved variables only, so ``A`` lives as long as the node, i.e. as long as any
    output of the graph (the loop's ``logits``) is referenced. ``keep`` collects
    those inputs for the caller to hold with the logits."""
    if not lin.quantized:
        return linear(sim, x, lin.w)
    w_shape, dtype = lin.w.shape, x.dtype
    fp16 = new(sim, w_shape, "fp16")
    w = new(sim, w_shape, dtype) if dtype != "fp16" else fp16
    del fp16
    out = new(sim, x.shape[:-1] + (w_shape[0],), dtype)
    del w
    x_shape = x.shape

    def backward_fn(node, g):
        half = new(sim, w_shape, "fp16")
        w_ = new(sim, w_shape, dtype) if dtype != "fp16" else half
        del half
        grad_x = new(sim, x_shape, dtype)
        del w_
        return [grad_x]

    saved = [x] if lin.saves_input and x.requires_grad else []
    if saved and keep is not None:
        keep.append(x)
    record(sim, out, [x], saved, backward_fn)
    return out


def lora_forward(sim: Simulator, x: SimTensor, lin: LitLinear, keep=None):
    """``LoRALinear.forward``: ``pretrained + (lora_dropout(x) @ A.T @ B.T) *
    scaling``."""
    pretrained = _base(sim, x, lin, keep)
    if lin.A is None:
        return pretrained
    xd = dropout(sim, x, lin.kernels) if lin.dropout else x
    h = linear(sim, xd, lin.A)
    del xd
    h2 = linear(sim, h, lin.B)
    del h
    lora = mul_scalar(sim, h2)
    del h2
    return add(sim, pretrained, lora)


def qkv_forward(sim: Simulator, x: SimTensor, lin: LitLinear, keep=None):
    """``LoRAQKVLinear.forward`` at the fused width."""
    pretrained = _base(sim, x, lin, keep)
    if lin.A is None:
        return pretrained
    b, t, _ = x.shape
    width = lin.w.shape[0]
    xd = dropout(sim, x, lin.kernels) if lin.dropout else x
    after_a = linear(sim, xd, lin.A)  # (B, T, r·n)
    del xd
    a_t = view(after_a, (b, after_a.shape[-1], t))  # .transpose(-2, -1)
    del after_a
    n, c_out = len(lin.qkv_shapes), sum(lin.qkv_shapes)
    w = view(lin.B, lin.B.shape + (1,))  # lora_B.unsqueeze(-1)
    if not lin.split_conv:
        after_b = _conv1d(sim, a_t, w, (b, c_out, t))  # groups = n
    else:
        r = lin.A.shape[0] // n
        outs = [
            _conv1d(sim, view(a_t, (b, r, t)), view(w, (c, r, 1)), (b, c, t))
            for c in lin.qkv_shapes
        ]
        after_b = _cat(sim, outs, (b, c_out, t))
        del outs
    del a_t, w
    after_b = view(after_b, (b, t, c_out))  # .transpose(-2, -1)
    if c_out != width:
        # zero_pad: x.transpose(0, 1); new_zeros((T, B, width)); index_copy(1, ind,
        # x.reshape(-1, C')) — the transposed reshape copies, except at B = 1, where
        # (T, 1, C') of the conv1d output's transpose is viewable as (T, C')
        zeros = new(sim, (t * b, width), after_b.dtype)
        index = new(sim, (c_out,), "i64")  # torch.tensor(self.lora_ind)
        src = view(after_b, (t * b, c_out))
        if b > 1:
            src = clone_contig(sim, src)
        del after_b
        padded = _index_copy(sim, zeros, src, index)
        del zeros, src, index
        after_b = view(padded, (b, t, width))
        del padded
    lora = mul_scalar(sim, after_b)
    del after_b
    return add(sim, pretrained, lora)


def rmsnorm(sim: Simulator, x: SimTensor, w: SimTensor, fp32: bool = True):
    """LitGPT's ``RMSNorm``: ``x.float()``; ``mean(x * x)``; ``x * rsqrt(norm +
    eps)``; ``.to(dtype)``; ``* weight``. ``fp32=False``: lit_gpt/rmsnorm.py before
    6178c7cc (:func:`trainmem.versions.litgpt_rmsnorm_fp32`), the same ops in ``x``'s
    dtype and ``self.weight * x_normed``."""
    dtype = x.dtype
    if not fp32:
        sq = mul(sim, x, x)
        norm_x = mean_last(sim, sq)
        del sq
        eps = new(sim, norm_x.shape, dtype)  # norm_x + self.eps
        record(sim, eps, [norm_x], [], lambda node, g: [g])
        del norm_x
        r = rsqrt(sim, eps)
        del eps
        x_normed = mul(sim, x, r)
        del r
        return mul(sim, w, x_normed)
    xf = cast(sim, x, "fp32")
    sq = mul(sim, xf, xf)
    norm_x = mean_last(sim, sq)
    del sq
    eps = new(sim, norm_x.shape, "fp32")  # norm_x + self.eps
    record(sim, eps, [norm_x], [], lambda node, g: [g])
    del norm_x
    r = rsqrt(sim, eps)
    del eps
    x_normed = mul(sim, xf, r)
    del xf, r
    x_normed = cast(sim, x_normed, dtype)
    return mul(sim, x_normed, w)


def apply_rope(sim: Simulator, x: SimTensor, cos: SimTensor, sin: SimTensor):
    """``apply_rope``: ``(x * cos) + (rotated * sin)`` with fp32 ``cos``/``sin``
    (fp32 products), ``rotated = cat((-x2, x1))`` alive until it returns, then
    ``roped.to(x.dtype)``."""
    half = x.shape[:-1] + (x.shape[-1] // 2,)
    x1 = view(x, half)
    x2 = view(x, half)
    rotated = _cat(sim, [neg(sim, x2), x1], x.shape)
    a = mul(sim, x, cos)
    b_ = mul(sim, rotated, sin)
    roped = add(sim, a, b_)
    del a, b_
    out = cast(sim, roped, x.dtype)
    del roped, rotated
    return out


def attention(sim, x, block: LitBlock, cos, sin, cfg) -> SimTensor:
    b, t, _ = x.shape
    heads, groups, d = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    q_per_kv = heads // groups
    keep = cfg.get("bnb_ctx")
    qkv = qkv_forward(sim, x, block.attn, keep)  # (B, T, (q_per_kv + 2)·groups·hs)
    qkv5 = view(qkv, (b, groups, q_per_kv + 2, t, d))  # view + permute
    q = view(qkv5, (b, groups, q_per_kv, t, d))
    k = view(qkv5, (b, groups, 1, t, d))
    v = view(qkv5, (b, groups, 1, t, d))
    if 1 < groups < heads:
        # k.expand(B, groups, q_per_kv, T, hs).reshape(B, -1, T, hs): copies (with
        # one group, multi-query attention, the size-1 group dim merges and q, the
        # expanded k and v stay views: the branch below)
        q = clone_contig(sim, view(q, (b, heads, t, d)))
        k = _expand_copy(sim, k, (b, heads, t, d))
        v = _expand_copy(sim, v, (b, heads, t, d))
    else:
        # one query per group, or one group: reshape(B, -1, T, hs) is a view of the
        # fused output
        q = view(q, (b, heads, t, d))
        k = view(k, (b, heads, t, d))
        v = view(v, (b, heads, t, d))
    q_roped = apply_rope(sim, view(q, q.shape), cos, sin)  # q[..., :rope_n_elem]
    k_roped = apply_rope(sim, view(k, k.shape), cos, sin)
    q = _cat(sim, [q_roped], q.shape)  # cat((q_roped, q[..., rope_n_elem:]))
    k = _cat(sim, [k_roped], k.shape)
    y = sdpa(sim, q, k, v)  # (B, T, heads, hs) after .transpose(1, 2)
    del q, k, v
    y = view(y, (b, t, heads * d))  # reshape: a view of the transposed output
    out = lora_forward(sim, y, block.proj, keep)
    del y, qkv, qkv5, q_roped, k_roped  # CausalSelfAttention.forward's locals
    return out


def mlp(sim, x, block: LitBlock, keep=None) -> SimTensor:
    """``LLaMAMLP``: ``fc_1(x)``, ``fc_2(x)``, ``silu(x_fc_1) * x_fc_2``, ``proj``."""
    x_fc_1 = lora_forward(sim, x, block.mlp["fc_1"], keep)
    x_fc_2 = lora_forward(sim, x, block.mlp["fc_2"])  # the same input as fc_1
    a = silu(sim, x_fc_1)
    h = mul(sim, a, x_fc_2)
    del a, x_fc_1, x_fc_2
    return lora_forward(sim, h, block.mlp["proj"], keep)


def block_forward(sim, x, cos, sin, block: LitBlock, cfg) -> SimTensor:
    """``Block.forward`` (non-parallel residual): ``x = attn(norm_1(x)) + x``; ``x =
    mlp(norm_2(x)) + x``."""
    fp32 = cfg.get("rmsnorm_fp32", True)
    x_normed = rmsnorm(sim, x, block.norm_1, fp32)
    attention_output = attention(sim, x_normed, block, cos, sin, cfg)
    del x_normed
    x = add(sim, attention_output, x)
    del attention_output
    m = mlp(sim, rmsnorm(sim, x, block.norm_2, fp32), block, cfg.get("bnb_ctx"))
    return add(sim, m, x)


def forward_loss(sim, model: LitGPT, ids, targets, cfg, held: list) -> SimTensor:
    """``logits = model(input_ids, lm_head_chunk_size=128)``; ``logits[-1] =
    logits[-1][..., :-1, :]``; ``loss = chunked_cross_entropy(logits, targets[...,
    1:])``. ``held`` is the loop's ``logits`` variable: the previous micro-batch's list
    is released only when this one is assigned to it."""
    b, s = ids.shape
    # this micro-batch's bnb ``ctx.tensors`` (see :func:`_base`)
    cfg["bnb_ctx"] = [] if cfg.get("grad", True) else None
    cos_full, sin_full = model.buffers
    cos = view(cos_full, (s, cos_full.shape[1]))  # self.cos[:T]
    sin = view(sin_full, (s, sin_full.shape[1]))
    x = embedding(sim, ids, model.wte)
    for block in model.blocks:
        if cfg["checkpointing"] and sim.grad_enabled:
            # FSDPStrategy(activation_checkpointing_policy={Block}) (multi-GPU
            # finetune): Block wrapped non-reentrant
            x = checkpoint(
                sim,
                lambda x_, c_, s_, block=block: block_forward(
                    sim, x_, c_, s_, block, cfg
                ),
                x,
                cos,
                sin,
                reentrant=cfg.get("reentrant", False),
            )
        else:
            x = block_forward(sim, x, cos, sin, block, cfg)
    x = rmsnorm(sim, x, model.ln_f, cfg.get("rmsnorm_fp32", True))
    vocab = model.lm_head.w.shape[0]
    ctx = cfg.pop("bnb_ctx")
    if not cfg.get("chunked_head", True):
        return _full_loss(sim, model, x, targets, held, cfg, ctx)
    chunks = [
        view(x, (b, min(LM_HEAD_CHUNK, s - i), x.shape[-1]))
        for i in range(0, s, LM_HEAD_CHUNK)
    ]
    logits = [lora_forward(sim, c, model.lm_head, ctx) for c in chunks]
    del chunks, x
    logits = fabric_output(sim, logits)
    # the loop rebinds ``logits``: the previous list goes now, and with it the
    # previous graph and the inputs its 4-bit Linears kept in ``ctx.tensors`` —
    # unless the loop's ``loss`` still holds that graph (:func:`_hold_graph`)
    _rebind_logits(held, logits, ctx, cfg)
    last = logits[-1]
    logits[-1] = narrow(sim, last, (b, last.shape[1] - 1, vocab))
    del last
    # chunked_cross_entropy(logits, targets[..., 1:])
    n_targets = s - 1
    logit_rows, target_rows = [], []
    for i, chunk in enumerate(logits):
        rows = b * chunk.shape[1]
        if i == len(logits) - 1 and b > 1:
            # the sliced chunk is not viewable as (rows, vocab): reshape copies
            logit_rows.append(clone_contig(sim, view(chunk, (rows, vocab))))
        else:
            logit_rows.append(view(chunk, (rows, vocab)))
        width = min(LM_HEAD_CHUNK, n_targets - LM_HEAD_CHUNK * i)
        # targets[..., 1:].split(128, dim=1)[i].reshape(-1): a copy unless b == 1
        target_rows.append(
            new(sim, (b * width,), "i64") if b > 1 else view(targets, (width,))
        )
    losses = [
        _cross_entropy_none(sim, lr, tr) for lr, tr in zip(logit_rows, target_rows)
    ]
    del logit_rows, target_rows, logits
    mask = new(sim, (b, n_targets), "u8")  # targets != ignore_index
    non_masked = new(sim, (), "i64")  # .sum()
    del mask
    keep = new(sim, (), "u8")  # max(1, non_masked_elems): 1 > non_masked
    del keep
    total = sum(t.shape[0] for t in losses)
    cat = _cat(sim, losses, (total,))
    del losses
    summed = _sum_all(sim, cat)
    del cat
    loss = mul_scalar(sim, summed)  # / non_masked_elems: a new 0-d tensor
    del summed, non_masked
    _rebind_loss(ctx, cfg)
    return loss


#: what Fabric's wrapped module returns its floating outputs as:
#: ``torch.get_default_dtype()``, fp32 outside ``forward_context``
FABRIC_OUTPUT_DTYPE = "fp32"


def fabric_output(sim: Simulator, outputs: list) -> list:
    """``_FabricModule.forward`` (lightning ``fabric/wrappers.py``, 2.1 to 2.3):
    ``output = self._precision.convert_output(output)`` after the module's forward
    and outside ``forward_context``. ``HalfPrecision`` (``bf16-true``/``16-true``,
    ``fabric/plugins/precision/half.py``), ``BitsandbytesPrecision``
    (``bitsandbytes.py``) and ``MixedPrecision`` (``amp.py``) all define it as
    ``apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor,
    dst_type=torch.get_default_dtype())``: every floating tensor of the returned list
    — each ``lm_head`` chunk — is copied to fp32 (``tensor.to(dst_type)``, a
    ``ToCopyBackward`` saving nothing) while the module's list is still referenced;
    the 16-bit chunks go when ``apply_to_collection`` returns the new list. The loss
    that follows (``log_softmax``, its saved output) is then in fp32."""
    converted = [cast(sim, t, FABRIC_OUTPUT_DTYPE) for t in outputs]
    del outputs[:]
    return converted


def _rebind_logits(held: list, logits: list, ctx, cfg) -> None:
    """``logits = model(...)``: the previous micro-batch's chunk list is released;
    its graph's ``ctx.tensors`` (``cfg["held_graph"]``) go with it unless the loop's
    ``loss`` holds that graph (``cfg["loss_holds_graph"]``)."""
    held.clear()
    held.extend(logits)
    if not cfg.get("loss_holds_graph"):
        cfg.setdefault("held_graph", [])[:] = ctx or ()


def _rebind_loss(ctx, cfg) -> None:
    """``loss = chunked_cross_entropy(...)`` (lit_gpt before bbf982aa,
    :func:`trainmem.versions.litgpt_loss_holds_graph`): the previous ``loss`` and the
    graph it reaches are released only now, after this micro-batch's cross-entropy."""
    if cfg.get("loss_holds_graph"):
        cfg.setdefault("held_graph", [])[:] = ctx or ()


def _full_loss(sim, model: LitGPT, x, targets, held: list, cfg, ctx=None):
    """finetune/full.py: ``logits = model(input_ids)`` (one ``lm_head`` over every
    token) and ``chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:])``: the
    sliced logits reshaped to rows (a copy when the batch is > 1), split into chunks
    of 128 *rows*, a cross-entropy per chunk in the logits' dtype."""
    b, s, _ = x.shape
    logits = fabric_output(sim, [lora_forward(sim, x, model.lm_head, ctx)])[0]
    del x
    _rebind_logits(held, [logits], ctx, cfg)
    vocab = logits.shape[-1]
    rows = b * (s - 1)
    sliced = narrow(sim, logits, (b, s - 1, vocab))
    flat = (
        clone_contig(sim, view(sliced, (rows, vocab)))
        if b > 1
        else view(sliced, (rows, vocab))
    )
    del sliced
    flat_targets = new(sim, (rows,), "i64") if b > 1 else view(targets, (rows,))
    pieces = _split_rows(sim, flat, LM_HEAD_CHUNK)
    losses = [
        _cross_entropy_none(sim, p, view(flat_targets, (p.shape[0],))) for p in pieces
    ]
    del pieces, flat
    mask = new(sim, (rows,), "u8")  # targets != ignore_index
    non_masked = new(sim, (), "i64")
    del mask
    keep = new(sim, (), "u8")
    del keep, flat_targets
    cat = _cat(sim, losses, (rows,))
    del losses
    summed = _sum_all(sim, cat)
    del cat
    loss = mul_scalar(sim, summed)
    del summed, non_masked
    _rebind_loss(ctx, cfg)
    return loss


def _split_rows(sim: Simulator, x: SimTensor, size: int) -> list[SimTensor]:
    """``x.split(size)``: views; autograd's ``SplitBackward`` waits for every piece's
    gradient and concatenates them into one tensor of ``x``'s shape."""
    rows, width = x.shape
    node_out = SimTensor(x.buffer, x.shape, x.dtype)
    shape, dtype = x.shape, x.dtype
    record(sim, node_out, [x], [], lambda node, g: [new(sim, shape, dtype)])
    pieces = []
    for i in range(0, rows, size):
        n = min(size, rows - i)
        pieces.append(view(node_out, (n, width)))
    return pieces


# --------------------------------------------------------------------------------------
# what the run does besides the step (LitGPT never resets the peak counter: finetune/
# lora.py@5895df10 prints torch.cuda.max_memory_allocated() after fit())
# --------------------------------------------------------------------------------------
def retained_inputs(sim: Simulator, model: LitGPT, batch: int, seq: int) -> list:
    """The previous micro-batch's 4-bit Linear inputs that bitsandbytes' ``ctx.tensors``
    still holds (:func:`_base`): the input of every quantized Linear that required
    grad in that forward — a Linear's input requires grad once any adapter ran
    upstream of it (the embedding and the norms are frozen); ``fc_1`` and ``fc_2``
    share one input, the ``lm_head`` chunks are views of ``ln_f``'s output."""
    dtype = model.wte.dtype
    grad = model.wte.requires_grad
    out = []

    def visit(lin: LitLinear, adapted: bool) -> bool:
        if grad and lin.quantized and lin.saves_input:
            out.append(new(sim, (batch, seq, lin.w.shape[1]), dtype, "activations"))
        return grad or adapted

    for block in model.blocks:
        grad = visit(block.attn, block.attn.A is not None)
        grad = visit(block.proj, block.proj.A is not None)
        fc_1, fc_2 = block.mlp["fc_1"], block.mlp["fc_2"]
        grad = visit(fc_1, fc_1.A is not None or fc_2.A is not None)
        grad = visit(block.mlp["proj"], block.mlp["proj"].A is not None)
    visit(model.lm_head, False)
    return out


def validation_loss(sim: Simulator, model: LitGPT, ids, targets, cfg) -> None:
    """finetune/lora.py@5895df10 ``validate`` (``@torch.no_grad()``, after
    ``optimizer.step()``/``zero_grad()``, the loop's ``logits`` still referenced):
    ``logits = model(input_ids)`` — one unchunked ``lm_head`` —, then
    ``chunked_cross_entropy(logits[..., :-1, :], targets[..., 1:], chunk_size=0)``:
    ``reshape(-1, vocab)`` of the slice (a copy when the batch is > 1) and one
    ``F.cross_entropy`` in the logits' dtype (``log_softmax`` output, ``nll_loss``);
    the loss goes to a CPU tensor (``losses[k] = ...``)."""
    grad, sim.grad_enabled = sim.grad_enabled, False
    b, s = ids.shape
    cos_full, sin_full = model.buffers
    cos = view(cos_full, (s, cos_full.shape[1]))
    sin = view(sin_full, (s, sin_full.shape[1]))
    x = embedding(sim, ids, model.wte)
    for block in model.blocks:
        x = block_forward(sim, x, cos, sin, block, cfg)
    x = rmsnorm(sim, x, model.ln_f, cfg.get("rmsnorm_fp32", True))
    logits = fabric_output(sim, [lora_forward(sim, x, model.lm_head)])[0]
    del x
    vocab = logits.shape[-1]
    rows = b * (s - 1)
    sliced = view(logits, (b, s - 1, vocab))
    flat = clone_contig(sim, view(sliced, (rows, vocab))) if b > 1 else sliced
    flat_targets = new(sim, (rows,), "i64") if b > 1 else None
    logp = log_softmax(sim, flat)
    loss = new(sim, (), logits.dtype)
    total_weight = new(sim, (), logits.dtype)
    del logp, loss, total_weight, flat, flat_targets, sliced, logits
    sim.grad_enabled = grad


def generation_cache(sim: Simulator, model: LitGPT, seq: int, cfg) -> list:
    """finetune/lora.py@5895df10 ``generate_example``: ``model.set_kv_cache(
    batch_size=1)`` under ``fabric.init_tensor()`` (the module's dtype) at
    ``max_seq_length`` = the training sequence (``min(longest, max_seq_length)``,
    set in ``fit``); model.py ``build_kv_cache``: k and v of ``(1, n_head,
    max_seq_length, head_size)`` per block (``n_head``, not the query groups), and
    ``build_mask_cache``: a ``(1, 1, T, T)`` bool mask. The prompt's forwards are a
    few dozen tokens and are not replayed."""
    dtype = model.wte.dtype
    kv = (1, cfg["heads"], seq, cfg["head_dim"])
    out = [new(sim, kv, dtype, "activations") for _ in model.blocks for _ in "kv"]
    out.append(new(sim, (1, 1, seq, seq), "u8", "activations"))  # torch.bool: 1 B
    return out
