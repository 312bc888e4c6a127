"""The ops of the Llama forward pass, each with PyTorch's autograd rule for what it saves and what
its backward allocates (``derivatives.yaml``), and ``torch.autocast``'s casts."""

from __future__ import annotations

from .accounting import T, Sim, new, shrink, view
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


def cast(sim: Sim, x: T, dt: str, cached_param=None) -> T:
    """``x.to(dt)`` (a no-op returning ``x`` when the dtype already matches)."""
    if x.dt == dt:
        return x
    cat = "weights" if cached_param is not None else None
    out = new(sim, x.shape, dt, cat=cat, phys=x.phys)
    if cached_param is not None and sim.param_cast_scale != 1.0:
        shrink(
            sim, out.buf, sim.param_cast_scale
        )  # ZeRO-3: only the local shard is cast
    if cached_param is not None and x.rg and x.fn is None:
        # autocast caches the cast of a leaf that requires grad until the autocast region exits,
        # whether or not autograd saves it (e.g. LoRA's A when its input needs no grad, or every
        # weight during a checkpointed forward)
        sim.autocast_cache.append(out)
    src_dt, shape = x.dt, x.shape

    def bwd(node, g):
        return [new(sim, shape, src_dt, phys=g.phys)]

    record(sim, out, [x], [], bwd)
    return out


def _ac(sim: Sim, x: T, param: bool = False) -> T:
    """The cast autocast applies to an input of a lower-precision op."""
    if sim.autocast is None or x.dt not in ("fp32",):
        return x
    return cast(sim, x, sim.autocast, cached_param=True if param else None)


def linear(sim: Sim, x: T, w: T, b: T | None = None, quant: bool = False) -> T:
    """``F.linear`` (``x @ w.T + b``): saves x if w needs grad, w if x needs grad.

    ``quant``: a bitsandbytes 4-bit weight, dequantized to the compute dtype for the matmul (a
    transient copy) and again in backward."""
    if quant:
        cdt = sim.autocast or x.dt
        xc = cast(sim, x, cdt) if x.dt != cdt else x
        wd = new(sim, w.shape, cdt)  # dequantized weight (temporary)
        out = new(sim, x.shape[:-1] + (w.shape[0],), cdt)
        del wd
        xshape, xdt = xc.shape, xc.dt
        wshape = w.shape

        def qbwd(node, g):
            wd2 = new(sim, wshape, xdt)
            gx = new(sim, xshape, xdt)
            del wd2
            return [gx]

        record(sim, out, [xc], [], qbwd)
        return out
    xc = _ac(sim, x)
    wc = _ac(sim, w, param=True)
    bc = _ac(sim, b, param=True) if b is not None else None
    d_out, d_in = w.shape
    out = new(sim, x.shape[:-1] + (d_out,), xc.dt)
    saved = []
    if w.rg:
        saved.append(xc)
    if x.rg:
        saved.append(wc)
    xshape, xdt, wdt, x_rg, w_rg, b_rg = (
        xc.shape,
        xc.dt,
        wc.dt,
        xc.rg,
        wc.rg,
        bc is not None and bc.rg,
    )

    def bwd(node, g):
        gw = new(sim, (d_out, d_in), wdt) if w_rg else None
        gx = new(sim, xshape, xdt) if x_rg else None
        gb = new(sim, (d_out,), wdt) if b_rg else None
        return [gx, gw, gb]

    record(sim, out, [xc, wc, bc], saved, bwd)
    return out


def add(sim: Sim, a: T, b: T) -> T:
    dt = _promote(a.dt, b.dt)
    shape = _bcast(a.shape, b.shape)
    out = new(sim, shape, dt, phys=a.phys if a.shape == shape else b.phys)
    ash, adt, bsh, bdt = a.shape, a.dt, b.shape, b.dt

    def bwd(node, g):
        def red(sh, d):
            if sh != shape:
                return new(sim, sh, d)
            if d != g.dt:
                return new(sim, sh, d)
            return g

        return [red(ash, adt) if a_rg else None, red(bsh, bdt) if b_rg else None]

    a_rg, b_rg = a.rg, b.rg
    record(sim, out, [a, b], [], bwd)
    return out


def add_scalar(sim: Sim, a: T) -> T:
    out = new(sim, a.shape, a.dt, phys=a.phys)
    record(sim, out, [a], [], lambda node, g: [g])
    return out


def mul(sim: Sim, a: T, b: T) -> T:
    """``a * b``: saves b if a needs grad, a if b needs grad; broadcast grads are summed."""
    dt = _promote(a.dt, b.dt)
    shape = _bcast(a.shape, b.shape)
    out = new(sim, shape, dt, phys=a.phys if a.shape == shape else b.phys)
    saved = []
    if a.rg:
        saved.append(b)
    if b.rg:
        saved.append(a)
    ash, adt, bsh, bdt, a_rg, b_rg = a.shape, a.dt, b.shape, b.dt, a.rg, b.rg

    def bwd(node, g):
        res = []
        for sh, d, rg in ((ash, adt, a_rg), (bsh, bdt, b_rg)):
            if not rg:
                res.append(None)
                continue
            full = new(sim, shape, _promote(g.dt, d))
            if sh != shape:
                r = new(sim, sh, full.dt)
                del full
                full = r
            if full.dt != d:
                full = new(sim, sh, d)
            res.append(full)
        return res

    record(sim, out, [a, b], saved, bwd)
    return out


def mul_scalar(sim: Sim, a: T) -> T:
    out = new(sim, a.shape, a.dt, phys=a.phys)
    shape, dt = a.shape, a.dt
    record(sim, out, [a], [], lambda node, g: [new(sim, shape, dt)])
    return out


def pow2(sim: Sim, x: T) -> T:
    out = new(sim, x.shape, x.dt, phys=x.phys)
    shape, dt = x.shape, x.dt

    def bwd(node, g):  # grad * 2 * x**1 : pow, mul.Scalar, mul.Tensor
        t1 = new(sim, shape, dt)
        t2 = new(sim, shape, dt)
        r = new(sim, shape, dt)
        del t1, t2
        return [r]

    record(sim, out, [x], [x], bwd)
    return out


def mean_last(sim: Sim, x: T) -> T:
    out = new(sim, x.shape[:-1] + (1,), x.dt)
    shape, dt = x.shape, x.dt
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)])
    return out


def rsqrt(sim: Sim, x: T) -> T:
    out = new(sim, x.shape, x.dt)
    shape, dt = x.shape, x.dt

    def bwd(node, g):  # -0.5 * grad * out**3 : pow, mul.Scalar, mul.Tensor
        t1 = new(sim, shape, dt)
        t2 = new(sim, shape, dt)
        r = new(sim, shape, dt)
        del t1, t2
        return [r]

    record(sim, out, [x], [], bwd, save_out=True)
    return out


def silu(sim: Sim, x: T) -> T:
    out = new(sim, x.shape, x.dt)
    shape, dt = x.shape, x.dt
    record(sim, out, [x], [x], lambda node, g: [new(sim, shape, dt)])
    return out


def neg(sim: Sim, x: T) -> T:
    out = new(sim, x.shape, x.dt, phys=x.phys)
    shape, dt = x.shape, x.dt
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)])
    return out


def rotate_half(sim: Sim, x: T) -> T:
    """``cat((-x2, x1), -1)`` with x1, x2 the two halves (slices are views)."""
    half = x.shape[:-1] + (x.shape[-1] // 2,)
    x1 = view(x, half, x.phys)
    x2 = view(x, half, x.phys)
    nx2 = neg(sim, x2)
    out = new(sim, x.shape, x.dt)
    n_rg, x1_rg = nx2.rg, x1.rg

    def bwd(node, g):  # cat backward: narrow views of g
        return [view(g, half) if n_rg else None, view(g, half) if x1_rg else None]

    record(sim, out, [nx2, x1], [], bwd)
    return out


def clone_contig(sim: Sim, x: T) -> T:
    """``.contiguous()`` / the copy a reshape of a non-contiguous tensor makes."""
    out = new(sim, x.shape, x.dt, phys="bhsd")
    record(sim, out, [x], [], lambda node, g: [g])
    return out


def _batch_dims_merge(x: T) -> bool:
    """Whether ``matmul`` can view the 4-D operand ``x`` as ``(b * heads, m, n)`` (no copy).

    Layouts (``x.phys``): ``"bhsd"`` contiguous and ``"t"`` (its last two dims transposed) always
    merge; ``"bshd"`` (heads interleaved in the projection's rows) only when the batch or the head
    count is 1; ``"x"`` (a single key/value head expanded over the query heads, stride 0) only
    when the batch is 1."""
    b, heads = x.shape[0], x.shape[1]
    if x.phys in ("bhsd", "t"):
        return True
    if x.phys == "x":
        return b == 1
    return b == 1 or heads == 1


def repeat_kv(sim: Sim, x: T, heads: int) -> T:
    """transformers' ``repeat_kv``: ``x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, heads, s,
    d)``. With one key/value head the reshape is a view (stride 0 over the heads, layout
    ``"x"``); otherwise it copies. Backward sums the expanded gradient back to ``(b, kv, s, d)``."""
    b, kv, s, d = x.shape
    if kv == heads:
        return x
    if kv == 1:
        out = T(x.buf, (b, heads, s, d), x.dt, phys="x")
    else:
        out = new(sim, (b, heads, s, d), x.dt, phys="bhsd")
    shape, dt = x.shape, x.dt
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)])
    return out


def bmm(sim: Sim, a: T, b: T, out_shape) -> T:
    """A 4-D ``matmul`` (through ``bmm``): copies an operand whose batch and head dims cannot be
    merged by a view first (see :func:`_batch_dims_merge`); saves both."""
    a = _ac(sim, a)
    b = _ac(sim, b)
    if not _batch_dims_merge(a):
        a = clone_contig(sim, a)
    if not _batch_dims_merge(b):
        b = clone_contig(sim, b)
    out = new(sim, out_shape, a.dt, phys="bhsd")
    saved = []
    if a.rg:
        saved.append(b)
    if b.rg:
        saved.append(a)
    ash, bsh, dt, a_rg, b_rg = a.shape, b.shape, a.dt, a.rg, b.rg

    def bwd(node, g):
        gb = new(sim, bsh, dt, phys="bhsd") if b_rg else None
        ga = new(sim, ash, dt, phys="bhsd") if a_rg else None
        return [ga, gb]

    record(sim, out, [a, b], saved, bwd)
    return out


def softmax_fp32(sim: Sim, x: T) -> T:
    """``softmax(x, dim=-1, dtype=float32)``: ATen converts a 16-bit input first (``x.to(float32)``,
    its own autograd node and a transient copy), then ``_softmax`` saves its output.  Two nodes, so
    in backward the fp32 gradient of the scores is converted to 16 bit only after ``_softmax``'s
    saved output and incoming gradient are released."""
    x = cast(sim, x, "fp32")
    out = new(sim, x.shape, "fp32", phys="bhsd")
    shape = x.shape
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, "fp32")], save_out=True)
    return out


def sdpa(sim: Sim, q: T, k: T, v: T) -> T:
    """``scaled_dot_product_attention`` (flash kernel): saves q, k, v, out and logsumexp."""
    q, k, v = _ac(sim, q), _ac(sim, k), _ac(sim, v)
    b, a, s, d = q.shape
    out = new(sim, (b, a, s, d), q.dt, phys="bshd")
    lse = new(sim, (b, a, s), "fp32")
    qs, ks, vs, dt = q.shape, k.shape, v.shape, q.dt
    q_rg, k_rg, v_rg = q.rg, k.rg, v.rg

    def bwd(node, g):
        gq = new(sim, qs, dt, phys="bshd")
        gk = new(sim, ks, dt, phys="bshd")
        gv = new(sim, vs, dt, phys="bshd")
        return [gq if q_rg else None, gk if k_rg else None, gv if v_rg else None]

    record(sim, out, [q, k, v], [q, k, v, lse], bwd, save_out=True)
    return out


def embedding(sim: Sim, ids: T, w: T) -> T:
    b, s = ids.shape
    out = new(sim, (b, s, w.shape[1]), w.dt)
    wshape, wdt = w.shape, w.dt
    record(sim, out, [None, w], [ids], lambda node, g: [None, new(sim, wshape, wdt)])
    return out


def log_softmax(sim: Sim, x: T) -> T:
    out = new(sim, x.shape, x.dt)
    shape, dt = x.shape, x.dt
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)], save_out=True)
    return out


def nll_loss(sim: Sim, logp: T, target: T) -> T:
    out = new(sim, (), "fp32")
    total_weight = new(sim, (), "fp32")
    shape, dt = logp.shape, logp.dt
    record(
        sim, out, [logp], [target, total_weight], lambda node, g: [new(sim, shape, dt)]
    )
    return out
