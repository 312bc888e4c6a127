"""The machinery around chapter 7's QLoRA recipe: loading the base, the training loop
with timing and peak memory, and the comparison with 16-bit LoRA and the estimator.

The recipe itself (quantisation config, ``prepare_model_for_kbit_training``, LoRA,
paged 8-bit AdamW) stays in the chapter's cell. ``small=True`` is the CPU run: a tiny
Llama built from a config (no download, no quantisation: bitsandbytes' 4-bit kernels
need CUDA) walks through the same steps.
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


def sizes(small: bool) -> tuple[int, int, int]:
    """(batch, seq, steps) of the run: tiny on the CPU, b4 x s512 on a GPU."""
    return (2, 32, 3) if small else (4, 512, 6)


def load_base(device, quant_kwargs: dict | None, compute_dtype, small: bool):
    """The base model: NF4-quantised (``quant_kwargs`` for ``BitsAndBytesConfig``) or
    16-bit (``quant_kwargs=None``); on the CPU (``small``) a tiny Llama, unquantised."""
    warnings.filterwarnings("ignore", message=_RENAMED)
    if small:
        from trainmem.measuring.models import build_model, tiny_llama_config

        return build_model(tiny_llama_config(), seed=0)
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

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
            loss = model(input_ids=ids, labels=ids).loss
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


def estimates(config, small: bool) -> dict[str, int]:
    """trainmem's peak for QLoRA (8-bit AdamW) and 16-bit LoRA (AdamW), both with
    checkpointing, r=8 on the seven projections, at the GPU run's batch and seq."""
    from trainmem.estimate import estimate

    batch, seq, _ = sizes(False)
    return {
        m: estimate(
            config,
            method=m,
            precision="bf16",
            batch=batch,
            seq=seq,
            lora_rank=8,
            optimizer="adamw8bit" if m == "qlora" else "adamw",
            lora_targets=TARGETS,
            checkpointing=True,
        ).total_bytes
        for m in ("qlora", "lora")
    }


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
    est = estimates(config, small)
    batch, seq, _ = sizes(False)
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
