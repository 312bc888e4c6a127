"""One training step replayed: parameter layouts (full, LoRA, QLoRA, ZeRO stages, mixed precision),
optimizer states and the optimizer's scratch, forward and backward per micro-batch."""

from __future__ import annotations

import math

from .accounting import ITEMSIZE, T, Sim, new, shrink
from .autograd import backward
from .llama import build_params, llama_loss, trainable_params
from .ops import mul_scalar


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


def simulate_step(shape, step) -> dict:
    """Replay step 2 of training (states exist, grads start as None) of the model
    ``shape`` (:class:`trainmem.config.Shape`) with the options ``step``
    (:class:`trainmem.config.StepConfig`), and return bytes: ``peak``, ``breakdown``
    (categories at the peak), ``activations`` (forward-allocated bytes alive at the end of
    the forward pass), ``model_states`` (weights + gradients + optimizer states + master
    weights when the optimizer step starts), ``phase_peaks``."""
    method, precision, optimizer = step.method, step.precision, step.optimizer
    zero, gpus = step.zero, step.gpus
    if shape.arch != "llama":
        raise NotImplementedError("the step replay models Llama-family decoders")
    sim = Sim()
    sim.set_phase("idle")
    # ZeRO >= 1 with mixed precision: DeepSpeed's layout (the ZeRO paper's), not torch AMP's. The
    # module is cast to the 16-bit dtype (weights, grads 2 B/param; no autocast), the optimizer
    # holds fp32 master weights and fp32 states for its shard only.
    zero_mp = (
        {"fp16-amp": "fp16", "bf16-amp": "bf16"}.get(precision) if zero >= 1 else None
    )
    # QLoRA (bitsandbytes ``load_in_4bit`` with a 16-bit ``torch_dtype``): only the Linear layers
    # inside the decoder blocks are NF4; embeddings, norms and lm_head stay in the 16-bit dtype.
    base16 = None
    if method == "qlora" and not zero_mp:
        base16 = "fp16" if precision == "fp16-amp" else "bf16"
    M = build_params(
        sim,
        shape,
        method=method,
        precision=precision,
        lora_rank=step.lora_rank,
        lora_targets=step.lora_targets,
        lora_dtype=step.lora_dtype,
        param_dtype=zero_mp,
        base_dtype=base16,
    )
    params = trainable_params(M)
    if method == "qlora":
        # NF4: 4 bits per weight + one fp32 absmax per 64 weights, or (double quantization) an
        # 8-bit absmax per 64 weights + one fp32 constant per 256 blocks.
        per = 0.5 + ((1 / 64 + 4 / (64 * 256)) if step.qlora_double_quant else 4 / 64)
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
        for p in trainable_params(M) + [
            w
            for L in M["layers"]
            for lin in L.values()
            if isinstance(lin, dict)
            for w in lin.values()
            if isinstance(w, T) and not w.rg
        ]:
            if p.buf.cat == "weights":
                shrink(sim, p.buf, shard)
        # the layer being computed is all-gathered (FSDP/ZeRO-3 prefetch ignored)
        layer_bytes = sum(
            w.nbytes
            for lin in M["layers"][0].values()
            if isinstance(lin, dict)
            for w in lin.values()
            if isinstance(w, T)
        )
        layer_bytes += sum(
            t.nbytes for t in M["layers"][0].values() if isinstance(t, T)
        )
        gathered_layer = sim.alloc(layer_bytes, "weights")  # held until the step ends
        sim.param_cast_scale = shard
    sim.grad_scale = shard if zero >= 2 else 1.0
    # optimizer states (created in step 1; fp32, like the master weights, under zero_mp)
    states = []
    sdt = "fp32" if zero_mp else None
    for p in params:
        if optimizer == "adamw8bit":
            if p.numel >= 4096:  # bitsandbytes keeps small tensors in 32-bit states
                states += [
                    new(sim, p.shape, "bool", cat="optimizer_states"),
                    new(sim, p.shape, "bool", cat="optimizer_states"),
                    new(
                        sim,
                        (2 * math.ceil(p.numel / 256),),
                        "fp32",
                        cat="optimizer_states",
                    ),
                ]
            else:
                states += [
                    new(sim, p.shape, "fp32", cat="optimizer_states"),
                    new(sim, p.shape, "fp32", cat="optimizer_states"),
                ]
            states.append(new(sim, (), "fp32", cat="optimizer_states"))
        elif optimizer == "adamw":
            states += [
                new(sim, p.shape, sdt or p.dt, cat="optimizer_states"),
                new(sim, p.shape, sdt or p.dt, cat="optimizer_states"),
            ]
            states.append(new(sim, (), "fp32", cat="optimizer_states"))  # step
        elif optimizer == "sgd-momentum":
            states.append(new(sim, p.shape, sdt or p.dt, cat="optimizer_states"))
    if zero >= 1:
        for st in states:
            shrink(sim, st.buf, shard)
    ids = new(sim, (step.batch, step.seq), "i64", cat="activations")
    labels = new(sim, (step.batch, step.seq), "i64", cat="activations")
    sim.peak = sim.cur
    sim.peak_by = dict(sim.by)
    sim.phase_peaks = {}
    cfg = {
        "heads": shape.heads,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "attn": step.attn_memory,
        "checkpointing": step.checkpointing,
    }
    amp = None if zero_mp else {"fp16-amp": "fp16", "bf16-amp": "bf16"}.get(precision)
    act_end = 0
    for _ in range(step.grad_accum):
        sim.set_phase("forward")
        sim.autocast = amp
        loss = llama_loss(sim, M, ids, labels, cfg)
        sim.autocast = None
        sim.autocast_cache = []  # leaving torch.autocast clears its cache
        if step.grad_accum > 1:
            loss = mul_scalar(sim, loss)
        if precision == "fp16-amp":
            loss = mul_scalar(sim, loss)  # GradScaler.scale(loss)
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
        adamw_step_scratch(sim, sizes, step.optimizer_impl)
    del masters, gathered_layer
    sim.set_phase("idle")
    at_step = sim.marks["optimizer_start"]
    model_states = sum(
        at_step[k]
        for k in ("weights", "gradients", "optimizer_states", "master_weights")
    )
    return {
        "peak": sim.peak,
        "breakdown": dict(sim.peak_by),
        "activations": act_end,
        "model_states": model_states,
        "phase_peaks": {
            k: v
            for k, v in sim.phase_peaks.items()
            if k in ("forward", "backward", "optimizer")
        },
    }
