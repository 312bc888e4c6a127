"""Measure the memory of one real training step, tensor by tensor.

``measure(...)`` builds the model from its config (random weights, no downloads), runs
the training step twice — forward, backward, optimizer step,
``zero_grad(set_to_none=True)`` — and reports the peak of the **second** step (the first
one creates the optimizer states), with the storages alive at that peak split into the
six categories of :mod:`trainmem.estimate`:

=================  =====================================================================
weights            parameters and buffers the model holds (frozen ones included), plus
                   the low-precision copies of parameters that ``torch.autocast`` makes
                   (and autograd keeps for backward) under ``fp16-amp``/``bf16-amp``
gradients          ``param.grad`` of the trainable parameters
optimizer_states   everything in ``optimizer.state`` (AdamW ``exp_avg``, ``exp_avg_sq``,
                   ``step``; SGD ``momentum_buffer``)
master_weights     under ``fp16-amp``/``bf16-amp`` (autocast over fp32 parameters) the
                   fp32 trainable parameters are the master copy: they are counted here,
                   not in weights
activations        tensors allocated during the forward pass that are still alive (held
                   by autograd for backward, incl. ``input_ids``/labels and the layer
                   inputs that activation checkpointing keeps)
temporaries        everything else alive at the peak: gradients flowing through
                   backward, tensors recomputed by checkpointing, the optimizer's
                   scratch tensors, ...
=================  =====================================================================

All sizes are in **bytes** (sum of ``untyped_storage().nbytes()``, each storage counted
once).

Devices:

* ``"cpu"`` — real tensors; exact and repeatable (the CPU allocator does not round).
* ``"fake"`` — the same step under ``torch._subclasses.fake_tensor.FakeTensorMode``:
  shapes and dtypes are propagated but nothing is allocated, so a 7B- or 13B-shaped
  model is measured on a laptop.  With ``extrapolate=True`` (default for ``"fake"`` when
  the model has more than 3 layers) the step is measured with 2 and 3 decoder layers and
  every per-phase, per-category number is extended linearly to the real layer count.
  This is exact whenever each phase's peak sits at the same place relative to the top of
  the network (true for decoder-only stacks of identical layers; the tests check it
  against the full run on small models) and is reported as ``extrapolated_from_layers``
  in the result.
* ``"cuda"`` — real tensors on a GPU; additionally reports
  ``torch.cuda.max_memory_allocated``, ``max_memory_reserved`` and the device's used
  memory (``torch.cuda.mem_get_info``), whose gap to ``reserved`` is the CUDA context
  plus other processes.

The optimizer's implementation is chosen explicitly (``optimizer_impl``: ``"foreach"``
by default, which is what a plain ``torch.optim.AdamW(params)`` runs on CUDA;
``"fused"``, which Hugging Face Trainer's default ``optim="adamw_torch_fused"`` runs;
``"for-loop"``) and is the same on every device, so the scratch memory of the step is
the one a GPU run has.  ``adamw8bit`` needs ``bitsandbytes`` on CUDA and is estimated
only. ``qlora`` runs where bitsandbytes runs — CUDA, and its CPU backend (0.49+): the
model is saved and loaded back by ``from_pretrained`` with a 4-bit
``BitsAndBytesConfig``, then ``prepare_model_for_kbit_training`` (``kbit_prepare``);
not on fake tensors. Each 4-bit weight's ``quant_state`` tensors count as weights. On
the CPU, peft's LoRA on a 4-bit Linear does not see ``torch.autocast("cpu")``
(:mod:`trainmem.kbit`): compare with an estimate at ``kernels="cpu"``."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import (
    CATEGORIES,
    OptionError,
    StepConfig,
    load_model_config,
    model_shape,
    step_signature,
)
from ..decisions import Decisions, decide
from ..frameworks import framework as framework_entry
from .tracker import MemoryTracker
from .training_setup import (
    build_training_setup,
    make_optimizer,
    quant_state_tensors,
    real_mask_decisions,
    to_fake,
    torch_dtype,
    until_states_exist,
)

__all__ = [
    "measure",
    "measure_step",
    "measure_memtracker",
    "Measurement",
    "build_training_setup",
    "make_optimizer",
]


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
        from ..estimate import format_table

        rows = dict(self.breakdown)
        extra = {"activations at end of forward": self.activation_bytes}
        if self.cuda:
            extra.update({f"cuda {k}": v for k, v in self.cuda.items()})
        title = f"measured peak ({self.device}, peak in {self.peak_phase})"
        if self.extrapolated_from_layers:
            title += f", extrapolated from {self.extrapolated_from_layers} layers"
        return format_table(title, rows, self.total_bytes, extra)


def _attention_backend(attn: str):
    """attn "math": SDPA restricted to its math backend (the composite every device
    runs when no fused kernel takes the inputs); other choices: no restriction."""
    if attn != "math":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


class _TrackedTraining:
    """The training loop of :func:`measure` with a :class:`MemoryTracker` attached.

    ``run(track)`` is one optimizer step (``grad_accum`` forwards and backwards, the
    optimizer step, ``zero_grad(set_to_none=True)``), setting the tracker's phase as it
    goes; with ``track`` it records in ``marks`` the event at the end of the forward
    pass, the gradients and the optimizer states."""

    def __init__(self, model, opt, inputs, d: Decisions, device: str, fake: bool):
        self.model, self.opt, self.step = model, opt, d.options
        self.inputs, self.labels = inputs, inputs.clone()
        self.device = "cuda" if device == "cuda" else "cpu"
        self.amp = d.dtypes.autocast is not None
        self.amp_dtype = torch_dtype(d.dtypes.autocast) if self.amp else None
        self.loss_scale = 2.0**16
        self.scaling = d.precision.loss_scaling
        self.scaler = None
        if self.scaling and not fake:
            self.scaler = torch.amp.GradScaler(self.device, init_scale=self.loss_scale)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.marks: dict[str, Any] = {}
        tracker = self.tracker = MemoryTracker()
        self.quant_state = quant_state_tensors(model)
        for t in list(model.parameters()) + list(model.buffers()) + self.quant_state:
            tracker.register(t)
        tracker.set_phase("forward")  # the batch is held for backward (embedding, loss)
        tracker.register(self.inputs)
        tracker.register(self.labels)
        tracker.set_phase("pre")
        tracker.param_storages = {id(p.untyped_storage()) for p in model.parameters()}

    def _forward_backward(self, track: bool) -> None:
        tracker, step = self.tracker, self.step
        tracker.set_phase("forward")
        autocast = (
            torch.autocast(self.device, dtype=self.amp_dtype)
            if self.amp
            else contextlib.nullcontext()
        )
        with autocast:
            loss = self.model(
                # use_cache as the estimate describes it (StepConfig.cache_on: the
                # config's default, off under checkpointing, or --use-cache)
                input_ids=self.inputs,
                labels=self.labels,
                use_cache=self.step.cache_on,
            ).loss
        if step.grad_accum > 1:
            loss = loss / step.grad_accum
        if track:
            self.marks["forward_end"] = tracker.event
        tracker.set_phase("backward")
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        elif self.scaling:  # fake mode: the scaler's arithmetic, no .item()
            (loss * self.loss_scale).backward()
        else:
            loss.backward()
        del loss

    def run(self, track: bool) -> None:
        tracker, opt = self.tracker, self.opt
        # backward too: a checkpointed layer recomputes its attention there
        with _attention_backend(self.step.attn):
            for _ in range(self.step.grad_accum):
                self._forward_backward(track)
        if track:
            self.marks["grads"] = [
                tracker.record_of(p.grad) for p in self.trainable if p.grad is not None
            ]
        tracker.set_phase("optimizer")
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            if self.scaling:
                grads = [p.grad for p in self.trainable if p.grad is not None]
                torch._foreach_mul_(grads, 1.0 / self.loss_scale)
            opt.step()
        if track:
            self.marks["states"] = [
                tracker.record_of(t)
                for state in opt.state.values()
                for t in state.values()
                if isinstance(t, torch.Tensor)
            ]
        opt.zero_grad(set_to_none=True)
        tracker.set_phase("idle")

    def measure_second_step(self, device: str) -> dict[str, int] | None:
        """Warm up (until the optimizer holds its states), then track one step; returns
        the CUDA allocator's statistics on ``"cuda"``, else ``None``."""
        if device == "cuda":
            torch.cuda.synchronize()
        with self.tracker:
            self.run(track=False)
            until_states_exist(self.run, self.opt, track=False)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.tracker.reset_peak()
            self.run(track=True)
        if device != "cuda":
            return None
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {
            "max_memory_allocated": int(torch.cuda.max_memory_allocated()),
            "max_memory_reserved": int(torch.cuda.max_memory_reserved()),
            "device_used": int(total - free),
        }

    def collect(self) -> dict:
        """The storages alive at the peak and at the end of the forward pass, by
        category, and the peak of each phase."""
        tracker, model, marks = self.tracker, self.model, self.marks
        weight_ids = {
            id(tracker.record_of(t))
            for t in list(model.parameters()) + list(model.buffers()) + self.quant_state
        }
        master_ids = set()
        if self.amp:
            master_ids = {
                id(tracker.record_of(p))
                for p in self.trainable
                if p.dtype == torch.float32
            }
            weight_ids -= master_ids
        grad_ids = {id(r) for r in marks["grads"] if r is not None}
        state_ids = {id(r) for r in marks["states"] if r is not None}

        def category(record) -> str:
            key = id(record)
            if key in master_ids:
                return "master_weights"
            if key in weight_ids or record.cast_of_param:
                return "weights"
            if key in grad_ids:
                return "gradients"
            if key in state_ids:
                return "optimizer_states"
            if record.phase == "forward":
                return "activations"
            return "temporaries"

        def alive_at(event: int) -> dict[str, int]:
            out = dict.fromkeys(CATEGORIES, 0)
            for record in tracker.records:
                if record.alloc <= event and (
                    record.free is None or record.free > event
                ):
                    out[category(record)] += record.nbytes
            return out

        # Which phase holds the peak: the phase whose own peak equals the global peak.
        phase_peaks = {
            k: v
            for k, v in tracker.phase_peaks.items()
            if k in ("forward", "backward", "optimizer")
        }
        return dict(
            total=tracker.peak,
            breakdown=alive_at(tracker.peak_event),
            activations=alive_at(marks["forward_end"])["activations"],
            phase_peaks=phase_peaks,
            peak_phase=max(phase_peaks, key=lambda k: (phase_peaks[k], k)),
            n_params=sum(p.numel() for p in model.parameters()),
            n_trainable=sum(p.numel() for p in self.trainable),
        )


def _one_run(config, step: StepConfig, *, device: str, seed: int = 0) -> dict:
    """Run two steps, track the second one. Returns a dict of raw numbers."""
    fake = device == "fake"
    real_device = "cuda" if device == "cuda" else "cpu"
    fake_mode = None
    torch.manual_seed(seed)
    if fake:
        from torch._subclasses.fake_tensor import FakeTensorMode

        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        # Build on the meta device (no memory), then turn every parameter and buffer
        # into a fake CPU tensor, so autocast and the CPU kernels' shape rules apply.
        meta_step = dataclasses.replace(step, optimizer="sgd", optimizer_impl="foreach")
        model, _ = build_training_setup(config, meta_step, device="meta")
    with fake_mode or contextlib.nullcontext(), real_mask_decisions(fake):
        if fake:
            to_fake(model, fake_mode)
            opt = make_optimizer(
                model, step.optimizer, optimizer_impl=step.optimizer_impl
            )
        else:
            model, opt = build_training_setup(config, step, device=real_device)
        shape = (step.batch, step.seq)
        if fake:
            inputs = torch.zeros(shape, dtype=torch.long, device=real_device)
        else:
            generator = torch.Generator(device="cpu").manual_seed(seed)
            inputs = torch.randint(0, config.vocab_size, shape, generator=generator)
            inputs = inputs.to(real_device)
        d = decide(model_shape(config), step)
        training = _TrackedTraining(model, opt, inputs, d, device, fake)
        cuda_stats = training.measure_second_step(device)
        result = training.collect()
        result["cuda"] = cuda_stats
        model = opt = training = None  # free the step's tensors before the next run
        return result


def _n_layers_field(config) -> str:
    if hasattr(config, "n_layer") and not hasattr(config, "num_hidden_layers"):
        return "n_layer"
    return "num_hidden_layers"


def _check_device(device: str) -> None:
    if device not in ("cpu", "fake", "cuda"):
        raise OptionError(
            "device", f"device must be one of cpu, fake, cuda, got {device!r}"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise OptionError(
            "device",
            "device 'cuda' requested but torch.cuda.is_available() is False; allowed: "
            "cpu, fake",
        )


def _measurable_config(model: Any, step: StepConfig, device: str):
    """The model config of ``model``, once ``step`` is known to be measurable here."""
    config = load_model_config(model)
    step.check_model(model_shape(config))
    if step.method == "qlora" and device == "fake":
        raise OptionError(
            "method",
            "method 'qlora' cannot be measured on fake tensors (bitsandbytes quantizes "
            "real weights); allowed for a fake measurement: full, lora",
        )
    return config


def measure(
    model: Any = "tiny",
    *,
    device: str = "cpu",
    extrapolate: bool | None = None,
    seed: int = 0,
    **options: Any,
) -> Measurement:
    """Measure one training step of ``model`` (preset name, config .json path, or HF
    config): ``options`` are the fields of :class:`~trainmem.config.StepConfig` (its
    defaults apply, as in :func:`trainmem.estimate.estimate`); then
    :func:`measure_step` runs.

    Returns a :class:`Measurement` (bytes). See the module docstring for the categories
    and the devices (``"cpu"``, ``"fake"``, ``"cuda"``). ``extrapolate`` (fake device
    only) measures 2 and 3 layers and extends linearly; ``None`` means "when the model
    has more than 3 layers". ``optimizer_impl`` (``"foreach"``, ``"fused"``,
    ``"for-loop"``) selects torch's implementation explicitly (see
    :data:`trainmem.config.OPTIMIZER_IMPLS`)."""
    _check_device(device)
    step = StepConfig.from_options(options)
    return measure_step(model, step, device=device, extrapolate=extrapolate, seed=seed)


_KEYWORD = inspect.Parameter.KEYWORD_ONLY
step_signature(
    measure,
    inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="tiny"),
    inspect.Parameter("device", _KEYWORD, default="cpu"),
    inspect.Parameter("extrapolate", _KEYWORD, default=None),
    inspect.Parameter("seed", _KEYWORD, default=0),
)


def _options_record(config, step: StepConfig, device: str, seed: int) -> dict:
    """The options of a measurement as its result reports them (``.options``)."""
    names = MEASURE_RECORD + (("load_dtype",) if step.load_dtype else ())
    if step.method == "qlora":
        names += ("kbit_prepare", "qlora_double_quant")
    model = getattr(config, "name_or_path", None) or "config"
    return step.record(names, seed=seed, device=device, model=model)


#: the options a measurement's result reports, in order (:meth:`StepConfig.record`)
MEASURE_RECORD = (
    "method",
    "precision",
    "optimizer",
    "batch",
    "seq",
    "grad_accum",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "lora_dtype",
    "checkpointing",
    "attn",
    "seed",
    "optimizer_impl",
    "device",
    "model",
)


def _from_run(run: dict, device: str, started: float, options: dict) -> Measurement:
    return Measurement(
        run["total"],
        run["breakdown"],
        run["activations"],
        run["phase_peaks"],
        run["peak_phase"],
        run["n_params"],
        run["n_trainable"],
        device,
        time.perf_counter() - started,
        None,
        run["cuda"],
        options,
    )


def measure_step(
    model: Any,
    step: StepConfig,
    *,
    device: str = "cpu",
    extrapolate: bool | None = None,
    seed: int = 0,
) -> Measurement:
    """:func:`measure` with the options of the step given as a
    :class:`~trainmem.config.StepConfig` (its ``zero`` and ``gpus`` do not apply: one
    device)."""
    _check_device(device)
    if step.zero != 0 or step.gpus != 1:
        raise OptionError("zero", "zero must be 0 and gpus 1 for a measurement")
    if not framework_entry(step.framework).measurable:
        # the measurement builds a transformers model; LitGPT's GPT is not built here
        raise OptionError(
            "framework",
            f"framework {step.framework!r} cannot be measured (the measurement runs "
            "the transformers + peft model); allowed for measure: hf",
        )
    config = _measurable_config(model, step, device)
    options = _options_record(config, step, device, seed)
    layers_field = _n_layers_field(config)
    n_layers = getattr(config, layers_field)
    if extrapolate is None:
        extrapolate = device == "fake" and n_layers > 3
    if extrapolate and n_layers <= 3:
        extrapolate = False
    started = time.perf_counter()
    if not extrapolate:
        run = _one_run(config, step, device=device, seed=seed)
        return _from_run(run, device, started, options)
    runs = {}
    for layers in (2, 3):
        shallow = config.__class__.from_dict(config.to_dict())
        setattr(shallow, layers_field, layers)
        runs[layers] = _one_run(shallow, step, device=device, seed=seed)
    two, three = runs[2], runs[3]

    def extend(at_two, at_three):
        return int(at_two + (at_three - at_two) * (n_layers - 2))

    # Each phase's peak is affine in the layer count; the step's peak is the largest.
    phase_peaks = {
        k: extend(two["phase_peaks"][k], three["phase_peaks"][k])
        for k in two["phase_peaks"]
    }
    peak_phase = max(phase_peaks, key=lambda k: (phase_peaks[k], k))
    breakdown = None  # when the peak moves to another phase at full depth
    if two["peak_phase"] == three["peak_phase"] == peak_phase:
        breakdown = {
            k: extend(two["breakdown"][k], three["breakdown"][k]) for k in CATEGORIES
        }
    total = phase_peaks[peak_phase]
    if breakdown is None or sum(breakdown.values()) != total:
        # fall back to the full run (correct, slower)
        run = _one_run(config, step, device=device, seed=seed)
        return _from_run(run, device, started, options)
    return Measurement(
        total,
        breakdown,
        extend(two["activations"], three["activations"]),
        phase_peaks,
        peak_phase,
        extend(two["n_params"], three["n_params"]),
        extend(two["n_trainable"], three["n_trainable"]),
        device,
        time.perf_counter() - started,
        (2, 3),
        None,
        options,
    )


# torch's own MemTracker, the independent second measurement, has its own module
from .torch_memtracker import measure_memtracker  # noqa: E402
