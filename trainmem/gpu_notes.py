"""What a card changes about a step besides memory, as notes ``{"code", "message"}``
that front ends word by ``code`` (the calculator's ``GPU_NOTES``), read from the step's
:class:`~trainmem.decisions.Decisions`. Standard library only."""

from __future__ import annotations

from .decisions import Decisions


def _gpu_notes(d: Decisions) -> list[dict]:
    """What the card changes besides memory, as ``{"code", "message"}`` (front ends
    word them by ``code``): bf16 on a card without bf16 units runs, but emulated
    (torch.cuda.is_bf16_supported() answers True through emulation below compute
    capability 8.0, so Trainer(bf16=True) accepts it); SDPA on its math path where
    torch's backend selection finds no fused kernel for the call
    (:mod:`trainmem.sdpa`, :func:`trainmem.decisions.decide`); a DeepSpeed ZeRO-3
    LoRA step with non-reentrant checkpointing, which DeepSpeed before its fix stops
    with a CheckpointError (seen on CPU with 0.16.4,
    ``benchmarks/deepspeed_cpu_check.py``); and on more than 2 NVSwitch-connected
    sm_90+ GPUs NCCL's NVLS buffers, which the estimate leaves out
    (:mod:`trainmem.gpus`)."""
    step, gpu = d.options, d.gpu
    notes = []
    major, minor = gpu.capability
    uses_bf16 = d.bf16_compute or step.lora_dtype == "bf16"
    if uses_bf16 and not gpu.bf16:
        notes.append(
            {
                "code": "bf16-emulated",
                "message": f"{gpu.name} (sm_{major}{minor}) has no bf16 units: torch "
                "emulates bf16 there and the step is slow; fp16-amp is the native "
                "choice",
            }
        )
    if d.sdpa_math_fallback:
        replayed = d.sdpa_backend == "math"  # decisions._attention
        why = f" ({d.attention_reason})" if d.attention_reason else ""
        notes.append(
            {
                "code": "sdpa-math" if replayed else "sdpa-math-not-modelled",
                "message": f"no fused SDPA kernel takes this call on {gpu.name} "
                f"(sm_{major}{minor}), so attention runs SDPA's math path (the "
                f"scores and softmax materialised){why}: "
                + (
                    "replayed on that path"
                    if replayed
                    else "this estimate does not include it"
                ),
            }
        )
    if (
        d.sharding.checkpoint_error
        and step.zero >= 3
        and step.method in ("lora", "qlora")
        and step.checkpointing
        and step.checkpointing_mode == "non-reentrant"
    ):
        notes.append(
            {
                "code": "deepspeed-checkpoint-error",
                "message": "DeepSpeed ZeRO-3 with LoRA and non-reentrant checkpointing "
                "stops in the backward with torch's CheckpointError in DeepSpeed "
                "releases without deepspeedai/DeepSpeed#8148 (seen with 0.16.4; "
                "huggingface/transformers#47254); gradient_checkpointing_kwargs="
                "{'use_reentrant': True} runs (--checkpointing-mode reentrant)",
            }
        )
    if gpu.nvlink and gpu.capability >= (9, 0) and step.gpus > 2:
        notes.append(
            {
                "code": "nvls-not-modelled",
                "message": "NCCL's NVLS (NVLink SHARP) buffers are not in this "
                "estimate: on more than 2 NVSwitch-connected GPUs of compute "
                "capability 9.0 or newer NCCL maps channels x 2 buffers per local GPU "
                "into each GPU, for every communicator (up to gigabytes per GPU, "
                "depending on the NCCL version); NCCL_NVLS_ENABLE=0 turns them off",
            }
        )
    return notes
