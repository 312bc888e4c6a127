"""Check the DeepSpeed ZeRO-3 rules of the replay against DeepSpeed itself, on CPU.

DeepSpeed is not a dependency of the course. Install it without its CUDA ops into a
folder of its own and run this script with that folder on the path::

    DS_BUILD_OPS=0 .venv/bin/pip install --no-build-isolation --no-deps \\
        --target /tmp/dspkgs deepspeed==0.16.4
    .venv/bin/pip install --target /tmp/dspkgs hjson py-cpuinfo msgpack ninja einops
    PYTHONPATH=/tmp/dspkgs:. DS_ACCELERATOR=cpu .venv/bin/python \\
        benchmarks/deepspeed_cpu_check.py \\
        --out benchmarks/results/deepspeed_cpu_check.md

Each case trains the tiny preset (transformers' Llama, full fine-tuning or peft's LoRA
on q_proj, v_proj and down_proj, DeepSpeed's bf16 mode, ZeRO-3 over 2 processes with
gloo) for two steps: DeepSpeed records its trace in the first. After the second
step's forward it lists the parameters that are gathered (``ds_status`` AVAILABLE) and
not persistent, with the prefetch off
(``stage3_prefetch_bucket_size`` 0) so that what is gathered is what the reuse rule
kept; and the optimizer's gradient bucket. The replay's side:
:func:`trainmem.memory.step.deepspeed_kept_params` (which parameters are kept after
their forward, ``stage3_max_reuse_distance``) plus lm_head (gathered from its forward
to its backward), the parameters under ``stage3_param_persistence_threshold``, and a
bucket of ``reduce_bucket_size`` elements in the module's dtype."""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

BASE = {"reduce": 4096, "prefetch": 0, "persist": 640}
CHECKPOINTING = (None, "reentrant", "non-reentrant")
REUSE = (10**9, 60_000, 30_000, 10_000)
#: full fine-tuning, and peft's LoRA (r 8) on three modules of each layer: its
#: lora_A/lora_B modules are traced after their base layer
METHODS = {"full": None, "lora": ("q_proj", "v_proj", "down_proj")}


def _rank(rank: int, world: int, port: int, case: dict, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    from trainmem.measuring.models import build_model, get_config

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": case["reduce"],
            "stage3_prefetch_bucket_size": case["prefetch"],
            "stage3_param_persistence_threshold": case["persist"],
            "stage3_max_reuse_distance": case["reuse"],
        },
    }
    model = build_model(get_config("tiny"))
    model.config.use_cache = False
    if case["targets"]:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=8, lora_alpha=16, target_modules=list(case["targets"]))
        model = get_peft_model(model, lora)
    if case["ckpt"]:
        reentrant = case["ckpt"] == "reentrant"
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant}
        )
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=config
    )
    ids = torch.randint(0, 256, (1, 16))
    for step in range(2):
        loss = engine(input_ids=ids, labels=ids).loss
        if step == 1:
            params = [(_plain(n), p) for n, p in engine.module.named_parameters()]
            gathered = sorted(
                n
                for n, p in params
                if p.ds_status == ZeroParamStatus.AVAILABLE and not p.ds_persist
            )
            persistent = sorted(n for n, p in params if p.ds_persist)
        engine.backward(loss)
        engine.step()
    bucket = optimizer._DeepSpeedZeroOptimizer_Stage3__ipg_bucket_flat_buffer
    if rank == 0:
        queue.put(
            dict(
                gathered=gathered,
                persistent=persistent,
                bucket=[bucket.numel(), str(bucket.dtype).removeprefix("torch.")],
                version=deepspeed.__version__,
            )
        )


def _plain(name: str) -> str:
    """A parameter's name without peft's wrapping (``base_model.model.``,
    ``.base_layer``, the adapter name ``.default``)."""
    name = name.removeprefix("base_model.model.")
    return name.replace(".base_layer", "").replace(".default", "")


def measured(case: dict, port: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, case, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=600)
    finally:
        for p in procs:
            p.join(120)


def _hf_names(model, shape) -> dict:
    """The transformers parameter name of each tensor of the replay's model (the
    Linears' paths from the family's ``module_paths``)."""
    names = {
        id(model.embed): "model.embed_tokens.weight",
        id(model.norm): "model.norm.weight",
        id(model.lm_head): "lm_head.weight",
    }
    for i, layer in enumerate(model.layers):
        at = f"model.layers.{i}"
        names[id(layer.input_layernorm)] = f"{at}.input_layernorm.weight"
        names[id(layer.post_attention_layernorm)] = (
            f"{at}.post_attention_layernorm.weight"
        )
        for name, lin in layer.linears.items():
            base = shape.family.module_paths[name].format(i=i)
            names[id(lin.w)] = f"{base}.weight"
            for part, t in (("lora_A", lin.A), ("lora_B", lin.B)):
                if t is not None:
                    names[id(t)] = f"{base}.{part}.weight"
    return names


def predicted(case: dict) -> dict:
    from trainmem import deepspeed
    from trainmem.config import StepConfig
    from trainmem.dtypes import DTYPES
    from trainmem.estimate import model_shape
    from trainmem.memory.accounting import ITEMSIZE, Simulator
    from trainmem.decisions import decide
    from trainmem.memory.step import DECODERS, deepspeed_kept_params

    lora = dict(lora_targets=case["targets"]) if case["targets"] else {}
    step = StepConfig(
        method="lora" if case["targets"] else "full",
        **lora,
        precision="bf16-amp",
        zero=3,
        gpus=2,
        zero_impl="deepspeed",
        checkpointing=bool(case["ckpt"]),
        checkpointing_mode=case["ckpt"] or "non-reentrant",
    )
    sizes = deepspeed.Sizes(
        case["reduce"], case["prefetch"], case["persist"], case["reuse"]
    )
    shape = model_shape("tiny")
    model, params = DECODERS["llama"].build(Simulator(), shape, decide(shape, step))

    def elements(tensors) -> int:
        return sum(t.buffer.nbytes // ITEMSIZE[t.dtype] for t in tensors)

    persistent = {id(p) for p in model.parameters() if p.numel < case["persist"]}
    names = _hf_names(model, shape)
    kept = deepspeed_kept_params(model, step, elements, sizes)
    gathered = {names[id(t)] for t in kept if id(t) not in persistent}
    gathered.add("lm_head.weight")  # gathered from its forward to its backward
    return dict(
        gathered=sorted(gathered),
        n_persistent=len(persistent),
        bucket=[sizes.reduce_bucket, DTYPES[params[0].dtype].torch],
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    lines = [
        "| method | checkpointing | max_reuse_distance | gathered after the forward "
        "(DeepSpeed) | replay | persistent | bucket (DeepSpeed / replay) |",
        "|---|---|---:|---|---|---:|---|",
    ]
    port, agree, version = 29600, True, None
    cases = [
        (method, ckpt, reuse)
        for method in METHODS
        # LoRA with non-reentrant checkpointing stops in DeepSpeed 0.16.4 itself
        # (torch's CheckpointError: a recomputed tensor's metadata differs)
        for ckpt in (CHECKPOINTING if method == "full" else CHECKPOINTING[:2])
        for reuse in (REUSE if method == "full" else REUSE[:2])
    ]
    for method, ckpt, reuse in cases:
        case = dict(BASE, ckpt=ckpt, reuse=reuse, targets=METHODS[method])
        got, want = measured(case, port), predicted(case)
        port += 1
        version = got["version"]
        same = got["gathered"] == want["gathered"]
        same_p = len(got["persistent"]) == want["n_persistent"]
        same_b = got["bucket"] == want["bucket"]
        agree &= same and same_p and same_b
        short = ", ".join(
            n.removeprefix("model.").removesuffix(".weight") for n in got["gathered"]
        )
        lines.append(
            f"| {method} | {ckpt or 'none'} | {reuse:,} | {short} | "
            f"{'same' if same else ', '.join(want['gathered'])} | "
            f"{len(got['persistent'])} ({'same' if same_p else 'differs'}) | "
            f"{got['bucket']} / {'same' if same_b else want['bucket']} |"
        )
    text = "\n".join(
        [
            "# DeepSpeed ZeRO-3 on CPU vs the replay's rules",
            "",
            f"DeepSpeed {version}, tiny preset, 2 processes (gloo); "
            f"reduce_bucket_size {BASE['reduce']}, stage3_prefetch_bucket_size "
            f"{BASE['prefetch']}, stage3_param_persistence_threshold "
            f"{BASE['persist']}. Generated by `benchmarks/deepspeed_cpu_check.py`.",
            "",
            *lines,
            "",
            f"All cases agree: {agree}",
            "",
            "LoRA with non-reentrant checkpointing is not a case: DeepSpeed "
            f"{version} stops in its backward (torch's CheckpointError, a recomputed "
            "tensor's metadata differs from the forward's).",
            "",
        ]
    )
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
