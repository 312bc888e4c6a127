"""The ops of the Llama forward pass, each with PyTorch's autograd rule for what it
saves and what its backward allocates (``derivatives.yaml``), and ``torch.autocast``'s
casts."""

from __future__ import annotations

from .accounting import SimTensor, Simulator, new, shrink, view
from .autograd import record


def _promote(a: str, b: str) -> str:
    if a == b:
        return a
    if "fp32" in (a, b) or {a, b} == {"fp16", "bf16"}:
        return "fp32"  # torch.promote_types(bfloat16, float16) is float32
    return a


def _bcast(a, b):
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    return tuple(max(x, y) for x, y in zip(a, b))


def cast(sim: Simulator, x: SimTensor, dtype: str, cached_param=None) -> SimTensor:
    """``x.to(dtype)`` (a no-op returning ``x`` when the dtype already matches)."""
    if x.dtype == dtype:
        return x
    category = "weights" if cached_param is not None else None
    out = new(sim, x.shape, dtype, category=category, layout=x.layout)
    sharded = sim.sharded
    if cached_param is not None and sharded and sharded.param_cast_scale != 1.0:
        # ZeRO-3: only the local shard is cast
        shrink(sim, out.buffer, sharded.param_cast_scale)
    if cached_param is not None and x.requires_grad and x.grad_fn is None:
        # autocast caches the cast of a leaf that requires grad until the autocast
        # region exits, whether or not autograd saves it (e.g. LoRA's A when its input
        # needs no grad, or every weight during a checkpointed forward)
        sim.autocast_cache.append(out)
    source_dtype, shape = x.dtype, x.shape

    def backward_fn(node, g):
        return [new(sim, shape, source_dtype, layout=g.layout)]

    record(sim, out, [x], [], backward_fn)
    return out


def _autocast_input(sim: Simulator, x: SimTensor, param: bool = False) -> SimTensor:
    """The cast autocast applies to an input of a lower-precision op."""
    if sim.autocast is None or x.dtype not in ("fp32",):
        return x
    return cast(sim, x, sim.autocast, cached_param=True if param else None)


def linear(
    sim: Simulator,
    x: SimTensor,
    w: SimTensor,
    b: SimTensor | None = None,
    quant: bool = False,
    quant_compute: str | None = None,
    quant_saves_input: bool = False,
    quant_output_cast: bool = False,
) -> SimTensor:
    """``F.linear`` (``x @ w.T + b``): saves x if w needs grad, w if x needs grad.

    ``quant``: a bitsandbytes 4-bit weight, dequantized to the compute dtype for the
    matmul (a transient copy) and again in backward; ``quant_output_cast``: the
    output is cast back to the input's dtype (``Linear4bit.forward``'s
    ``.to(inp_dtype)``, under autocast too: :mod:`trainmem.kbit`)."""
    if quant:
        # bnb Linear4bit: x.to(compute_dtype) when bnb_4bit_compute_dtype is set
        # (``quant_compute``), the output cast back to the input's dtype
        compute_dtype = quant_compute or sim.autocast or x.dtype
        in_dtype = x.dtype
        x_cast = cast(sim, x, compute_dtype) if x.dtype != compute_dtype else x
        w_dequant = new(sim, w.shape, compute_dtype)  # dequantized weight (temporary)
        out = new(sim, x.shape[:-1] + (w.shape[0],), compute_dtype)
        del w_dequant
        x_shape, x_dtype = x_cast.shape, x_cast.dtype
        w_shape = w.shape

        def backward_fn(node, g):
            w_dequant = new(sim, w_shape, x_dtype)
            grad_x = new(sim, x_shape, x_dtype)
            del w_dequant
            return [grad_x]

        # MatMul4Bit kept ctx.tensors = (A, B) up to bitsandbytes 0.43.1
        saved = [x_cast] if quant_saves_input and x_cast.requires_grad else []
        record(sim, out, [x_cast], saved, backward_fn)
        del x_cast
        if quant_output_cast and in_dtype != compute_dtype:
            out = cast(sim, out, in_dtype)
        return out
    x_cast = _autocast_input(sim, x)
    w_cast = _autocast_input(sim, w, param=True)
    b_cast = _autocast_input(sim, b, param=True) if b is not None else None
    d_out, d_in = w.shape
    out = new(sim, x.shape[:-1] + (d_out,), x_cast.dtype)
    saved = []
    if w.requires_grad:
        saved.append(x_cast)
    if x.requires_grad:
        saved.append(w_cast)
    x_shape, x_dtype, w_dtype, x_needs_grad, w_needs_grad, b_needs_grad = (
        x_cast.shape,
        x_cast.dtype,
        w_cast.dtype,
        x_cast.requires_grad,
        w_cast.requires_grad,
        b_cast is not None and b_cast.requires_grad,
    )

    def backward_fn(node, g):
        grad_w = new(sim, (d_out, d_in), w_dtype) if w_needs_grad else None
        grad_x = new(sim, x_shape, x_dtype) if x_needs_grad else None
        grad_b = new(sim, (d_out,), w_dtype) if b_needs_grad else None
        return [grad_x, grad_w, grad_b]

    record(sim, out, [x_cast, w_cast, b_cast], saved, backward_fn)
    return out


def add(sim: Simulator, a: SimTensor, b: SimTensor) -> SimTensor:
    dtype = _promote(a.dtype, b.dtype)
    shape = _bcast(a.shape, b.shape)
    out = new(sim, shape, dtype, layout=a.layout if a.shape == shape else b.layout)
    a_shape, a_dtype, b_shape, b_dtype = a.shape, a.dtype, b.shape, b.dtype

    def backward_fn(node, g):
        def reduce_to(sh, d):
            if sh != shape:
                return new(sim, sh, d)
            if d != g.dtype:
                return new(sim, sh, d)
            return g

        return [
            reduce_to(a_shape, a_dtype) if a_needs_grad else None,
            reduce_to(b_shape, b_dtype) if b_needs_grad else None,
        ]

    a_needs_grad, b_needs_grad = a.requires_grad, b.requires_grad
    record(sim, out, [a, b], [], backward_fn)
    return out


def add_scalar(sim: Simulator, a: SimTensor) -> SimTensor:
    out = new(sim, a.shape, a.dtype, layout=a.layout)
    record(sim, out, [a], [], lambda node, g: [g])
    return out


def mul(sim: Simulator, a: SimTensor, b: SimTensor) -> SimTensor:
    """``a * b``: saves b if a needs grad, a if b needs grad; broadcast grads are
    summed."""
    dtype = _promote(a.dtype, b.dtype)
    shape = _bcast(a.shape, b.shape)
    out = new(sim, shape, dtype, layout=a.layout if a.shape == shape else b.layout)
    saved = []
    if a.requires_grad:
        saved.append(b)
    if b.requires_grad:
        saved.append(a)
    a_shape, a_dtype, b_shape, b_dtype, a_needs_grad, b_needs_grad = (
        a.shape,
        a.dtype,
        b.shape,
        b.dtype,
        a.requires_grad,
        b.requires_grad,
    )

    def backward_fn(node, g):
        res = []
        for sh, d, needs_grad in (
            (a_shape, a_dtype, a_needs_grad),
            (b_shape, b_dtype, b_needs_grad),
        ):
            if not needs_grad:
                res.append(None)
                continue
            full = new(sim, shape, _promote(g.dtype, d))
            if sh != shape:
                r = new(sim, sh, full.dtype)
                del full
                full = r
            if full.dtype != d:
                full = new(sim, sh, d)
            res.append(full)
        return res

    record(sim, out, [a, b], saved, backward_fn)
    return out


def mul_scalar(sim: Simulator, a: SimTensor) -> SimTensor:
    out = new(sim, a.shape, a.dtype, layout=a.layout)
    shape, dtype = a.shape, a.dtype
    record(sim, out, [a], [], lambda node, g: [new(sim, shape, dtype)])
    return out


def pow2(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype, layout=x.layout)
    shape, dtype = x.shape, x.dtype

    def backward_fn(node, g):  # grad * 2 * x**1 : pow, mul.Scalar, mul.Tensor
        t1 = new(sim, shape, dtype)
        t2 = new(sim, shape, dtype)
        r = new(sim, shape, dtype)
        del t1, t2
        return [r]

    record(sim, out, [x], [x], backward_fn)
    return out


def mean_last(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape[:-1] + (1,), x.dtype)
    shape, dtype = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dtype)])
    return out


def rsqrt(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype)
    shape, dtype = x.shape, x.dtype

    def backward_fn(node, g):  # -0.5 * grad * out**3 : pow, mul.Scalar, mul.Tensor
        t1 = new(sim, shape, dtype)
        t2 = new(sim, shape, dtype)
        r = new(sim, shape, dtype)
        del t1, t2
        return [r]

    record(sim, out, [x], [], backward_fn, save_out=True)
    return out


def silu(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype)
    shape, dtype = x.shape, x.dtype
    record(sim, out, [x], [x], lambda node, g: [new(sim, shape, dtype)])
    return out


def neg(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype, layout=x.layout)
    shape, dtype = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dtype)])
    return out


def rotate_half(sim: Simulator, x: SimTensor) -> SimTensor:
    """``cat((-x2, x1), -1)`` with x1, x2 the two halves (slices are views)."""
    half = x.shape[:-1] + (x.shape[-1] // 2,)
    x1 = view(x, half, x.layout)
    x2 = view(x, half, x.layout)
    neg_x2 = neg(sim, x2)
    out = new(sim, x.shape, x.dtype)
    neg_needs_grad, x1_needs_grad = neg_x2.requires_grad, x1.requires_grad

    def backward_fn(node, g):  # cat backward: narrow views of g
        return [
            view(g, half) if neg_needs_grad else None,
            view(g, half) if x1_needs_grad else None,
        ]

    record(sim, out, [neg_x2, x1], [], backward_fn)
    return out


def clone(sim: Simulator, x: SimTensor) -> SimTensor:
    """``x.clone()``: a copy in the same layout; saves nothing."""
    out = new(sim, x.shape, x.dtype, layout=x.layout)
    record(sim, out, [x], [], lambda node, g: [g])
    return out


def clone_contig(sim: Simulator, x: SimTensor) -> SimTensor:
    """``.contiguous()`` / the copy a reshape of a non-contiguous tensor makes."""
    out = new(sim, x.shape, x.dtype, layout="bhsd")
    record(sim, out, [x], [], lambda node, g: [g])
    return out


def _batch_dims_merge(x: SimTensor) -> bool:
    """Whether ``matmul`` can view the 4-D operand ``x`` as ``(b * heads, m, n)`` (no
    copy).

    Layouts (``x.layout``): ``"bhsd"`` contiguous and ``"t"`` (its last two dims
    transposed) always merge; ``"bshd"`` (heads interleaved in the projection's rows)
    only when the batch or the head count is 1; ``"x"`` (a single key/value head
    expanded over the query heads, stride 0) only when the batch is 1."""
    b, heads = x.shape[0], x.shape[1]
    if x.layout in ("bhsd", "t"):
        return True
    if x.layout == "x":
        return b == 1
    return b == 1 or heads == 1


def repeat_kv(
    sim: Simulator, x: SimTensor, heads: int, always_copy: bool = False
) -> SimTensor:
    """transformers' ``repeat_kv``: ``x[:, :, None].expand(b, kv, n_rep, s,
    d).reshape(b, heads, s, d)``. With one key/value head the reshape is a view (stride
    0 over the heads, layout ``"x"``); otherwise it copies. ``always_copy``: SDPA's
    math path (``repeat_interleave``: ``unsqueeze``, ``expand``, ``clone``), which
    copies for one head too. Backward sums the expanded gradient back to
    ``(b, kv, s, d)``."""
    b, kv, s, d = x.shape
    if kv == heads:
        return x
    if kv == 1 and not always_copy:
        out = SimTensor(x.buffer, (b, heads, s, d), x.dtype, layout="x")
    else:
        out = new(sim, (b, heads, s, d), x.dtype, layout="bhsd")
    shape, dtype = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dtype)])
    return out


def bmm(sim: Simulator, a: SimTensor, b: SimTensor, out_shape) -> SimTensor:
    """A 4-D ``matmul`` (through ``bmm``): copies an operand whose batch and head dims
    cannot be merged by a view first (see :func:`_batch_dims_merge`); saves both."""
    a = _autocast_input(sim, a)
    b = _autocast_input(sim, b)
    if not _batch_dims_merge(a):
        a = clone_contig(sim, a)
    if not _batch_dims_merge(b):
        b = clone_contig(sim, b)
    out = new(sim, out_shape, a.dtype, layout="bhsd")
    saved = []
    if a.requires_grad:
        saved.append(b)
    if b.requires_grad:
        saved.append(a)
    a_shape, b_shape, dtype, a_needs_grad, b_needs_grad = (
        a.shape,
        b.shape,
        a.dtype,
        a.requires_grad,
        b.requires_grad,
    )

    def backward_fn(node, g):
        grad_b = new(sim, b_shape, dtype, layout="bhsd") if b_needs_grad else None
        grad_a = new(sim, a_shape, dtype, layout="bhsd") if a_needs_grad else None
        return [grad_a, grad_b]

    record(sim, out, [a, b], saved, backward_fn)
    return out


def softmax_fp32(sim: Simulator, x: SimTensor) -> SimTensor:
    """``softmax(x, dim=-1, dtype=float32)``: ATen converts a 16-bit input first
    (``x.to(float32)``, its own autograd node and a transient copy), then ``_softmax``
    saves its output.  Two nodes, so in backward the fp32 gradient of the scores is
    converted to 16 bit only after ``_softmax``'s saved output and incoming gradient are
    released."""
    x = cast(sim, x, "fp32")
    out = new(sim, x.shape, "fp32", layout="bhsd")
    shape = x.shape
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, "fp32")], save_out=True)
    return out


def _additive_mask(sim: Simulator, mask: SimTensor, dtype: str) -> SimTensor:
    """SDPA's ``convert_boolean_attn_mask``: ``where(mask, 0.0, scalar_tensor(-inf))``
    in the query's dtype, a new ``(b, 1, s, s)`` tensor per call."""
    zero, neg_inf = new(sim, (), dtype), new(sim, (), dtype)
    out = new(sim, mask.shape, dtype)
    del zero, neg_inf
    return out


def sdpa(
    sim: Simulator,
    q: SimTensor,
    k: SimTensor,
    v: SimTensor,
    lse_align: int = 1,
    mask: SimTensor | None = None,
    mask_align: int = 1,
) -> SimTensor:
    """``scaled_dot_product_attention`` on a fused kernel (flash, cuDNN,
    memory-efficient; :mod:`trainmem.sdpa`): saves q, k, v, out and the fp32
    logsumexp, whose query dim the memory-efficient kernel pads to ``lse_align``.
    ``mask``: a bool attention mask, converted to an additive one in the query's dtype
    and saved too; the memory-efficient kernel gets it with rows padded to
    ``mask_align`` elements (``preprocess_mask``: a padded copy when unaligned)."""
    q, k, v = _autocast_input(sim, q), _autocast_input(sim, k), _autocast_input(sim, v)
    b, a, s, d = q.shape
    saved_mask = []
    if mask is not None:
        bias = _additive_mask(sim, mask, q.dtype)
        cols = bias.shape[-1]
        if mask_align > 1 and cols % mask_align:
            padded = new(
                sim, bias.shape[:-1] + (cols - cols % mask_align + mask_align,), q.dtype
            )
            del bias
            bias = padded
        saved_mask = [bias]
        del bias
    out = new(sim, (b, a, s, d), q.dtype, layout="bshd")
    lse = new(sim, (b, a, -(-s // lse_align) * lse_align), "fp32")
    q_shape, k_shape, v_shape, dtype = q.shape, k.shape, v.shape, q.dtype
    q_needs_grad, k_needs_grad, v_needs_grad = (
        q.requires_grad,
        k.requires_grad,
        v.requires_grad,
    )

    def backward_fn(node, g):
        grad_q = new(sim, q_shape, dtype, layout="bshd")
        grad_k = new(sim, k_shape, dtype, layout="bshd")
        grad_v = new(sim, v_shape, dtype, layout="bshd")
        return [
            grad_q if q_needs_grad else None,
            grad_k if k_needs_grad else None,
            grad_v if v_needs_grad else None,
        ]

    record(sim, out, [q, k, v], [q, k, v, lse, *saved_mask], backward_fn, save_out=True)
    return out


def _bmm_result(sim: Simulator, o: SimTensor) -> SimTensor:
    """``matmul``'s 4-D result: the ``(b * heads, m, n)`` bmm output viewed back
    (``_unsafe_view``). Its backward reshapes the incoming gradient to three dims,
    which copies a gradient whose batch and head dims do not merge."""
    out = view(o, o.shape, o.layout)
    shape = o.shape

    def backward_fn(node, g):
        if _batch_dims_merge(g):
            return [g]
        return [new(sim, shape, g.dtype, layout="bhsd")]

    record(sim, out, [o], [], backward_fn)
    return out


def sdpa_math(
    sim: Simulator,
    q: SimTensor,
    k: SimTensor,
    v: SimTensor,
    mask: SimTensor | None = None,
) -> SimTensor:
    """``scaled_dot_product_attention`` on its math path (aten's composite
    ``_scaled_dot_product_attention_math``, causal, torch 2.5+), what runs where no
    fused kernel takes the dtype (bf16 below sm_80) or under
    ``sdpa_kernel(SDPBackend.MATH)``. Measured op by op on CPU (the composite is the
    same on every device):

    * 16-bit q, k, v are copied to fp32 (``allow_fp16_bf16_reduction_math_sdp`` is
      off by default) and q is scaled by sqrt(scale); these are C++ locals, alive
      until the op returns;
    * the causal mask: an ``(s, s)`` bool (``ones().tril()``) turned into an fp32
      additive mask (``where`` of two scalars), alive until the op returns;
    * GQA repeats k and v (``unsqueeze``/``expand``/``clone``), also locals;
    * ``k^T`` scaled by sqrt(scale) is a temporary of the first ``matmul``, which
      copies an operand whose batch and head dims do not merge (q and k in the
      projections' interleaved layout) and saves what it multiplies;
    * the fp32 scores, the masked scores and their softmax (saved) each replace the
      previous one; the probabilities are also returned cast to the input dtype (the
      second output, dropped by the caller when the op returns);
    * the second ``matmul`` (it copies v when needed) and its result cast back.

    Autocast does not reach inside: the op is cast once at its entry. ``mask``: a bool
    attention mask instead of ``is_causal``, converted to an additive one in the input
    dtype before the composite runs (which then builds no causal mask of its own)."""
    q, k, v = _autocast_input(sim, q), _autocast_input(sim, k), _autocast_input(sim, v)
    outer, sim.autocast = sim.autocast, None
    try:
        b, a, s, d = q.shape
        in_dtype = q.dtype
        acc = "fp32" if in_dtype in ("bf16", "fp16") else in_dtype
        given = None if mask is None else _additive_mask(sim, mask, in_dtype)
        q32, k32, v32 = cast(sim, q, acc), cast(sim, k, acc), cast(sim, v, acc)
        qs = mul_scalar(sim, q32)
        if given is None:
            ones = new(sim, (s, s), "u8")  # torch.bool: one byte an element
            tril = new(sim, (s, s), "u8")
            del ones
            scalars = new(sim, (), acc), new(sim, (), acc)
            mask = new(sim, (s, s), acc)
            del scalars, tril
        else:
            mask = given
            del given
        # GQA (the same tensors when every head has its own k and v)
        kr = repeat_kv(sim, k32, a, always_copy=True)
        vr = repeat_kv(sim, v32, a, always_copy=True)
        kt = view(kr, (b, a, d, s), {"bhsd": "t"}.get(kr.layout, kr.layout))
        ks = mul_scalar(sim, kt)
        del kt
        scores = _bmm_result(sim, bmm(sim, qs, ks, (b, a, s, s)))
        del ks
        w = add(sim, scores, mask)
        del scores
        p = softmax_fp32(sim, w)
        del w
        # the second output, the probabilities in the input dtype: no gradient ever
        # reaches its node
        weights = new(sim, p.shape, in_dtype)
        o = _bmm_result(sim, bmm(sim, p, vr, (b, a, s, d)))
        del p, vr
        out = cast(sim, o, in_dtype)
        del o, kr, qs, mask, q32, k32, v32, weights
        return out
    finally:
        sim.autocast = outer


def embedding(sim: Simulator, ids: SimTensor, w: SimTensor) -> SimTensor:
    b, s = ids.shape
    out = new(sim, (b, s, w.shape[1]), w.dtype)
    w_shape, w_dtype = w.shape, w.dtype
    record(
        sim, out, [None, w], [ids], lambda node, g: [None, new(sim, w_shape, w_dtype)]
    )
    return out


def log_softmax(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype)
    shape, dtype = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dtype)], save_out=True)
    return out


def nll_loss(
    sim: Simulator, logp: SimTensor, target: SimTensor, reduction: str = "mean"
) -> SimTensor:
    """``F.nll_loss``: the loss (a scalar, or one per row for ``reduction="none"``) and
    ``total_weight`` in ``logp``'s dtype; saves the target and ``total_weight``."""
    if reduction not in ("mean", "none"):
        raise ValueError(f"reduction must be 'mean' or 'none', got {reduction!r}")
    n = () if reduction == "mean" else (logp.shape[0],)
    out = new(sim, n, logp.dtype)
    total_weight = new(sim, (), logp.dtype)
    shape, dtype = logp.shape, logp.dtype
    record(
        sim,
        out,
        [logp],
        [target, total_weight],
        lambda node, g: [new(sim, shape, dtype)],
    )
    return out


def dropout(sim: Simulator, x: SimTensor, device: str = "cuda") -> SimTensor:
    """``F.dropout(x, p)`` with 0 < p < 1 in training mode (ATen ``Dropout.cpp``).

    On CUDA the fused kernel (``is_fused_kernel_acceptable``) runs ``native_dropout``:
    the output and a bool mask of ``x``'s shape; autograd saves the mask only
    (``native_dropout_backward(grad, mask, scale)``, one new tensor). On CPU
    ``_dropout_impl`` builds ``noise = empty_like(x).bernoulli_(1 - p).div_(1 - p)``
    and returns ``x * noise``: the saved mask is a tensor of ``x``'s dtype."""
    out_first = device != "cuda"
    mask_dtype = "u8" if device == "cuda" else x.dtype  # torch.bool: 1 byte
    if out_first:
        mask = new(sim, x.shape, mask_dtype, layout=x.layout)
        out = new(sim, x.shape, x.dtype, layout=x.layout)
    else:
        out = new(sim, x.shape, x.dtype, layout=x.layout)
        mask = new(sim, x.shape, mask_dtype, layout=x.layout)
    shape, dtype = x.shape, x.dtype
    record(sim, out, [x], [mask], lambda node, g: [new(sim, shape, dtype)])
    return out


def narrow(sim: Simulator, x: SimTensor, shape) -> SimTensor:
    """A slice of ``x`` (``logits[..., :-1, :]``): a view forward; its backward
    (``slice_backward``) allocates a zero tensor of ``x``'s full shape."""
    out = SimTensor(x.buffer, shape, x.dtype)
    full, dtype = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, full, dtype)])
    return out
