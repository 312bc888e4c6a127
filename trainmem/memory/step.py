"""One training step replayed: the model built by its decoder layout
(:data:`DECODERS`), sharded (:mod:`.shard_plan`), the optimizer's states and scratch
(:mod:`.optimizer_step`), forward and backward per micro-batch (repeats written by
:mod:`.repeat`), and what the framework's loop runs after the step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .accounting import ITEMSIZE, Simulator, new, shrink
from .allocator import RepeatDetector, common_period
from .autograd import backward
from .llama import Model, build_params, llama_loss, trainable_params
from .ops import mul_scalar
from ..dtypes import nf4_bytes_per_weight, nf4_state_tables
from ..versions import (
    bnb_saves_input,
    litgpt_loss_holds_graph,
    litgpt_rmsnorm_fp32,
    rope_buffers,
)
from . import litgpt, preference, traced
from .offload import Offload

from ..optimizers import optimizer
from .optimizer_step import SCRATCH_RULES as SCRATCH_RULES, _optimizer_states
from .repeat import _Repeater as _Repeater, _periods
from .shard_deepspeed import deepspeed_kept_params as deepspeed_kept_params
from .shard_plan import (
    DDP_BUCKET_CAPS as DDP_BUCKET_CAPS,
    _shard_for_zero,
    ddp_bucket_sizes as ddp_bucket_sizes,
)


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
    flow = d.kbit
    model = build_params(
        sim,
        shape,
        method=step.method,
        lora_rank=step.lora_rank,
        lora_targets=step.lora_targets,
        dtypes=d.dtypes,
        rope_buffers=rope_buffers(d.versions),
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
                model.quant_tables += [
                    new(sim, (nbytes,), "u8", category="weights")
                    for nbytes in nf4_state_tables(step.qlora_double_quant)
                ]
                linear.saves_input = flow.saves_input
                # Linear4bit: x.to(compute_dtype), the output .to(the input's dtype)
                linear.compute = flow.compute
                linear.output_cast = flow.output_in_input_dtype
                linear.lora_sees_autocast = flow.lora_sees_autocast
                linear.clones_base_output = flow.clones_base_output
    if step.lora_dropout > 0:
        for layer in model.layers:
            for linear in layer.linears.values():
                if linear.A is not None:
                    linear.dropout = True
                    linear.kernels = step.kernels
    return model, trainable_params(model)


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


def _micro_batch(sim, model, d, batch, cfg, litgpt_logits) -> int:
    """One micro-batch: forward, loss (scaled for accumulation and fp16), backward.
    Returns the forward-allocated bytes alive at the end of its forward pass."""
    step = d.options
    ids, labels = batch
    sim.set_phase("forward")
    sim.autocast = d.dtypes.autocast
    cfg["kv_cache"] = [] if d.kv_cache_copies else None
    cfg["kv_cache_values_as_keys"] = d.kv_cache_values_as_keys
    if d.activation_offload:
        sim.offload = Offload()  # the forward's saved tensors go to the host
    if d.objective is not None and d.objective.logps:
        # DPO / GRPO (trainmem.objectives): the objective's loss on the decoder
        loss = OBJECTIVE_LOSSES[d.objective.name](sim, model, ids, labels, cfg, d)
    else:
        loss = DECODERS[d.layout].loss(sim, model, ids, labels, cfg, litgpt_logits)
    sim.offload = None
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
    sim.sharded.after_backward()
    del loss, unsharded_grad, bucket
    return activations_at_end


def _forward_backward(
    sim: Simulator, model: Model, shape, d, batch, replay_as=None, reference=None
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
        # transformers repeat_kv-s key and value before SDPA (trainmem.sdpa.hf_call)
        "sdpa_repeats_kv": d.sdpa_repeats_kv,
        # memory-efficient attention pads its logsumexp (trainmem.sdpa)
        "lse_align": d.sdpa_lse_align,
        # a materialised causal mask (trainmem.versions.hf_materializes_causal_mask)
        "causal_mask": d.causal_mask,
        "mask_align": d.sdpa_mask_align,
        "checkpointing": step.checkpointing,
        "loss_form": d.loss_form,
        "reentrant": step.checkpointing_mode == "reentrant",
        # LitGPT: finetune/lora.py chunks lm_head, finetune/full.py does not
        "chunked_head": step.method != "full",
        # the chunked cross-entropy's rows per chunk (None: the standard loss)
        "loss_chunk": d.loss_chunk,
        "context_parallel": d.context_parallel,
        **(reference or {}),
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
        # every recorded family (trainmem/data/families/<model_type>.json)
        Decoder("traced", traced.build, traced.loss),
    )
}


#: the losses of the objectives that read log-probabilities, by objective name
OBJECTIVE_LOSSES = {"dpo": preference.dpo_loss, "grpo": preference.grpo_loss}


def _reference(sim: Simulator, shape, d, rows: int) -> dict:
    """What the objective's reference holds for the whole step: a frozen copy of the
    model loaded like the policy (``copy``), or the precomputed log-probabilities the
    batch carries (``precomputed``: one float per sequence)."""
    out = {"reference_model": None, "precomputed_logps": None}
    if d.reference == "copy":
        out["reference_model"] = build_params(
            sim,
            shape,
            method="lora",  # every parameter frozen, no adapter
            lora_rank=1,
            lora_targets=(),
            dtypes=d.dtypes,
            rope_buffers=rope_buffers(d.versions),
        )
    elif d.reference == "precomputed":
        out["precomputed_logps"] = new(sim, (rows,), "fp32", category="activations")
    if d.objective is not None and d.objective.rollouts:
        # the scored rollouts the batch carries: advantages, and the reference's
        # per-token log-probabilities when there is a reference
        completion = d.options.max_completion_length
        out["advantages"] = new(sim, (rows,), "fp32", category="activations")
        if d.reference != "none":
            out["reference_logps"] = new(
                sim, (rows, completion), "fp32", category="activations"
            )
    return out


def _warm_up_step(d) -> bool:
    """Whether the allocator replay runs step 1 before the step: a torch optimizer
    over the local parameters (``zero`` 0) creates its states lazily, in its first
    ``step()`` (``_init_group``: ``torch.zeros_like(p)`` for each state), where the
    caching allocator hands them the blocks step 1's activations left free; step 2's
    activations then need segments of their own. (DeepSpeed creates its partitions'
    states when it is initialised; sharded steps keep the states-first replay, and so
    do LitGPT's loops, which carry the previous micro-batch across steps.)"""
    return d.options.zero == 0 and not d.framework.previous_seq


def _first_step(
    sim: Simulator, model: Model, params, shape, d, replay_as, reference=None
) -> list:
    """Step 1 of training, for the caching allocator only: the micro-batches'
    forward and backward with no optimizer states, the optimizer's ``step()``
    creating them (:func:`_optimizer_states`) before its scratch, then
    ``zero_grad(set_to_none=True)``; a ``reset_peak`` event then starts step 2's
    peak (``torch.cuda.reset_peak_memory_stats()``). Returns the states."""
    step = d.options
    rows, tokens = d.sequences if d.objective is not None else (step.batch, step.seq)
    batch = tuple(
        new(sim, (rows, tokens), "i64", category="activations") for _ in range(2)
    )
    _forward_backward(sim, model, shape, d, batch, replay_as, reference)
    sim.set_phase("optimizer")
    states = _optimizer_states(sim, params, step, d.dtypes.optimizer_states)
    rule = optimizer(step.optimizer).impl(step.optimizer_impl).scratch
    if rule is not None:
        SCRATCH_RULES[rule](sim, params, d.dtypes.optimizer_states, 1.0)
    for p in params:  # zero_grad(set_to_none=True)
        if p.grad_accumulator is not None:
            p.grad_accumulator.grad = None
    del batch
    sim.set_phase("idle")
    sim.events.append(("reset_peak", 0))
    return states


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
    state_dtype = d.dtypes.optimizer_states
    rows, tokens = d.sequences if d.objective is not None else (step.batch, step.seq)
    # (context parallelism: the tokens of this GPU's shard of the sequence)
    reference = _reference(sim, shape, d, rows)
    if replay_as is not None and _warm_up_step(d):
        # the caching allocator as step 2 finds it: step 1 ran with no optimizer
        # states, which its optimizer step then created in the cached pool
        states = _first_step(sim, model, params, shape, d, replay_as, reference)
    else:
        states = _optimizer_states(sim, params, step, state_dtype)
    ids = new(sim, (rows, tokens), "i64", category="activations")
    labels = new(sim, (rows, tokens), "i64", category="activations")
    sim.peak = sim.live
    sim.peak_by_category = dict(sim.live_by_category)
    sim.phase_peaks = {}
    activations_at_end, cfg = _forward_backward(
        sim, model, shape, d, (ids, labels), replay_as, reference
    )
    after_micro_batches = None if sim.events is None else len(sim.events)
    del gathered_root  # resharded at the end of backward (_catch_all_reshard)
    sim.set_phase("optimizer")
    sim.mark("optimizer_start")
    rule = optimizer(step.optimizer).impl(step.optimizer_impl).scratch
    if rule is not None:
        part = 1.0 / step.gpus if step.zero >= 1 else 1.0
        SCRATCH_RULES[rule](sim, params, state_dtype, part)
    del masters, held
    if d.framework.eval_after_step and step.zero == 0:
        DECODERS[d.layout].after_step(sim, model, step, (ids, labels), cfg)
    if d.objective is not None and d.objective.rollouts:
        # zero_grad(set_to_none=True), then the next step's rollouts
        for p in params:
            if p.grad_accumulator is not None:
                p.grad_accumulator.grad = None
        preference.generate(sim, model, d, cfg)
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
            if k
            in ("forward", "backward", "optimizer", "validate", "generate", "score")
        },
    }
