"""The model, optimizer and batch that :mod:`trainmem.measuring.measure` trains, built
the same way for every device (real CPU or CUDA tensors, or fake tensors for 7B
shapes)."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util

import torch

from ..config import OptionError, StepConfig, model_shape
from ..decisions import decide
from ..dtypes import dtype as dtype_entry
from .models import build_model
from ..optimizers import OPTIMIZERS
from ..optimizers import optimizer as optimizer_entry


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a :data:`trainmem.dtypes.DTYPES` name (``"bf16"``)."""
    return getattr(torch, dtype_entry(name).torch)


def build_training_setup(
    config, step: StepConfig, *, device: str = "cpu", lr: float = 1e-4
):
    """Model (train mode) and optimizer exactly as
    :func:`trainmem.measuring.measure.measure` runs them: ``config`` a model config,
    ``step`` the options of the training step."""
    # attn "math": transformers' SDPA attention, run under sdpa_kernel(MATH) by the
    # measured step (trainmem.measuring.measure)
    impl = "sdpa" if step.attn == "math" else step.attn
    # the weights in the step's load dtype (from_pretrained's dtype; from_config
    # would follow the config's own dtype)
    d = decide(model_shape(config), step)
    if step.method == "qlora":
        model = quantized_model(config, d, device=device, attn_implementation=impl)
    else:
        model = build_model(
            config,
            device=device,
            dtype=torch_dtype(d.dtypes.load),
            attn_implementation=impl,
        )
    if step.method in ("lora", "qlora"):
        from peft import LoraConfig, get_peft_model

        lora_config = LoraConfig(
            r=step.lora_rank,
            lora_alpha=step.lora_alpha,
            target_modules=list(step.lora_targets),
            lora_dropout=step.lora_dropout,
            bias="none",
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora_config)
        if step.lora_dtype is not None:
            dtype = torch_dtype(step.lora_dtype)
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.data = param.data.to(dtype)
    if step.checkpointing and not (d.kbit and d.kbit.prepared):
        # (prepare_model_for_kbit_training has enabled it, as its callers ask)
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={
                "use_reentrant": step.checkpointing_mode == "reentrant"
            }
        )
    model.train()
    return model, make_optimizer(model, step.optimizer, lr, step.optimizer_impl)


def quantized_model(config, d, *, device: str = "cpu", attn_implementation=None):
    """The QLoRA base as a user loads it: the model saved (random weights, in the
    load dtype) and loaded back by ``from_pretrained`` with a 4-bit NF4
    ``BitsAndBytesConfig`` (double quantization as ``qlora_double_quant`` says, the
    compute dtype :class:`trainmem.kbit.KbitFlow` names), then, for ``kbit_prepare
    "peft"``, ``prepare_model_for_kbit_training`` with the step's checkpointing. Needs
    bitsandbytes (>= 0.49 runs on the CPU as well as on CUDA)."""
    import logging
    import tempfile

    step, flow = d.options, d.kbit
    if importlib.util.find_spec("bitsandbytes") is None:
        raise OptionError(
            "method",
            "method 'qlora' needs bitsandbytes to be measured (pip install "
            "bitsandbytes; 0.49 or newer runs on the CPU); allowed without it: full, "
            "lora",
        )
    # bitsandbytes logs at import that its optional CPU inference kernel (the
    # `kernels` package) is missing; training does not use it
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.utils import logging as hf_logging

    load = torch_dtype(flow.load)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=step.qlora_double_quant,
        bnb_4bit_compute_dtype=torch_dtype(flow.compute),
    )
    kwargs = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = build_model(config, dtype=load, **kwargs)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            del model
            model = AutoModelForCausalLM.from_pretrained(
                folder,
                quantization_config=quant,
                dtype=load,
                device_map={"": device},
                **kwargs,
            )
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if flow.prepared:
        from peft import prepare_model_for_kbit_training

        reentrant = step.checkpointing_mode == "reentrant"
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=step.checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": reentrant},
        )
    return model


def quant_state_tensors(model) -> list:
    """The tensors bitsandbytes keeps beside each 4-bit weight (``quant_state``: the
    absmax constants, their own constants under double quantization, the code
    tables), which are neither parameters nor buffers."""
    out = []
    for p in model.parameters():
        state = getattr(p, "quant_state", None)
        while state is not None:
            for name in ("absmax", "code", "offset"):
                t = getattr(state, name, None)
                if isinstance(t, torch.Tensor):
                    out.append(t)
            state = getattr(state, "state2", None)
    return out


@contextlib.contextmanager
def real_mask_decisions(active: bool):
    """transformers treats fake tensors as "tracing" and then materialises the causal
    mask that a real run skips (SDPA ``is_causal``). Make the fake run take the real
    run's decisions."""
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


def to_fake(model, mode):
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


def make_optimizer(
    model, optimizer: str, lr: float = 1e-4, optimizer_impl: str | None = None
):
    """The optimizer :func:`measure` uses, over the trainable parameters, built from its
    :mod:`trainmem.optimizers` entry with the implementation chosen explicitly
    (``foreach``, ``fused`` or ``for-loop``: the same on every device, so the CPU
    measurement holds the scratch memory a GPU run holds)."""
    spec = optimizer_entry(optimizer)
    impl_name = optimizer_impl or spec.default_impl
    impl = spec.impl(impl_name)
    if spec.torch is None or impl.flags is None:
        why = spec.unmeasurable or f"{impl_name} is not a torch implementation here"
        runnable = {
            o.name: [k for k, i in o.impls.items() if i.flags is not None]
            for o in OPTIMIZERS.values()
            if o.torch is not None
        }
        allowed = ", ".join(f"{n} ({', '.join(k)})" for n, k in runnable.items())
        raise OptionError(
            "optimizer",
            f"optimizer {optimizer!r} with optimizer_impl {impl_name!r} cannot be "
            f"measured here ({why}); allowed for measure: {allowed}",
        )
    module_name, _, class_name = spec.torch[0].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    params = [p for p in model.parameters() if p.requires_grad]
    return cls(params, lr=lr, **spec.torch[1], **impl.flags)


def until_states_exist(train_step, opt, **kw) -> None:
    """Repeat warm-up steps until the optimizer holds its states: under ``fp16-amp`` the
    GradScaler skips ``optimizer.step()`` while its scale overflows fp16 (the first
    steps of every run), and the step to measure is one of the steady state that
    follows."""
    for _ in range(32):
        if opt.state or not opt.param_groups[0]["params"] or not _has_states(opt):
            return
        train_step(**kw)
    raise RuntimeError(
        "the optimizer never stepped in 32 warm-up steps (gradients overflow?)"
    )


def _has_states(opt) -> bool:
    """Whether this optimizer keeps per-parameter states at all (plain SGD does not)."""
    if isinstance(opt, torch.optim.SGD):
        return any(g.get("momentum", 0) for g in opt.param_groups)
    return True
