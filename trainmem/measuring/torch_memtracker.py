"""The same training step as :func:`trainmem.measuring.measure.measure`, measured by
torch's own ``MemTracker`` instead of :class:`trainmem.measuring.tracker.MemoryTracker`:
the independent second measurement of ``benchmarks/memory_accuracy.py`` (re-exported by
:mod:`trainmem.measuring.measure`)."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from ..config import (
    OptionError,
    StepConfig,
    load_model_config,
    model_shape,
    step_signature,
)
from ..decisions import decide
from .training_setup import build_training_setup, torch_dtype, until_states_exist


@contextlib.contextmanager
def _acyclic_module_hooks():
    """Keep MemTracker's module tracker from keeping the autograd graph alive (see
    :func:`measure_memtracker`).

    ``ModTracker`` calls ``register_multi_grad_hook(tensors, fn)`` (mode ``"all"``) on
    the tensors that enter each module. That hook's closure holds the ``grad_fn`` (or,
    for a leaf, the ``AccumulateGrad`` node) of every tensor, and the hook is stored on
    those same nodes: a cycle through C++ that Python's collector cannot free. The
    graph's nodes outlive the step, and with them any leaf that is not a parameter — the
    embedding output that gradient checkpointing marks ``requires_grad_()`` under LoRA —
    and its ``.grad``. Mode ``"any"`` holds no node, so the hooks are registered in that
    mode; they only tell MemTracker which module backward is in (its per-module labels),
    not how many bytes are alive."""
    from torch.distributed._tools import mod_tracker

    orig = mod_tracker.register_multi_grad_hook

    def hook_any(tensors, fn, mode="all"):
        return orig(tensors, fn, mode="any")

    mod_tracker.register_multi_grad_hook = hook_any
    try:
        yield
    finally:
        mod_tracker.register_multi_grad_hook = orig


class _NoHook:
    """A hook handle with nothing to remove (see :func:`measure_memtracker`)."""

    def remove(self) -> None:
        pass


def measure_memtracker(model: Any = "tiny", *, seed: int = 0, **options: Any) -> int:
    """Peak bytes of the same training step measured by torch's own tracker instead of
    ours.

    ``torch.distributed._tools.mem_tracker.MemTracker`` (also a ``TorchDispatchMode``,
    written independently of :class:`trainmem.measuring.tracker.MemoryTracker`) watches
    the 2nd of two steps of the model, optimizer and batch :func:`measure` builds (real
    CPU tensors; the model, optimizer and batch are registered with ``track_external``).
    Returns its peak total (bytes): the second measurement of
    ``benchmarks/memory_accuracy.py``.

    Two adjustments make MemTracker measure the same program as a plain training loop,
    not the loop with MemTracker attached: its module tracker's multi-grad hooks (mode
    ``"all"``) form a reference cycle through the autograd graph that ``gc`` cannot
    free, which keeps the frozen embedding's output — a leaf that requires grad under
    LoRA + gradient checkpointing — and its ``.grad`` alive after backward, once per
    forward; they are registered in mode ``"any"`` (:func:`_acyclic_module_hooks`). And
    MemTracker hooks every parameter it meets, which torch refuses for frozen ones;
    those are marked as hooked already."""
    import gc

    from torch.distributed._tools.mem_tracker import MemTracker

    step = StepConfig.from_options(options)
    if step.zero != 0 or step.gpus != 1:
        raise OptionError("zero", "zero must be 0 and gpus 1 for a measurement")
    batch, seq, grad_accum = step.batch, step.seq, step.grad_accum
    config = load_model_config(model)
    step.check_model(model_shape(config))
    torch.manual_seed(seed)
    net, opt = build_training_setup(config, step, device="cpu")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    inputs = torch.randint(0, config.vocab_size, (batch, seq), generator=generator)
    labels = inputs.clone()
    d = decide(model_shape(config), step)
    amp = d.dtypes.autocast is not None
    amp_dtype = torch_dtype(d.dtypes.autocast) if amp else None
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=2.0**16)
        if d.precision.loss_scaling
        else None
    )

    def train_step(tracker=None):
        for _ in range(grad_accum):
            if tracker is not None:
                tracker.reset_mod_stats()  # MemTracker refuses a 2nd root forward else
            autocast = (
                torch.autocast("cpu", dtype=amp_dtype)
                if amp
                else contextlib.nullcontext()
            )
            with autocast:
                # the program trainmem.measuring.measure runs: use_cache as the step
                # says
                loss = net(
                    input_ids=inputs, labels=labels, use_cache=step.cache_on
                ).loss
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

    train_step()
    until_states_exist(train_step, opt)
    gc.collect()
    tracker = MemTracker()
    # MemTracker installs a gradient hook on every parameter it meets, which torch
    # refuses for a frozen one (LoRA's base weights): mark those as already hooked
    # (handles with no effect).
    for p in net.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    tracker.track_external(net, opt, inputs, labels)
    with tracker, _acyclic_module_hooks():
        train_step(tracker)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    tracker = net = opt = None  # free the step's tensors
    gc.collect()
    return int(peak)


step_signature(
    measure_memtracker,
    inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default="tiny"),
    inspect.Parameter("seed", inspect.Parameter.KEYWORD_ONLY, default=0),
)
