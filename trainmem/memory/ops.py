"""The ops of the Llama forward pass, each with PyTorch's autograd rule for what it
saves and what its backward allocates (``derivatives.yaml``), and ``torch.autocast``'s
casts."""

from __future__ import annotations

from .accounting import SimTensor, Simulator, new, shrink, view
from .autograd import record


def _promote(a: str, b: str) -> str:
    if a == b:
        return a
    if "fp32" in (a, b):
        return "fp32"
    return a


def _bcast(a, b):
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    return tuple(max(x, y) for x, y in zip(a, b))


def cast(sim: Simulator, x: SimTensor, dt: str, cached_param=None) -> SimTensor:
    """``x.to(dt)`` (a no-op returning ``x`` when the dtype already matches)."""
    if x.dtype == dt:
        return x
    cat = "weights" if cached_param is not None else None
    out = new(sim, x.shape, dt, category=cat, layout=x.layout)
    if cached_param is not None and sim.param_cast_scale != 1.0:
        shrink(
            sim, out.buffer, sim.param_cast_scale
        )  # ZeRO-3: only the local shard is cast
    if cached_param is not None and x.requires_grad and x.grad_fn is None:
        # autocast caches the cast of a leaf that requires grad until the autocast
        # region exits, whether or not autograd saves it (e.g. LoRA's A when its input
        # needs no grad, or every weight during a checkpointed forward)
        sim.autocast_cache.append(out)
    src_dt, shape = x.dtype, x.shape

    def backward_fn(node, g):
        return [new(sim, shape, src_dt, layout=g.layout)]

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
) -> SimTensor:
    """``F.linear`` (``x @ w.T + b``): saves x if w needs grad, w if x needs grad.

    ``quant``: a bitsandbytes 4-bit weight, dequantized to the compute dtype for the
    matmul (a transient copy) and again in backward."""
    if quant:
        compute_dtype = sim.autocast or x.dtype
        xc = cast(sim, x, compute_dtype) if x.dtype != compute_dtype else x
        wd = new(sim, w.shape, compute_dtype)  # dequantized weight (temporary)
        out = new(sim, x.shape[:-1] + (w.shape[0],), compute_dtype)
        del wd
        xshape, xdt = xc.shape, xc.dtype
        wshape = w.shape

        def backward_fn(node, g):
            wd2 = new(sim, wshape, xdt)
            gx = new(sim, xshape, xdt)
            del wd2
            return [gx]

        record(sim, out, [xc], [], backward_fn)
        return out
    xc = _autocast_input(sim, x)
    wc = _autocast_input(sim, w, param=True)
    bc = _autocast_input(sim, b, param=True) if b is not None else None
    d_out, d_in = w.shape
    out = new(sim, x.shape[:-1] + (d_out,), xc.dtype)
    saved = []
    if w.requires_grad:
        saved.append(xc)
    if x.requires_grad:
        saved.append(wc)
    xshape, xdt, wdt, x_rg, w_rg, b_rg = (
        xc.shape,
        xc.dtype,
        wc.dtype,
        xc.requires_grad,
        wc.requires_grad,
        bc is not None and bc.requires_grad,
    )

    def backward_fn(node, g):
        gw = new(sim, (d_out, d_in), wdt) if w_rg else None
        gx = new(sim, xshape, xdt) if x_rg else None
        gb = new(sim, (d_out,), wdt) if b_rg else None
        return [gx, gw, gb]

    record(sim, out, [xc, wc, bc], saved, backward_fn)
    return out


def add(sim: Simulator, a: SimTensor, b: SimTensor) -> SimTensor:
    dt = _promote(a.dtype, b.dtype)
    shape = _bcast(a.shape, b.shape)
    out = new(sim, shape, dt, layout=a.layout if a.shape == shape else b.layout)
    ash, adt, bsh, bdt = a.shape, a.dtype, b.shape, b.dtype

    def backward_fn(node, g):
        def reduce_to(sh, d):
            if sh != shape:
                return new(sim, sh, d)
            if d != g.dtype:
                return new(sim, sh, d)
            return g

        return [
            reduce_to(ash, adt) if a_rg else None,
            reduce_to(bsh, bdt) if b_rg else None,
        ]

    a_rg, b_rg = a.requires_grad, b.requires_grad
    record(sim, out, [a, b], [], backward_fn)
    return out


def add_scalar(sim: Simulator, a: SimTensor) -> SimTensor:
    out = new(sim, a.shape, a.dtype, layout=a.layout)
    record(sim, out, [a], [], lambda node, g: [g])
    return out


def mul(sim: Simulator, a: SimTensor, b: SimTensor) -> SimTensor:
    """``a * b``: saves b if a needs grad, a if b needs grad; broadcast grads are
    summed."""
    dt = _promote(a.dtype, b.dtype)
    shape = _bcast(a.shape, b.shape)
    out = new(sim, shape, dt, layout=a.layout if a.shape == shape else b.layout)
    saved = []
    if a.requires_grad:
        saved.append(b)
    if b.requires_grad:
        saved.append(a)
    ash, adt, bsh, bdt, a_rg, b_rg = (
        a.shape,
        a.dtype,
        b.shape,
        b.dtype,
        a.requires_grad,
        b.requires_grad,
    )

    def backward_fn(node, g):
        res = []
        for sh, d, rg in ((ash, adt, a_rg), (bsh, bdt, b_rg)):
            if not rg:
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
    shape, dt = a.shape, a.dtype
    record(sim, out, [a], [], lambda node, g: [new(sim, shape, dt)])
    return out


def pow2(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype, layout=x.layout)
    shape, dt = x.shape, x.dtype

    def backward_fn(node, g):  # grad * 2 * x**1 : pow, mul.Scalar, mul.Tensor
        t1 = new(sim, shape, dt)
        t2 = new(sim, shape, dt)
        r = new(sim, shape, dt)
        del t1, t2
        return [r]

    record(sim, out, [x], [x], backward_fn)
    return out


def mean_last(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape[:-1] + (1,), x.dtype)
    shape, dt = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)])
    return out


def rsqrt(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype)
    shape, dt = x.shape, x.dtype

    def backward_fn(node, g):  # -0.5 * grad * out**3 : pow, mul.Scalar, mul.Tensor
        t1 = new(sim, shape, dt)
        t2 = new(sim, shape, dt)
        r = new(sim, shape, dt)
        del t1, t2
        return [r]

    record(sim, out, [x], [], backward_fn, save_out=True)
    return out


def silu(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype)
    shape, dt = x.shape, x.dtype
    record(sim, out, [x], [x], lambda node, g: [new(sim, shape, dt)])
    return out


def neg(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype, layout=x.layout)
    shape, dt = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)])
    return out


def rotate_half(sim: Simulator, x: SimTensor) -> SimTensor:
    """``cat((-x2, x1), -1)`` with x1, x2 the two halves (slices are views)."""
    half = x.shape[:-1] + (x.shape[-1] // 2,)
    x1 = view(x, half, x.layout)
    x2 = view(x, half, x.layout)
    nx2 = neg(sim, x2)
    out = new(sim, x.shape, x.dtype)
    n_rg, x1_rg = nx2.requires_grad, x1.requires_grad

    def backward_fn(node, g):  # cat backward: narrow views of g
        return [view(g, half) if n_rg else None, view(g, half) if x1_rg else None]

    record(sim, out, [nx2, x1], [], backward_fn)
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


def repeat_kv(sim: Simulator, x: SimTensor, heads: int) -> SimTensor:
    """transformers' ``repeat_kv``: ``x[:, :, None].expand(b, kv, n_rep, s,
    d).reshape(b, heads, s, d)``. With one key/value head the reshape is a view (stride
    0 over the heads, layout ``"x"``); otherwise it copies. Backward sums the expanded
    gradient back to ``(b, kv, s, d)``."""
    b, kv, s, d = x.shape
    if kv == heads:
        return x
    if kv == 1:
        out = SimTensor(x.buffer, (b, heads, s, d), x.dtype, layout="x")
    else:
        out = new(sim, (b, heads, s, d), x.dtype, layout="bhsd")
    shape, dt = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)])
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
    ash, bsh, dt, a_rg, b_rg = (
        a.shape,
        b.shape,
        a.dtype,
        a.requires_grad,
        b.requires_grad,
    )

    def backward_fn(node, g):
        gb = new(sim, bsh, dt, layout="bhsd") if b_rg else None
        ga = new(sim, ash, dt, layout="bhsd") if a_rg else None
        return [ga, gb]

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


def sdpa(sim: Simulator, q: SimTensor, k: SimTensor, v: SimTensor) -> SimTensor:
    """``scaled_dot_product_attention`` (flash kernel): saves q, k, v, out and
    logsumexp."""
    q, k, v = _autocast_input(sim, q), _autocast_input(sim, k), _autocast_input(sim, v)
    b, a, s, d = q.shape
    out = new(sim, (b, a, s, d), q.dtype, layout="bshd")
    lse = new(sim, (b, a, s), "fp32")
    qs, ks, vs, dt = q.shape, k.shape, v.shape, q.dtype
    q_rg, k_rg, v_rg = q.requires_grad, k.requires_grad, v.requires_grad

    def backward_fn(node, g):
        gq = new(sim, qs, dt, layout="bshd")
        gk = new(sim, ks, dt, layout="bshd")
        gv = new(sim, vs, dt, layout="bshd")
        return [gq if q_rg else None, gk if k_rg else None, gv if v_rg else None]

    record(sim, out, [q, k, v], [q, k, v, lse], backward_fn, save_out=True)
    return out


def embedding(sim: Simulator, ids: SimTensor, w: SimTensor) -> SimTensor:
    b, s = ids.shape
    out = new(sim, (b, s, w.shape[1]), w.dtype)
    wshape, wdt = w.shape, w.dtype
    record(sim, out, [None, w], [ids], lambda node, g: [None, new(sim, wshape, wdt)])
    return out


def log_softmax(sim: Simulator, x: SimTensor) -> SimTensor:
    out = new(sim, x.shape, x.dtype)
    shape, dt = x.shape, x.dtype
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)], save_out=True)
    return out


def nll_loss(sim: Simulator, logp: SimTensor, target: SimTensor) -> SimTensor:
    out = new(sim, (), "fp32")
    total_weight = new(sim, (), "fp32")
    shape, dt = logp.shape, logp.dtype
    record(
        sim, out, [logp], [target, total_weight], lambda node, g: [new(sim, shape, dt)]
    )
    return out
