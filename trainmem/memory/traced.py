"""The decoder of any recorded model family, replayed from its data file: the forward
and backward of one micro-batch as the real ``transformers`` module runs it, storage by
storage, every size an expression in the shape's symbols (:data:`SYMBOLS`), scaled
here to the shape asked for.

The data files (``trainmem/data/families/<model_type>.json``) are written by
:mod:`trainmem.measuring.family_trace` (``python -m
trainmem.measuring.family_trace --write``), which records them from the module
itself; this module reads them with the standard library only (the book's in-page
calculator runs it in Pyodide).

A data file holds one trace per *variant*: the options that change which tensors the
step makes (:func:`variant_key`: method, precision, load and adapter dtypes, attention,
KV cache, checkpointing, LoRA targets and dropout) and the shape regime
(:func:`variant_regime`: grouped-query attention or not, tied embeddings or not,
recorded at batch > 1). Each trace: the parameters and buffers of the model (one decoder
layer's, repeated), and the events of the sections ``P`` (before the first layer),
``F`` (one layer's forward), ``Q`` (head, loss, the start of backward), ``B`` (one
layer's backward) and ``S`` (the rest of backward). An event is ``["a", expr, dtype,
kind, grad]`` (an allocation of ``expr`` elements; ``kind`` ``"w"``: autocast's copy
of a weight, ``"n"``: the noise of CPU dropout, a bool mask under CUDA's kernels;
``grad``: the parameter whose ``.grad`` it becomes), ``["f", ref]`` (the allocation
``ref`` freed), ``["fl", order, refs]`` (the same allocations of every layer freed in
turn) or ``["phase", "backward"]``.
"""

from __future__ import annotations

import ast
import json
import os
from functools import lru_cache

from ..errors import OptionError
from ..frameworks import framework
from ..precisions import precision
from .accounting import ITEMSIZE, SimTensor, Simulator
from .autograd import Node, _accumulate, param

#: the symbols a size is written in: batch, sequence, hidden, intermediate, heads,
#: key/value heads, head dim, vocabulary, LoRA rank, learned positions, layers
SYMBOLS = ("b", "s", "h", "i", "a", "k", "d", "v", "r", "p", "L")

DATA_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "families")

_ALLOWED = (
    ast.Expression,
    ast.BinOp,
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.FloorDiv,
    ast.Name,
    ast.Load,
    ast.Constant,
)


@lru_cache(maxsize=None)
def _compiled(expr: str):
    tree = ast.parse(expr, mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, _ALLOWED):
            raise ValueError(f"size expression {expr!r}: {type(node).__name__}")
        if isinstance(node, ast.Name) and node.id not in SYMBOLS:
            raise ValueError(f"size expression {expr!r}: unknown symbol {node.id!r}")
        if isinstance(node, ast.Constant) and not isinstance(node.value, int):
            raise ValueError(f"size expression {expr!r}: {node.value!r}")
    return compile(tree, expr, "eval")


def evaluate(expr: str, symbols: dict) -> int:
    """The value of the size expression ``expr`` (integers, ``+ - * //`` and
    :data:`SYMBOLS`) at ``symbols``."""
    return eval(_compiled(expr), {"__builtins__": {}}, symbols)


def step_dtypes(step) -> tuple[str, str]:
    """The load and adapter dtypes ``step`` resolves to, as
    :func:`trainmem.decisions.decide` resolves them for the steps a trace records (no
    ZeRO, no QLoRA): a trace's key names them, so an option stated (``trainmem hf``
    states the load dtype ``from_pretrained`` picks) and the same one left to its
    default find the same trace."""
    prec, frame = precision(step.precision), framework(step.framework)
    load = step.load_dtype or prec.default_load(step.method, frame.lora_16bit_load)
    return load, step.lora_dtype or frame.adapter_dtype or load


def variant_key(step, regime: dict) -> str:
    """The options and shape regime a trace is recorded for, as its data key."""
    lora = step.method != "full"
    load, adapters = step_dtypes(step)
    parts = [
        step.method,
        step.precision,
        f"load={load}",
        f"adapters={adapters if lora else '-'}",
        # flash: the same memory as sdpa; a family without an SDPA path: its own
        f"attn={regime.get('attn') or step.attn_memory}",
        f"cache={'on' if step.cache_on else 'off'}",
        "ckpt=" + (step.checkpointing_mode if step.checkpointing else "off"),
        "targets=" + (",".join(sorted(step.lora_targets)) if lora else "-"),
        f"dropout={'on' if lora and step.lora_dropout > 0 else 'off'}",
        "gqa" if regime["gqa"] else "mha",
        "tied" if regime["tied"] else "untied",
    ]
    if regime.get("fused"):
        parts.append("attn-dropout=in-kernel")
    return "|".join(parts)


def variant_regime(shape, step) -> dict:
    """The shape regime of ``shape`` (see :func:`variant_key`), and ``fused``: the
    family's attention dropout runs inside a fused SDPA kernel. On CUDA the
    memory-efficient and flash kernels take ``dropout_p`` and keep only the RNG state
    for backward; on CPU (torch's ``_fused_sdp_choice``) no fused kernel takes
    dropout, and SDPA's math path materialises the probabilities, the dropout noise
    and the dropped probabilities. The CUDA variant is recorded with the attention
    dropout at 0, where CPU's flash kernel runs and saves what the fused kernel does
    (output and logsumexp). ``attn``: the attention a family without an SDPA path
    runs whatever is asked (Gemma 2 in transformers 5: eager, what
    ``from_pretrained`` picks for it)."""
    family = shape.family  # its Family entry (trainmem.families.traced_family)
    fused = (
        family.attention_dropout is not None
        and step.kernels == "cuda"
        and step.attn_memory == "sdpa"
    )
    return dict(
        gqa=shape.kv_heads < shape.heads,
        tied=shape.tied,
        b1=False,
        fused=fused,
        attn=family.attn,
    )


def symbols(shape, step=None) -> dict:
    """The symbol values of ``shape`` (and of ``step``'s batch, sequence, rank)."""
    out = dict(
        h=shape.hidden,
        i=shape.intermediate,
        a=shape.heads,
        k=shape.kv_heads,
        d=shape.head_dim,
        v=shape.vocab,
        p=shape.positions,
        L=shape.layers,
        b=1,
        s=1,
        r=1,
    )
    if step is not None:
        out.update(b=step.batch, s=step.seq, r=step.lora_rank)
    return out


@lru_cache(maxsize=None)
def load(model_type: str) -> dict:
    """The data file of ``model_type`` (its recorded variants)."""
    path = os.path.join(DATA_DIR, f"{model_type}.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise OptionError(
            "model",
            f"model_type {model_type!r} has no recorded trace ({path}); run "
            "python -m trainmem.measuring.family_trace --write",
        ) from None


#: the libraries whose code a trace records
TRACED_LIBRARIES = ("transformers", "peft", "torch")


def other_versions(data: dict, step) -> list[str]:
    """The libraries whose versions ``step`` names differ from those ``data`` was
    recorded with (``"transformers 5.24.0"``, ...)."""
    from ..versions import _parse_version

    asked = step.library_versions
    return [
        f"{lib} {data[lib]}"
        for lib in TRACED_LIBRARIES
        if asked[lib] != _parse_version(data[lib])
    ]


def trace_for(model_type: str, key: str, step=None) -> dict:
    """The trace of ``key`` (:func:`variant_key`) for ``model_type``; a variant not
    recorded, or other library versions than it was recorded with, raise
    :class:`OptionError` naming the recorded ones."""
    data = load(model_type)
    differ = [] if step is None else other_versions(data, step)
    if differ:
        raise OptionError(
            "versions",
            f"versions: the {model_type} traces record {', '.join(differ)}; "
            "regenerate them under the versions asked "
            "(python -m trainmem.measuring.family_trace --write)",
        )
    if key not in data["variants"]:
        recorded = "; ".join(sorted(data["variants"]))
        raise OptionError(
            "model",
            f"{model_type}: the step {key} is not recorded for this family (the "
            f"replay reads the traces of trainmem/data/families/{model_type}.json: "
            f"{recorded})",
        )
    return data["variants"][key]


def recorded(shape, step) -> bool:
    """Whether the data file of ``shape``'s family holds ``step``'s variant (and the
    step is one the traced replay runs: no QLoRA, no ZeRO)."""
    if step.method == "qlora" or step.zero != 0:
        return False
    key = variant_key(step, variant_regime(shape, step))
    try:
        data = load(shape.arch)
    except OptionError:  # no data file (yet: the generator decides steps too)
        return False
    return key in data["variants"] and not other_versions(data, step)


def structure(model_type: str, regime: dict) -> dict:
    """The full fine-tuning fp32 trace of ``model_type`` in ``regime`` (batch > 1):
    its parameters define the model's Linear layers and parameter count."""
    data = load(model_type)
    tied = "tied" if regime["tied"] else "untied"
    gqa = "gqa" if regime["gqa"] else "mha"
    for key, trace in data["variants"].items():
        parts = key.split("|")
        if parts[:2] == ["full", "fp32"] and gqa in parts and tied in parts:
            return trace
    raise OptionError(
        "model", f"{model_type}: no full fine-tuning trace for a {gqa}, {tied} shape"
    )


# --------------------------------------------------------------------------------------
# expansion at a shape
# --------------------------------------------------------------------------------------
def _layer(ref, j, layers):
    if ref is None:
        return None
    kind, x = ref
    if kind == "rel":
        return j + x
    if kind == "first":
        return x
    return layers - 1 - x


def _block(part: dict, t: int, layers: int) -> list:
    head, tail = part["head"], part["tail"]
    if t < len(head):
        return head[t]
    if t >= layers - len(tail):
        return tail[t - (layers - len(tail))]
    return part["core"]


def expand(trace: dict, sym: dict, layers: int):
    """The events of ``trace`` with ``layers`` layers at the symbol values ``sym``:
    ``("a", ident, nbytes, grad, dtype, kind)``, ``("f", ident)``, ``("phase",
    name)``; ``ident`` = (section, layer, index), ``grad`` = ``(part, layer,
    index)`` of the parameter or ``None``."""
    for part in ("F", "B"):
        fixed = len(trace[part]["head"]) + len(trace[part]["tail"])
        if layers < fixed:
            raise OptionError(
                "model", f"the recorded trace needs at least {fixed} layers"
            )
    order = [("P", None, trace["P"])]
    order += [("F", j, _block(trace["F"], j, layers)) for j in range(layers)]
    order.append(("Q", None, trace["Q"]))
    order += [
        ("B", layers - 1 - t, _block(trace["B"], t, layers)) for t in range(layers)
    ]
    order.append(("S", None, trace["S"]))
    for sec, j, events in order:
        n = 0
        for e in events:
            if e[0] == "a":
                nbytes = evaluate(e[1], sym) * ITEMSIZE[e[2]]
                grad = None
                if len(e) > 4:
                    _, part, rel, k = e[4]
                    grad = ("g", part, _layer(rel, j, layers), k)
                yield ("a", (sec, j, n), nbytes, grad, e[2], e[3])
                n += 1
            elif e[0] == "f":
                tsec, rel, k = e[1]
                yield ("f", (tsec, _layer(rel, j, layers), k))
            elif e[0] == "fl":  # the same allocations of every layer, in turn
                js = range(layers) if e[1] == "asc" else range(layers - 1, -1, -1)
                part = {"head": e[2], "core": e[3], "tail": e[4]}
                for t, lj in enumerate(js):
                    for tsec, k in _block(part, t, layers):
                        yield ("f", (tsec, lj, k))
            else:
                yield tuple(e)


# --------------------------------------------------------------------------------------
# the decoder for the step replay
# --------------------------------------------------------------------------------------
class TracedModel:
    """The parameters and buffers of a recorded family's model, and the events of one
    micro-batch at the step's shape."""

    def __init__(self, params, buffers, events, n_pre, n_layer, kernels):
        self.params, self.buffers, self.events = params, buffers, events
        self.n_pre, self.n_layer = n_pre, n_layer
        # whose kernels run the step: under CUDA's fused dropout the mask is bool
        self.kernels = kernels

    def parameters(self):
        return list(self.params)

    def param_of(self, grad) -> SimTensor:
        _, part, j, k = grad
        if part == "pre":
            return self.params[k]
        n_layers = (len(self.params) - self.n_pre) // max(self.n_layer, 1)
        if part == "layer":
            return self.params[self.n_pre + j * self.n_layer + k]
        return self.params[self.n_pre + n_layers * self.n_layer + k]


def _check_step(shape, d) -> None:
    step = d.options
    if step.method == "qlora":
        raise OptionError(
            "method",
            f"method 'qlora' is not recorded for {shape.arch} (its traces run the "
            "transformers module without bitsandbytes); allowed: full, lora",
        )
    if step.zero != 0:
        raise OptionError(
            "zero",
            f"zero {step.zero}: sharding is modelled for the Llama-family replay, not "
            f"for {shape.arch}; allowed: 0",
        )


def build(sim: Simulator, shape, d):
    """The parameters and buffers of ``shape``'s model as the recorded variant holds
    them; returns the :class:`TracedModel` and its trainable parameters."""
    _check_step(shape, d)
    step = d.options
    regime = variant_regime(shape, step)
    trace = trace_for(shape.arch, variant_key(step, regime), step)
    sym = symbols(shape, step)
    amp = d.dtypes.autocast is not None
    layers = shape.layers
    pre = [p for p in trace["params"] if p[1] == "pre"]
    per_layer = [p for p in trace["params"] if p[1] == "layer"]
    post = [p for p in trace["params"] if p[1] == "post"]

    def make(entry):
        _, _, dims, dtype, trainable = entry
        dims = tuple(evaluate(x, sym) for x in dims)
        fp32_master = amp and trainable and dtype == "fp32"
        return param(
            sim, dims, dtype, trainable, "master_weights" if fp32_master else "weights"
        )

    params = [make(p) for p in pre]
    for _ in range(layers):
        params += [make(p) for p in per_layer]
    params += [make(p) for p in post]
    buffers = []
    for _, where, dims, dtype in trace["buffers"]:
        count = layers if where == "layer" else 1
        for _ in range(count):
            shape_ = tuple(evaluate(x, sym) for x in dims)
            n = 1
            for x in shape_:
                n *= x
            buffers.append(
                SimTensor(sim.alloc(n * ITEMSIZE[dtype], "weights"), shape_, dtype)
            )
    events = list(expand(trace, sym, layers))
    model = TracedModel(params, buffers, events, len(pre), len(per_layer), step.kernels)
    return model, [p for p in params if p.requires_grad]


def loss(sim: Simulator, model: TracedModel, ids, labels, cfg, held):
    """One micro-batch's forward (the events up to the backward phase); the returned
    loss's backward replays the rest. Tensors still alive at the end of backward that
    are not gradients stay alive through the optimizer step (``cfg["held"]``)."""
    live: dict = {}
    events = model.events
    n = 0
    while n < len(events) and events[n][0] != "phase":
        _apply(sim, model, live, events[n])
        n += 1
    rest = events[n + 1 :]

    def backward_fn(node, g):
        for e in rest:
            _apply(sim, model, live, e)
        cfg.setdefault("held", []).extend(live.values())
        live.clear()
        return [None]  # the events hold the gradients (of the edge below: none)

    out = SimTensor(None, (), "fp32", requires_grad=True)
    out.grad_fn = Node(next(sim.node_ids), [None], [], backward_fn)
    return out


def _apply(sim: Simulator, model: TracedModel, live: dict, e) -> None:
    if e[0] == "a":
        _, ident, nbytes, grad, dtype, kind = e
        if kind == "n" and model.kernels == "cuda":
            nbytes //= ITEMSIZE[dtype]  # native_dropout's mask: one byte an element
        t = SimTensor(sim.alloc(nbytes, "weights" if kind == "w" else None), (), dtype)
        if grad is None:
            live[ident] = t
            return
        node = model.param_of(grad).grad_accumulator
        if node.grad is None:
            _accumulate(sim, node, t)  # becomes .grad (gradients)
        # else: added in place into .grad, and freed (grad accumulation)
    elif e[0] == "f":
        live.pop(e[1], None)
