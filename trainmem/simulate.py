"""A symbolic replay of one training step: the activation model behind :mod:`trainmem.estimate`.

No tensor is created here.  A :class:`T` is a (shape, dtype) with a reference-counted buffer of
``numel * itemsize`` **bytes**; the Llama/Qwen2 forward pass is written out op by op exactly as
``transformers`` runs it (RMSNorm's fp32 upcast, RoPE's ``rotate_half``, eager vs SDPA attention,
peft's LoRA ``Linear``, the causal-LM loss with its ``logits.float()``), and every op follows
PyTorch's autograd rule for *what it saves for backward* (``derivatives.yaml``): ``mm`` saves its
input only if the weight needs a gradient, ``mul`` saves the *other* operand, ``pow`` saves its
input, ``softmax``/``log_softmax`` save their output, SDPA saves q, k, v, the output and the
log-sum-exp, and so on.  ``torch.autocast`` is modelled the way it works: every lower-precision op
casts its inputs (casts of activations are *not* cached, so the input of q/k/v is cast three
times).  Backward walks the recorded graph in reverse creation order like the autograd engine,
allocating each gradient, accumulating gradients of tensors used twice, and freeing the saved
tensors of each node after it ran.  Non-reentrant activation checkpointing keeps only each
layer's inputs and recomputes the layer's forward when its backward starts (with PyTorch's early
stop once the last saved tensor is recomputed).  The optimizer step allocates what the chosen
torch implementation allocates (:func:`adamw_step_scratch`: foreach, fused, for-loop).

The running total of live bytes, split into the six categories of the estimator, gives the peak.
Python's reference counting frees a buffer exactly when the last :class:`T` (or saved slot) that
uses it goes away, as for real tensors.
"""
from __future__ import annotations

import heapq
import math
from itertools import count

CATS = ("weights", "gradients", "optimizer_states", "master_weights", "activations", "temporaries")
ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2, "i64": 8, "bool": 1}


class Sim:
    """Byte accounting: current and peak live bytes, by category."""

    def __init__(self):
        self.cur = 0
        self.peak = 0
        self.by = dict.fromkeys(CATS, 0)
        self.peak_by = dict(self.by)
        self.phase = "forward"
        self.phase_peaks: dict[str, int] = {}
        self.seq = count()
        self.save = True               # False inside a checkpointed region's first forward
        self.autocast = None           # lower-precision dtype name under torch.autocast
        self.grad_enabled = True
        self.ckpt = None               # the active _CkptGroup while recording a checkpointed region
        self.marks: dict[str, dict] = {}
        self.grad_scale = 1.0          # ZeRO >= 2: the fraction of each gradient kept locally
        self.param_cast_scale = 1.0    # ZeRO-3: the fraction of each weight cast by autocast
        self.autocast_cache: list = []  # autocast's casts of trainable leaves, kept to its exit
        self.last_alloc = None         # (buffer, peak, peak_by, phase peak) before the last alloc

    def alloc(self, nbytes: int, cat: str | None = None) -> "Buf":
        if cat is None:
            cat = "activations" if self.phase == "forward" else "temporaries"
        b = Buf(self, int(nbytes), cat)
        self.last_alloc = (b, self.peak, self.peak_by, self.phase_peaks.get(self.phase))
        self.cur += b.n
        self.by[cat] += b.n
        if self.cur > self.phase_peaks.get(self.phase, -1):
            self.phase_peaks[self.phase] = self.cur
        if self.cur > self.peak:
            self.peak = self.cur
            self.peak_by = dict(self.by)
        return b

    def unalloc_last(self, b: "Buf") -> None:
        """Take back the allocation of ``b`` (the most recent one) as if it never happened: the
        recompute of a checkpointed region stops before the kernel of its last node runs."""
        if self.last_alloc is None or self.last_alloc[0] is not b:
            return
        _, self.peak, self.peak_by, phase_peak = self.last_alloc
        if phase_peak is None:
            self.phase_peaks.pop(self.phase, None)
        else:
            self.phase_peaks[self.phase] = phase_peak
        self.cur -= b.n
        self.by[b.cat] -= b.n
        b.n = 0
        self.last_alloc = None

    def _free(self, b: "Buf"):
        self.cur -= b.n
        self.by[b.cat] -= b.n

    def recat(self, b: "Buf", cat: str):
        self.by[b.cat] -= b.n
        b.cat = cat
        self.by[cat] += b.n

    def mark(self, name: str):
        self.marks[name] = dict(self.by, total=self.cur)

    def set_phase(self, phase: str):
        self.phase = phase
        self.phase_peaks.setdefault(phase, self.cur)


class Buf:
    __slots__ = ("sim", "n", "cat", "info", "__weakref__")

    def __init__(self, sim, n, cat):
        self.sim, self.n, self.cat = sim, n, cat
        self.info = None

    def __del__(self):
        self.sim._free(self)


class T:
    """A symbolic tensor: shape, dtype, buffer, autograd edge. ``phys`` names the physical
    layout of 4-D attention tensors: ``"bhsd"`` (contiguous) or ``"bshd"`` (a transposed view of
    a ``(b, s, h*d)`` projection)."""
    __slots__ = ("buf", "shape", "dt", "rg", "fn", "acc", "phys", "__weakref__")

    def __init__(self, buf, shape, dt, rg=False, fn=None, phys=None):
        self.buf, self.shape, self.dt, self.rg, self.fn, self.phys = buf, tuple(shape), dt, rg, fn, phys
        self.acc = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dt]

    def edge(self):
        if not self.rg:
            return None
        return self.fn if self.fn is not None else self.acc


def new(sim: Sim, shape, dt, cat=None, phys=None) -> T:
    n = math.prod(shape) * ITEMSIZE[dt]
    t = T(sim.alloc(n, cat), shape, dt, phys=phys)
    t.buf.info = (tuple(shape), dt)
    return t


def view(t: T, shape, phys=None) -> T:
    """A view: same buffer, gradient passes through unchanged (no allocation either way)."""
    v = T(t.buf, shape, t.dt, t.rg, t.fn, phys)
    v.acc = t.acc
    return v


class Node:
    __slots__ = ("seq", "edges", "saved", "bwd", "group", "saves", "__weakref__")

    def __init__(self, seq, edges, saved, bwd, group=None, saves=False):
        self.seq, self.edges, self.saved, self.bwd, self.group = seq, edges, saved, bwd, group
        self.saves = saves      # autograd saved tensors for it (under checkpointing: placeholders)

    def __lt__(self, other):
        return self.seq > other.seq


class AccGrad:
    """AccumulateGrad of a leaf parameter: the first gradient is stolen, later ones added in place."""
    __slots__ = ("param", "grad", "seq", "sink", "__weakref__")

    def __init__(self, param: T):
        self.param = param
        self.grad = None
        self.seq = math.inf
        self.sink = False

    def __lt__(self, other):
        return self.seq > other.seq


def record(sim: Sim, out: T, inputs: list, saved: list, bwd, save_out: bool = False) -> None:
    """Attach a backward node to ``out`` if any input requires grad (and grad mode is on).

    ``saved`` are the tensors autograd keeps for this node; ``save_out`` adds the output itself.
    """
    if not sim.grad_enabled or not any(i is not None and i.rg for i in inputs):
        return
    group = sim.ckpt
    saving = bool(saved) or save_out
    if group is not None and group.recording:
        group.n_nodes += 1
        if saving:
            group.last_saving = group.n_nodes
        saved, save_out = [], False      # checkpoint: nothing kept, recomputed in backward
    if not sim.save:
        saved, save_out = [], False
    bufs = [t.buf for t in saved] + ([out.buf] if save_out else [])
    node = Node(next(sim.seq), [i.edge() if i is not None else None for i in inputs], bufs, bwd, group,
                saves=saving)
    out.rg = True
    out.fn = node
    if group is not None and group.recording:
        group.nodes.append(node)
    if group is not None and group.replaying is not None:
        group.replay_node(sim, node, out, save_out)


class _StopRecompute(Exception):
    pass


class _CkptGroup:
    def __init__(self, fn, inputs):
        self.fn, self.inputs = fn, inputs
        self.nodes: list[Node] = []
        self.n_nodes = 0
        self.last_saving = 0
        self.recording = True
        self.replaying = None
        self.done = False
        self.executed = 0

    def replay_node(self, sim, node, out, save_out):
        """Hand the recomputed saved tensors to the original node; stop after the last one.

        Autograd packs saved *inputs* before the kernel runs and saved outputs after it, so when
        the last node saves only inputs the recompute stops before its output is allocated."""
        i = self.replaying
        self.replaying += 1
        if i < len(self.nodes):
            self.nodes[i].saved = node.saved
        if self.replaying >= self.last_saving:
            if not save_out:
                sim.unalloc_last(out.buf)
            raise _StopRecompute

    def recompute(self, sim):
        if self.done:
            return
        self.done = True
        prev = sim.ckpt
        sim.ckpt = self
        self.recording = False
        self.replaying = 0
        prev_ac, prev_cache = sim.autocast, sim.autocast_cache
        sim.autocast, sim.autocast_cache = self.autocast, []
        try:
            ins = [view(t, t.shape, t.phys) if t is not None else None for t in self.inputs]
            for t in ins:       # same requires_grad as in the forward, so the node order matches
                if t is not None:
                    t.fn, t.acc = (_DUMMY if t.rg else None), None
            try:
                self.fn(*ins)
            except _StopRecompute:
                pass
        finally:
            sim.ckpt = prev
            sim.autocast, sim.autocast_cache = prev_ac, prev_cache   # the recompute's autocast exits
            self.replaying = None
            # the checkpoint keeps its inputs until the layer's backward is over (see backward())


_DUMMY = Node(-1, [], [], None)


def checkpoint(sim: Sim, fn, *inputs):
    """Non-reentrant ``torch.utils.checkpoint``: keep ``inputs``, drop the saved tensors."""
    group = _CkptGroup(fn, list(inputs))
    group.autocast = sim.autocast
    prev = sim.ckpt
    sim.ckpt = group
    try:
        out = fn(*inputs)
    finally:
        sim.ckpt = prev
        group.recording = False
    # the nodes of the group need the recompute before their backward runs
    for n in group.nodes:
        n.group = group
    return out


# ----------------------------------------------------------------------------------------------
# ops (forward + autograd rule); shapes are tuples, dtypes "fp32"/"bf16"/"fp16"/"i64"
# ----------------------------------------------------------------------------------------------
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
        shrink(sim, out.buf, sim.param_cast_scale)   # ZeRO-3: only the local shard is cast
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
        wd = new(sim, w.shape, cdt)                      # dequantized weight (temporary)
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
    xshape, xdt, wdt, x_rg, w_rg, b_rg = xc.shape, xc.dt, wc.dt, xc.rg, wc.rg, bc is not None and bc.rg

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

    def bwd(node, g):   # grad * 2 * x**1 : pow, mul.Scalar, mul.Tensor
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

    def bwd(node, g):   # -0.5 * grad * out**3 : pow, mul.Scalar, mul.Tensor
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
    shape, dt = x.shape, x.dt
    n_rg, x1_rg = nx2.rg, x1.rg

    def bwd(node, g):   # cat backward: narrow views of g
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


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------
def param(sim: Sim, shape, dt, trainable: bool, cat: str) -> T:
    p = new(sim, shape, dt, cat=cat)
    p.rg = trainable
    if trainable:
        p.acc = AccGrad(p)
    return p


def backward(sim: Sim, loss: T):
    """Run the recorded graph backward from the scalar ``loss`` (reverse creation order)."""
    root = loss.fn
    if root is None:
        return
    deps: dict = {}
    stack = [root]
    seen = {id(root)}
    while stack:
        n = stack.pop()
        if isinstance(n, AccGrad):
            continue
        for e in n.edges:
            if e is None or e is _DUMMY:
                continue
            deps[id(e)] = deps.get(id(e), 0) + 1
            if id(e) not in seen:
                seen.add(id(e))
                stack.append(e)
    g0 = new(sim, (), "fp32")               # ones_like(loss)
    buffers = {id(root): g0}
    del g0
    heap = [root]
    while heap:
        node = heapq.heappop(heap)
        g = buffers.pop(id(node))
        if isinstance(node, AccGrad):
            p = node.param
            if node.sink:                   # a leaf that is not a parameter: grad discarded
                del g
                continue
            if p.buf is not None and getattr(p, "acc", None) is node:
                if node.grad is None:
                    if g.buf.cat != "gradients":
                        sim.recat(g.buf, "gradients")
                        if sim.grad_scale != 1.0:
                            shrink(sim, g.buf, sim.grad_scale)
                    node.grad = g
                # else: in-place add into the existing .grad; g is freed below
            del g
            continue
        # non-reentrant checkpointing recomputes when a saved tensor is first unpacked: at the
        # first node of the region that saved something (nodes that save nothing run before)
        if node.group is not None and not node.group.done and node.saves:
            node.group.recompute(sim)
        grads = node.bwd(node, g)
        del g
        node.saved = None
        grp = node.group
        if grp is not None:
            grp.executed += 1
            if grp.executed == len(grp.nodes):
                grp.inputs = grp.fn = None      # release the kept inputs (and break the
                grp.nodes = []                  # group <-> node reference cycle)
                grp.executed = -1
        for e, gr in zip(node.edges, grads):
            if e is None or gr is None or e is _DUMMY:
                continue
            k = id(e)
            if k in buffers:
                old = buffers[k]      # a second gradient for the same node: old + new, a new tensor
                buffers[k] = T(sim.alloc(old.nbytes), old.shape, old.dt)
                del old
            else:
                buffers[k] = gr
            deps[k] -= 1
            if deps[k] == 0:
                heapq.heappush(heap, e)
        del grads, gr


# ----------------------------------------------------------------------------------------------
# Llama / Qwen2 decoder (transformers' modeling_llama.py, op by op)
# ----------------------------------------------------------------------------------------------
def rmsnorm(sim: Sim, x: T, w: T) -> T:
    xf = cast(sim, x, "fp32")                       # hidden_states.to(torch.float32)
    var = mean_last(sim, pow2(sim, xf))
    r = rsqrt(sim, add_scalar(sim, var))
    del var
    xn = mul(sim, xf, r)
    del xf, r
    return mul(sim, w, cast(sim, xn, x.dt))         # weight * hidden_states.to(input_dtype)


def lora_linear(sim: Sim, x: T, lin: dict) -> T:
    """peft ``lora.Linear.forward``: base(x) + lora_B(lora_A(x.to(A.dtype))) * scaling."""
    result = linear(sim, x, lin["w"], lin.get("b"), quant=lin.get("q", False))
    if "A" not in lin:
        return result
    rdt = result.dt
    x = cast(sim, x, lin["A"].dt)       # x = self._cast_input_dtype(x, ...): lives to the end
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
        o = clone_contig(sim, view(o, (b, s, a, d), "t"))   # transpose(1, 2).contiguous()
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
        h.acc.param = None          # (no reference cycle: h is freed as usual)
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
        pos = view(pos, pos.shape)      # position_ids: kept by every checkpointed layer
    for L in M["layers"]:
        if cfg["checkpointing"]:
            h = checkpoint(sim, lambda h_, c_, s_, p_, L=L, m_=mask: decoder_layer(sim, h_, c_, s_, L, cfg, m_),
                           h, cos, sin, pos)
        else:
            h = decoder_layer(sim, h, cos, sin, L, cfg, mask)
    del cos, sin
    if cfg["checkpointing"]:
        del pos
    h = rmsnorm(sim, h, M["norm"])
    del mask                                      # LlamaModel.forward returns here
    logits = linear(sim, h, M["lm_head"])
    # (h, the model output's last_hidden_state, lives until the causal-LM forward returns)
    # ForCausalLMLoss: logits.float(); pad+shift labels; cross_entropy = log_softmax + nll_loss
    lf = cast(sim, logits, "fp32")
    padded = new(sim, (b, s + 1), "i64")          # the padded labels live until the loss returns
    target = new(sim, (b * s,), "i64")
    logp = log_softmax(sim, view(lf, (b * s, lf.shape[-1])))
    del lf
    loss = nll_loss(sim, logp, target)
    del logp, target, padded, logits, h
    return loss


def log_softmax(sim: Sim, x: T) -> T:
    out = new(sim, x.shape, x.dt)
    shape, dt = x.shape, x.dt
    record(sim, out, [x], [], lambda node, g: [new(sim, shape, dt)], save_out=True)
    return out


def nll_loss(sim: Sim, logp: T, target: T) -> T:
    out = new(sim, (), "fp32")
    total_weight = new(sim, (), "fp32")
    shape, dt = logp.shape, logp.dt
    record(sim, out, [logp], [target, total_weight], lambda node, g: [new(sim, shape, dt)])
    return out


def build_params(sim: Sim, shape, *, method: str, precision: str, lora_rank: int, lora_targets,
                 lora_dtype: str | None, param_dtype: str | None = None,
                 base_dtype: str | None = None) -> dict:
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

    h, i = shape.hidden, shape.intermediate
    M = {"embed": P((shape.vocab, h), full)}
    # rotary buffers: inv_freq and original_inv_freq (head_dim/2 floats each)
    buf_dt = param_dtype or ("bf16" if precision == "bf16" else "fp32")
    M["_buffers"] = [new(sim, (shape.head_dim // 2,), buf_dt, cat="weights") for _ in range(2)]
    ldt = param_dtype or lora_dtype or "fp32"      # peft upcasts adapters to fp32 by default
    layers = []
    lin_shapes = shape.linear_shapes()
    for _ in range(shape.layers):
        L = {}      # in torch's parameter order: self_attn, mlp, the two norms
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            d_in, d_out = lin_shapes[name]
            lin = {"w": P((d_out, d_in), full)}
            if (name != "o_proj" and shape.qkv_bias) or (name == "o_proj" and shape.o_bias):
                lin["b"] = P((d_out,), full)
            if method != "full" and name in lora_targets:
                lin["A"] = param(sim, (lora_rank, d_in), ldt, True,
                                 "master_weights" if (amp and ldt == "fp32") else "weights")
                lin["B"] = param(sim, (d_out, lora_rank), ldt, True,
                                 "master_weights" if (amp and ldt == "fp32") else "weights")
            L[name] = lin
        for name in ("gate_proj", "up_proj", "down_proj"):
            d_in, d_out = lin_shapes[name]
            lin = {"w": P((d_out, d_in), full)}
            if shape.mlp_bias:
                lin["b"] = P((d_out,), full)
            if method != "full" and name in lora_targets:
                lin["A"] = param(sim, (lora_rank, d_in), ldt, True,
                                 "master_weights" if (amp and ldt == "fp32") else "weights")
                lin["B"] = param(sim, (d_out, lora_rank), ldt, True,
                                 "master_weights" if (amp and ldt == "fp32") else "weights")
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


def shrink(sim: Sim, buf: Buf, factor: float):
    """Scale a buffer's size (ZeRO partitioning, quantized storage)."""
    new_n = int(math.ceil(buf.n * factor))
    sim.cur += new_n - buf.n
    sim.by[buf.cat] += new_n - buf.n
    buf.n = new_n


def adamw_step_scratch(sim: Sim, sizes: list[int], impl: str) -> None:
    """The scratch tensors torch's AdamW allocates in ``step()`` (``sizes``: bytes of each
    parameter's ``exp_avg_sq``, in the optimizer's parameter order).

    * ``foreach`` (``_multi_tensor_adam``): ``torch.tensor(1.0)`` for the step count, then
      ``_foreach_sqrt(exp_avg_sq)``: one copy of every state at once.
    * ``for-loop`` (``_single_tensor_adam``): per parameter ``denom = (exp_avg_sq.sqrt() / bc)
      .add_(eps)`` — the ``sqrt`` and the quotient coexist, and the previous parameter's ``denom``
      is released only when the name is rebound, after the new one exists.
    * ``fused`` (``_fused_adamw_``): updates in place, no scratch.
    """
    if impl == "foreach":
        step_one = new(sim, (), "fp32")
        tmp = [sim.alloc(n) for n in sizes]
        del tmp, step_one
    elif impl == "for-loop":
        denom = None
        for n in sizes:
            root = sim.alloc(n)
            quotient = sim.alloc(n)
            del root
            denom = quotient
            del quotient
        del denom


def simulate_step(shape, *, method="full", precision="fp32", optimizer="adamw", batch=1, seq=512,
                  lora_rank=8, lora_targets=("q_proj", "v_proj"), lora_dtype=None,
                  checkpointing=False, attn="sdpa", grad_accum=1, zero=0, gpus=1,
                  qlora_double_quant=True, optimizer_impl="foreach") -> dict:
    """Replay step 2 of training (states exist, grads start as None) and return bytes:
    ``peak``, ``breakdown`` (categories at the peak), ``activations`` (forward-allocated bytes alive
    at the end of the forward pass), ``model_states`` (weights + gradients + optimizer states +
    master weights when the optimizer step starts), ``phase_peaks``."""
    if shape.arch != "llama":
        raise NotImplementedError("the step replay models Llama-family decoders")
    sim = Sim()
    sim.set_phase("idle")
    # ZeRO >= 1 with mixed precision: DeepSpeed's layout (the ZeRO paper's), not torch AMP's. The
    # module is cast to the 16-bit dtype (weights, grads 2 B/param; no autocast), the optimizer
    # holds fp32 master weights and fp32 states for its shard only.
    zero_mp = {"fp16-amp": "fp16", "bf16-amp": "bf16"}.get(precision) if zero >= 1 else None
    # QLoRA (bitsandbytes ``load_in_4bit`` with a 16-bit ``torch_dtype``): only the Linear layers
    # inside the decoder blocks are NF4; embeddings, norms and lm_head stay in the 16-bit dtype.
    base16 = None
    if method == "qlora" and not zero_mp:
        base16 = "fp16" if precision == "fp16-amp" else "bf16"
    M = build_params(sim, shape, method=method, precision=precision, lora_rank=lora_rank,
                     lora_targets=tuple(lora_targets), lora_dtype=lora_dtype, param_dtype=zero_mp,
                     base_dtype=base16)
    params = trainable_params(M)
    if method == "qlora":
        # NF4: 4 bits per weight + one fp32 absmax per 64 weights, or (double quantization) an
        # 8-bit absmax per 64 weights + one fp32 constant per 256 blocks.
        per = 0.5 + ((1 / 64 + 4 / (64 * 256)) if qlora_double_quant else 4 / 64)
        for L in M["layers"]:
            for name, lin in L.items():
                if isinstance(lin, dict) and "w" in lin:
                    w = lin["w"]
                    shrink(sim, w.buf, per / ITEMSIZE[w.dt])
                    lin["q"] = True
    shard = 1.0 / gpus
    masters = []
    gathered_layer = None
    if zero_mp:
        masters = [new(sim, p.shape, "fp32", cat="master_weights") for p in params]
        for m in masters:
            shrink(sim, m.buf, shard)
    if zero >= 1:
        for p in params:
            if p.buf.cat == "master_weights":
                shrink(sim, p.buf, shard)
    if zero >= 3:
        for p in trainable_params(M) + [w for L in M["layers"] for lin in L.values()
                                       if isinstance(lin, dict) for w in lin.values() if isinstance(w, T) and not w.rg]:
            if p.buf.cat == "weights":
                shrink(sim, p.buf, shard)
        # the layer being computed is all-gathered (FSDP/ZeRO-3 prefetch ignored)
        layer_bytes = sum(w.nbytes for lin in M["layers"][0].values() if isinstance(lin, dict)
                          for w in lin.values() if isinstance(w, T))
        layer_bytes += sum(t.nbytes for t in M["layers"][0].values() if isinstance(t, T))
        gathered_layer = sim.alloc(layer_bytes, "weights")     # held until the step ends
        sim.param_cast_scale = shard
    sim.grad_scale = shard if zero >= 2 else 1.0
    # optimizer states (created in step 1; fp32, like the master weights, under zero_mp)
    states = []
    sdt = "fp32" if zero_mp else None
    for p in params:
        if optimizer == "adamw8bit":
            if p.numel >= 4096:     # bitsandbytes keeps small tensors in 32-bit states
                states += [new(sim, p.shape, "bool", cat="optimizer_states"),
                           new(sim, p.shape, "bool", cat="optimizer_states"),
                           new(sim, (2 * math.ceil(p.numel / 256),), "fp32", cat="optimizer_states")]
            else:
                states += [new(sim, p.shape, "fp32", cat="optimizer_states"),
                           new(sim, p.shape, "fp32", cat="optimizer_states")]
            states.append(new(sim, (), "fp32", cat="optimizer_states"))
        elif optimizer == "adamw":
            states += [new(sim, p.shape, sdt or p.dt, cat="optimizer_states"),
                       new(sim, p.shape, sdt or p.dt, cat="optimizer_states")]
            states.append(new(sim, (), "fp32", cat="optimizer_states"))      # step
        elif optimizer == "sgd-momentum":
            states.append(new(sim, p.shape, sdt or p.dt, cat="optimizer_states"))
    if zero >= 1:
        for st in states:
            shrink(sim, st.buf, shard)
    ids = new(sim, (batch, seq), "i64", cat="activations")
    labels = new(sim, (batch, seq), "i64", cat="activations")
    sim.peak = sim.cur
    sim.peak_by = dict(sim.by)
    sim.phase_peaks = {}
    cfg = {"heads": shape.heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
           "attn": attn, "checkpointing": checkpointing}
    amp = None if zero_mp else {"fp16-amp": "fp16", "bf16-amp": "bf16"}.get(precision)
    act_end = 0
    for _ in range(grad_accum):
        sim.set_phase("forward")
        sim.autocast = amp
        loss = llama_loss(sim, M, ids, labels, cfg)
        sim.autocast = None
        sim.autocast_cache = []         # leaving torch.autocast clears its cache
        if grad_accum > 1:
            loss = mul_scalar(sim, loss)
        if precision == "fp16-amp":
            loss = mul_scalar(sim, loss)            # GradScaler.scale(loss)
        sim.mark("forward_end")
        act_end = sim.marks["forward_end"]["activations"]
        sim.set_phase("backward")
        backward(sim, loss)
        del loss
    sim.set_phase("optimizer")
    sim.mark("optimizer_start")
    if optimizer == "adamw":
        part = shard if zero >= 1 else 1.0
        sizes = [int(math.ceil(p.numel * ITEMSIZE[sdt or p.dt] * part)) for p in params]
        adamw_step_scratch(sim, sizes, optimizer_impl)
    del masters, gathered_layer
    sim.set_phase("idle")
    at_step = sim.marks["optimizer_start"]
    model_states = sum(at_step[k] for k in ("weights", "gradients", "optimizer_states", "master_weights"))
    return {"peak": sim.peak, "breakdown": dict(sim.peak_by), "activations": act_end,
            "model_states": model_states,
            "phase_peaks": {k: v for k, v in sim.phase_peaks.items()
                            if k in ("forward", "backward", "optimizer")}}
