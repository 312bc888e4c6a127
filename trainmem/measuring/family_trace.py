"""Record a model family's training step as data the standard-library replay scales
(:mod:`trainmem.memory.traced`): the forward and backward of one micro-batch of the
real ``transformers`` module, storage by storage, with every size written in the
shape's symbols.

How a trace is made (:func:`record_variant`):

* The step :func:`trainmem.measure.measure` measures (same model, optimizer, loop and
  :class:`~trainmem.tracker.MemoryTracker`) runs on a tiny random-weight model built
  from the family's config class, at two *probe* shapes whose sizes are distinct
  numbers (:data:`PROBES`), with 2, 3 and 4 decoder layers.
* Hooks on the decoder layers cut the events into sections: ``P`` (before layer 0),
  ``F`` (one per layer, its forward), ``Q`` (the head, the loss and backward down to
  the last layer's output gradient), ``B`` (one per layer, its backward, read from the
  gradient of its output) and ``S`` (the rest of backward).
* Each allocation's element count is written as an expression in the symbols of
  :data:`SYMBOLS` (``b*s*h``, ``(a+2*k)*d``, ...): the one expression whose values at
  both probes are the two counts measured (:func:`symbolize`).
* Each free names the allocation it frees by section, layer (relative to the freeing
  layer, or counted from the first or the last layer) and position; the per-layer
  sections are stored once (layers whose sections differ, the first or the last, are
  stored on their own).
* The trace recorded with 3 layers is expanded at 2 and 4 layers and compared with
  those runs event by event, and at the second probe with the second probe's run: a
  trace that does not reproduce them is refused.

``python -m trainmem.measuring.family_trace --write`` regenerates every data file
(``trainmem/data/families/<model_type>.json``); ``--check`` compares them with a fresh
recording.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Any

import torch

from ..config import StepConfig
from .tracker import MemoryTracker
from ..families import MODEL_TYPES, attention_keys, linear_keys, model_type
from ..memory.traced import (
    DATA_DIR,
    SYMBOLS,
    evaluate,
    expand,
    variant_key,
)

#: the two probe shapes (distinct values, so each size has one expression)
#: (the query heads per key/value head differ too: 2 and 4, so ``a`` and ``2*k`` are
#: told apart; the hidden size is a multiple of the heads and not ``a*d``, as
#: Gemma 3's config requires and so that ``h`` and ``a*d`` are told apart)
PROBES = (
    dict(b=3, s=17, a=6, k=3, d=8, h=54, i=52, v=97, r=5, p=29),
    dict(b=5, s=19, a=8, k=2, d=14, h=96, i=100, v=131, r=7, p=31),
)


def probe_symbols(mt, probe: dict, regime: dict) -> dict:
    """The probe's symbol values for model type ``mt`` in ``regime`` (``gqa``,
    ``tied``, ``b1``): symbols the config cannot set are derived as its class
    derives them (``d = h // a``, ``k = a``)."""
    sym = dict(probe)
    if regime["b1"]:
        sym["b"] = 1
    if not regime["gqa"]:
        sym["k"] = sym["a"]
    if "d" not in mt.fields:
        sym["h"] = sym["a"] * sym["d"]
    return sym


def probe_config(mt, sym: dict, layers: int, regime: dict):
    """A ``transformers`` config of model type ``mt`` at the symbol values ``sym``."""
    import transformers

    fields = {}
    for symbol, field in mt.fields.items():
        if symbol in sym:
            fields[field] = sym[symbol]
    fields[mt.fields["L"]] = layers
    if "tied" in mt.fields:
        fields[mt.fields["tied"]] = regime["tied"]
    fields.update(mt.probe_fields)
    if mt.probe_layer_type:
        fields["layer_types"] = [mt.probe_layer_type] * layers
    if regime.get("fused"):
        # CUDA's fused SDPA applies the dropout inside the kernel: recorded where
        # CPU's flash kernel runs, at attention dropout 0 (traced.variant_regime)
        fields[mt.attention_dropout] = 0.0
    cfg = getattr(transformers, mt.config_class)(**fields)
    cfg.name_or_path = f"{mt.name}-probe"
    return cfg


# --------------------------------------------------------------------------------------
# one run: the events of the tracked step
# --------------------------------------------------------------------------------------
def _decoder_layers(model, n: int):
    """The ``ModuleList`` of the ``n`` decoder layers."""
    found = [
        m
        for m in model.modules()
        if isinstance(m, torch.nn.ModuleList)
        and len(m) == n
        and all(type(x) is type(m[0]) for x in m)
    ]
    if not found:
        raise RuntimeError(f"no ModuleList of {n} decoder layers in the model")
    return found[0]


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)) and x and isinstance(x[0], torch.Tensor):
        return x[0]
    return None


def run_events(config, step: StepConfig, layers: int) -> dict:
    """The events of one forward and backward of ``config`` (``layers`` decoder
    layers) under ``step``, as :func:`trainmem.measure.measure` runs them: parameters
    (name, shape, dtype, trainable), buffers and a flat list of events."""
    from ..decisions import decide
    from .measure import _TrackedTraining
    from .training_setup import build_training_setup
    from ..families import model_shape

    torch.manual_seed(0)
    model, opt = build_training_setup(config, step, device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(0)
    inputs = torch.randint(
        0, config.vocab_size, (step.batch, step.seq), generator=generator
    )
    d = decide(model_shape(config), step)
    training = _TrackedTraining(model, opt, inputs, d, "cpu", False)
    tracker = training.tracker
    tracker.__class__ = _NoiseTracker  # notes the storages bernoulli_ fills
    tracker.noise = set()
    marks: list[tuple[int, tuple]] = []
    state = {"on": False}
    phase_of = tracker.set_phase

    def set_phase(phase):
        if state["on"]:
            marks.append((tracker.event, ("phase", phase)))
        phase_of(phase)

    tracker.set_phase = set_phase
    layer_list = _decoder_layers(model, layers)
    handles = []

    def mark(tag):
        if state["on"]:
            marks.append((tracker.event, tag))

    def grad_hook(tag):
        def hook(grad):
            mark(tag)

        return hook

    for j, layer in enumerate(layer_list):

        def pre(mod, args, kwargs, j=j):
            if not state["on"] or tracker.phase != "forward":
                return
            mark(("fs", j))
            if j == 0:
                x = _first_tensor(args) if args else None
                if x is None:
                    x = kwargs.get("hidden_states")
                if x is not None and x.requires_grad:
                    x.register_hook(grad_hook(("bi", 0)))

        def post(mod, args, kwargs, out, j=j):
            if not state["on"] or tracker.phase != "forward":
                return
            mark(("fe", j))
            y = _first_tensor(out)
            if y is not None and y.requires_grad:
                y.register_hook(grad_hook(("bo", j)))

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    try:
        # one forward and backward from gradients None, as in every step after the
        # first (``zero_grad(set_to_none=True)``); the optimizer's part of the step is
        # the replay's own (trainmem.memory.optimizer_step)
        with tracker, _attention(step):
            start = tracker.event
            state["on"] = True
            training._forward_backward(track=True)
            training.marks["grads"] = [
                None if p.grad is None else tracker.record_of(p.grad)
                for p in training.trainable
            ]
            tracker.set_phase("optimizer")
            state["on"] = False
    finally:
        for h in handles:
            h.remove()
    names = {id(p): n for n, p in model.named_parameters()}
    params = [
        (names[id(p)], tuple(p.shape), _dtype(p.dtype), p.requires_grad)
        for p in model.parameters()
    ]
    buffers = [(n, tuple(b.shape), _dtype(b.dtype)) for n, b in model.named_buffers()]
    grad_of = {}
    for k, record in enumerate(training.marks["grads"]):
        if record is not None:
            grad_of[id(record)] = k
    trainable = [k for k, p in enumerate(model.parameters()) if p.requires_grad]
    grad_param = {rid: trainable[k] for rid, k in grad_of.items()}
    flat = []
    for record in tracker.records:
        if record.alloc > start:
            flat.append((record.alloc, "a", record))
        if record.free is not None and record.free > start:
            flat.append((record.free, "f", record))
    for event, tag in marks:
        flat.append((event + 0.5, "m", tag))
    flat.sort(key=lambda e: e[0])
    events = []
    for _, kind, x in flat:
        if kind == "m":
            events.append(("m", x))
        elif kind == "a":
            events.append(("a", x, grad_param.get(id(x))))
        else:
            events.append(("f", x))
    noise = set(tracker.noise)
    model = opt = training = None
    return {
        "params": params,
        "buffers": buffers,
        "events": events,
        "start": start,
        "noise": noise,
    }


class _NoiseTracker(MemoryTracker):
    """The tracker, noting the storages ``bernoulli_`` fills: the noise tensor of
    ATen's CPU dropout (``_dropout_impl``: ``empty_like(x).bernoulli_(1 - p)``, in
    ``x``'s dtype), where CUDA's fused ``native_dropout`` keeps a bool mask."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.bernoulli_ and args:
            record = self.record_of(args[0])
            if record is not None:
                self.noise.add(id(record))
        return super().__torch_dispatch__(func, types, args, kwargs)


def _attention(step):
    from .measure import _attention_backend

    return _attention_backend(step.attn)


def _dtype(dtype) -> str:
    from ..dtypes import DTYPES

    name = str(dtype).replace("torch.", "")
    for entry in DTYPES.values():
        if entry.torch == name:
            return entry.name
    # other dtypes (bool, int32) by their size: only the bytes are replayed
    by_size = {1: "u8", 2: "bf16", 4: "fp32", 8: "i64"}
    return by_size[torch.empty((), dtype=dtype).element_size()]


# --------------------------------------------------------------------------------------
# sizes as expressions
# --------------------------------------------------------------------------------------
def _plausible() -> list[str]:
    """The expressions a size may be, simplest first: constants, a symbol (times 2, 3,
    4), products of up to four symbols (flattened dims, whole element counts), and
    the forms of fused projections and shifted labels (``(a+2*k)*d``, ``s+1``, ...),
    alone or times a symbol."""
    names = [x for x in SYMBOLS if x != "L"]
    out = [str(c) for c in range(0, 9)]
    for x in names:
        out += [x] + [f"{c}*{x}" for c in (2, 3, 4)]
    for degree in range(2, 5):
        for combo in itertools.combinations_with_replacement(names, degree):
            out.append("*".join(combo))
    for extra in (
        "s+1",
        "s-1",
        "a+2*k",
        "d//2",
        "a*d",
        "k*d",
        "(a+2*k)*d",
        "2*i",
        "a//k",
    ):
        out.append(extra)
        out += [f"{x}*({extra})" for x in names]
        out += [f"b*s*({extra})"]
    return out


def _candidates(sym_values: list[dict]) -> dict[tuple, str]:
    """Expressions by their values at the probes, simplest first (a value pair keeps
    the first expression that gives it)."""
    out: dict[tuple, str] = {}
    for expr in _plausible():
        key = tuple(evaluate(expr, s) for s in sym_values)
        out.setdefault(key, expr)
    return out


def symbolize(values: tuple, cands: dict) -> str:
    """The expression of :func:`_candidates` whose values at the probes are
    ``values``."""
    if values in cands:
        return cands[values]
    raise ValueError(
        f"no expression in the shape's symbols gives {values} at the probes"
    )


def _size_pairs(rec_pair) -> tuple[list[tuple], int]:
    """(dims as value pairs, itemsize) of an allocation seen at both probes."""
    r1, r2 = rec_pair
    item = torch.empty((), dtype=r1.dtype).element_size()
    n1 = 1
    for x in r1.shape:
        n1 *= x
    n2 = 1
    for x in r2.shape:
        n2 *= x
    if (
        len(r1.shape) == len(r2.shape)
        and n1 * item == r1.nbytes
        and n2 * item == r2.nbytes
    ):
        return list(zip(r1.shape, r2.shape)), item
    return [(r1.nbytes // item, r2.nbytes // item)], item


# --------------------------------------------------------------------------------------
# sections and templates
# --------------------------------------------------------------------------------------
def _sections(events: list, layers: int) -> list[tuple[str, int | None, list]]:
    """Cut a run's events at the layer marks: (section, layer, events)."""
    cuts = {}
    for n, e in enumerate(events):
        if e[0] == "m" and e[1][0] in ("fs", "fe", "bo", "bi"):
            cuts.setdefault(e[1], n)
    bounds = [("P", None, 0, cuts[("fs", 0)])]
    for j in range(layers):
        # what runs between two layers (a layer's output unpacked) is the first's
        end = cuts[("fs", j + 1)] if j + 1 < layers else cuts[("fe", j)]
        bounds.append(("F", j, cuts[("fs", j)], end))
    bounds.append(("Q", None, cuts[("fe", layers - 1)], cuts[("bo", layers - 1)]))
    for j in reversed(range(layers)):
        end = cuts[("bo", j - 1)] if j else cuts.get(("bi", 0))
        if end is None:
            end = next(
                n
                for n, e in enumerate(events)
                if e[0] == "m" and e[1] == ("phase", "optimizer")
            )
        bounds.append(("B", j, cuts[("bo", j)], end))
    optimizer = next(
        n
        for n, e in enumerate(events)
        if e[0] == "m" and e[1] == ("phase", "optimizer")
    )
    bounds.append(("S", None, bounds[-1][3], optimizer))

    def kept(e, j):
        if e[0] == "a" and j is None and _python_scalar(e[1]):
            return False
        return e[0] != "m" or e[1] == ("phase", "backward")

    return [(sec, j, [e for e in events[a:b] if kept(e, j)]) for sec, j, a, b in bounds]


def _python_scalar(record) -> bool:
    """A 0-d tensor made from a Python number (``torch.tensor(x)``: ``lift_fresh``)
    outside the layers: Gemma 3 makes one per layer before the first; left out of
    the trace (8 bytes each), with its free."""
    return record.shape == () and record.op is torch.ops.aten.lift_fresh.default


def build_trace(run: dict, run2: dict, layers: int, sym: list[dict]) -> dict:
    """The template of the run with ``layers`` layers (``run``) and the same run at
    the second probe (``run2``): sections with symbolic sizes, frees by reference."""
    cands = _candidates(sym)
    ev1 = [e for e in run["events"]]
    ev2 = [e for e in run2["events"]]
    if len(ev1) != len(ev2) or any(a[0] != b[0] for a, b in zip(ev1, ev2)):
        raise RuntimeError("the two probes ran different events")
    # the expression of every allocation
    exprs: dict[int, tuple[str, str]] = {}
    for a, b in zip(ev1, ev2):
        if a[0] == "a":
            dims, _ = _size_pairs((a[1], b[1]))
            parts = [symbolize(pair, cands) for pair in dims]
            if "0" in parts:
                parts = ["0"]
            parts = [p for p in parts if p != "1"] or ["1"]
            exprs[id(a[1])] = ("*".join(_paren(p) for p in parts), _dtype(a[1].dtype))
    secs = _sections(ev1, layers)
    where: dict[int, tuple] = {}  # id(record) -> (section, layer, index)
    for sec, j, evs in secs:
        n = 0
        for e in evs:
            if e[0] == "a":
                where[id(e[1])] = (sec, j, n)
                n += 1
    n_params = len(run["params"])
    layer_params = _layer_param_slices(run["params"], layers)
    out_secs = []
    for sec, j, evs in secs:
        out = []
        for e in evs:
            if e[0] == "m":
                out.append(["phase", "backward"])
            elif e[0] == "a":
                rec = e[1]
                ex, dt = exprs[id(rec)]
                grad = None
                if e[2] is not None:
                    grad = _param_ref(e[2], layer_params, n_params, j, layers)
                kind = "w" if rec.cast_of_param else ""
                if id(rec) in run["noise"]:
                    kind = "n"  # CPU dropout's noise (a bool mask on CUDA)
                out.append(["a", ex, dt, kind] + ([grad] if grad else []))
            else:
                target = where.get(id(e[1]))
                if target is None:
                    continue  # allocated before the step (not in the trace)
                out.append(["f", target])
        out = _sorted_frees(out)
        if j is None:
            out = _per_layer_frees(out, layers)
        out = [["f", _ref(e[1], j, layers)] if e[0] == "f" else e for e in out]
        out_secs.append((sec, j, out))
    return _fold(out_secs, layers)


_SECTION_ORDER = {"P": 0, "F": 1, "Q": 2, "B": 3, "S": 4}


def _target_key(target) -> tuple:
    sec, j, k = target
    return (_SECTION_ORDER[sec], -1 if j is None else j, k)


def _sorted_frees(events: list) -> list:
    """Each run of consecutive frees in one order (by section, layer, position):
    frees with no allocation between them leave the same bytes in any order, and
    some come in an order of their own (``torch.autocast`` clearing its cache of
    weight casts, a hash map, as the region exits)."""
    out: list = []
    run: list = []
    for e in events:
        if e[0] == "f":
            run.append(e)
            continue
        out.extend(sorted(run, key=lambda x: _target_key(x[1])))
        run = []
        out.append(e)
    out.extend(sorted(run, key=lambda x: _target_key(x[1])))
    return out


def _per_layer_frees(events: list, layers: int) -> list:
    """Runs of frees, outside the layers, of the same allocations of every layer in
    turn (the KV cache as the model output is dropped, autocast's weight casts as its
    region exits) as one event ``["fl", order, head, core, tail]`` (``order``:
    ``"asc"`` from layer 0, ``"desc"`` from the last; ``core``: the ``[section,
    index]`` freed of each layer, ``head``/``tail``: those of the first/last layers
    in that order where they differ)."""
    out: list = []
    n = 0
    while n < len(events):
        e = events[n]
        if e[0] != "f" or e[1][1] is None:
            out.append(e)
            n += 1
            continue
        m = n
        while m < len(events) and events[m][0] == "f" and events[m][1][1] is not None:
            m += 1
        groups: list = []
        for sec, j, k in (x[1] for x in events[n:m]):
            if groups and groups[-1][0] == j:
                groups[-1][1].append([sec, k])
            else:
                groups.append((j, [[sec, k]]))
        order = [g[0] for g in groups]
        refs = [g[1] for g in groups]
        if order in (list(range(layers)), list(reversed(range(layers)))):
            core = refs[len(refs) // 2]
            head = []
            while len(head) < len(refs) and refs[len(head)] != core:
                head.append(refs[len(head)])
            tail: list = []
            while len(tail) < len(refs) - len(head) and refs[-1 - len(tail)] != core:
                tail.insert(0, refs[-1 - len(tail)])
            middle = refs[len(head) : len(refs) - len(tail)]
            if middle and all(r == core for r in middle):
                kind = "asc" if order[0] == 0 else "desc"
                out.append(["fl", kind, head, core, tail])
                n = m
                continue
        out.extend(events[n:m])
        n = m
    return out


def _paren(p: str) -> str:
    return f"({p})" if ("+" in p or "-" in p) and not p.startswith("(") else p


def _layer_param_slices(params, layers):
    """Index ranges of each layer's parameters (names containing ``.{j}.``)."""
    idx: dict[int, list[int]] = {j: [] for j in range(layers)}
    for k, (name, *_rest) in enumerate(params):
        parts = name.split(".")
        for j in range(layers):
            if str(j) in parts and _is_layer_name(parts, j):
                idx[j].append(k)
                break
    return idx


def _is_layer_name(parts, j):
    n = parts.index(str(j))
    return n > 0 and parts[n - 1] in ("layers", "h", "layer", "blocks")


def _param_ref(k, layer_params, n_params, j, layers):
    for lj, ks in layer_params.items():
        if k in ks:
            return ["g", "layer", _layer_rel(lj, j, layers), ks.index(k)]
    before = min(layer_params[0]) if layer_params[0] else n_params
    if k < before:
        return ["g", "pre", None, k]
    after = max(layer_params[layers - 1]) + 1
    return ["g", "post", None, k - after]


def _layer_rel(target_j, j, layers):
    if j is not None:
        return ["rel", target_j - j]
    if target_j < (layers - 1) / 2:
        return ["first", target_j]
    return ["last", layers - 1 - target_j]


def _ref(target, j, layers):
    sec, tj, n = target
    if tj is None:
        return [sec, None, n]
    return [sec, _layer_rel(tj, j, layers), n]


def _fold(secs, layers) -> dict:
    """Store each per-layer section once: the blocks equal to the middle layers'
    (``core``), the first and last ones apart when they differ."""
    out: dict[str, Any] = {}
    for name in ("P", "Q", "S"):
        out[name] = next(evs for sec, _, evs in secs if sec == name)
    for name in ("F", "B"):
        blocks = {j: evs for sec, j, evs in secs if sec == name}
        # in processing order: forward from layer 0, backward from the last layer
        order = list(range(layers)) if name == "F" else list(reversed(range(layers)))
        seq = [blocks[j] for j in order]
        core = seq[len(seq) // 2]
        head = []
        while len(head) < len(seq) and seq[len(head)] != core:
            head.append(seq[len(head)])
        tail = []
        while len(tail) < len(seq) - len(head) and seq[-1 - len(tail)] != core:
            tail.insert(0, seq[-1 - len(tail)])
        if any(b != core for b in seq[len(head) : len(seq) - len(tail)]):
            raise RuntimeError(f"the {name} blocks of the layers do not repeat")
        out[name] = {"head": head, "core": core, "tail": tail}
    return out


# --------------------------------------------------------------------------------------
# one variant: record, fold, verify
# --------------------------------------------------------------------------------------
def _numeric(run: dict, layers: int) -> list:
    """A run's events as (kind, nbytes, section, layer, index) for comparison."""
    secs = _sections(run["events"], layers)
    where = {}
    out = []
    for sec, j, evs in secs:
        n = 0
        for e in evs:
            if e[0] == "m":
                continue
            if e[0] == "a":
                where[id(e[1])] = (sec, j, n)
                n += 1
                out.append(("a", e[1].nbytes, e[2]))
            else:
                t = where.get(id(e[1]))
                if t is not None:
                    out.append(("f", t))
    return _sorted_frees(out)


def _grad_index(params, layers):
    """The flat parameter index of a gradient reference, for comparison."""
    slices = _layer_param_slices(params, layers)
    after = max(slices[layers - 1]) + 1

    def index(ref):
        if ref is None:
            return None
        _, part, j, k = ref
        if part == "pre":
            return k
        if part == "post":
            return after + k
        return slices[j][k]

    return index


def record_variant(mt, step: StepConfig, regime: dict) -> dict:
    """The trace of model type ``mt`` under ``step`` in ``regime``: recorded with 3
    layers at both probes, verified against runs with 2 and 4 layers and at the
    second probe."""
    syms = [probe_symbols(mt, p, regime) for p in PROBES]
    steps = [
        dataclasses.replace(step, batch=s["b"], seq=s["s"], lora_rank=s["r"])
        for s in syms
    ]
    runs = {
        (0, n): run_events(probe_config(mt, syms[0], n, regime), steps[0], n)
        for n in (2, 3, 4)
    }
    runs[(1, 3)] = run_events(probe_config(mt, syms[1], 3, regime), steps[1], 3)
    trace = build_trace(runs[(0, 3)], runs[(1, 3)], 3, syms)
    trace["params"] = _param_template(
        runs[(0, 3)]["params"], runs[(1, 3)]["params"], 3, syms
    )
    trace["buffers"] = _buffer_template(
        runs[(0, 3)]["buffers"], runs[(1, 3)]["buffers"], 3, syms
    )
    for (probe, n), run in runs.items():
        index = _grad_index(run["params"], n)
        want = _numeric(run, n)
        got = []
        for e in expand(trace, syms[probe], n):
            if e[0] == "a":
                got.append(("a", e[2], index(e[3])))
            elif e[0] == "f":
                got.append(("f", e[1]))
        got = _sorted_frees(got)
        if got != want:
            first = next(
                (i for i, (x, y) in enumerate(zip(got, want)) if x != y),
                min(len(got), len(want)),
            )
            raise RuntimeError(
                f"{mt.name} {variant_key(step, regime)}: the trace does not reproduce "
                f"the run with {n} layers at probe {probe + 1} (event {first}: "
                f"{got[first : first + 2]} vs {want[first : first + 2]}, "
                f"{len(got)} vs {len(want)} events)"
            )
    return trace


def _param_template(p1, p2, layers, syms):
    cands = _candidates(syms)
    slices = _layer_param_slices(p1, layers)
    in_layer = {k: j for j, ks in slices.items() for k in ks}
    out = []
    for k, ((name, sh1, dt, tr), (_, sh2, _, _)) in enumerate(zip(p1, p2)):
        j = in_layer.get(k)
        if j not in (None, 0):
            continue
        dims = [symbolize(pair, cands) for pair in zip(sh1, sh2)]
        part = (
            "pre"
            if j is None and k < min(slices[0])
            else ("layer" if j == 0 else "post")
        )
        out.append([name, part, dims, dt, tr])
    return out


def _buffer_template(b1, b2, layers, syms):
    cands = _candidates(syms)
    out = []
    for (name, sh1, dt), (_, sh2, _) in zip(b1, b2):
        parts = name.split(".")
        layer = next(
            (j for j in range(layers) if str(j) in parts and _is_layer_name(parts, j)),
            None,
        )
        if layer not in (None, 0):
            continue
        dims = [symbolize(pair, cands) for pair in zip(sh1, sh2)]
        out.append([name, "layer" if layer == 0 else "model", dims, dt])
    return out


#: the steps recorded for every model type, in each regime its configs can take: the
#: four (method, precision) pairs, and the recipes readers run on top of them --
#: fp16 autocast with loss scaling (GPUs without bf16: T4, V100), transformers 5's
#: 16-bit load under autocast (a 16-bit checkpoint loaded by
#: from_pretrained's default) and 4.x's fp32 load under LoRA, pure bf16, activation
#: checkpointing (transformers 5's non-reentrant default), LoRA on every linear layer
#: (``ALL_LINEAR``: peft's ``target_modules="all-linear"``, the family's own names) and
#: LoRA dropout. A step not listed is refused by name.
ALL_LINEAR = "all-linear"
#: LoRA on the attention block's linear layers (q, k, v, o; Phi-3's qkv_proj and
#: o_proj; GPT-2's c_attn and attn.c_proj): the other target list guides print
ATTENTION = "attention"
RECORDED = (
    dict(method="full", precision="fp32"),
    dict(method="lora", precision="fp32"),
    dict(method="full", precision="bf16-amp"),
    dict(method="lora", precision="bf16-amp"),
    dict(method="full", precision="fp16-amp"),
    dict(method="lora", precision="fp16-amp"),
    dict(method="full", precision="bf16-amp", load_dtype="bf16"),
    dict(method="lora", precision="bf16-amp", load_dtype="fp32"),
    dict(method="full", precision="bf16"),
    dict(method="lora", precision="bf16"),
    dict(method="full", precision="fp32", checkpointing=True),
    dict(method="full", precision="bf16-amp", checkpointing=True),
    dict(method="lora", precision="bf16-amp", checkpointing=True),
    dict(method="lora", precision="bf16-amp", lora_targets=ALL_LINEAR),
    dict(
        method="lora", precision="bf16-amp", lora_targets=ALL_LINEAR, checkpointing=True
    ),
    dict(method="lora", precision="bf16-amp", lora_dropout=0.05),
    # the LoRA recipe most guides print (r 16, dropout 0.05, all linear layers,
    # checkpointing), and its parts; the same on fp16 for GPUs without bf16
    dict(
        method="lora", precision="bf16-amp", lora_targets=ALL_LINEAR, lora_dropout=0.05
    ),
    dict(method="lora", precision="bf16-amp", checkpointing=True, lora_dropout=0.05),
    dict(
        method="lora",
        precision="bf16-amp",
        lora_targets=ALL_LINEAR,
        checkpointing=True,
        lora_dropout=0.05,
    ),
    dict(method="lora", precision="bf16-amp", lora_targets=ATTENTION),
    dict(
        method="lora",
        precision="bf16-amp",
        lora_targets=ATTENTION,
        checkpointing=True,
        lora_dropout=0.05,
    ),
    dict(method="lora", precision="fp16-amp", checkpointing=True),
    dict(
        method="lora",
        precision="fp16-amp",
        lora_targets=ALL_LINEAR,
        checkpointing=True,
        lora_dropout=0.05,
    ),
)


def recorded_steps(
    mt, all_linear: tuple[str, ...], attention: tuple[str, ...] = ()
) -> list[StepConfig]:
    """The :class:`StepConfig` of each :data:`RECORDED` step for model type ``mt``
    (``all_linear``, ``attention``: its LoRA target names for ``ALL_LINEAR`` and
    ``ATTENTION``)."""
    named = {ALL_LINEAR: all_linear, ATTENTION: attention}
    steps = []
    for options in RECORDED:
        options = dict(options)
        targets = options.pop("lora_targets", mt.lora_default)
        steps.append(
            StepConfig(
                lora_targets=named.get(targets, targets),
                optimizer="adamw",
                attn=mt.attn or "sdpa",
                **options,
            )
        )
    return steps


def all_linear_targets(trace: dict) -> tuple[str, ...]:
    """The LoRA targets ``target_modules="all-linear"`` gives the model of a full
    fine-tuning ``trace``: every 2-D weight of a decoder layer (peft leaves the
    output layer out)."""
    layer = [
        (name, dims) for name, part, dims, _, _ in trace["params"] if part == "layer"
    ]
    return tuple(key for key, _ in linear_keys(layer))


def attention_targets(trace: dict) -> tuple[str, ...]:
    """The linear layers of a decoder layer's attention block (their parameter names
    pass through an ``attn`` module: ``self_attn``, GPT-2's ``attn``), named as
    :func:`all_linear_targets` names them."""
    layer = [
        (name, dims) for name, part, dims, _, _ in trace["params"] if part == "layer"
    ]
    return attention_keys(layer)


def regimes(mt) -> list[dict]:
    """The shape regimes recorded for ``mt`` (:attr:`ModelType.regimes`: grouped-query
    attention or not, tied embeddings or not; batch > 1; with an attention dropout,
    CPU's SDPA and CUDA's fused one)."""
    fused = (False, True) if mt.attention_dropout else (False,)
    return [
        dict(gqa=g, tied=t, b1=False, fused=f, attn=mt.attn)
        for g, t in mt.regimes
        for f in fused
    ]


def record_model_type(name: str, progress=None) -> dict:
    """Every recorded variant of model type ``name`` (the data file's content)."""
    mt = model_type(name)
    variants = {}
    for regime in regimes(mt):
        # the first step is full fine-tuning: its parameters name the linear layers
        first = recorded_steps(mt, ())[0]
        structure = record_variant(mt, first, regime)
        all_linear = all_linear_targets(structure)
        attention = attention_targets(structure)
        for step in recorded_steps(mt, all_linear, attention):
            key = variant_key(step, regime)
            if progress:
                progress(f"{name}: {key}")
            variants[key] = (
                structure if step == first else record_variant(mt, step, regime)
            )
    return {
        "model_type": name,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "torch": torch.__version__.split("+")[0],
        "variants": variants,
    }


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def data_path(name: str) -> str:
    return os.path.join(DATA_DIR, f"{name}.json")


def dumps(data: dict) -> str:
    """The data file's text (one event a line, so a diff reads)."""
    return json.dumps(data, separators=(",", ":"), sort_keys=True) + "\n"


def traced_model_types() -> list[str]:
    return [m.name for m in MODEL_TYPES.values() if m.fields]


def main(argv=None) -> int:
    """``python -m trainmem.measuring.family_trace [--write | --check] [type ...]``:
    record the traces of the model types (default: all recorded ones) and write
    their data files, or compare them with the files."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m trainmem.measuring.family_trace")
    parser.add_argument("model_types", nargs="*", default=traced_model_types())
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for name in args.model_types:
        data = record_model_type(name, progress=lambda m: print(m, flush=True))
        text = dumps(data)
        path = data_path(name)
        if args.write:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"wrote {path}", flush=True)
        else:
            try:
                with open(path, encoding="utf-8") as f:
                    current = f.read()
            except FileNotFoundError:
                current = None
            if current != text:
                stale.append(name)
    if stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
