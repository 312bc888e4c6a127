"""The sharding plan of a replayed step, as the :mod:`trainmem.sharding` entry of the
step's decisions says: ZeRO partitioning of masters, states, gradients and weights
with the gathered units (FSDP) or modules (DeepSpeed: its trace, prefetch bucket,
persistence threshold and reuse distance), the gradient buffers of the reduction,
and DDP's gradient buckets at ``zero=0``. The state the rest of the replay reads
goes into a :class:`~.sharded.Sharded` (``sim.sharded``)."""

from __future__ import annotations

import math

from .. import deepspeed
from ..dtypes import nf4_bytes_per_weight
from .accounting import ITEMSIZE, Simulator, new, resize, shrink
from .llama import Model
from .sharded import Sharded


def _quant_state_bytes(weight, step) -> int:
    """The absmax constants of a 4-bit weight (its bytes beyond 4 bits a weight)."""
    per_weight = nf4_bytes_per_weight(step.qlora_double_quant) - 0.5
    return int(math.ceil(weight.numel * per_weight))


def _linears(model) -> list:
    """Every Linear of ``model`` (LitGPT's ``lm_head`` included: it is quantized with
    the rest under QLoRA)."""
    if hasattr(model, "linears") and callable(model.linears):
        return model.linears()
    return [linear for layer in model.layers for linear in layer.linears.values()]


def _shard_weights(sim: Simulator, model: Model, d, shard: float, ds_sizes):
    """ZeRO-3: every weight sharded, frozen ones too (a 4-bit weight's packed data,
    not its quant_state), and what is gathered at once — FSDP's unit being computed
    (and the next one on N > 1) and its root unit, or DeepSpeed's modules with its
    prefetch bucket, the layers it keeps for their backward and its one-module
    gathers of the embeddings and lm_head. Returns the gathered layers' buffer and
    the gathered root unit's (``None`` when there is none)."""
    step, plan, sharded = d.options, d.sharding, sim.sharded
    gathered_root = None
    # A 4-bit weight is two things: its packed data (4 bits a weight, the
    # parameter FSDP/DeepSpeed shard and all-gather) and its quant_state (the
    # absmax constants), which bitsandbytes keeps whole on every rank as an
    # attribute of the Linear4bit module (bitsandbytes/nn/modules.py,
    # fix_4bit_weight_quant_state_from_module, 0.43.0+: the state is put back on
    # the gathered weight), so it is neither sharded nor gathered.
    quant_state = {
        id(linear.w): _quant_state_bytes(linear.w, step)
        for linear in _linears(model)
        if linear.quantized
    }

    def gathered_bytes(tensors) -> int:
        """The tensors' storage as it is all-gathered: their buffers before
        sharding (NF4 weights in their packed size, without the quant_state),
        not their shapes in the compute dtype."""
        return sum(t.buffer.nbytes - quant_state.get(id(t), 0) for t in tensors)

    def elements(tensors) -> int:
        """The elements DeepSpeed counts for the tensors (``ds_numel``: of a
        4-bit weight, its packed data)."""
        return sum(gathered_bytes([t]) // ITEMSIZE[t.dtype] for t in tensors)

    persisted = set()
    if plan.module_gather:
        # DeepSpeed never partitions a parameter of fewer elements than
        # stage3_param_persistence_threshold (ds_persist): it stays whole on every
        # rank and is not gathered (its optimizer partition is still 1/N)
        threshold = ds_sizes.persistence_threshold
        persisted = {id(p) for p in model.parameters() if elements([p]) < threshold}
    unit = [t for t in model.layers[0].tensors() if id(t) not in persisted]
    unit_bytes = gathered_bytes(unit)
    # every parameter is sharded, frozen ones too: FSDP flattens whatever a unit
    # holds (embeddings, norms and lm_head included) and DeepSpeed partitions
    # every parameter
    in_layers = {id(t) for layer in model.layers for t in layer.tensors()}
    root = [t for t in model.parameters() if id(t) not in in_layers]
    # the root unit (what no decoder layer holds: the embeddings, the final norm,
    # lm_head) as it is all-gathered, measured before sharding
    root_bytes = gathered_bytes(t for t in root if t.buffer.category == "weights")
    if plan.module_gather:
        live = _deepspeed_gathered(
            model, step, unit_bytes, gathered_bytes, elements, persisted, ds_sizes
        )
        sharded.kept_bytes = _deepspeed_kept(
            model, step, gathered_bytes, elements, persisted, ds_sizes, live
        )
        # what DeepSpeed gathers of the embeddings and lm_head, one module at a
        # time: the embeddings and lm_head are gathered when their module runs and
        # released after it unless reused soon (max_reuse_distance): the
        # embedding for its forward, lm_head from its forward to its backward
        # (llama_loss gathers them)
        sharded.gathered_modules = {
            id(p): gathered_bytes([p])
            for p in (model.embed, model.lm_head)
            if id(p) not in persisted
        }
    for p in model.parameters():
        if p.buffer.category == "weights" and id(p) not in persisted:
            kept = quant_state.get(id(p), 0)
            packed = p.buffer.nbytes - kept
            resize(sim, p.buffer, math.ceil(packed * shard) + kept)
    if plan.module_gather:
        gathered_layer = sim.alloc(live, "weights")
    else:
        # the unit being computed is all-gathered, and on more than one GPU so is
        # the next one: FSDP issues the next unit's all-gather while this one
        # computes (forward: torch/distributed/fsdp/_runtime_utils.py
        # _pre_forward_unshard and the rate limiter of _limit_all_gathers, which
        # lets two all-gathers be in flight; backward: the default
        # BackwardPrefetch.BACKWARD_PRE prefetches the previous unit before this
        # one's gradient is computed; FSDP2's all-gather stream overlaps the same
        # way, fully_shard in torch/distributed/fsdp/_fully_shard/
        # _fsdp_param_group.py; torch 2.4-2.13). With one GPU FSDP runs
        # NO_SHARD: no gathered copy beyond the one unit.
        units = 2 if step.gpus > 1 else 1
        gathered_layer = sim.alloc(units * unit_bytes, "weights")
    if plan.keeps_root and step.gpus > 1 and root_bytes:
        # The root unit is not resharded after the forward: FSDP keeps the
        # root's parameters all-gathered "with the intention that they are
        # immediately used for backward computation" (FSDP1:
        # torch/distributed/fsdp/_runtime_utils.py _post_forward_reshard,
        # free_unsharded_flat_param = not state._is_root and ...; FSDP2: the
        # root's param group gets post_forward_mesh_info = None in
        # FSDPState._lazy_init). Its frozen parameters have no post-backward
        # hook that reshards them earlier (the reshard-only hook waits for
        # gradients of the root's inputs, token ids that need none), so they
        # stay gathered until the backward's final callback (_catch_all_reshard)
        # at the end of backward: the whole forward and backward, on top of
        # their shard.
        gathered_root = sim.alloc(root_bytes, "weights")
    sharded.param_cast_scale = shard
    return gathered_layer, gathered_root


def _shard_for_zero(sim: Simulator, model: Model, params: list, d):
    """ZeRO partitioning over ``step.gpus``: the optimizer's fp32 master copies
    (DeepSpeed layout) and the master weights from stage 1, gradients from 2, weights
    from 3 (plus the all-gathered layers, and on N > 1 the all-gathered root unit).
    Returns the master copies, what lives until the step ends (the gathered layers'
    buffer and DeepSpeed ZeRO-3's gradient bucket, each ``None`` when there is none)
    and the gathered root unit's buffer (``None`` when there is none), which FSDP
    frees at the end of backward."""
    step, plan = d.options, d.sharding
    sharded = sim.sharded = Sharded()
    shard = 1.0 / step.gpus
    masters = []
    gathered_layer = gathered_root = None
    ds_sizes = None
    if plan.module_gather:  # (the hf model; config.py rejects litgpt)
        ds_sizes = deepspeed.sizes(step.deepspeed_sizes, model.norm.shape[0])
    if d.dtypes.master:
        masters = [
            new(sim, p.shape, d.dtypes.master, category="master_weights")
            for p in params
        ]
        for master in masters:
            shrink(sim, master.buffer, shard)
    if step.zero >= 1:
        for p in params:
            if p.buffer.category == "master_weights":
                shrink(sim, p.buffer, shard)
    if step.zero >= 3:
        gathered_layer, gathered_root = _shard_weights(sim, model, d, shard, ds_sizes)
    sharded.grad_scale = shard if step.zero >= 2 else 1.0
    bucket = None
    if plan.gradient_bucket:
        # DeepSpeed's contiguous gradient bucket (trainmem.deepspeed), in the
        # module's dtype (the trainable parameters'): ZeRO-3 allocates it with the
        # optimizer and keeps it; ZeRO-2 allocates it when each backward starts and
        # drops it after the reduction. Each gradient is copied into it by its hook,
        # so no unit's unsharded gradient waits beside it.
        nbytes = ds_sizes.reduce_bucket * ITEMSIZE[params[0].dtype] if params else 0
        if step.zero >= 3:
            bucket = sim.alloc(nbytes, "gradients")
        else:
            sharded.backward_bucket_bytes = nbytes
    elif step.zero >= 2 and step.gpus > 1:
        # before a unit's gradient is reduce-scattered it exists unsharded: FSDP's
        # _post_backward_hook (_runtime_utils.py) reduce-scatters flat_param.grad (the
        # whole unit, in the gradient dtype) into a 1/N shard (torch.empty_like of one
        # chunk), then frees the unsharded gradient; one unit's trainable gradients
        # are therefore alive during backward on top of the sharded ones
        sharded.reduce_scatter_bytes = sum(
            t.nbytes for t in model.layers[0].tensors() if t.requires_grad
        )
    return masters, (gathered_layer, bucket), gathered_root


#: DDP's bucket caps once its first iteration has rebuilt the buckets in the order
#: the gradients became ready: the first bucket 1 MiB
#: (``dist._DEFAULT_FIRST_BUCKET_BYTES``), the others ``bucket_cap_mb`` = 25 MiB
#: (torch/nn/parallel/distributed.py; the Reducer's ``rebuild_buckets`` in
#: torch/csrc/distributed/c10d/reducer.cpp; the Trainer's ``ddp_bucket_cap_mb``
#: defaults to None, DDP's 25)
DDP_BUCKET_CAPS = (1 << 20, 25 << 20)


def ddp_bucket_sizes(tensors, caps=DDP_BUCKET_CAPS) -> list[int]:
    """The bytes of each DDP bucket over ``tensors`` (``(nbytes, dtype)`` in the order
    their gradients become ready), as c10d's ``compute_bucket_assignment_by_size``
    forms them: one open bucket per dtype, closed once it holds at least its cap; each
    closed bucket moves that dtype on to the next cap, and what stays open at the end
    is a bucket too."""
    open_, out = {}, []
    for nbytes, dtype in tensors:
        bucket = open_.setdefault(dtype, [0, 0])  # bytes, index of its cap
        bucket[0] += nbytes
        if bucket[0] >= caps[bucket[1]]:
            out.append(bucket[0])
            bucket[:] = [0, min(bucket[1] + 1, len(caps) - 1)]
    return out + [b[0] for b in open_.values() if b[0]]


def _ddp_buckets(sim: Simulator, params: list, step) -> list:
    """DistributedDataParallel's gradient buckets (``zero=0`` on ``gpus`` > 1): the
    Reducer allocates one flat tensor per bucket (``at::empty`` of the bucket's
    elements, in its parameters' dtype) when DDP wraps the model and keeps them. With
    ``gradient_as_bucket_view=False`` — DDP's default; neither accelerate's
    ``DistributedDataParallelKwargs`` nor the Trainer changes it — each gradient is
    copied into its bucket for the all-reduce and back into ``param.grad``, so the
    buckets are a second copy of every trainable gradient, alive the whole run."""
    if step.zero != 0 or step.gpus <= 1:
        return []
    ready = [(p.nbytes, p.dtype) for p in params]
    return [sim.alloc(n, "gradients") for n in ddp_bucket_sizes(reversed(ready))]


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
