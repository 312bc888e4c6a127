"""``python -m trainmem estimate|measure|hf|fit`` — training memory from the shell.

They print a table in GiB (2**30 bytes) and GB (10**9 bytes), or with ``--json`` one
JSON object whose top level has ``total_bytes`` (the peak) and ``breakdown``
(``weights``, ``gradients``, ``optimizer_states``, ``master_weights``, ``activations``,
``temporaries``; integer bytes); ``estimate --gpu NAME`` adds ``reserved_bytes``,
``device_bytes``, ``fits`` and ``headroom_bytes`` (:mod:`trainmem.gpus`), and ``fit``
answers ``{"max_batch": N}`` or ``{"max_seq": N}`` with the cheapest change that makes
an out-of-memory configuration fit (:mod:`trainmem.fit`). Bad input exits with status 2
and one line on stderr naming the argument and the allowed values."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from .families import preset_names

_EPILOG = """\
terms (bytes at the peak of one training step; they sum to total_bytes):
  weights           parameters and buffers the model holds (frozen ones too) and, under
                    fp16-amp/bf16-amp, the low-precision weight copies autocast keeps
                    for backward
  gradients         .grad of the trainable parameters
  optimizer_states  AdamW exp_avg + exp_avg_sq (+ step), SGD momentum buffers, 8-bit
                    states
  master_weights    fp32 trainable parameters under fp16-amp/bf16-amp (torch AMP: the
                    fp32 parameters are the master copy)
  activations       tensors from the forward pass held for backward
  temporaries       everything else alive at the peak (gradients in flight, recomputed
                    activations under checkpointing, the optimizer's scratch tensors)
  also reported: activation_bytes (held for backward at the end of the forward pass),
  the peak of each phase, parameter counts.

conventions: 18 B/param = torch AMP (fp32 params 4 + bf16 copy 2 + fp32 grads 4 +
Adam 8); 16 B/param = ZeRO paper (fp16 params 2 + fp16 grads 2 + fp32 master 4 +
Adam 8) or fp32 training.

examples:
  python -m trainmem estimate --model llama-7b --method lora --precision bf16-amp \\
      --batch 4 --seq 512
  python -m trainmem estimate --model my_config.json --method full --checkpointing \\
      --zero 3 --gpus 8 --json
  python -m trainmem measure --model tiny --method lora --device cpu --batch 2 --seq 64
  python -m trainmem measure --model llama-7b --method lora --device fake --batch 1 \\
      --seq 512
  python -m trainmem estimate --model mistral-7b --optimizer-impl fused --checkpointing
  python -m trainmem hf --model config.json --training-args args.json \\
      --peft-config adapter_config.json --seq 1024
  python -m trainmem estimate --model llama2-7b --method qlora --batch 4 --gpu T4
  python -m trainmem fit --model llama2-7b --method lora --gpu A100-40GB --json
  python -m trainmem fit --model llama2-7b --method qlora --gpu T4 --vary seq \\
      --batch 1
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(name):
    def conv(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be an integer ≥ 1, got {text!r}"
            ) from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"must be an integer ≥ 1, got {v}")
        return v

    conv.__name__ = name
    return conv


def _rank(text):
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be an integer ≥ 1, got {text!r}"
        ) from None
    return v  # range (≥ 1 and ≤ layer width) is checked against the model


#: the model each command runs when ``--model`` is not given: the functions' own
#: defaults (``estimate()`` a 7B shape, ``measure()`` the tiny Llama on real tensors)
MODEL_DEFAULTS = {
    "estimate": "llama-7b",
    "fit": "llama-7b",
    "measure": "tiny",
    "hf": "llama-7b",
}

_KINDS = {"positive": None, "int": int, "list": str}


def _add_step_options(p: argparse.ArgumentParser, command: str) -> None:
    """``--model``, one flag per :class:`~trainmem.config.StepConfig` field (its
    default, choices and help from the field), and ``--json``."""
    from .config import StepConfig

    p.add_argument(
        "--model",
        default=MODEL_DEFAULTS[command],
        help=f"preset name ({', '.join(preset_names())}) or path to an HF config.json "
        f"(model_type llama, mistral, qwen2, gpt2); default {MODEL_DEFAULTS[command]}",
    )
    for f in dataclasses.fields(StepConfig):
        meta = f.metadata
        if meta.get("no_flag"):
            continue
        if meta.get("estimate_only") and command not in ("estimate", "fit"):
            continue
        flag = meta.get("flag", "--" + f.name.replace("_", "-"))
        if isinstance(f.default, bool):
            action = "store_false" if f.default else "store_true"
            p.add_argument(flag, dest=f.name, action=action, help=meta["help"])
            continue
        kind = meta.get("kind")
        kw: dict = {"dest": f.name}
        if "choices" in meta:
            kw["choices"] = tuple(c for c in meta["choices"] if c is not None)
            if isinstance(f.default, int):
                kw["type"] = int
        elif kind == "positive":
            kw["type"] = _positive(f.name)
        elif kind == "int":
            kw["type"] = _rank
        elif kind == "fraction":
            kw["type"] = _fraction
        default = f.default
        if kind == "list":
            default = ",".join(default)
        shown = "" if default is None else f"; default {default}"
        p.add_argument(flag, default=default, help=meta["help"] + shown, **kw)
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (total_bytes, breakdown, ...) instead of the table",
    )


def _fraction(text):
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be a number in [0, 1), got {text!r}"
        ) from None
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1), got {v}")
    return v


def _add_gpu_option(p: argparse.ArgumentParser, required: bool) -> None:
    from .gpus import GPUS

    p.add_argument(
        "--gpu",
        required=required,
        choices=tuple(GPUS),
        default=None,
        help=f"GPU preset ({', '.join(GPUS)}): adds reserved_bytes (the caching "
        "allocator's max_memory_reserved), device_bytes (what nvidia-smi shows, a "
        "lower bound), fits and headroom_bytes",
    )


def _add_estimate(sub) -> None:
    """``estimate``: the step options, ``--gpu`` and ``--timeline``."""
    pe = sub.add_parser(
        "estimate",
        help="analytic estimate of the peak (no torch needed, instant)",
        description="Estimate the peak memory of one training step, term by term "
        "(bytes per GPU).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    _add_step_options(pe, "estimate")
    _add_gpu_option(pe, required=False)
    pe.add_argument(
        "--timeline",
        action="store_true",
        help="with --json: add the step's memory timeline (bytes by category over the "
        "replayed allocations, about 200 points)",
    )


def _add_fit(sub) -> None:
    """``fit``: the step options, a required ``--gpu`` and ``--vary``."""
    pf = sub.add_parser(
        "fit",
        help="the largest micro-batch (or sequence) that fits a GPU, and the cheapest "
        "change that makes an out-of-memory configuration fit",
        description="What fits on a GPU: the largest micro-batch (--vary batch) or "
        "sequence (--vary seq), from the step replay and the caching-allocator "
        "model, and the cheapest change (smaller micro-batch with accumulation, 8-bit "
        "AdamW, checkpointing, QLoRA) that makes the given configuration fit.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    _add_step_options(pf, "fit")
    _add_gpu_option(pf, required=True)
    pf.add_argument(
        "--vary",
        default="batch",
        choices=("batch", "seq"),
        help="what to maximise: the micro-batch (--seq fixed) or the sequence length "
        "(--batch fixed); default batch",
    )


def _add_measure(sub) -> None:
    """``measure``: the step options, ``--device`` and ``--no-extrapolate``."""
    pm = sub.add_parser(
        "measure",
        help="run two real training steps and account every tensor",
        description="Measure one training step (forward, backward, optimizer step; "
        "the peak of the 2nd of two steps) tensor by tensor.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    _add_step_options(pm, "measure")
    pm.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "fake", "cuda"),
        help="cpu: real tensors; fake: FakeTensorMode (no memory: 7B/13B shapes); "
        "cuda: a GPU, adds max_memory_allocated/reserved; default cpu",
    )
    pm.add_argument(
        "--no-extrapolate",
        action="store_true",
        help="with --device fake: run every layer instead of extending 2- and 3-layer "
        "runs linearly (slower; the result is the same)",
    )


def _add_hf(sub) -> None:
    """``hf``: a model config, TrainingArguments, a LoraConfig and the launcher."""
    ph = sub.add_parser(
        "hf",
        help="estimate from a model config, TrainingArguments and a LoraConfig",
        description="Estimate the peak memory of one Trainer step from what a "
        "Hugging Face user has: the model's config.json, the "
        "TrainingArguments (as JSON: optim, bf16/fp16, "
        "gradient_checkpointing, per_device_train_batch_size, "
        "gradient_accumulation_steps, max_length, deepspeed or fsdp) and the peft "
        "adapter_config.json (LoRA; a 4-bit quantization_config in "
        "config.json makes it QLoRA).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    ph.add_argument(
        "--model",
        default=MODEL_DEFAULTS["hf"],
        help="preset name or path to the model's config.json; default "
        + MODEL_DEFAULTS["hf"],
    )
    ph.add_argument(
        "--training-args",
        metavar="FILE",
        help="TrainingArguments as JSON (TrainingArguments.to_json_string(), or any "
        "subset of its fields); default: Trainer's defaults",
    )
    ph.add_argument(
        "--peft-config",
        metavar="FILE",
        help="peft adapter_config.json (LoRA); omit for full fine-tuning",
    )
    ph.add_argument(
        "--seq",
        type=_positive("seq"),
        default=None,
        help="tokens per sequence; default: max_length of the training arguments",
    )
    ph.add_argument(
        "--versions",
        default=None,
        help="the user's library versions, e.g. transformers=4.48.1,peft=0.13.2,"
        "bitsandbytes=0.43.3,torch=2.4.1 (any subset; default: the pinned ones)",
    )
    ph.add_argument(
        "--gpus",
        type=_positive("gpus"),
        default=1,
        help="data-parallel GPUs the launcher starts (the sharding itself comes from "
        "the arguments' deepspeed or fsdp field); default 1",
    )
    _add_gpu_option(ph, required=False)
    ph.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (total_bytes, breakdown, ...) instead of the table",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m trainmem",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=_EPILOG,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for add in (_add_estimate, _add_fit, _add_measure, _add_hf):
        add(sub)
    return parser


def _read_json(option: str, path: str | None):
    """The dict in a JSON file named by a command-line flag (``None`` without one)."""
    if path is None:
        return None
    from .config import read_json_object

    return read_json_object(path, option)


def _run_hf(args):
    from .estimate import estimate_from_hf

    return estimate_from_hf(
        args.model,
        _read_json("training_args", args.training_args),
        _read_json("peft_config", args.peft_config),
        seq=args.seq,
        versions=args.versions,
        gpu=args.gpu,
        gpus=args.gpus,
    )


def _one_line(err: ValueError) -> str:
    """The error as one line; an :class:`~trainmem.config.OptionError` names its flag
    (``err.option``), other errors are shown as they are."""
    from .config import OptionError

    msg = " ".join(str(err).split())
    if not isinstance(err, OptionError):
        return msg
    flag = "--" + err.option.replace("_", "-")
    if msg.startswith(err.option):
        return flag + msg[len(err.option) :]
    return f"{flag}: {msg}"


def _step_config(args):
    """The :class:`~trainmem.config.StepConfig` of the parsed ``estimate``/``measure``
    arguments: every field that has a flag of the command."""
    from .config import StepConfig

    return StepConfig.from_options(
        {
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(StepConfig)
            if hasattr(args, f.name)
        }
    )


def _run(args):
    """The result of the ``estimate`` or ``measure`` command."""
    step = _step_config(args)
    if args.command == "estimate":
        from .estimate import estimate_step

        return estimate_step(args.model, step, gpu=args.gpu, timeline=args.timeline)
    if args.command == "fit":
        from .fit import fit

        return _FitResult(fit(args.model, step, args.gpu, args.vary))
    from .measuring.measure import measure_step

    return measure_step(
        args.model,
        step,
        device=args.device,
        extrapolate=False if args.no_extrapolate else None,
    )


class _FitResult:
    """``trainmem fit``'s answer with the ``to_dict``/``table`` of the other
    commands."""

    def __init__(self, result: dict):
        self.result = result

    def to_dict(self):
        return self.result

    def table(self) -> str:
        r = self.result
        key = "max_batch" if "max_batch" in r else "max_seq"
        gib = 1024**3
        lines = [f"{r['gpu']}: {key} = {r[key]}"]
        if r[key]:
            lines.append(
                f"  at {key[4:]} {r[key]}: tensors {r['total_bytes'] / gib:.2f} GiB, "
                f"reserved {r['reserved_bytes'] / gib:.2f} GiB, device "
                f"{r['device_bytes'] / gib:.2f} GiB, headroom "
                f"{r['headroom_bytes'] / gib:.2f} GiB"
            )
        req = r["requested"]
        what = ", ".join(f"{k} {v}" for k, v in req.items() if k != "fits")
        lines.append(f"requested ({what}): {'fits' if req['fits'] else 'does NOT fit'}")
        change = r.get("cheapest_change")
        if change:
            if change["change"]:
                lines.append(
                    f"cheapest change that fits: {change['change']} (device "
                    f"{change['device_bytes'] / gib:.2f} GiB)"
                )
            else:
                lines.append("no single or combined change tried makes it fit")
        lines += [f"note: {n['message']}" for n in r.get("notes", ())]
        return "\n".join(lines)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = f"{parser.prog} {args.command}"
    try:
        result = _run_hf(args) if args.command == "hf" else _run(args)
    except ValueError as e:
        sys.stderr.write(f"{prog}: error: {_one_line(e)}\n")
        return 2
    print(json.dumps(result.to_dict()) if args.json else result.table())
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
