"""The machinery around chapter 7's QLoRA recipe: loading the base, the training loop
with timing and peak memory, and the comparison with 16-bit LoRA and the estimator.

The recipe itself (quantisation config, ``prepare_model_for_kbit_training``, LoRA,
paged 8-bit AdamW) stays in the chapter's cell; :data:`RECIPE` and :func:`estimates`
state and estimate exactly that recipe. ``small=True`` is the CPU run: a tiny Llama
built from a config (no download) walks through the same steps, NF4-quantised by
bitsandbytes' CPU backend where bitsandbytes (0.49 or newer) is installed.

``from_pretrained`` returns the model in **eval mode** (transformers'
``modeling_utils.py``: ``model.eval()`` after loading), and transformers checkpoints
a decoder layer only in training mode (``modeling_layers.py``,
``GradientCheckpointingLayer``: ``if self.gradient_checkpointing and self.training
...``): without ``model.train()`` the checkpointing that ``prepare_model_for_kbit_
training`` enables silently does nothing and every layer's activations are kept.
:func:`train_steps` calls ``model.train()``, as ``transformers.Trainer`` does.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from ..families import LLAMA_LINEARS

#: The capstone's model (lab 6).
NAME = "Qwen/Qwen2.5-0.5B"
#: LoRA on all seven projections of a decoder layer.
TARGETS = LLAMA_LINEARS
#: Non-reentrant activation checkpointing (the variant LoRA's gradients flow through).
CKPT = {"use_reentrant": False}
# peft calls a transformers API that transformers 5 renamed (a FutureWarning per call)
_RENAMED = ".*will be removed in v6.*"
#: LoRA rank and alpha of the chapter's run
RANK, ALPHA = 8, 16
#: the recipe the chapter's cell runs, as the estimate's options (the compute dtype
#: fills ``precision`` and ``load_dtype``: :func:`recipe_options`). QLoRA: NF4 + double
#: quantisation, the rest loaded in the compute dtype, ``prepare_model_for_kbit_
#: training`` (fp32 norms and embeddings), autocast, non-reentrant checkpointing,
#: LoRA r=8 on the seven projections, bitsandbytes' 8-bit AdamW (PagedAdamW8bit pages
#: only states of tensors from 1e5 elements; every LoRA matrix here is smaller, so
#: its states are plain 8-bit AdamW's). 16-bit LoRA: the same base unquantised, peft's
#: fp32 adapters, the same autocast and checkpointing, torch AdamW.
RECIPE = {
    "qlora": dict(
        method="qlora",
        kbit_prepare="peft",
        qlora_double_quant=True,
        optimizer="adamw8bit",
    ),
    "lora": dict(method="lora", optimizer="adamw"),
}


def sizes(small: bool) -> tuple[int, int, int]:
    """(batch, seq, steps) of the run: tiny on the CPU, b4 x s512 on a GPU."""
    return (2, 32, 3) if small else (4, 512, 6)


def bnb_on_cpu() -> bool:
    """Whether bitsandbytes is installed in a version with a CPU backend (0.49+)."""
    import importlib.metadata
    import re

    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2]) >= (0, 49)


def load_base(device, quant_kwargs: dict | None, compute_dtype, small: bool):
    """The base model: NF4-quantised (``quant_kwargs`` for ``BitsAndBytesConfig``) or
    16-bit (``quant_kwargs=None``), the rest in ``compute_dtype``; on the CPU
    (``small``) a tiny Llama, saved and loaded back quantised by bitsandbytes' CPU
    backend where it is installed (:func:`bnb_on_cpu`), else unquantised."""
    warnings.filterwarnings("ignore", message=_RENAMED)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if small:
        import logging
        import tempfile

        from trainmem.measuring.models import build_model, tiny_llama_config

        model = build_model(tiny_llama_config(), seed=0, dtype=compute_dtype)
        if quant_kwargs is None or not bnb_on_cpu():
            return model
        from transformers.utils import logging as hf_logging

        # (its import-time note about an optional CPU inference kernel is not ours)
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        hf_logging.disable_progress_bar()  # a few ms of saving and loading
        try:
            with tempfile.TemporaryDirectory() as folder:
                model.save_pretrained(folder)
                quantized = AutoModelForCausalLM.from_pretrained(
                    folder,
                    quantization_config=BitsAndBytesConfig(**quant_kwargs),
                    dtype=compute_dtype,
                    device_map={"": "cpu"},
                )
            # the model's name, not the temporary folder's (peft records it)
            quantized.name_or_path = model.name_or_path
            return quantized
        finally:
            hf_logging.enable_progress_bar()

    if quant_kwargs is not None:  # BitsAndBytesConfig needs bitsandbytes: GPU only
        return AutoModelForCausalLM.from_pretrained(
            NAME,
            quantization_config=BitsAndBytesConfig(**quant_kwargs),
            dtype=compute_dtype,
            device_map={"": device.index or 0},
        )
    return AutoModelForCausalLM.from_pretrained(NAME, dtype=compute_dtype).to(device)


@dataclass
class StepRun:
    peak_bytes: int | None  # torch.cuda.max_memory_allocated; None on the CPU
    seconds_per_step: float  # mean over the steps after the first
    losses: list[float]


def train_steps(model, opt, device, compute_dtype, small: bool) -> StepRun:
    """A few steps on random tokens under autocast (loss scaling for fp16); the peak
    allocated memory and the mean time of the steps after the first."""
    batch, seq, steps = sizes(small)
    # from_pretrained left the model in eval mode, where transformers skips the
    # checkpointing it was asked for (module docstring)
    model.train()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    scaler = torch.amp.GradScaler(device.type, enabled=compute_dtype == torch.float16)
    vocab = model.config.vocab_size
    times, losses = [], []
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=compute_dtype):
            # no KV cache in training (what the estimate assumes under checkpointing)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    return StepRun(peak, sum(times[1:]) / (steps - 1), losses)


def recipe_options(compute_dtype, checkpointing: bool = True) -> dict[str, dict]:
    """The estimate's options for each run of the recipe (:data:`RECIPE`) at the GPU
    run's batch and sequence: autocast and load dtype from ``compute_dtype`` (bf16,
    fp16 below sm_80), non-reentrant checkpointing (``checkpointing=False``: the
    recipe as it runs in eval mode, module docstring)."""
    name = str(compute_dtype).split(".")[-1]
    half = {"bfloat16": "bf16", "float16": "fp16"}[name]
    batch, seq, _ = sizes(False)
    common = dict(
        precision=f"{half}-amp",
        load_dtype=half,
        batch=batch,
        seq=seq,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        lora_targets=TARGETS,
        checkpointing=checkpointing,
        checkpointing_mode="non-reentrant",
    )
    return {m: {**common, **opts} for m, opts in RECIPE.items()}


def estimates(config, compute_dtype, checkpointing: bool = True) -> dict[str, int]:
    """trainmem's peak (tensors) for the QLoRA and 16-bit LoRA runs of the recipe
    (:func:`recipe_options`)."""
    from trainmem.estimate import estimate

    return {
        m: estimate(config, **opts).total_bytes
        for m, opts in recipe_options(compute_dtype, checkpointing).items()
    }


def recipe_line(compute_dtype) -> str:
    """The recipe the estimate assumes, in one line."""
    half = str(compute_dtype).split(".")[-1]
    return (
        f"recipe: base loaded in {half}, autocast {half}, non-reentrant "
        f"checkpointing (model.train()), LoRA r={RANK} on the 7 projections | QLoRA: "
        "NF4 + double quant, prepare_model_for_kbit_training (fp32 norms and "
        f"embeddings), 8-bit AdamW | {half} LoRA: fp32 adapters, AdamW"
    )


def _line(label: str, run: StepRun) -> str:
    mem = (
        f"max_memory_allocated {run.peak_bytes / 2**30:6.2f} GiB"
        if run.peak_bytes is not None
        else "CPU 上运行（没有 CUDA 峰值）"
    )
    return (
        f"{label:14} {mem} | {run.seconds_per_step * 1e3:8.1f} ms/step | "
        f"loss {run.losses[0]:.3f} -> {run.losses[-1]:.3f}"
    )


def compare_with_lora(qlora: StepRun, device, compute_dtype, lora_config, small: bool):
    """Print the estimate, then the QLoRA run next to the same LoRA on a 16-bit base
    (same checkpointing, plain AdamW); on a GPU also measured / estimated and the
    step-time ratio. Returns the two runs."""
    from peft import get_peft_model

    if small:
        from trainmem.measuring.models import get_config

        config = get_config("qwen2.5-0.5b")  # trainmem's copy of its config.json
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(NAME)
    est = estimates(config, compute_dtype)
    batch, seq, _ = sizes(False)
    print(recipe_line(compute_dtype))
    print(
        f"trainmem estimate, Qwen2.5-0.5B b{batch} x s{seq} + ckpt: "
        f"QLoRA {est['qlora'] / 2**30:.2f} GiB | "
        f"16-bit LoRA {est['lora'] / 2**30:.2f} GiB"
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = load_base(device, None, compute_dtype, small)
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=CKPT)
    else:  # the same checkpointing as QLoRA's: only the base weights differ
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CKPT)
    model = get_peft_model(model, lora_config)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    lora = train_steps(model, opt, device, compute_dtype, small)
    label = f"{str(compute_dtype).split('.')[-1]} LoRA"
    print(_line("QLoRA", qlora))
    print(_line(label, lora))
    if device.type == "cuda":
        print(
            f"measured / estimate: QLoRA {qlora.peak_bytes / est['qlora']:.2f}, "
            f"{label} {lora.peak_bytes / est['lora']:.2f} | step time QLoRA / "
            f"{label}: {qlora.seconds_per_step / lora.seconds_per_step:.2f}x"
        )
    return {"QLoRA": qlora, label: lora}
