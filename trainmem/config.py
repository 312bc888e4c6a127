"""What the estimator and the measurement are told: the model and the training step.

* :class:`StepConfig` — every option of one training step (method, precision, optimizer,
  batch, sequence length, LoRA, checkpointing, attention, ZeRO, ...), validated once
  when it is built: a bad value raises :class:`OptionError` naming the option.
  :func:`estimate <trainmem.estimate.estimate>`, :func:`simulate_step
  <trainmem.memory.step.simulate_step>` and :func:`measure
  <trainmem.measuring.measure.measure>` all take one.
* re-exported: :class:`Shape`, :func:`load_model_config` and :func:`model_shape` (the
  model, from :mod:`trainmem.families`), :class:`OptionError` and
  :func:`read_json_object` (from :mod:`trainmem.errors`).

Standard library only (the book's in-page calculator runs this module in Pyodide).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any

from .deepspeed import SIZES as DEEPSPEED_SIZES
from .dtypes import FLOAT_DTYPES
from .errors import OptionError as OptionError
from .errors import check_choice as check_choice
from .errors import check_positive_int as check_positive_int
from .errors import read_json_object as read_json_object
from .families import Shape as Shape
from .families import load_model_config as load_model_config
from .families import model_shape as model_shape
from .frameworks import FRAMEWORKS as _FRAMEWORKS
from .frameworks import framework as framework_entry

# the six byte categories every result uses (re-exported)
from .memory.accounting import CATEGORIES as CATEGORIES
from .optimizers import IMPLS
from .optimizers import OPTIMIZERS as _OPTIMIZERS
from .optimizers import optimizer as optimizer_entry
from .precisions import PRECISIONS as _PRECISIONS
from .precisions import precision as precision_entry
from .sharding import SHARDINGS as _SHARDINGS
from .sharding import sharding as sharding_entry

METHODS = ("full", "lora", "qlora")
#: the precision names (:data:`trainmem.precisions.PRECISIONS`, one entry each)
PRECISIONS = tuple(_PRECISIONS)
#: the optimizer names (:data:`trainmem.optimizers.OPTIMIZERS`, one entry each)
OPTIMIZERS = tuple(_OPTIMIZERS)
ATTN_IMPLS = ("sdpa", "eager", "flash", "math")
#: torch.optim implementations; they differ only in the scratch memory of the step.
#: ``foreach`` is what ``torch.optim.AdamW(params)`` picks on CUDA; ``fused`` is what
#: Hugging Face Trainer runs by default (``optim="adamw_torch_fused"``, transformers
#: 5); ``for-loop`` is ``foreach=False`` (also what the plain constructor picks on
#: CPU). Each optimizer entry lists the ones it has and its default.
OPTIMIZER_IMPLS = IMPLS
LORA_DTYPES = (None, *FLOAT_DTYPES)
ZERO_STAGES = (0, 1, 2, 3)
#: who shards the model at ``zero`` >= 2 (torch FSDP, or DeepSpeed ZeRO)
ZERO_IMPLS = tuple(_SHARDINGS)
USE_CACHE = (None, "on", "off")
KBIT_PREPARE = ("peft", "none")
KERNELS = ("cuda", "cpu")
#: whose training step is modelled: Hugging Face (transformers + peft + Trainer's
#: loop) or LitGPT (its own GPT module, LoRA layers and finetune loop)
FRAMEWORKS = tuple(_FRAMEWORKS)


def split_targets(lora_targets) -> tuple[str, ...]:
    """LoRA target module names as a tuple; a string is a comma-separated list."""
    if isinstance(lora_targets, str):
        return tuple(t.strip() for t in lora_targets.split(",") if t.strip())
    return tuple(lora_targets)


# --------------------------------------------------------------------------------------
# the training step
# --------------------------------------------------------------------------------------
def _option(default, help: str, **cli):
    """A :class:`StepConfig` field whose metadata tells the command line how to take it
    (``help``; ``choices``; ``kind``: ``"positive"``, ``"int"``, ``"list"`` or, for a
    bool, a flag; ``flag``: the flag's name when not ``--field-name``;
    ``estimate_only``: not a flag of ``measure``)."""
    value = field(default=default, metadata=dict(help=help, **cli))
    return value


@dataclass(frozen=True)
class StepConfig:
    """The options of one training step, validated when built (see
    :mod:`trainmem.estimate` for what each one means).

    A bad value raises :class:`OptionError` whose ``option`` is the field's name.
    ``lora_targets`` may be given as a comma-separated string; it is stored as a tuple.
    The LoRA targets and rank depend on the model as well: :meth:`check_model` checks
    them against a :class:`Shape` (for ``method="lora"``/``"qlora"`` only)."""

    method: str = _option(
        "full",
        "full fine-tuning, LoRA, or QLoRA (4-bit NF4 base weights)",
        choices=METHODS,
    )
    precision: str = _option(
        "bf16-amp",
        "fp32; fp16-amp / bf16-amp = torch.autocast (fp16 with loss scaling) over "
        "the parameters in the load dtype (full fine-tuning: fp32; LoRA: the 16-bit "
        "base, fp32 adapters); bf16 = pure bf16 parameters, grads and states",
        choices=PRECISIONS,
    )
    optimizer: str = _option(
        "adamw",
        "; ".join(f"{o.name}: {o.summary}" for o in _OPTIMIZERS.values()),
        choices=OPTIMIZERS,
    )
    optimizer_impl: str | None = _option(
        None,
        "torch's implementation, which sets the scratch memory of the step: foreach "
        "(what torch.optim.AdamW(params) picks on CUDA), fused (Hugging Face Trainer's "
        "default optim adamw_torch_fused), for-loop (foreach=False); default: the "
        "optimizer's own ("
        + ", ".join(f"{o.name} {o.default_impl}" for o in _OPTIMIZERS.values())
        + ")",
        choices=OPTIMIZER_IMPLS,
    )
    batch: int = _option(1, "micro-batch size (≥ 1)", kind="positive")
    seq: int = _option(512, "sequence length in tokens (≥ 1)", kind="positive")
    grad_accum: int = _option(
        1, "gradient-accumulation micro-steps per optimizer step", kind="positive"
    )
    lora_rank: int = _option(
        8,
        "LoRA rank r (1 ≤ r ≤ smallest in/out width of the targets)",
        kind="int",
    )
    lora_alpha: int = _option(
        16, "LoRA alpha (scaling alpha/r; no memory effect)", kind="int"
    )
    lora_targets: tuple[str, ...] = _option(
        ("q_proj", "v_proj"),
        "comma-separated module names: q_proj,k_proj,v_proj,o_proj,gate_proj,"
        "up_proj,down_proj (gpt2: c_attn,attn.c_proj,c_fc,mlp.c_proj)",
        kind="list",
    )
    lora_dtype: str | None = _option(
        None, "adapter dtype; default: peft's (fp32 adapters)", choices=FLOAT_DTYPES
    )
    load_dtype: str | None = _option(
        None,
        "the dtype the weights are loaded in (from_pretrained's dtype), independent "
        "of autocast. Default: LoRA (hf) under fp16-amp/bf16-amp loads the autocast "
        "dtype -- the recipe LoRA users run: a 16-bit base loaded from a 16-bit "
        "checkpoint (from_pretrained's default from transformers 5), peft's fp32 "
        "adapters, "
        "autocast (Trainer(bf16=True)); fp32 is autocast over fp32 weights (their "
        "16-bit copies kept for backward). Full fine-tuning and QLoRA: the "
        "precision's (fp32 under autocast, bf16 for pure bf16)",
        choices=FLOAT_DTYPES,
    )
    qlora_double_quant: bool = _option(
        True,
        "QLoRA without double quantization of the NF4 constants",
        flag="--no-double-quant",
    )
    checkpointing: bool = _option(
        False,
        "activation (gradient) checkpointing of every decoder layer (non-reentrant)",
    )
    attn: str = _option(
        "sdpa",
        "attention implementation: sdpa (flash: same memory), eager (stores the b x "
        "heads x s x s scores) or math (SDPA's math path: fp32 scores and softmax; "
        "what bf16 SDPA runs below sm_80)",
        choices=ATTN_IMPLS,
    )
    zero: int = _option(
        0,
        "ZeRO/FSDP stage: 1 shards optimizer states + master weights, 2 also "
        "gradients, 3 also weights. With fp16/bf16-amp and stage >= 1 the ZeRO-paper "
        "layout is used (16-bit weights and grads, fp32 master/m/v); stage 0 is "
        "torch.autocast over fp32 parameters",
        choices=ZERO_STAGES,
        estimate_only=True,
    )
    gpus: int = _option(
        1,
        "data-parallel GPUs (≥ 1); with --zero 0 torch DDP, whose gradient buckets "
        "hold a second copy of the trainable gradients",
        kind="positive",
        estimate_only=True,
    )
    zero_impl: str = _option(
        "fsdp",
        "who shards at --zero 2/3: fsdp (torch FSDP: a decoder layer per unit, the "
        "next one prefetched, the root unit kept gathered through backward) or "
        "deepspeed (DeepSpeed ZeRO: a gradient bucket of reduce_bucket_size "
        "elements, each module's parameters gathered as it runs plus a prefetch "
        "bucket, small parameters never partitioned)",
        choices=ZERO_IMPLS,
        estimate_only=True,
    )
    deepspeed_sizes: str = _option(
        "defaults",
        "with --zero-impl deepspeed: the bucket sizes — defaults (DeepSpeed's own, "
        "what a config without them gets, as accelerate builds it from its yaml: "
        "reduce 5e8, prefetch 5e7, persistence 1e5 elements) or hf-auto (the "
        "Trainer's 'auto': hidden², 0.9·hidden², 10·hidden)",
        choices=DEEPSPEED_SIZES,
        estimate_only=True,
    )
    checkpointing_mode: str = _option(
        "non-reentrant",
        "with --checkpointing: torch.utils.checkpoint's form — non-reentrant (what "
        "transformers >= 5.0 asks for) or reentrant (use_reentrant=True, the default "
        "of gradient_checkpointing_enable() before 5.0): the whole layer is "
        "recomputed and its output kept until the layer's backward ends",
        choices=("non-reentrant", "reentrant"),
    )
    lora_dropout: float = _option(
        0.0,
        "peft's lora_dropout (0 ≤ p < 1; > 0 adds a mask and a dropped copy of each "
        "adapted module's input; 0 is nn.Identity)",
        kind="fraction",
    )
    use_cache: str | None = _option(
        None,
        "the forward's KV cache; default: as transformers decides (the config's "
        "use_cache=True, turned off by checkpointing)",
        choices=USE_CACHE,
    )
    versions: str | None = _option(
        None,
        "library versions the modelled behaviours depend on, e.g. transformers=4.48.1,"
        "peft=0.13.2,bitsandbytes=0.43.3,torch=2.4.1 (any subset; default: the "
        "versions this course pins)",
    )
    kbit_prepare: str = _option(
        "peft",
        "QLoRA: peft = prepare_model_for_kbit_training (non-quantized weights upcast "
        "to fp32), none = the base kept in its 16-bit load dtype",
        choices=KBIT_PREPARE,
    )
    kernels: str = _option(
        "cuda",
        "whose kernels the step runs: cuda (what the estimate describes) or cpu "
        "(where trainmem.measuring.measure checks it; dropout keeps a float mask "
        "there)",
        choices=KERNELS,
        estimate_only=True,
    )

    previous_seq: int | None = _option(
        None,
        "litgpt: tokens of the micro-batch before the step's first one, whose logits "
        "(and graph) the loop still references during its forward; 0: none (the "
        "run's first micro-batch); default: seq. Later micro-batches of the step "
        "follow one of seq tokens",
        kind="int",
        estimate_only=True,
    )
    framework: str = _option(
        "hf",
        "whose training step: hf (transformers + peft, the Trainer's loop) or litgpt "
        "(LitGPT's GPT: fused qkv with LoRAQKVLinear, fp32 RMSNorm, lm_head in "
        "128-token chunks with a bf16 cross-entropy per chunk, every Linear incl. "
        "lm_head 4-bit under QLoRA)",
        choices=FRAMEWORKS,
    )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> "StepConfig":
        """A :class:`StepConfig` of keyword options; a name that is not a field
        raises :class:`OptionError` naming it and the fields."""
        names = [f.name for f in fields(cls)]
        for name in options:
            if name not in names:
                raise OptionError(
                    name,
                    f"{name} is not an option of a training step; allowed: "
                    f"{', '.join(names)}",
                )
        return cls(**options)

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", split_targets(self.lora_targets))
        check_choice("method", self.method, METHODS)
        precision_entry(self.precision)
        spec = optimizer_entry(self.optimizer)
        if self.optimizer_impl is None:
            object.__setattr__(self, "optimizer_impl", spec.default_impl)
        check_choice("attn", self.attn, ATTN_IMPLS)
        check_choice("lora_dtype", self.lora_dtype, LORA_DTYPES)
        check_choice("load_dtype", self.load_dtype, LORA_DTYPES)
        check_choice("optimizer_impl", self.optimizer_impl, OPTIMIZER_IMPLS)
        spec.impl(self.optimizer_impl)
        check_positive_int("batch", self.batch)
        check_positive_int("seq", self.seq)
        check_positive_int("grad_accum", self.grad_accum)
        check_positive_int("gpus", self.gpus)
        check_choice("zero", self.zero, ZERO_STAGES)
        check_choice("zero_impl", self.zero_impl, ZERO_IMPLS)
        check_choice("deepspeed_sizes", self.deepspeed_sizes, DEEPSPEED_SIZES)
        check_choice("use_cache", self.use_cache, USE_CACHE)
        check_choice("kbit_prepare", self.kbit_prepare, KBIT_PREPARE)
        check_choice("kernels", self.kernels, KERNELS)
        check_choice("framework", self.framework, FRAMEWORKS)
        shard, frame = sharding_entry(self.zero_impl), framework_entry(self.framework)
        if self.zero not in shard.stages:
            stages = " and ".join(str(s) for s in shard.stages)
            raise OptionError(
                "zero_impl",
                f"zero_impl {shard.name!r} is modelled for ZeRO stages {stages}, got "
                f"zero={self.zero} {shard.stages_refused}",
            )
        if shard.frameworks and self.framework not in shard.frameworks:
            raise OptionError(
                "zero_impl",
                f"zero_impl {shard.name!r} is modelled for the "
                f"{', '.join(shard.frameworks)} framework {shard.frameworks_refused}",
            )
        if self.deepspeed_sizes != "defaults" and not shard.sizes:
            with_sizes = [s.name for s in _SHARDINGS.values() if s.sizes]
            raise OptionError(
                "deepspeed_sizes",
                f"deepspeed_sizes applies to zero_impl {with_sizes[0]!r} only",
            )
        if self.previous_seq is not None:
            p = self.previous_seq
            if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                raise OptionError(
                    "previous_seq",
                    f"previous_seq must be an integer >= 0, got {p!r}",
                )
            if not frame.previous_seq:
                keeps = [f.name for f in _FRAMEWORKS.values() if f.previous_seq]
                raise OptionError(
                    "previous_seq",
                    f"previous_seq is a {'/'.join(keeps)} option (its loop keeps the "
                    f"previous micro-batch's logits); the {frame.name} replay drops "
                    "them",
                )
        if self.attn in frame.attn_refused:
            raise OptionError("attn", frame.attn_refused[self.attn])
        check_choice(
            "checkpointing_mode",
            self.checkpointing_mode,
            ("non-reentrant", "reentrant"),
        )
        p = self.lora_dropout
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
            raise OptionError(
                "lora_dropout", f"lora_dropout must be a number in [0, 1), got {p!r}"
            )
        from .versions import parse_versions

        parse_versions(self.versions)  # raises OptionError for a bad entry

    def record(self, names, **given) -> dict[str, Any]:
        """The options ``names``, in that order, as a result reports them
        (``.options`` of an estimate or a measurement): ``lora_targets`` as a list,
        ``use_cache`` as ``"on"``/``"off"`` (:attr:`cache_on`), ``versions`` as the
        text of every library's version; ``given`` supplies names that are not
        fields (``model``, ``device``) or overrides one (``attn``)."""
        from .versions import version_text

        forms = {
            "lora_targets": lambda v: list(v),
            "use_cache": lambda v: "on" if self.cache_on else "off",
            "versions": lambda v: {
                k: version_text(k, t) for k, t in self.library_versions.items()
            },
        }
        out = {}
        for name in names:
            if name in given:
                out[name] = given[name]
            else:
                out[name] = forms.get(name, lambda v: v)(getattr(self, name))
        return out

    @property
    def library_versions(self) -> dict:
        from .versions import parse_versions

        return parse_versions(self.versions)

    @property
    def cache_on(self) -> bool:
        """Whether the forward builds a KV cache: transformers' default is the config's
        ``use_cache`` (True for Llama-family configs), ``--use-cache off`` turns it
        off, and under gradient checkpointing the decoder always turns it off
        ("use_cache=True is incompatible with gradient checkpointing. Setting
        use_cache=False")."""
        if self.checkpointing:
            return False
        return self.use_cache != "off"

    @property
    def uses_lora(self) -> bool:
        return self.method in ("lora", "qlora")

    @property
    def attn_memory(self) -> str:
        """The attention implementation as far as memory goes (flash = SDPA)."""
        return "sdpa" if self.attn == "flash" else self.attn

    def check_model(self, shape: Shape) -> None:
        """Check the LoRA targets and rank against the Linear layers of ``shape``
        (and that the framework models the model's family)."""
        shard, frame = sharding_entry(self.zero_impl), framework_entry(self.framework)
        if shard.replayed_only and shape.family.replay in (None, "traced"):
            raise OptionError(
                "zero_impl",
                f"zero_impl {shard.name!r} is modelled for the replayed Llama-family "
                f"decoders, got {shape.arch}",
            )
        if frame.families and shape.family.replay not in frame.families:
            raise OptionError(
                "framework",
                f"framework {frame.name!r} models Llama-family decoders, got "
                f"{shape.arch}",
            )
        if frame.mqa_by_version and shape.kv_heads == 1 < shape.heads:
            from .versions import litgpt_mqa_expanded

            if not litgpt_mqa_expanded(self.library_versions):
                raise OptionError(
                    "versions",
                    "versions: LitGPT before 50b1974b hands SDPA one key/value head "
                    f"for {shape.heads} query heads (multi-query attention, "
                    "not expanded), and torch then runs its math kernel: not "
                    "replayed; use a later litgpt or a model with more kv heads",
                )
        if not self.uses_lora:
            return
        shapes = dict(shape.linear_shapes())
        if frame.lora_head:
            # LitGPT's lora_head adapts the output head too
            shapes["lm_head"] = (shape.hidden, shape.vocab)
        together = frame.lora_together
        mlp = [t for t in together if t in self.lora_targets]
        if mlp and len(mlp) != len(together):
            raise OptionError(
                "lora_targets",
                "lora_targets: LitGPT's lora_mlp adapts fc_1, fc_2 and proj "
                f"together: name all of {', '.join(together)} or none, got "
                f"{', '.join(mlp)}",
            )
        if not self.lora_targets:
            raise OptionError(
                "lora_targets",
                f"lora_targets must name at least one of {', '.join(shapes)}",
            )
        for target in self.lora_targets:
            if target not in shapes:
                raise OptionError(
                    "lora_targets",
                    f"lora_targets: unknown target module {target!r}; allowed: "
                    f"{', '.join(shapes)}",
                )
        width = min(min(shapes[t]) for t in self.lora_targets)
        rank = self.lora_rank
        if (
            not isinstance(rank, int)
            or isinstance(rank, bool)
            or not 1 <= rank <= width
        ):
            raise OptionError(
                "lora_rank",
                f"lora_rank must be ≥ 1 and ≤ min(d_in, d_out)={width}, got {rank!r}",
            )


def step_signature(func, *before: inspect.Parameter):
    """Give ``func(..., **options)`` the signature it runs with: the parameters
    ``before`` (the model, the device, ...) then every :class:`StepConfig` field as a
    keyword with its default, so ``help()`` and editors list the one option list."""
    params = list(before) + [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default)
        for f in fields(StepConfig)
    ]
    func.__signature__ = inspect.Signature(params)
    return func
