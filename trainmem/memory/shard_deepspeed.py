"""DeepSpeed ZeRO in the replay (the ``"deepspeed"`` entry of
:mod:`trainmem.sharding`): parameters gathered module by module as DeepSpeed's trace
uses them, with its prefetch bucket, its persistence threshold (small parameters never
partitioned) and its reuse distance (layers kept gathered from the forward into the
backward); the gradients copied into a contiguous bucket. Its sizes (defaults and the
Trainer's ``"auto"``) are :mod:`trainmem.deepspeed`'s."""

from __future__ import annotations

from .. import deepspeed
from .accounting import ITEMSIZE, Simulator
from .shard_plan import ShardReplay, Weights


def _sizes(which: str, hidden: int):
    return deepspeed.sizes(which, hidden)


def _persisted(model, weights: Weights, sizes) -> set:
    """DeepSpeed never partitions a parameter of fewer elements than
    stage3_param_persistence_threshold (ds_persist): it stays whole on every rank and
    is not gathered (its optimizer partition is still 1/N)."""
    threshold = sizes.persistence_threshold
    return {id(p) for p in model.parameters() if weights.elements([p]) < threshold}


def _gather(sim: Simulator, model, step, weights: Weights, persisted, sizes):
    """What DeepSpeed holds gathered of the decoder layers at the backward's peak
    (:func:`_deepspeed_gathered`), the layers it keeps from the forward into the
    backward (:func:`_deepspeed_kept`, held by ``sim.sharded`` from the end of the
    decoder stack), and the embeddings and lm_head gathered one module at a time when
    their module runs and released after it unless reused soon (max_reuse_distance):
    the embedding for its forward, lm_head from its forward to its backward (the
    decoder gathers them through ``sim.sharded``). No root unit stays gathered."""
    gathered_bytes, elements = weights.gathered_bytes, weights.elements
    unit = [t for t in model.layers[0].tensors() if id(t) not in persisted]
    live = _deepspeed_gathered(
        model, step, gathered_bytes(unit), gathered_bytes, elements, persisted, sizes
    )
    sim.sharded.kept_bytes = _deepspeed_kept(
        model, step, gathered_bytes, elements, persisted, sizes, live
    )
    sim.sharded.gathered_modules = {
        id(p): gathered_bytes([p])
        for p in (model.embed, model.lm_head)
        if id(p) not in persisted
    }
    return sim.alloc(live, "weights"), None


def _gradients(sim: Simulator, model, params, step, sizes):
    """DeepSpeed's contiguous gradient bucket (:mod:`trainmem.deepspeed`), in the
    module's dtype (the trainable parameters'): ZeRO-3 allocates it with the optimizer
    and keeps it; ZeRO-2 allocates it when each backward starts and drops it after the
    reduction. Each gradient is copied into it by its hook, so no unit's unsharded
    gradient waits beside it."""
    nbytes = sizes.reduce_bucket * ITEMSIZE[params[0].dtype] if params else 0
    if step.zero >= 3:
        return sim.alloc(nbytes, "gradients")
    sim.sharded.backward_bucket_bytes = nbytes
    return None


def _layer_groups(layer) -> list[list[tuple[str, list]]]:
    """A decoder layer's modules with parameters, in the order its forward runs them,
    grouped by what a Linear is under peft: its base weight and bias, then its
    lora_A and lora_B modules (a norm is a group of its own)."""
    out = [[("input_layernorm", [layer.input_layernorm])]]
    for name, lin in layer.linears.items():
        if name == "gate_proj":
            out.append([("post_attention_layernorm", [layer.post_attention_layernorm])])
        group = [(name, [t for t in (lin.w, lin.b) if t is not None])]
        group += [
            (f"{name}.lora_{ab}", [t])
            for ab, t in (("A", lin.A), ("B", lin.B))
            if t is not None
        ]
        out.append(group)
    return out


def _needing_grad(layers, embed_grad: bool) -> list[set]:
    """Per layer, the names of the modules whose output requires grad (DeepSpeed
    registers a module's backward hook only on such outputs): a module's output
    does when its input does or it has a trainable parameter; peft's lora_A and
    lora_B always do. ``embed_grad``: whether the embeddings' output does (trainable
    embeddings, or transformers' enable_input_require_grads under checkpointing)."""
    h, out = embed_grad, []
    for modules in layers:
        trains = {name: any(t.requires_grad for t in ts) for name, ts in modules}
        grad = {}

        def linear(name: str, x: bool) -> bool:
            grad[name] = x or trains[name]
            for part in ("lora_A", "lora_B", "wrapper"):
                if f"{name}.{part}" in trains:
                    grad[f"{name}.{part}"] = True
            return grad[name] or f"{name}.lora_B" in trains

        grad["input_layernorm"] = h or trains["input_layernorm"]
        attn = [linear(n, grad["input_layernorm"]) for n in ATTENTION]
        h = linear("o_proj", any(attn)) or h
        grad["post_attention_layernorm"] = h or trains["post_attention_layernorm"]
        act = [linear(n, grad["post_attention_layernorm"]) for n in MLP_IN]
        h = linear("down_proj", any(act)) or h
        out.append({name for name, g in grad.items() if g})
    return out


ATTENTION = ("q_proj", "k_proj", "v_proj")


MLP_IN = ("gate_proj", "up_proj")


def deepspeed_trace(model, step, elements, sizes) -> tuple[list, int]:
    """One step's module uses as DeepSpeed ZeRO-3 records them (its
    ``__submodule_order`` of a forward and backward), and how many of them the
    forward's decoder stack ends at: ``([(key, tensors), ...], n)``. Keys:
    ``"embed"``, ``(layer, module name)`` (:func:`_layer_groups`), ``"norm"``,
    ``"lm_head"``. The forward: the embeddings,
    every layer's modules, the final norm and lm_head; the backward: lm_head, the
    final norm, and per layer from the last its modules in reverse, then the
    embeddings — in the backward only the modules whose output requires grad
    (:func:`_needing_grad`). Under checkpointing a layer's forward is recomputed
    inside its backward, and its modules fetch their parameters again: reentrant
    checkpointing recomputes before any of the layer's backward hooks; non-reentrant
    recomputes when the first saved tensor is unpacked, which is after the backward
    hook of the layer's last module (the one its output's gradient reaches first)
    has fetched it. peft's LoRA wrapper reads ``lora_A.weight`` (its dtype, to cast
    the input) before lora_A runs; a partitioned lora_A weight is then gathered for
    the wrapper and DeepSpeed registers it as the wrapper's external parameter, so
    the wrapper is a module of the trace with that weight, before its base layer in
    the forward and first in the backward. Checked against DeepSpeed's recorded
    trace on CPU (``benchmarks/deepspeed_cpu_check.py``)."""
    groups = []  # per layer: each module with its peft wrapper and adapters
    for layer in model.layers:
        mine = _layer_groups(layer)
        for group in mine:
            lin = layer.linears.get(group[0][0])
            if lin is not None and lin.A is not None:
                if elements([lin.A]) >= sizes.persistence_threshold:
                    group.insert(0, (f"{group[0][0]}.wrapper", [lin.A]))
        groups.append(mine)
    layers = [[m for group in mine for m in group] for mine in groups]
    embed_grad = model.embed.requires_grad or step.checkpointing
    needed = _needing_grad(layers, embed_grad)
    embed = [("embed", [model.embed])]
    forward = embed + [((i, n), ts) for i, ms in enumerate(layers) for n, ts in ms]
    head = [("lm_head", [model.lm_head])]
    norm = [("norm", [model.norm])]
    backward = head + norm
    for i in reversed(range(len(layers))):
        ahead = [((i, name), ts) for name, ts in layers[i]]
        back = []
        for group in reversed(groups[i]):  # a wrapper's hook fires first
            wrapped = group[:1] if group[0][0].endswith(".wrapper") else []
            for name, ts in wrapped + group[len(wrapped) :][::-1]:
                if name in needed[i]:
                    back.append(((i, name), ts))
        if not step.checkpointing:
            backward += back
        elif step.checkpointing_mode == "reentrant":
            backward += ahead + back
        else:
            backward += back[:1] + ahead + back[1:]
    trace = forward + norm + head + backward + (embed if embed_grad else [])
    return trace, len(forward)


def deepspeed_kept_params(model, step, elements, sizes) -> list:
    """The parameters of the embeddings and decoder layers that DeepSpeed keeps
    gathered after the forward, for their use in the backward: at its last use in
    the forward, some module of the trace (:func:`deepspeed_trace`) uses each again
    within ``max_reuse_distance`` elements (:func:`trainmem.deepspeed.kept`;
    ``elements``: a list of tensors -> the elements DeepSpeed counts for them)."""
    trace, n = deepspeed_trace(model, step, elements, sizes)
    uses = [(tuple(id(t) for t in ts), elements(ts)) for _, ts in trace]
    kept = deepspeed.kept(uses, sizes)
    last = {}
    for k in range(n):
        for t in trace[k][1]:
            last[id(t)] = (k, t)
    return [t for k, t in last.values() if (k, id(t)) in kept]


def _deepspeed_kept(
    model, step, gathered_bytes, elements, persisted, sizes, live
) -> int:
    """Bytes DeepSpeed ZeRO-3 keeps gathered from the forward into the backward
    (:func:`deepspeed_kept_params`), beyond ``live`` (what
    :func:`_deepspeed_gathered` already holds for the module being computed). With a
    70B model only the last layer is kept (it is the one computed first); models of
    fewer elements keep more layers, those under the distance all of them and the
    embeddings too. Checked against DeepSpeed itself on CPU
    (``benchmarks/deepspeed_cpu_check.py``)."""
    kept = deepspeed_kept_params(model, step, elements, sizes)
    held = gathered_bytes(t for t in kept if id(t) not in persisted)
    return max(0, held - live)


def _deepspeed_gathered(
    model, step, unit_bytes, gathered_bytes, elements, persisted, sizes
):
    """What DeepSpeed ZeRO-3 holds gathered of the decoder layers at the backward's
    peak. It gathers parameters module by module (a forward/backward pre-hook per
    module, ``PartitionedParameterCoordinator.fetch_sub_module``) and releases a
    module's after it ran unless the trace uses them again within
    ``max_reuse_distance`` (1e9 elements, ``__params_to_release``): a checkpointed
    layer's recomputed forward keeps them for that layer's backward, so the whole
    layer is gathered; without checkpointing the largest Linear is. (At the end of the
    forward the last layer is kept for its recompute the same way; the one before it
    is already beyond the distance, behind lm_head's forward and backward.) On top,
    the prefetch: the next parameters of the trace, taken one by one while fewer than
    ``stage3_prefetch_bucket_size`` elements are in flight, so the one that crosses
    the bound is fetched whole — counted here over the next layer's parameters in
    module order, in the elements they are stored in."""
    if step.checkpointing:
        live = unit_bytes
    else:
        live = max(
            gathered_bytes(t for t in lin.tensors() if id(t) not in persisted)
            for lin in model.layers[0].linears.values()
        )
    prefetched = in_flight = 0
    for t in model.layers[0].tensors():
        if id(t) in persisted:
            continue
        if in_flight >= sizes.prefetch_bucket:
            break
        prefetched += gathered_bytes([t])
        in_flight += elements([t])
    return live + prefetched


DEEPSPEED = ShardReplay(
    sizes=_sizes, persisted=_persisted, gather=_gather, gradients=_gradients
)
