"""The estimator from what a Hugging Face ``Trainer`` user has: a model config,
``TrainingArguments`` (or ``trl.SFTConfig``) and a peft ``LoraConfig``.

:func:`hf_options` turns them into :func:`trainmem.estimate.estimate`'s options
(re-exported there); :func:`trainmem.estimate.estimate_from_hf` runs the estimate (CLI:
``python -m trainmem hf``). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import deepspeed
from .config import ATTN_IMPLS, OptionError
from .dtypes import DTYPES, FLOAT_DTYPES
from .families import LLAMA_LINEARS
from .optimizers import hf_optims
from .precisions import precision as precision_entry
from .versions import (
    hf_checkpointing_reentrant,
    hf_default_optim,
    hf_loads_stored_dtype,
    parse_versions,
    version_text,
)

#: ``TrainingArguments.optim`` -> (optimizer, optimizer_impl), from the ``hf_optims`` of
#: every :mod:`trainmem.optimizers` entry. Trainer builds ``torch.optim.AdamW`` with
#: ``fused=True`` for ``adamw_torch_fused`` (the default of transformers 5 with torch >=
#: 2.8) and with no implementation flag for ``adamw_torch``, which on CUDA is
#: ``foreach``.
HF_OPTIMS = hf_optims()
#: target_modules="all-linear": every Linear of the decoder blocks (peft leaves lm_head
#: out)
ALL_LINEAR = LLAMA_LINEARS


_HF_NAMES = {
    "lora_rank": ("peft_config", "r"),
    "lora_targets": ("peft_config", "target_modules"),
    "batch": ("training_args", "per_device_train_batch_size"),
    "grad_accum": ("training_args", "gradient_accumulation_steps"),
    "group_size": ("training_args", "num_generations"),
    "max_completion_length": ("training_args", "max_completion_length"),
}


def hf_field(obj, name: str, default=None):
    """``obj.name`` or ``obj[name]``: a field of a Hugging Face object or of the dict of
    its JSON file alike (``default`` when ``obj`` is ``None`` or lacks the field)."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def hf_options(
    model: Any,
    training_args: Any = None,
    peft_config: Any = None,
    *,
    seq: int | None = None,
    quantization_config: Any = None,
    versions: Any = None,
) -> dict[str, Any]:
    """The :func:`estimate` keyword arguments a Hugging Face ``Trainer`` run corresponds
    to.

    ``training_args``: a ``transformers.TrainingArguments`` (or ``trl.SFTConfig``), or a
    dict of its fields (its JSON); ``None`` means Trainer's defaults. Read: ``optim``
    (see :data:`HF_OPTIMS`), ``bf16``/``fp16`` (autocast: ``bf16-amp``/
    ``fp16-amp``; neither: ``fp32``) over the weights in the dtype ``from_pretrained``
    loads them in (:func:`load_dtype`, always stated off QLoRA),
    ``gradient_checkpointing`` or ``activation_checkpointing`` (transformers 5's
    name) with
    ``gradient_checkpointing_kwargs``' ``use_reentrant`` (left out: the default of the
    transformers in ``versions``, :func:`trainmem.versions.hf_checkpointing_reentrant`),
    ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``deepspeed``
    or ``fsdp`` (ZeRO stage and who shards, :func:`_sharding_options`; the number of
    GPUs is an override) and, for ``SFTConfig``, ``max_length`` (``max_seq_length`` in
    older trl). ``peft_config``: a
    ``peft.LoraConfig`` or its ``adapter_config.json`` dict (``r``, ``lora_alpha``,
    ``target_modules``; ``"all-linear"`` allowed), ``None`` for full fine-tuning. A
    4-bit ``quantization_config`` (``BitsAndBytesConfig(load_in_4bit=True, ...)``, or
    the model config's own) makes it QLoRA. ``seq``: tokens per sequence, when the
    arguments do not fix a length. ``versions``: as ``--versions`` (unnamed libraries:
    the course's pins); the defaults of the fields left out follow them (``optim``:
    :func:`trainmem.versions.hf_default_optim`).

    Raises ``ValueError`` naming the field and the allowed values.
    """
    versions = parse_versions(versions)
    opts = _training_options(training_args, seq, versions)
    attn = hf_field(model, "_attn_implementation", None) or hf_field(
        model, "attn_implementation", None
    )
    if attn in ATTN_IMPLS:
        opts["attn"] = attn
    elif attn in ("flash_attention_2", "flash_attention_3"):
        opts["attn"] = "flash"
    quant = (
        quantization_config
        if quantization_config is not None
        else hf_field(model, "quantization_config", None)
    )
    four_bit = bool(hf_field(quant, "load_in_4bit", False))
    if peft_config is not None:
        opts.update(_lora_options(peft_config, model))
        if four_bit:
            opts["method"] = "qlora"
            opts["qlora_double_quant"] = bool(
                hf_field(quant, "bnb_4bit_use_double_quant", False)
            )
    elif four_bit:
        raise OptionError(
            "peft_config",
            "a 4-bit quantized model needs a peft_config (QLoRA): full fine-tuning "
            "of 4-bit weights is not possible",
        )
    load = load_dtype(model, versions)
    if opts["method"] != "qlora":
        # what from_pretrained loads, always stated: it may differ from the
        # precision's default recipe either way (an fp32 load under 4.x, a 16-bit
        # one under 5.x); QLoRA's base follows its quantization rule unless the
        # load is 16-bit
        opts["load_dtype"] = load
    elif load != precision_entry(opts["precision"]).params:
        opts["load_dtype"] = load
    opts.update(_objective_options(training_args, peft_config is not None))
    if hf_field(training_args, "activation_offloading", False):
        opts["activation_offload"] = True  # TRL's SFTConfig
    if hf_field(training_args, "use_liger_kernel", False) and "objective" not in opts:
        opts.update(loss_impl="chunked", loss_chunk=liger_chunk(model, opts))
    return opts


def liger_chunk(model: Any, opts: dict) -> int:
    """The rows per chunk of Liger's fused linear cross-entropy
    (``use_liger_kernel=True``): ``next_power_of_2(ceil(rows / ceil(vocab /
    hidden)))``, at most the rows, so that a chunk's logits are about the size of the
    hidden states. Liger computes the gradients inside its forward (a gradient of the
    hidden states and, for a trainable ``lm_head``, of the weight, kept to backward)
    instead of recomputing the chunks in backward as ``loss_impl="chunked"`` replays:
    the logits are never whole in either."""
    from .families import model_shape

    shape = model_shape(model)
    rows = opts["batch"] * opts["seq"]
    factor = -(-shape.vocab // shape.hidden)
    want = -(-rows // factor)
    return min(1 << (want - 1).bit_length(), rows)


def _trl_config(training_args: Any) -> str | None:
    """``"dpo"`` for TRL's ``DPOConfig``, ``"grpo"`` for its ``GRPOConfig`` (the
    object, or the dict of its fields: told apart by the fields only they have),
    ``None`` otherwise."""
    name = type(training_args).__name__
    if name == "DPOConfig" or (
        isinstance(training_args, dict) and "precompute_ref_log_probs" in training_args
    ):
        return "dpo"
    if name == "GRPOConfig" or (
        isinstance(training_args, dict) and "num_generations" in training_args
    ):
        return "grpo"
    return None


def _objective_options(training_args: Any, peft: bool) -> dict[str, Any]:
    """The objective a TRL config trains (:mod:`trainmem.objectives`).

    ``DPOConfig``: ``objective="dpo"`` (``per_device_train_batch_size`` counts
    preference pairs; ``max_length`` the tokens of each sequence), the reference
    precomputed when ``precompute_ref_log_probs``, else a frozen copy or, under peft,
    the disabled adapter. ``GRPOConfig``: ``objective="grpo"`` with
    ``num_generations`` and ``max_completion_length`` (TRL's defaults 8 and 512), a
    reference only when ``beta`` is not 0 (its default is 0.0); ``seq`` is the prompt
    length, which the config does not fix."""
    kind = _trl_config(training_args)
    if kind == "dpo":
        precomputed = bool(hf_field(training_args, "precompute_ref_log_probs", False))
        return dict(objective="dpo", reference="precomputed" if precomputed else "auto")
    if kind == "grpo":
        beta = float(hf_field(training_args, "beta", 0.0) or 0.0)
        reference = "none" if beta == 0 else ("adapter" if peft else "copy")
        return dict(
            objective="grpo",
            reference=reference,
            group_size=hf_field(training_args, "num_generations", 8) or 8,
            max_completion_length=hf_field(training_args, "max_completion_length", 512)
            or 512,
        )
    return {}


def config_dtype(model: Any) -> str | None:
    """The dtype a model config says its checkpoint is stored in: ``dtype``
    (transformers 5's name) or ``torch_dtype`` (4.x configs), as a
    :data:`trainmem.dtypes.DTYPES` name (``"bfloat16"`` and ``torch.bfloat16`` ->
    ``"bf16"``); ``None`` when neither is set or ``"auto"``."""
    value = hf_field(model, "dtype", None)
    if value is None:
        value = hf_field(model, "torch_dtype", None)
    if value is None:
        return None
    name = str(value).removeprefix("torch.")
    for d in DTYPES.values():
        if d.torch == name and d.name in FLOAT_DTYPES:
            return d.name
    if name == "auto":
        return None
    raise OptionError(
        "model",
        f"model config: dtype must be one of "
        f"{', '.join(DTYPES[d].torch for d in FLOAT_DTYPES)}, got {value!r}",
    )


def load_dtype_reason(model: Any, versions: dict) -> str:
    """Why :func:`load_dtype` answers what it does, in one sentence. A preset name
    is a shape only: it names no stored dtype, so fp32 is assumed and said."""
    stored = config_dtype(model)
    t = version_text("transformers", versions["transformers"])
    if hf_loads_stored_dtype(versions):
        rule = f"transformers {t} loads the stored dtype (dtype='auto', from 5.0)"
        if stored:
            return f"weights loaded in {stored}: {rule}, the config's dtype"
        if isinstance(model, str):
            return (
                f"weights loaded in fp32 (assumed): {rule}, and preset {model!r} "
                "is a shape that names no stored dtype; pass the checkpoint's "
                "config.json (its dtype / torch_dtype) to load what it stores"
            )
        return f"weights loaded in fp32: {rule} and the config names none"
    said = f" although the config stores {stored}" if stored else ""
    return (
        f"weights loaded in fp32: transformers {t} loads fp32 unless dtype/"
        f"torch_dtype is passed (before 5.0){said}"
    )


def load_dtype(model: Any, versions: dict) -> str:
    """The dtype ``from_pretrained(path)`` without ``dtype`` loads the model in, for
    the transformers of ``versions``: from 5.0 the stored dtype (the config's,
    :func:`config_dtype`; a config without one: fp32 assumed), before 5.0 fp32
    (:func:`trainmem.versions.hf_loads_stored_dtype`)."""
    stored = config_dtype(model)
    if stored and hf_loads_stored_dtype(versions):
        return stored
    return "fp32"


def _training_options(
    training_args: Any, seq: int | None, versions: dict
) -> dict[str, Any]:
    """The options ``TrainingArguments`` (and ``seq``) fix; see :func:`hf_options`."""
    optim = hf_field(training_args, "optim", None) or hf_default_optim(versions)
    optim = str(getattr(optim, "value", optim))  # OptimizerNames -> its string
    if optim not in HF_OPTIMS:
        raise OptionError(
            "training_args",
            f"optim must be one of {', '.join(HF_OPTIMS)}, got {optim!r}",
        )
    optimizer, impl = HF_OPTIMS[optim]
    bf16 = bool(hf_field(training_args, "bf16", False))
    fp16 = bool(hf_field(training_args, "fp16", False))
    if bf16 and fp16:
        raise OptionError(
            "training_args",
            "bf16 and fp16 cannot both be set in the training arguments",
        )
    precision = "bf16-amp" if bf16 else ("fp16-amp" if fp16 else "fp32")
    # transformers 5 renames gradient_checkpointing to activation_checkpointing (keeps
    # both)
    checkpointing = bool(
        hf_field(training_args, "activation_checkpointing", False)
        or hf_field(training_args, "gradient_checkpointing", False)
    )
    checkpointing_kwargs = (
        hf_field(training_args, "activation_checkpointing_kwargs", None)
        or hf_field(training_args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    reentrant = checkpointing_kwargs.get("use_reentrant")
    if reentrant is None:
        reentrant = hf_checkpointing_reentrant(versions)
    length = seq
    if length is None:
        length = hf_field(training_args, "max_length", None) or hf_field(
            training_args, "max_seq_length", None
        )
    if length is None:
        raise OptionError(
            "seq",
            "seq must be given (tokens per sequence): the training arguments set no "
            "max_length",
        )
    opts = dict(
        method="full",
        precision=precision,
        optimizer=optimizer,
        optimizer_impl=impl,
        batch=hf_field(training_args, "per_device_train_batch_size", 8),
        seq=length,
        grad_accum=hf_field(training_args, "gradient_accumulation_steps", 1),
        checkpointing=checkpointing,
    )
    if checkpointing:
        opts["checkpointing_mode"] = "reentrant" if reentrant else "non-reentrant"
    opts.update(_sharding_options(training_args))
    return opts


def _sharding_options(training_args: Any) -> dict[str, Any]:
    """``zero``, ``zero_impl`` and ``deepspeed_sizes`` from TrainingArguments'
    ``deepspeed`` (a DeepSpeed config: its dict, or the path of its JSON file) or
    ``fsdp``; neither: no sharding. ``fsdp`` is transformers 4's words
    (``"full_shard auto_wrap"``, a list of them) or transformers 5's ``True`` with
    ``fsdp_config["reshard_after_forward"]`` (FSDP2: ``True`` = full shard, ``False`` =
    shard_grad_op; FSDP1: the strategy's name). The number of GPUs is the
    launcher's, not an argument's (``estimate_from_hf(..., gpus=N)``, ``trainmem hf
    --gpus N``)."""
    ds = hf_field(training_args, "deepspeed", None)
    fsdp = hf_field(training_args, "fsdp", None)
    if ds and fsdp:
        raise OptionError(
            "training_args", "deepspeed and fsdp cannot both be set in the arguments"
        )
    if ds:
        return _deepspeed_options(ds)
    if not fsdp:
        return {}
    config = hf_field(training_args, "fsdp_config", None) or {}
    if isinstance(fsdp, bool):
        words = [str(config.get("reshard_after_forward", True)).lower()]
    else:
        words = fsdp.split() if isinstance(fsdp, str) else list(fsdp)
        words = [str(getattr(w, "value", w)).lower() for w in words]  # FSDPOption
    offload = str(config.get("offload_params", config.get("cpu_offload", False)))
    if "offload" in words or offload.lower() == "true":
        raise OptionError(
            "training_args", "fsdp offload (parameters on the CPU) is not modelled"
        )
    if "no_shard" in words:
        return {}
    # accelerate's FSDP default is FULL_SHARD; FSDP2's reshard_after_forward=False is
    # SHARD_GRAD_OP
    stage = 2 if ("shard_grad_op" in words or "false" in words) else 3
    return {"zero": stage, "zero_impl": "fsdp"}


def _deepspeed_options(ds: Any) -> dict[str, Any]:
    """The options a DeepSpeed config fixes (see :func:`_sharding_options`)."""
    if isinstance(ds, str):
        from .errors import read_json_object

        ds = read_json_object(ds, "training_args")
    zero = hf_field(ds, "zero_optimization", None) or {}
    stage = zero.get("stage", 0)
    if stage not in (2, 3):
        raise OptionError(
            "training_args",
            f"deepspeed zero_optimization.stage {stage!r} is not modelled (stages 2 "
            "and 3 are)",
        )
    for offload in ("offload_optimizer", "offload_param"):
        device = (zero.get(offload) or {}).get("device", "none")
        if device not in (None, "none"):
            raise OptionError(
                "training_args",
                f"deepspeed zero_optimization.{offload}.device {device!r}: offloading "
                "is not modelled",
            )
    keys = [deepspeed.CONFIG_KEYS[f] for f in deepspeed.STAGE_SIZES[stage]]
    given = {k: zero[k] for k in keys if k in zero}
    defaults = {
        deepspeed.CONFIG_KEYS[f]: getattr(deepspeed.DEFAULTS, f)
        for f in deepspeed.STAGE_SIZES[stage]
    }
    if given and all(v == "auto" for v in given.values()):
        if len(given) != len(keys):
            missing = sorted(set(keys) - set(given))
            raise OptionError(
                "training_args",
                f"deepspeed zero_optimization sets some sizes to 'auto' and leaves "
                f"out {', '.join(missing)}: a mix is not modelled",
            )
        sizes = "hf-auto"
    else:
        for key, value in given.items():
            if value != defaults[key]:
                raise OptionError(
                    "training_args",
                    f"deepspeed zero_optimization.{key} = {value!r}: the sizes "
                    "modelled are 'auto' (the Trainer's) or DeepSpeed's defaults "
                    f"({key} {defaults[key]:,} when left out)",
                )
        sizes = "defaults"
    return {"zero": stage, "zero_impl": "deepspeed", "deepspeed_sizes": sizes}


def _model_targets(model: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The LoRA targets peft picks for ``model``'s type when ``target_modules`` is
    left out (its ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`` entry, the
    registry's ``lora_default``), and those ``"all-linear"`` stands for: every linear
    layer of a decoder block, under the family's own names (GPT-2's ``c_attn``, Phi-3's
    ``qkv_proj``)."""
    from .families import MODEL_TYPES, model_shape

    try:
        shape = model_shape(model)
    except (OptionError, TypeError, ValueError, OSError):
        return ("q_proj", "v_proj"), ALL_LINEAR
    entry = MODEL_TYPES.get(shape.arch)
    default = entry.lora_default if entry else ("q_proj", "v_proj")
    return tuple(default), tuple(shape.linear_shapes())


def _lora_options(peft_config: Any, model: Any = None) -> dict[str, Any]:
    """The LoRA options of a peft ``LoraConfig`` or its dict; see :func:`hf_options`
    (``model``: the config the targets are named for)."""
    peft_type = hf_field(peft_config, "peft_type", "LORA")
    peft_type = str(peft_type).split(".")[-1].upper()
    if peft_type != "LORA":
        raise OptionError(
            "peft_config", f"peft_config: peft_type must be LORA, got {peft_type!r}"
        )
    if hf_field(peft_config, "use_dora", False):
        raise OptionError(
            "peft_config",
            "peft_config: use_dora=True is not modelled; allowed: use_dora=False",
        )
    targets = hf_field(peft_config, "target_modules", None)
    default, every = _model_targets(model)
    if targets is None:
        targets = default  # peft's default for the model type
    elif isinstance(targets, str):
        targets = every if targets == "all-linear" else (targets,)
    options = dict(
        method="lora",
        lora_rank=hf_field(peft_config, "r", 8),
        lora_alpha=hf_field(peft_config, "lora_alpha", 8),
        lora_targets=tuple(sorted(targets, key=lambda t: (every + (t,)).index(t))),
    )
    # peft's default 0.0 is nn.Identity; > 0 keeps a mask per adapted module
    dropout = float(hf_field(peft_config, "lora_dropout", 0.0) or 0.0)
    if dropout:
        options["lora_dropout"] = dropout
    return options


def hf_field_error(e: OptionError, overrides) -> OptionError:
    """``e`` renamed to the Hugging Face field its option came from (``batch`` ->
    ``training_args per_device_train_batch_size``), unless the caller overrode it."""
    if e.option in _HF_NAMES and e.option not in overrides:
        source, field_name = _HF_NAMES[e.option]
        rest = str(e)[len(e.option) :] if str(e).startswith(e.option) else f": {e}"
        return OptionError(source, f"{source} {field_name}{rest}")
    return e


# --------------------------------------------------------------------------------------
# a published run's conditions -> options
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunFramework:
    """How the estimator replays a run of one framework a published source names:
    the :mod:`trainmem.frameworks` entry it runs as, whether its recipes train
    bf16-true (parameters in bf16, no autocast), its LoRA adapters' dtype (``None``:
    peft's fp32 unless ``autocast_adapter_dtype=False``; LitGPT's follow the bf16-true
    module) and QLoRA's k-bit preparation when the run does not say (LitGPT quantizes
    through Fabric's BitsandbytesPrecision, without peft's
    ``prepare_model_for_kbit_training``: the rest of the model stays bf16)."""

    framework: str
    bf16_true: bool
    lora_dtype: str | None
    kbit_prepare: str
    #: the run's ``optimizer`` condition names bitsandbytes' paged AdamW
    reads_optimizer: bool = False


RUN_FRAMEWORKS = {
    "hf": RunFramework("hf", False, None, "peft"),
    "litgpt": RunFramework("litgpt", True, "bf16", "none", reads_optimizer=True),
    "torchtune": RunFramework("hf", True, None, "none"),
}
#: the first word of a run's ``precision`` condition -> the estimator's precision.
#: Trainer's bf16=True under FSDP/DeepSpeed is ``bf16-amp`` (16-bit compute copies,
#: fp32 master weights: the estimator's ZeRO layout); bf16-true / a model loaded in
#: bf16 without autocast is pure ``bf16``
RUN_PRECISIONS = {"bf16-amp": "bf16-amp", "bf16": "bf16", "bf16-true": "bf16"}


def run_options(conditions: dict, devices: int = 1) -> dict[str, Any]:
    """The estimator's options for one published run on ``devices`` GPUs, each read
    from a condition the source states (``coursekit/data/published_gpu.json``'s
    ``conditions``)."""
    c = conditions
    run = RUN_FRAMEWORKS[c["framework"]]
    opts: dict = {
        "method": c["method"],
        "batch": c["micro_batch"],
        "seq": c["seq"] or c["seq_bound"],
        "checkpointing": bool(c.get("checkpointing")),
        "grad_accum": c.get("grad_accum") or 1,
        # FlashAttention-2 (flash_attn's kernels, GQA without repeat_kv) or SDPA,
        # whose kernel torch selects (trainmem.sdpa)
        "attn": "flash" if c["attention"].startswith("flash_attention") else "sdpa",
        "optimizer": "adamw",
        "optimizer_impl": "foreach",  # torch.optim.AdamW(params) on CUDA
    }
    precision = RUN_PRECISIONS.get(c["precision"].split()[0])
    if precision is None and run.bf16_true:
        precision = RUN_PRECISIONS["bf16-true"]
    if precision:
        opts["precision"] = precision
    if c.get("global_batch"):
        # the run's gradient accumulation (LitGPT: global_batch_size // (micro_batch
        # * devices)); the gradients stay allocated through the next forward
        opts["grad_accum"] = max(1, c["global_batch"] // (c["micro_batch"] * devices))
    if c["method"] != "full":
        opts["lora_rank"] = c["lora_r"]
        opts["lora_alpha"] = c.get("lora_alpha") or 2 * c["lora_r"]
        targets = c["lora_targets"]
        opts["lora_targets"] = tuple(ALL_LINEAR if targets == "all-linear" else targets)
        if c.get("lora_head"):
            opts["lora_targets"] += ("lm_head",)  # LitGPT's lora_head
        opts["lora_dtype"] = run.lora_dtype
        opts["lora_dropout"] = c.get("lora_dropout") or 0.0
    if c.get("quantize"):
        opts["qlora_double_quant"] = c["quantize"].endswith("-dq")
        opts["kbit_prepare"] = c.get("kbit_prepare") or run.kbit_prepare
    if c.get("checkpointing") == "reentrant":
        opts["checkpointing_mode"] = "reentrant"
    if devices > 1 and (c["method"] == "full" or c.get("zero")):
        # FSDP full sharding
        opts["zero"], opts["gpus"] = c.get("zero") or 3, devices
        if c.get("zero_impl"):
            opts["zero_impl"] = c["zero_impl"]
            if c.get("deepspeed_sizes"):
                opts["deepspeed_sizes"] = c["deepspeed_sizes"]
    opts["framework"] = run.framework
    if run.reads_optimizer and c.get("optimizer", "").startswith(
        "bnb.optim.PagedAdamW"
    ):
        opts["optimizer"] = "paged_adamw"
    if c.get("versions"):
        opts["versions"] = c["versions"]
    return opts
