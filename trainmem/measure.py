"""Measure the memory of one real training step, tensor by tensor.

``measure(...)`` builds the model from its config (random weights, no downloads), runs the
training step twice — forward, backward, optimizer step, ``zero_grad(set_to_none=True)`` — and
reports the peak of the **second** step (the first one creates the optimizer states), with the
storages alive at that peak split into the six categories of :mod:`trainmem.estimate`:

=================  ===============================================================================
weights            parameters and buffers the model holds (frozen ones included), plus the
                   low-precision copies of parameters that ``torch.autocast`` makes (and autograd
                   keeps for backward) under ``fp16-amp``/``bf16-amp``
gradients          ``param.grad`` of the trainable parameters
optimizer_states   everything in ``optimizer.state`` (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``;
                   SGD ``momentum_buffer``)
master_weights     under ``fp16-amp``/``bf16-amp`` (autocast over fp32 parameters) the fp32
                   trainable parameters are the master copy: they are counted here, not in weights
activations        tensors allocated during the forward pass that are still alive (held by
                   autograd for backward, incl. ``input_ids``/labels and the layer inputs that
                   activation checkpointing keeps)
temporaries        everything else alive at the peak: gradients flowing through backward, tensors
                   recomputed by checkpointing, the optimizer's scratch tensors, ...
=================  ===============================================================================

All sizes are in **bytes** (sum of ``untyped_storage().nbytes()``, each storage counted once).

Devices:

* ``"cpu"`` — real tensors; exact and repeatable (the CPU allocator does not round).
* ``"fake"`` — the same step under ``torch._subclasses.fake_tensor.FakeTensorMode``: shapes and
  dtypes are propagated but nothing is allocated, so a 7B- or 13B-shaped model is measured on a
  laptop.  With ``extrapolate=True`` (default for ``"fake"`` when the model has more than 3
  layers) the step is measured with 2 and 3 decoder layers and every per-phase, per-category
  number is extended linearly to the real layer count.  This is exact whenever each phase's peak
  sits at the same place relative to the top of the network (true for decoder-only stacks of
  identical layers; the tests check it against the full run on small models) and is reported as
  ``extrapolated_from_layers`` in the result.
* ``"cuda"`` — real tensors on a GPU; additionally reports ``torch.cuda.max_memory_allocated``,
  ``max_memory_reserved`` and the device's used memory (``torch.cuda.mem_get_info``), whose gap to
  ``reserved`` is the CUDA context plus other processes.

The optimizer's implementation is chosen explicitly (``optimizer_impl``: ``"foreach"`` by default,
which is what a plain ``torch.optim.AdamW(params)`` runs on CUDA; ``"fused"``, which Hugging Face
Trainer's default ``optim="adamw_torch_fused"`` runs; ``"for-loop"``) and is the same on every
device, so the scratch memory of the step is the one a GPU run has.  ``adamw8bit`` and ``qlora`` need ``bitsandbytes`` and a
CUDA device and are estimated only.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .estimate import CATEGORIES, OptionError, check_options, resolve_config
from .models import build_model
from .tracker import MemoryTracker

__all__ = ["measure", "Measurement", "build_training_setup"]


@dataclass
class Measurement:
    """Result of :func:`measure`. All sizes in bytes."""

    total_bytes: int  # peak of live storages during the 2nd step
    breakdown: dict[str, int]  # categories at the peak (sum == total_bytes)
    activation_bytes: int  # forward-allocated bytes alive at the end of forward
    phase_peaks: dict[str, int]  # peak within each phase (forward, backward, optimizer)
    peak_phase: str
    n_params: int
    n_trainable: int
    device: str
    seconds: float
    extrapolated_from_layers: tuple[int, ...] | None = None
    cuda: dict[str, int] | None = None  # max_memory_allocated / reserved / device_used
    options: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = {
            "total_bytes": int(self.total_bytes),
            "breakdown": {k: int(self.breakdown[k]) for k in CATEGORIES},
            "activation_bytes": int(self.activation_bytes),
            "phase_peaks": {k: int(v) for k, v in self.phase_peaks.items()},
            "peak_phase": self.peak_phase,
            "n_params": self.n_params,
            "n_trainable": self.n_trainable,
            "device": self.device,
            "seconds": round(self.seconds, 3),
            "extrapolated_from_layers": list(self.extrapolated_from_layers)
            if self.extrapolated_from_layers
            else None,
            "options": self.options,
        }
        if self.cuda is not None:
            d["cuda"] = self.cuda
        return d

    def to_json(self, **kw) -> str:
        import json

        return json.dumps(self.to_dict(), **kw)

    def table(self) -> str:
        from .estimate import format_table

        rows = dict(self.breakdown)
        extra = {"activations at end of forward": self.activation_bytes}
        if self.cuda:
            extra.update({f"cuda {k}": v for k, v in self.cuda.items()})
        title = f"measured peak ({self.device}, peak in {self.peak_phase})"
        if self.extrapolated_from_layers:
            title += f", extrapolated from {self.extrapolated_from_layers} layers"
        return format_table(title, rows, self.total_bytes, extra)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_training_setup(
    cfg,
    *,
    method="full",
    precision="fp32",
    optimizer="adamw",
    lora_rank=8,
    lora_alpha=16,
    lora_targets=("q_proj", "v_proj"),
    lora_dtype=None,
    checkpointing=False,
    attn="sdpa",
    device="cpu",
    lr=1e-4,
    optimizer_impl="foreach",
):
    """Model (train mode) and optimizer exactly as :func:`measure` runs them."""
    model = build_model(cfg, device=device, attn_implementation=attn)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if method == "lora":
        from peft import LoraConfig, get_peft_model

        lcfg = LoraConfig(
            r=lora_rank,
            lora_alpha=lora_alpha,
            target_modules=list(lora_targets),
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lcfg)
        if lora_dtype is not None:
            dt = _DTYPES[lora_dtype]
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.data = p.data.to(dt)
    if checkpointing:
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    model.train()
    return model, make_optimizer(model, optimizer, lr, optimizer_impl)


@contextlib.contextmanager
def _real_mask_decisions(active: bool):
    """transformers treats fake tensors as "tracing" and then materialises the causal mask that
    a real run skips (SDPA ``is_causal``). Make the fake run take the real run's decisions."""
    if not active:
        yield
        return
    from transformers import masking_utils

    orig = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    if orig is None:  # pragma: no cover - other transformers versions
        yield
        return

    def ignore(padding_mask, q_length, kv_length, *args, **kwargs):
        local = kwargs.get("local_attention_size", args[2] if len(args) > 2 else None)
        if (
            padding_mask is None
            and q_length == kv_length
            and (local is None or kv_length < local)
        ):
            return True  # what the real (non-fake) run decides
        return orig(padding_mask, q_length, kv_length, *args, **kwargs)

    orig_packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    masking_utils._ignore_causal_mask_sdpa = ignore
    if orig_packed is not None:  # our position ids are a plain arange: never packed
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = orig
        if orig_packed is not None:
            masking_utils.find_packed_sequence_indices = orig_packed


def _to_fake(model, mode):
    """Replace the (meta) parameters and buffers of ``model`` by fake CPU tensors."""
    from torch._subclasses.fake_tensor import FakeTensor

    def fake_of(t):
        return FakeTensor(
            mode,
            torch.empty(t.shape, dtype=t.dtype, device="meta"),
            torch.device("cpu"),
        )

    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                mod._parameters[name] = torch.nn.Parameter(
                    fake_of(p), requires_grad=p.requires_grad
                )
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = fake_of(b)


def _impl_flags(optimizer_impl: str) -> dict:
    """torch.optim keyword arguments that select one implementation explicitly."""
    if optimizer_impl == "fused":
        return {"fused": True}
    return {"foreach": optimizer_impl == "foreach"}


def make_optimizer(
    model, optimizer: str, lr: float = 1e-4, optimizer_impl: str = "foreach"
):
    """The optimizer :func:`measure` uses, over the trainable parameters, with the implementation
    chosen explicitly (``foreach``, ``fused`` or ``for-loop``: the same on every device, so the
    CPU measurement holds the scratch memory a GPU run holds)."""
    params = [p for p in model.parameters() if p.requires_grad]
    flags = _impl_flags(optimizer_impl)
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=lr, **flags)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.0, **flags)
    elif optimizer == "sgd-momentum":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.9, **flags)
    else:
        raise OptionError(
            "optimizer",
            f"optimizer {optimizer!r} cannot be measured here (needs bitsandbytes on CUDA); "
            "allowed for measure: adamw, sgd, sgd-momentum",
        )
    return opt


def _one_run(
    cfg,
    *,
    device,
    method,
    precision,
    optimizer,
    batch,
    seq,
    grad_accum,
    lora_rank,
    lora_alpha,
    lora_targets,
    lora_dtype,
    checkpointing,
    attn,
    seed=0,
    optimizer_impl="foreach",
):
    """Run two steps, track the second one. Returns a dict of raw numbers."""
    fake = device == "fake"
    real_device = "cuda" if device == "cuda" else "cpu"
    outer = contextlib.nullcontext()
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        outer = FakeTensorMode(allow_non_fake_inputs=True)
    torch.manual_seed(seed)
    if fake:
        # Build on the meta device (no memory), then turn every parameter and buffer into a
        # fake CPU tensor, so autocast and the CPU kernels' shape rules apply.
        model, _ = build_training_setup(
            cfg,
            method=method,
            precision=precision,
            optimizer="sgd",
            lora_rank=lora_rank,
            lora_alpha=lora_alpha,
            lora_targets=lora_targets,
            lora_dtype=lora_dtype,
            checkpointing=checkpointing,
            attn=attn,
            device="meta",
        )
    with outer, _real_mask_decisions(fake):
        if fake:
            _to_fake(model, outer)
            opt = make_optimizer(model, optimizer, optimizer_impl=optimizer_impl)
        else:
            model, opt = build_training_setup(
                cfg,
                method=method,
                precision=precision,
                optimizer=optimizer,
                lora_rank=lora_rank,
                lora_alpha=lora_alpha,
                lora_targets=lora_targets,
                lora_dtype=lora_dtype,
                checkpointing=checkpointing,
                attn=attn,
                device=real_device,
                optimizer_impl=optimizer_impl,
            )
        vocab = cfg.vocab_size
        g = torch.Generator(device="cpu").manual_seed(seed)
        if fake:
            x = torch.zeros(batch, seq, dtype=torch.long, device=real_device)
        else:
            x = torch.randint(0, vocab, (batch, seq), generator=g).to(real_device)
        y = x.clone()
        amp = precision in ("fp16-amp", "bf16-amp")
        amp_dtype = torch.float16 if precision == "fp16-amp" else torch.bfloat16
        scaler = None
        scale = 2.0**16
        if precision == "fp16-amp" and not fake:
            scaler = torch.amp.GradScaler(real_device, init_scale=scale)

        tracker = MemoryTracker()
        trainable = [p for p in model.parameters() if p.requires_grad]
        for t in list(model.parameters()) + list(model.buffers()):
            tracker.register(t)
        tracker.set_phase("forward")  # the batch is held for backward (embedding, loss)
        tracker.register(x)
        tracker.register(y)
        tracker.set_phase("pre")
        tracker.param_storages = {id(p.untyped_storage()) for p in model.parameters()}
        marks: dict[str, int] = {}

        def step(track: bool):
            for _ in range(grad_accum):
                tracker.set_phase("forward")
                ctx = (
                    torch.autocast(real_device, dtype=amp_dtype)
                    if amp
                    else contextlib.nullcontext()
                )
                with ctx:
                    loss = model(input_ids=x, labels=y, use_cache=False).loss
                if grad_accum > 1:
                    loss = loss / grad_accum
                if track:
                    marks["forward_end"] = tracker.event
                tracker.set_phase("backward")
                if scaler is not None:
                    scaler.scale(loss).backward()
                elif (
                    precision == "fp16-amp"
                ):  # fake mode: the scaler's arithmetic, no .item()
                    (loss * scale).backward()
                else:
                    loss.backward()
                del loss
            if track:
                marks["grads"] = [
                    tracker.record_of(p.grad) for p in trainable if p.grad is not None
                ]
            tracker.set_phase("optimizer")
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                if precision == "fp16-amp":
                    torch._foreach_mul_(
                        [p.grad for p in trainable if p.grad is not None], 1.0 / scale
                    )
                opt.step()
            if track:
                marks["states"] = [
                    tracker.record_of(t)
                    for st in opt.state.values()
                    for t in st.values()
                    if isinstance(t, torch.Tensor)
                ]
            opt.zero_grad(set_to_none=True)
            tracker.set_phase("idle")

        if device == "cuda":
            torch.cuda.synchronize()
        with tracker:
            step(track=False)
            _until_states_exist(step, opt, track=False)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            tracker.reset_peak()
            step(track=True)
        cuda_stats = None
        if device == "cuda":
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            cuda_stats = {
                "max_memory_allocated": int(torch.cuda.max_memory_allocated()),
                "max_memory_reserved": int(torch.cuda.max_memory_reserved()),
                "device_used": int(total - free),
            }

        # ---- classify the storages alive at each event of interest ----
        weight_ids = {
            id(tracker.record_of(t))
            for t in list(model.parameters()) + list(model.buffers())
        }
        master_ids = set()
        if amp:
            master_ids = {
                id(tracker.record_of(p)) for p in trainable if p.dtype == torch.float32
            }
            weight_ids -= master_ids
        grad_ids = {id(r) for r in marks["grads"] if r is not None}
        state_ids = {id(r) for r in marks["states"] if r is not None}

        def category(rec) -> str:
            i = id(rec)
            if i in master_ids:
                return "master_weights"
            if i in weight_ids or rec.cast_of_param:
                return "weights"
            if i in grad_ids:
                return "gradients"
            if i in state_ids:
                return "optimizer_states"
            if rec.phase == "forward":
                return "activations"
            return "temporaries"

        def at(event: int) -> dict[str, int]:
            out = dict.fromkeys(CATEGORIES, 0)
            for rec in tracker.records:
                if rec.alloc <= event and (rec.free is None or rec.free > event):
                    out[category(rec)] += rec.nbytes
            return out

        peak_bd = at(tracker.peak_event)
        fwd_end = at(marks["forward_end"])
        # Which phase holds the peak: the phase whose own peak equals the global peak.
        phase_peaks = {
            k: v
            for k, v in tracker.phase_peaks.items()
            if k in ("forward", "backward", "optimizer")
        }
        peak_phase = max(phase_peaks, key=lambda k: (phase_peaks[k], k))
        n_params = sum(p.numel() for p in model.parameters())
        n_trainable = sum(p.numel() for p in trainable)
        res = dict(
            total=tracker.peak,
            breakdown=peak_bd,
            activations=fwd_end["activations"],
            phase_peaks=phase_peaks,
            peak_phase=peak_phase,
            n_params=n_params,
            n_trainable=n_trainable,
            cuda=cuda_stats,
        )
        model = opt = tracker = None  # free the step's tensors before the next run
        return res


def _n_layers_field(cfg) -> str:
    return (
        "n_layer"
        if hasattr(cfg, "n_layer") and not hasattr(cfg, "num_hidden_layers")
        else "num_hidden_layers"
    )


def measure(
    model: Any = "tiny",
    *,
    method: str = "full",
    precision: str = "fp32",
    optimizer: str = "adamw",
    batch: int = 1,
    seq: int = 512,
    lora_rank: int = 8,
    lora_alpha: int = 16,
    lora_targets=("q_proj", "v_proj"),
    lora_dtype: str | None = None,
    checkpointing: bool = False,
    attn: str = "sdpa",
    grad_accum: int = 1,
    device: str = "cpu",
    extrapolate: bool | None = None,
    seed: int = 0,
    optimizer_impl: str = "foreach",
) -> Measurement:
    """Measure one training step of ``model`` (preset name, config .json path, or HF config).

    Returns a :class:`Measurement` (bytes). See the module docstring for the categories and the
    devices (``"cpu"``, ``"fake"``, ``"cuda"``). ``extrapolate`` (fake device only) measures 2 and
    3 layers and extends linearly; ``None`` means "when the model has more than 3 layers".
    ``optimizer_impl`` (``"foreach"``, ``"fused"``, ``"for-loop"``) selects torch's AdamW/SGD
    implementation explicitly (see :data:`trainmem.estimate.OPTIMIZER_IMPLS`).
    """
    if device not in ("cpu", "fake", "cuda"):
        raise OptionError(
            "device", f"device must be one of cpu, fake, cuda, got {device!r}"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise OptionError(
            "device",
            "device 'cuda' requested but torch.cuda.is_available() is False; allowed: cpu, fake",
        )
    cfg = resolve_config(model)
    check_options(
        cfg,
        method=method,
        precision=precision,
        optimizer=optimizer,
        batch=batch,
        seq=seq,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        attn=attn,
        grad_accum=grad_accum,
        zero=0,
        gpus=1,
        lora_dtype=lora_dtype,
        optimizer_impl=optimizer_impl,
    )
    if method == "qlora":
        raise OptionError(
            "method",
            "method 'qlora' cannot be measured here (needs bitsandbytes on CUDA); "
            "allowed for measure: full, lora",
        )
    kw = dict(
        method=method,
        precision=precision,
        optimizer=optimizer,
        batch=batch,
        seq=seq,
        grad_accum=grad_accum,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_targets=tuple(lora_targets),
        lora_dtype=lora_dtype,
        checkpointing=checkpointing,
        attn=attn,
        seed=seed,
        optimizer_impl=optimizer_impl,
    )
    options = dict(kw, device=device)
    options["lora_targets"] = list(kw["lora_targets"])
    options["model"] = getattr(cfg, "name_or_path", None) or "config"
    lf = _n_layers_field(cfg)
    n_layers = getattr(cfg, lf)
    if extrapolate is None:
        extrapolate = device == "fake" and n_layers > 3
    if extrapolate and n_layers <= 3:
        extrapolate = False
    t0 = time.perf_counter()
    if not extrapolate:
        r = _one_run(cfg, device=device, **kw)
        return Measurement(
            r["total"],
            r["breakdown"],
            r["activations"],
            r["phase_peaks"],
            r["peak_phase"],
            r["n_params"],
            r["n_trainable"],
            device,
            time.perf_counter() - t0,
            None,
            r["cuda"],
            options,
        )
    runs = {}
    for L in (2, 3):
        c = cfg.__class__.from_dict(cfg.to_dict())
        setattr(c, lf, L)
        runs[L] = _one_run(c, device=device, **kw)
    a, b = runs[2], runs[3]

    def ext(v2, v3):
        return int(v2 + (v3 - v2) * (n_layers - 2))

    # Each phase's peak is affine in the layer count; the step's peak is the largest of them.
    phase_peaks = {
        k: ext(a["phase_peaks"][k], b["phase_peaks"][k]) for k in a["phase_peaks"]
    }
    peak_phase = max(phase_peaks, key=lambda k: (phase_peaks[k], k))
    if a["peak_phase"] == b["peak_phase"] == peak_phase:
        breakdown = {k: ext(a["breakdown"][k], b["breakdown"][k]) for k in CATEGORIES}
    else:  # the peak moves to another phase at full depth: re-measure that phase's breakdown
        breakdown = None
    total = phase_peaks[peak_phase]
    if breakdown is None or sum(breakdown.values()) != total:
        # fall back to the full run (correct, slower)
        r = _one_run(cfg, device=device, **kw)
        return Measurement(
            r["total"],
            r["breakdown"],
            r["activations"],
            r["phase_peaks"],
            r["peak_phase"],
            r["n_params"],
            r["n_trainable"],
            device,
            time.perf_counter() - t0,
            None,
            r["cuda"],
            options,
        )
    return Measurement(
        total,
        breakdown,
        ext(a["activations"], b["activations"]),
        phase_peaks,
        peak_phase,
        ext(a["n_params"], b["n_params"]),
        ext(a["n_trainable"], b["n_trainable"]),
        device,
        time.perf_counter() - t0,
        (2, 3),
        None,
        options,
    )


@contextlib.contextmanager
def _acyclic_module_hooks():
    """Keep MemTracker's module tracker from keeping the autograd graph alive (see
    :func:`measure_memtracker`).

    ``ModTracker`` calls ``register_multi_grad_hook(tensors, fn)`` (mode ``"all"``) on the tensors
    that enter each module. That hook's closure holds the ``grad_fn`` (or, for a leaf, the
    ``AccumulateGrad`` node) of every tensor, and the hook is stored on those same nodes: a cycle
    through C++ that Python's collector cannot free. The graph's nodes outlive the step, and with
    them any leaf that is not a parameter — the embedding output that gradient checkpointing
    marks ``requires_grad_()`` under LoRA — and its ``.grad``. Mode ``"any"`` holds no node, so
    the hooks are registered in that mode; they only tell MemTracker which module backward is in
    (its per-module labels), not how many bytes are alive."""
    from torch.distributed._tools import mod_tracker

    orig = mod_tracker.register_multi_grad_hook

    def hook_any(tensors, fn, mode="all"):
        return orig(tensors, fn, mode="any")

    mod_tracker.register_multi_grad_hook = hook_any
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = orig


def _until_states_exist(step, opt, **kw) -> None:
    """Repeat warm-up steps until the optimizer holds its states: under ``fp16-amp`` the
    GradScaler skips ``optimizer.step()`` while its scale overflows fp16 (the first steps of every
    run), and the step to measure is one of the steady state that follows."""
    for _ in range(32):
        if opt.state or not opt.param_groups[0]["params"] or not _has_states(opt):
            return
        step(**kw)
    raise RuntimeError(
        "the optimizer never stepped in 32 warm-up steps (gradients overflow?)"
    )


def _has_states(opt) -> bool:
    """Whether this optimizer keeps per-parameter states at all (plain SGD does not)."""
    if isinstance(opt, torch.optim.SGD):
        return any(g.get("momentum", 0) for g in opt.param_groups)
    return True


class _NoHook:
    """A hook handle with nothing to remove (see :func:`measure_memtracker`)."""

    def remove(self) -> None:
        pass


def measure_memtracker(
    model: Any = "tiny",
    *,
    method: str = "full",
    precision: str = "fp32",
    optimizer: str = "adamw",
    batch: int = 1,
    seq: int = 512,
    lora_rank: int = 8,
    lora_alpha: int = 16,
    lora_targets=("q_proj", "v_proj"),
    lora_dtype: str | None = None,
    checkpointing: bool = False,
    attn: str = "sdpa",
    grad_accum: int = 1,
    optimizer_impl: str = "foreach",
    seed: int = 0,
) -> int:
    """Peak bytes of the same training step measured by torch's own tracker instead of ours.

    ``torch.distributed._tools.mem_tracker.MemTracker`` (also a ``TorchDispatchMode``, written
    independently of :class:`trainmem.tracker.MemoryTracker`) watches the 2nd of two steps of the
    model, optimizer and batch :func:`measure` builds (real CPU tensors; the model, optimizer and
    batch are registered with ``track_external``). Returns its peak total (bytes): the second
    measurement of ``benchmarks/memory_accuracy.py``.

    Two adjustments make MemTracker measure the same program as a plain training loop, not the
    loop with MemTracker attached: its module tracker's multi-grad hooks (mode ``"all"``) form a
    reference cycle through the autograd graph that ``gc`` cannot free, which keeps the frozen
    embedding's output — a leaf that requires grad under LoRA + gradient checkpointing — and its
    ``.grad`` alive after backward, once per forward; they are registered in mode ``"any"``
    (:func:`_acyclic_module_hooks`). And MemTracker hooks every parameter it meets, which torch
    refuses for frozen ones; those are marked as hooked already.
    """
    import gc

    from torch.distributed._tools.mem_tracker import MemTracker

    cfg = resolve_config(model)
    check_options(
        cfg,
        method=method,
        precision=precision,
        optimizer=optimizer,
        batch=batch,
        seq=seq,
        lora_rank=lora_rank,
        lora_targets=lora_targets,
        attn=attn,
        grad_accum=grad_accum,
        zero=0,
        gpus=1,
        lora_dtype=lora_dtype,
        optimizer_impl=optimizer_impl,
    )
    torch.manual_seed(seed)
    net, opt = build_training_setup(
        cfg,
        method=method,
        precision=precision,
        optimizer=optimizer,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_targets=tuple(lora_targets),
        lora_dtype=lora_dtype,
        checkpointing=checkpointing,
        attn=attn,
        device="cpu",
        optimizer_impl=optimizer_impl,
    )
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    y = x.clone()
    amp = precision in ("fp16-amp", "bf16-amp")
    amp_dtype = torch.float16 if precision == "fp16-amp" else torch.bfloat16
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=2.0**16)
        if precision == "fp16-amp"
        else None
    )

    def step(tracker=None):
        for _ in range(grad_accum):
            if tracker is not None:
                tracker.reset_mod_stats()  # MemTracker refuses a 2nd root forward otherwise
            ctx = (
                torch.autocast("cpu", dtype=amp_dtype)
                if amp
                else contextlib.nullcontext()
            )
            with ctx:
                loss = net(input_ids=x, labels=y, use_cache=False).loss
            if grad_accum > 1:
                loss = loss / grad_accum
            (scaler.scale(loss) if scaler is not None else loss).backward()
            del loss
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    _until_states_exist(step, opt)
    gc.collect()
    tracker = MemTracker()
    # MemTracker installs a gradient hook on every parameter it meets, which torch refuses for a
    # frozen one (LoRA's base weights): mark those as already hooked (handles with no effect).
    for p in net.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    tracker.track_external(net, opt, x, y)
    with tracker, _acyclic_module_hooks():
        step(tracker)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    tracker = net = opt = None  # free the step's tensors
    gc.collect()
    return int(peak)
