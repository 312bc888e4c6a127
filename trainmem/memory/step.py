"""One training step replayed: parameter layouts (full, LoRA, QLoRA, ZeRO stages, mixed
precision), optimizer states and the optimizer's scratch, forward and backward per
micro-batch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .accounting import ITEMSIZE, Simulator, new, resize, shrink
from .allocator import RepeatDetector, common_period
from .autograd import backward
from .llama import Model, build_params, llama_loss, trainable_params
from .ops import mul_scalar
from .sharded import Sharded
from .. import deepspeed
from ..dtypes import nf4_bytes_per_weight
from ..versions import (
    bnb_saves_input,
    litgpt_loss_holds_graph,
    litgpt_rmsnorm_fp32,
)
from . import litgpt

from ..optimizers import optimizer


def _adamw_foreach(sim: Simulator, params: list, state_dtype, part: float) -> None:
    """torch's ``_multi_tensor_adam``: ``torch.tensor(1.0)`` for the step count, then
    ``_foreach_sqrt(exp_avg_sq)``: one copy of every state at once."""
    step_one = new(sim, (), "fp32")
    tmp = [sim.alloc(n) for n in _state_sizes(params, state_dtype, part)]
    del tmp, step_one


def _adamw_for_loop(sim: Simulator, params: list, state_dtype, part: float) -> None:
    """torch's ``_single_tensor_adam``: per parameter ``denom = (exp_avg_sq.sqrt() / bc)
    .add_(eps)`` — the ``sqrt`` and the quotient coexist, and the previous parameter's
    ``denom`` is released only when the name is rebound, after the new one exists."""
    denom = None
    for n in _state_sizes(params, state_dtype, part):
        root = sim.alloc(n)
        quotient = sim.alloc(n)
        del root
        denom = quotient
        del quotient
    del denom


def _lion_for_loop(sim: Simulator, params: list, state_dtype, part: float) -> None:
    """:class:`trainmem.lion.Lion` (lion-pytorch's update), per parameter: ``update =
    exp_avg.clone().mul_(b1).add(grad, alpha=1 - b1).sign_()`` — the clone and the sum
    coexist, the clone goes, and ``update`` is released when the per-parameter update
    function returns."""
    for n in _state_sizes(params, state_dtype, part):
        clone = sim.alloc(n)
        added = sim.alloc(n)
        del clone, added


def _adafactor_for_loop(sim: Simulator, params: list, state_dtype, part: float) -> None:
    """torch's ``_single_tensor_adafactor`` (``foreach=False``), per parameter: a
    matrix allocates ``row_mean`` (rows × 1) and ``col_mean`` (1 × cols), then
    ``var_estimate = row_var @ col_var`` (a full-size tensor) and the scalar
    ``row_var.mean()`` it is divided by; a vector allocates ``grad * grad`` and
    ``variance.clone()``. ``update`` is ``var_estimate`` updated in place, and each
    loop variable keeps the previous parameter's tensor until it is rebound. The norms
    that end in ``.item()`` are 0-d tensors freed at once."""
    live: dict[str, object] = {}

    def bind(name: str, nbytes: int) -> None:
        buffer = sim.alloc(nbytes)  # the new tensor exists before the old is released
        live[name] = buffer

    for p in params:
        size = ITEMSIZE[state_dtype or p.dtype]
        shape = p.shape
        scalar = sim.alloc(size)  # param.norm(2)
        del scalar
        if len(shape) > 1:
            rows = math.prod(shape[:-1])
            cols = math.prod(shape[:-2]) * shape[-1]
            bind("row_mean", int(math.ceil(rows * size * part)))
            bind("col_mean", int(math.ceil(cols * size * part)))
            bind("var_estimate", int(math.ceil(p.numel * size * part)))
            mean = sim.alloc(size * math.prod(shape[:-2]))  # row_var.mean(dim=-2)
            del mean
        else:
            bind("grad_squared", int(math.ceil(p.numel * size * part)))
            bind("var_estimate", int(math.ceil(p.numel * size * part)))
        live["update"] = live["var_estimate"]
        scalar = sim.alloc(size)  # update.norm(2)
        del scalar
    live.clear()


#: How ``optimizer.step()`` allocates scratch memory, by the rule names the optimizer
#: registry (:mod:`trainmem.optimizers`) gives each implementation.
SCRATCH_RULES = {
    "adamw-foreach": _adamw_foreach,
    "adamw-for-loop": _adamw_for_loop,
    "lion-for-loop": _lion_for_loop,
    "adafactor-for-loop": _adafactor_for_loop,
}


def _state_sizes(params: list, state_dtype, part: float) -> list[int]:
    """Bytes of one full-size state of each parameter, in the optimizer's order."""
    return [
        int(math.ceil(p.numel * ITEMSIZE[state_dtype or p.dtype] * part))
        for p in params
    ]


def _build_litgpt(sim: Simulator, shape, d):
    """LitGPT's GPT (:mod:`.litgpt`); under QLoRA every Linear, ``lm_head`` included,
    is 4-bit: Fabric's ``BitsandbytesPrecision.convert_module`` replaces each
    ``torch.nn.Linear`` (no ``ignore_modules`` in finetune/lora.py)."""
    step = d.options
    model = litgpt.build_params(sim, shape, d)
    versions = d.versions
    if step.method == "qlora":
        bytes_per_weight = nf4_bytes_per_weight(step.qlora_double_quant)
        for lin in model.linears():
            shrink(sim, lin.w.buffer, bytes_per_weight / ITEMSIZE[lin.w.dtype])
            lin.quantized = True
            lin.saves_input = bnb_saves_input(versions)
    if step.lora_dropout > 0:
        for lin in model.linears():
            if lin.A is not None:
                lin.dropout = True
                lin.kernels = step.kernels
    return model, litgpt.trainable_params(model)


def _build_llama(sim: Simulator, shape, d):
    """The parameters (and buffers) of the transformers decoder, QLoRA's base weights
    quantized; returns the :class:`~.llama.Model` and its trainable parameters.
    QLoRA (bitsandbytes ``load_in_4bit`` with a 16-bit ``torch_dtype``): only the
    Linear layers inside the decoder blocks are NF4; embeddings, norms and lm_head
    stay in the 16-bit dtype, or fp32 after peft's prepare_model_for_kbit_training
    (``Dtypes.quant_base``)."""
    step = d.options
    compute_dtype = d.dtypes.quant_compute
    versions = d.versions
    model = build_params(
        sim,
        shape,
        method=step.method,
        lora_rank=step.lora_rank,
        lora_targets=step.lora_targets,
        dtypes=d.dtypes,
    )
    if step.method == "qlora":
        # NF4: 4 bits per weight + its share of the absmax constants
        bytes_per_weight = nf4_bytes_per_weight(step.qlora_double_quant)
        for layer in model.layers:
            for linear in layer.linears.values():
                shrink(
                    sim, linear.w.buffer, bytes_per_weight / ITEMSIZE[linear.w.dtype]
                )
                linear.quantized = True
                linear.saves_input = bnb_saves_input(versions)
                if step.kbit_prepare == "peft":
                    linear.compute = compute_dtype
    if step.lora_dropout > 0:
        for layer in model.layers:
            for linear in layer.linears.values():
                if linear.A is not None:
                    linear.dropout = True
                    linear.kernels = step.kernels
    return model, trainable_params(model)


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


def _optimizer_states(sim: Simulator, params: list, step, state_dtype) -> list:
    """The optimizer states created in step 1 (``state_dtype`` ``None``: each
    parameter's own dtype), sharded under ZeRO. Paged states (bitsandbytes' paged
    optimizers, :class:`trainmem.optimizers.State` ``paged``) live in CUDA managed
    memory, outside the caching allocator this replay models: not allocated here."""
    spec = optimizer(step.optimizer)
    states = [
        new(sim, st.shape, st.dtype, category="optimizer_states")
        for p in params
        for st in spec.states(p.shape, state_dtype or p.dtype)
        if not st.paged
    ]
    if step.zero >= 1:
        for st in states:
            shrink(sim, st.buffer, 1.0 / step.gpus)
    return states


# Micro-batches after the first run the same code on tensors of the same shapes (the
# gradients already allocated, accumulated in place): from the second on, each leaves
# the same tensors alive as the one before. So the tensor peaks are all reached within
# the first three, and the caching allocator's (``reserved``, block rounding) once the
# states it is left in after each micro-batch cycle (``RepeatDetector``). A LitGPT
# resource-table row (global batch 128 at micro-batch 1) took 17 s to replay in full;
# tests/test_gpu_memory.py checks every reported number against the full replay.
STOP_AT_REPEAT = True
TENSOR_MICRO_BATCHES = 3  # without the allocator replay (no ``gpu``)
# With the allocator replay, some steps never reach a repeating allocator state (a
# LitGPT NF4 row: 128 micro-batches), so every micro-batch is replayed. Their events
# need not be simulated again, though: once a micro-batch's events are the one
# before's with each tensor renamed to its counterpart (the ``k``-th allocation of a
# micro-batch for the ``k``-th of the one before, the tensors of earlier micro-batches
# kept), the next ones are the same events renamed again (:class:`_Repeater`). Both
# shortcuts are off when ``STOP_AT_REPEAT`` is False (the full replay the tests
# compare with).
SIMULATED_MICRO_BATCHES = 4


def _allocated(events, a: int, b: int) -> list:
    return [ev[1] for ev in events[a:b] if ev[0] == "alloc"]


def _renamed(events, a: int, b: int, names: dict) -> list:
    get = names.get
    return [(ev[0], get(ev[1], ev[1])) + ev[2:] for ev in events[a:b]]


class _Repeater:
    """Writes a micro-batch's events as the last simulated one's (``starts``: where
    each micro-batch's events begin; the last simulated one ends at the end of
    ``events``) with fresh names (negative, never a Simulator uid) for what it
    allocates and the previous micro-batch's names for what it frees of that one."""

    def __init__(self, events: list, starts: list[int]):
        *_, before, last = starts
        self.template = (last, len(events))
        self.previous = _allocated(events, before, last)
        self.made = self.recorded = _allocated(events, last, len(events))
        self.fresh = -1

    @staticmethod
    def repeats(events: list, starts: list[int]) -> bool:
        """Whether the last micro-batch's events are the one before's renamed."""
        if len(starts) < 3:
            return False
        a, b, c = starts[-3:]
        names = dict(zip(_allocated(events, b, c), _allocated(events, c, len(events))))
        if len(names) != len(_allocated(events, b, c)):
            return False
        names.update(zip(_allocated(events, a, b), _allocated(events, b, c)))
        return _renamed(events, b, c, names) == events[c:]

    def write(self, events: list) -> None:
        made = list(range(self.fresh, self.fresh - len(self.recorded), -1))
        self.fresh -= len(made)
        names = dict(zip(self.recorded, made))
        names.update(zip(self.previous, self.made))
        events.extend(_renamed(events, *self.template, names))
        self.made = made

    def rename_after(self, events: list, start: int) -> None:
        """The events from ``start`` on (the rest of the step, simulated with the last
        simulated micro-batch's tensors) name the last written micro-batch's."""
        if self.made is not self.recorded:
            names = dict(zip(self.recorded, self.made))
            events[start:] = _renamed(events, start, len(events), names)


def _micro_batch(sim, model, d, batch, cfg, litgpt_logits) -> int:
    """One micro-batch: forward, loss (scaled for accumulation and fp16), backward.
    Returns the forward-allocated bytes alive at the end of its forward pass."""
    step = d.options
    ids, labels = batch
    sim.set_phase("forward")
    sim.autocast = d.dtypes.autocast
    cfg["kv_cache"] = [] if d.kv_cache_copies else None
    loss = DECODERS[d.layout].loss(sim, model, ids, labels, cfg, litgpt_logits)
    sim.autocast = None
    sim.autocast_cache = []  # leaving torch.autocast clears its cache
    if step.grad_accum > 1:
        loss = mul_scalar(sim, loss)
    if d.precision.loss_scaling:
        loss = mul_scalar(sim, loss)  # GradScaler.scale(loss)
    sim.mark("forward_end")
    activations_at_end = sim.marks["forward_end"]["activations"]
    sim.set_phase("backward")
    unsharded_grad, bucket = sim.sharded.backward_buffers(sim)
    backward(sim, loss)
    # DeepSpeed's layers kept gathered from the forward: released by the end of
    # backward (each after its own backward)
    cfg.pop("ds_kept", None)
    del loss, unsharded_grad, bucket
    return activations_at_end


def _forward_backward(
    sim: Simulator, model: Model, shape, d, batch, replay_as=None
) -> tuple[int, dict]:
    """The ``grad_accum`` micro-batches of the step (forward, loss scaling, backward);
    returns the forward-allocated bytes alive at the end of the (last) forward pass
    and the replay's state the rest of the step reads (``cfg``)."""
    step = d.options
    cfg = {
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "attn": d.attention,
        "checkpointing": step.checkpointing,
        "loss_form": d.loss_form,
        "reentrant": step.checkpointing_mode == "reentrant",
        # LitGPT: finetune/lora.py chunks lm_head, finetune/full.py does not
        "chunked_head": step.method != "full",
    }
    activations_at_end = 0
    litgpt_logits = []
    if d.framework.previous_seq:
        versions = d.versions
        cfg["rmsnorm_fp32"] = litgpt_rmsnorm_fp32(versions)
        cfg["loss_holds_graph"] = litgpt_loss_holds_graph(versions)
        # finetune/lora.py's loop variable ``logits``: the previous micro-batch's chunk
        # list (of ``previous_seq`` tokens; 0: none, the run's first micro-batch) is
        # alive until this forward's list is assigned to it
        prev = step.seq if step.previous_seq is None else step.previous_seq
        litgpt_logits = _previous_logits(sim, model, step, prev) if prev else []
        # with it the previous graph and its 4-bit Linears' ``ctx.tensors``
        cfg["held_graph"] = (
            litgpt.retained_inputs(sim, model, step.batch, prev) if prev else []
        )
    recorded = sim.events is not None
    # the replays the events are for: without a limit, and under the card's (whose
    # allocator releases cached segments when it runs short)
    prelude, capacity = replay_as or ([], None)
    detectors: dict = {}  # capacity -> RepeatDetector
    if recorded and STOP_AT_REPEAT:
        detectors[capacity] = RepeatDetector(prelude, capacity)
    n = step.grad_accum
    if not recorded and STOP_AT_REPEAT:
        n = min(n, TENSOR_MICRO_BATCHES)
    starts: list[int] = []
    stop = n - 1  # the last micro-batch to replay
    repeater = None
    for j in range(n):
        if recorded:
            starts.append(len(sim.events))
        if repeater is not None:
            repeater.write(sim.events)
        else:
            activations_at_end = _micro_batch(sim, model, d, batch, cfg, litgpt_logits)
            if (
                recorded
                and STOP_AT_REPEAT
                and j + 1 >= SIMULATED_MICRO_BATCHES
                and j < stop
                and _Repeater.repeats(sim.events, starts)
            ):
                repeater = _Repeater(sim.events, starts)
        if detectors and j >= 1 and j < stop:
            period = common_period(
                _periods(detectors, sim.events, starts, prelude, capacity)
            )
            if period:
                # the states cycle: the step ends in the state this cycle reaches
                # after the micro-batches still to run
                stop = j + (n - 1 - j) % period
        if j >= stop:
            break
    if d.framework.previous_seq:
        cfg["held"] = litgpt_logits  # alive through the optimizer step and validate
    cfg["repeater"] = repeater  # renames the rest of the step's events
    cfg["replays"] = {  # those that have set-up and the first micro-batch
        (tuple(prelude), cap): (d.replay, d.fed)
        for cap, d in detectors.items()
        if d.fed
    }
    return activations_at_end, cfg


def _periods(detectors: dict, events, starts, prelude, capacity):
    """The periods of the allocator replays the events are for, after the
    micro-batch that just ended. Under the card's limit the replay is the unlimited
    one until the allocator first gives back cached segments (the limit changes
    nothing before that), so the unlimited replay runs only from then on, caught up
    from the start."""
    yield detectors[capacity].period(events, starts)
    if capacity is None:
        return
    if None not in detectors:
        if not detectors[capacity].replay.alloc.released:
            return  # the same states: the same periods
        detectors[None] = RepeatDetector(prelude, None)
        detectors[None].catch_up(events, starts)
        yield detectors[None].periods()
        return
    yield detectors[None].period(events, starts)


def _litgpt_eval(sim: Simulator, model, step, batch, cfg) -> None:
    """What finetune/lora.py@5895df10 runs after a step when ``step_count %
    eval.interval == 0`` (gradients ``None`` after ``zero_grad()``, optimizer states
    and the loop's ``logits`` alive): ``validate`` on a micro-batch of the same shape
    (the validation split padded like the training one), then ``generate_example``
    with its KV cache. Each is its own phase; the reported peak is the max."""
    sim.set_phase("validate")
    litgpt.validation_loss(sim, model, *batch, cfg)
    sim.set_phase("generate")
    cache = litgpt.generation_cache(sim, model, step.seq, cfg)
    del cache  # model.clear_kv_cache()


def _previous_logits(sim: Simulator, model, step, seq: int) -> list:
    """The logits chunks of the micro-batch before the step (``seq`` tokens;
    ``(batch, <=128, vocab)`` each, as Fabric's wrapper returned them: fp32,
    :func:`.litgpt.fabric_output`), allocated in that micro-batch's forward."""
    vocab = model.lm_head.w.shape[0]
    dtype = litgpt.FABRIC_OUTPUT_DTYPE
    chunk = litgpt.LM_HEAD_CHUNK if step.method != "full" else seq
    return [
        new(sim, (step.batch, min(chunk, seq - i), vocab), dtype, "activations")
        for i in range(0, seq, chunk)
    ]


@dataclass(frozen=True)
class Decoder:
    """One decoder layout the replay knows: ``build(sim, shape, d)`` -> (model, its
    trainable parameters); ``loss(sim, model, ids, labels, cfg, held)`` -> the loss
    of one micro-batch's forward; ``after_step``: what the framework's loop runs
    after the optimizer step (``None``: nothing)."""

    name: str
    build: Callable
    loss: Callable
    after_step: Callable | None = None


def _llama_loss(sim, model, ids, labels, cfg, held):
    return llama_loss(sim, model, ids, labels, cfg)


#: the decoder layouts, by :attr:`trainmem.decisions.Decisions.layout`
DECODERS = {
    d.name: d
    for d in (
        Decoder("llama", _build_llama, _llama_loss),
        Decoder("litgpt", _build_litgpt, litgpt.forward_loss, _litgpt_eval),
    )
}


def simulate_step(
    shape, d, record_events: bool = False, replay_as: tuple | None = None
) -> dict:
    """Replay step 2 of training (states exist, grads start as None) of the model
    ``shape`` (:class:`trainmem.config.Shape`) as the step's decisions ``d``
    (:class:`trainmem.decisions.Decisions`, :func:`trainmem.decisions.decide`) say,
    and return bytes: ``peak``, ``breakdown``
    (categories at the peak), ``activations`` (forward-allocated bytes alive at the end
    of the forward pass), ``model_states`` (weights + gradients + optimizer states +
    master weights when the optimizer step starts), ``phase_peaks``. ``replay_as``:
    ``(prelude, capacity)`` of the caching-allocator replay the events are for
    (``trainmem.gpus.replay_setup``), which decides when micro-batches stop adding
    anything new (``_forward_backward``)."""
    if d.layout not in DECODERS:
        raise NotImplementedError(
            f"the step replay models the decoder layouts {', '.join(DECODERS)}, "
            f"not {shape.arch}"
        )
    step = d.options
    sim = Simulator()
    if record_events:
        sim.events = []  # every allocation and free, for the caching-allocator model
    sim.set_phase("idle")
    # ZeRO >= 1 with mixed precision: DeepSpeed's layout (the ZeRO paper's), not torch
    # AMP's. The module is cast to the 16-bit dtype (weights, grads 2 B/param; no
    # autocast), the optimizer holds fp32 master weights and fp32 states for its shard
    # only (``d.dtypes``: module, master, optimizer_states).
    model, params = DECODERS[d.layout].build(sim, shape, d)
    masters, held, gathered_root = _shard_for_zero(sim, model, params, d)
    ddp = _ddp_buckets(sim, params, step)
    state_dtype = d.dtypes.optimizer_states
    states = _optimizer_states(sim, params, step, state_dtype)
    ids = new(sim, (step.batch, step.seq), "i64", category="activations")
    labels = new(sim, (step.batch, step.seq), "i64", category="activations")
    sim.peak = sim.live
    sim.peak_by_category = dict(sim.live_by_category)
    sim.phase_peaks = {}
    activations_at_end, cfg = _forward_backward(
        sim, model, shape, d, (ids, labels), replay_as
    )
    after_micro_batches = None if sim.events is None else len(sim.events)
    del gathered_root  # resharded at the end of backward (_catch_all_reshard)
    sim.set_phase("optimizer")
    sim.mark("optimizer_start")
    rule = optimizer(step.optimizer).impl(step.optimizer_impl).scratch
    if rule is not None:
        part = 1.0 / step.gpus if step.zero >= 1 else 1.0
        SCRATCH_RULES[rule](sim, params, state_dtype, part)
    del masters, held, ddp
    if d.framework.eval_after_step and step.zero == 0:
        DECODERS[d.layout].after_step(sim, model, step, (ids, labels), cfg)
    cfg.pop("held", None)
    cfg.pop("held_graph", None)
    sim.set_phase("idle")
    events = sim.events
    sim.events = None  # the rest is teardown
    repeater = cfg.pop("repeater", None)
    if repeater is not None:
        repeater.rename_after(events, after_micro_batches)
    at_step = sim.marks["optimizer_start"]
    model_states = sum(
        at_step[k]
        for k in ("weights", "gradients", "optimizer_states", "master_weights")
    )
    del states, ids, labels
    return {
        "events": events,
        # the caching-allocator replays already fed the events up to a count
        # (``_forward_backward``): (prelude, capacity) -> (Replay, events fed)
        "replays": cfg.pop("replays", {}),
        "peak": sim.peak,
        "breakdown": dict(sim.peak_by_category),
        "activations": activations_at_end,
        "model_states": model_states,
        "phase_peaks": {
            k: v
            for k, v in sim.phase_peaks.items()
            if k in ("forward", "backward", "optimizer", "validate", "generate")
        },
    }
