"""Training-memory estimator: peak bytes of one training step, term by term.

Public API (stable; chapters and labs call it)::

    from trainmem.estimate import estimate
    est = estimate("llama-7b", method="lora", precision="bf16-amp", optimizer="adamw",
                   batch=4, seq=512, lora_rank=8, lora_targets=("q_proj", "v_proj"),
                   checkpointing=True, attn="sdpa")
    est.total_bytes          # int, the peak (bytes)
    est.breakdown            # {"weights", "gradients", "optimizer_states", "master_weights",
                             #  "activations", "temporaries"} -> int bytes, at the peak; sums to total
    est.activation_bytes     # bytes held for backward at the end of the forward pass
    est.n_params, est.n_trainable
    est.to_json(); est.to_dict(); print(est.table())      # table in GiB (2**30) and GB (10**9)

``estimate(model, method, precision, optimizer, batch, seq, lora_rank, lora_alpha, lora_targets,
lora_dtype, qlora_double_quant, checkpointing, attn, zero, gpus, grad_accum, optimizer_impl)``:

* ``model``: a preset name (``trainmem.models.PRESETS``: llama-7b, llama2-13b, qwen2.5-0.5b, gpt2,
  tiny, ...), a path to an HF ``config.json``, or a ``transformers`` config.
* ``method``: ``"full"`` | ``"lora"`` | ``"qlora"`` (bitsandbytes ``load_in_4bit``: the Linear
  weights inside the decoder blocks in 4-bit NF4 — 0.5 B/weight + quantization constants — and
  the embeddings, norms and ``lm_head`` in 16 bit, fp16 under ``fp16-amp`` and bf16 otherwise).
* ``precision``: ``"fp32"`` | ``"fp16-amp"`` | ``"bf16-amp"`` (``torch.autocast`` over fp32
  parameters; fp16 adds loss scaling) | ``"bf16"`` (pure bf16: parameters, gradients and AdamW states
  in bf16, no master copy).
* ``optimizer``: ``"adamw"`` (torch) | ``"adamw8bit"`` (bitsandbytes) | ``"sgd"`` |
  ``"sgd-momentum"``.
* ``optimizer_impl``: torch's implementation, which decides the scratch memory of the step
  (:data:`OPTIMIZER_IMPLS`): ``"foreach"`` (default here; what ``torch.optim.AdamW(params)`` picks
  on CUDA) allocates ``sqrt(exp_avg_sq)`` for every parameter at once, one more copy of the
  states (4 B/param under AMP); ``"fused"`` (Hugging Face Trainer's default, ``optim=
  "adamw_torch_fused"`` in transformers 5) updates in place, no scratch; ``"for-loop"``
  (``foreach=False``; the plain constructor's choice on CPU) needs two copies of one parameter
  at a time (plus the previous parameter's ``denom``). SGD and 8-bit AdamW: no scratch.
* ``batch``, ``seq``: micro-batch size and sequence length (tokens); ``grad_accum`` micro-batches
  per optimizer step (gradients then stay allocated during the next forward).
* ``lora_rank`` (r), ``lora_alpha``, ``lora_targets`` (module names), ``lora_dtype`` (``None`` =
  peft's default: fp32 adapters), ``qlora_double_quant``.
* ``checkpointing``: non-reentrant activation checkpointing of every decoder layer.
* ``attn``: ``"sdpa"`` (also ``"flash"``: the same memory) | ``"eager"`` (materialises the
  ``b x heads x s x s`` scores).
* ``zero`` (0-3) and ``gpus``: per-GPU memory under ZeRO partitioning over ``gpus`` data-parallel
  GPUs — stage >= 1 divides optimizer states and fp32 master weights by ``gpus``, >= 2 also
  gradients, 3 also weights (plus one gathered, unsharded layer in flight).  The AdamW ``foreach``
  scratch (``temporaries`` at the optimizer step) covers the local shard only.  This part is a
  model, not measured here.  Which parameter layout applies:

  - ``zero=0``: the layout of plain PyTorch, as measured — under ``fp16-amp``/``bf16-amp`` torch
    AMP (fp32 parameters that *are* the master weights, fp32 gradients, autocast's 16-bit weight
    copies kept for backward: the 18 B/param convention below).
  - ``zero>=1`` with ``fp16-amp``/``bf16-amp``: the ZeRO paper's / DeepSpeed's layout — the module
    is cast to the 16-bit dtype (no autocast; adapters too), so 16-bit parameters 2Ψ (replicated
    for forward/backward at stages 1-2, sharded at stage 3) + 16-bit gradients 2Ψ (sharded from
    stage 2) + fp32 master weights 4Ψ and fp32 Adam m, v 8Ψ held by the optimizer for its shard
    (12Ψ/N from stage 1).  The model states then equal :func:`trainmem.zero.per_gpu_memory`
    exactly (stage 3: plus the gathered layer, ``2 × params of one layer`` bytes).  Activations
    follow the 16-bit module (a 16-bit residual stream, as with ``precision="bf16"``).
    DeepSpeed's transient fp32 copy of the local gradient shard at the step is not modelled.
  - ``fp32`` and pure ``bf16``: one layout at every stage (4 + 4 + 8, resp. 2 + 2 + 4 bytes per
    parameter, each term sharded as above); fp32 matches ``per_gpu_memory(weight_bytes=4,
    grad_bytes=4, k=8)``.

How the peak is computed.  Parameters, gradients and optimizer states are counted exactly from the
config.  Activations and temporaries come from :mod:`trainmem.simulate`, a symbolic replay of the
step: the Llama forward written op by op as ``transformers`` runs it, each op saving for backward
what PyTorch's autograd saves, backward in autograd's order, then the optimizer's scratch memory.
It agrees with the tensor-level measurement of :mod:`trainmem.measure` (real CPU tensors, and fake
tensors for 7B shapes) and with torch's own ``MemTracker`` to a few bytes in most configurations;
``benchmarks/results/memory_accuracy.md`` lists a fixed grid and a random grid of tiny Llama,
Qwen2 and Mistral configurations (GQA, tied embeddings, odd widths, every option) with the worst
rows.  The ``forward`` phase peak under checkpointing is modelled less exactly (it is rarely the
step's peak).  On a GPU, ``max_memory_allocated`` adds the caching allocator's
512-byte rounding and kernel workspaces; ``max_memory_reserved`` adds fragmentation and the device
total adds the CUDA context (several hundred MiB) — none of these is in the estimate.
Llama-family configs (llama, mistral, qwen2) are replayed; ``gpt2`` uses the closed-form
activation estimate of Korthikanti et al. (2022) and is marked ``exact=False``.

From what a Hugging Face Trainer user has — a model config, ``TrainingArguments`` and a peft
``LoraConfig`` — :func:`estimate_from_hf` (CLI: ``python -m trainmem hf``) derives these options
(``optim`` → optimizer and implementation, ``bf16``/``fp16`` → precision, checkpointing, batch,
accumulation, ``max_length``, LoRA rank and targets, 4-bit quantization → QLoRA).

Bytes per parameter — the two conventions behind "16" and "18" (see :func:`bytes_per_param`):

* **16 B/param, ZeRO paper** (Rajbhandari et al., 2020), mixed-precision Adam: fp16 parameters 2 +
  fp16 gradients 2 + fp32 master weights 4 + fp32 Adam m 4 + fp32 Adam v 4 = 16.
* **18 B/param, torch AMP / Hugging Face "model training anatomy"**: fp32 parameters 4 (these are
  the master weights) + fp32 gradients 4 + Adam m, v 8 = 16, plus the fp16/bf16 working copies of
  the weights that autocast makes and autograd keeps until backward, 2 → 18.
* fp32 training: 4 + 4 + 8 = 16; pure bf16 (no master copy): 2 + 2 + 2 + 2 = 8.
* ``accelerate estimate-memory`` uses "4x the model size in the dtype" (16 B/param fp32, 8 B/param
  half precision) and no activations: :func:`accelerate_rule_bytes`.

Units: every ``*_bytes`` value and breakdown entry is an int number of bytes; GiB = 2**30 bytes,
GB = 10**9 bytes.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable

CATEGORIES = (
    "weights",
    "gradients",
    "optimizer_states",
    "master_weights",
    "activations",
    "temporaries",
)
METHODS = ("full", "lora", "qlora")
PRECISIONS = ("fp32", "fp16-amp", "bf16-amp", "bf16")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd", "sgd-momentum")
ATTN_IMPLS = ("sdpa", "eager", "flash")
#: torch.optim implementations of AdamW / SGD; they differ only in the scratch memory of the step.
#: ``foreach`` (the default here) is what ``torch.optim.AdamW(params)`` picks on CUDA; ``fused``
#: is what Hugging Face Trainer runs by default (``optim="adamw_torch_fused"``, transformers 5);
#: ``for-loop`` is ``foreach=False`` (also what the plain constructor picks on CPU).
OPTIMIZER_IMPLS = ("foreach", "fused", "for-loop")
LORA_DTYPES = (None, "fp32", "bf16", "fp16")
GiB = 1024**3
GB = 1000**3


class OptionError(ValueError):
    """Bad input to the estimator or the measurement; ``option`` names the argument it came from
    (``"lora_rank"``, ``"model"``, ``"training_args"``, ...), so a front end can name its own flag
    without parsing the message."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


# --------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder-only transformer that decide its memory (no units: counts)."""

    arch: str  # "llama" (also Qwen2/Mistral-style) or "gpt2"
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    positions: int = 0  # learned position embeddings (gpt2); 0 for RoPE models
    name: str = "config"

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each Linear of one decoder layer, by module name (LoRA targets)."""
        if self.arch == "gpt2":
            h, i = self.hidden, self.intermediate
            return {
                "c_attn": (h, 3 * h),
                "attn.c_proj": (h, h),
                "c_fc": (h, i),
                "mlp.c_proj": (i, h),
            }
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }


def _from_hf(cfg) -> Shape:
    name = getattr(cfg, "name_or_path", "") or "config"
    mt = getattr(cfg, "model_type", "")
    if mt == "gpt2":
        h = cfg.n_embd
        return Shape(
            "gpt2",
            cfg.vocab_size,
            h,
            cfg.n_inner or 4 * h,
            cfg.n_layer,
            cfg.n_head,
            cfg.n_head,
            h // cfg.n_head,
            True,
            qkv_bias=True,
            o_bias=True,
            mlp_bias=True,
            positions=cfg.n_positions,
            name=name,
        )
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    qkv_bias = bool(getattr(cfg, "attention_bias", False)) or mt == "qwen2"
    o_bias = bool(getattr(cfg, "attention_bias", False))
    return Shape(
        "llama",
        cfg.vocab_size,
        h,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        heads,
        kv,
        hd,
        bool(getattr(cfg, "tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
        name=name,
    )


def load_config_file(path: str):
    """A ``transformers`` config from a ``config.json`` file (HF format, ``model_type`` llama,
    qwen2, mistral or gpt2). Raises ``ValueError`` naming the file and the problem."""
    from . import models

    return models.load_config_file(path)


def resolve_config(model: Any):
    """``model`` as a transformers config: a preset name, a path to a config .json, or a config."""
    from . import models

    if isinstance(model, str):
        if model.endswith(".json") or os.path.sep in model:
            return models.load_config_file(model)
        return models.get_config(model)
    if hasattr(model, "vocab_size") and (
        hasattr(model, "to_dict") or hasattr(model, "model_type")
    ):
        return model  # a transformers config, or any object with its fields
    if isinstance(model, Shape):
        raise OptionError(
            "model",
            "model: pass a preset name, a config .json path or a transformers config",
        )
    raise OptionError(
        "model",
        f"model must be a preset name ({', '.join(models.preset_names())}), a config .json "
        f"path or a transformers config, got {type(model).__name__}",
    )


def model_shape(model: Any) -> Shape:
    """The :class:`Shape` of a preset name, config .json path or transformers config."""
    if isinstance(model, Shape):
        return model
    from . import models

    if (
        isinstance(model, str) and model in models.PRESETS
    ):  # no transformers import needed
        f = dict(models.PRESETS[model])
        arch = f.pop("arch")
        if arch == "gpt2":
            h = f["n_embd"]
            return Shape(
                "gpt2",
                f["vocab_size"],
                h,
                f.get("n_inner") or 4 * h,
                f["n_layer"],
                f["n_head"],
                f["n_head"],
                h // f["n_head"],
                True,
                qkv_bias=True,
                o_bias=True,
                mlp_bias=True,
                positions=f.get("n_positions", 1024),
                name=model,
            )
        h, heads = f["hidden_size"], f["num_attention_heads"]
        return Shape(
            "llama",
            f["vocab_size"],
            h,
            f["intermediate_size"],
            f["num_hidden_layers"],
            heads,
            f.get("num_key_value_heads") or heads,
            f.get("head_dim") or h // heads,
            bool(f.get("tie_word_embeddings", arch == "qwen2")),
            qkv_bias=arch == "qwen2",
            o_bias=bool(f.get("attention_bias", False)),
            mlp_bias=bool(f.get("mlp_bias", False)),
            name=model,
        )
    return _from_hf(resolve_config(model))


def _choice(name: str, value, allowed):
    if value not in allowed:
        shown = ", ".join("None" if a is None else str(a) for a in allowed)
        raise OptionError(name, f"{name} must be one of {shown}, got {value!r}")


def _positive_int(name: str, value):
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise OptionError(name, f"{name} must be an integer ≥ 1, got {value!r}")


def check_options(
    shape_or_cfg,
    *,
    method,
    precision,
    optimizer,
    batch,
    seq,
    lora_rank,
    lora_targets,
    attn,
    grad_accum,
    zero,
    gpus,
    lora_dtype=None,
    optimizer_impl="foreach",
):
    """Validate the estimator/measurement options; ``ValueError`` names the argument and the
    allowed values."""
    shape = shape_or_cfg if isinstance(shape_or_cfg, Shape) else _from_hf(shape_or_cfg)
    _choice("method", method, METHODS)
    _choice("precision", precision, PRECISIONS)
    _choice("optimizer", optimizer, OPTIMIZERS)
    _choice("attn", attn, ATTN_IMPLS)
    _choice("lora_dtype", lora_dtype, LORA_DTYPES)
    _choice("optimizer_impl", optimizer_impl, OPTIMIZER_IMPLS)
    _positive_int("batch", batch)
    _positive_int("seq", seq)
    _positive_int("grad_accum", grad_accum)
    _positive_int("gpus", gpus)
    _choice("zero", zero, (0, 1, 2, 3))
    if method in ("lora", "qlora"):
        shapes = shape.linear_shapes()
        targets = (
            list(lora_targets) if not isinstance(lora_targets, str) else [lora_targets]
        )
        if not targets:
            raise OptionError(
                "lora_targets",
                f"lora_targets must name at least one of {', '.join(shapes)}",
            )
        for t in targets:
            if t not in shapes:
                raise OptionError(
                    "lora_targets",
                    f"lora_targets: unknown target module {t!r}; allowed: {', '.join(shapes)}",
                )
        width = min(min(shapes[t]) for t in targets)
        if (
            not isinstance(lora_rank, int)
            or isinstance(lora_rank, bool)
            or not 1 <= lora_rank <= width
        ):
            raise OptionError(
                "lora_rank",
                f"lora_rank must be ≥ 1 and ≤ min(d_in, d_out)={width}, got {lora_rank!r}",
            )
    return shape


# --------------------------------------------------------------------------------------------
# parameter counts and bytes per parameter
# --------------------------------------------------------------------------------------------
def count_params(model: Any) -> int:
    """Number of parameters of the base model (no adapters), exactly as ``transformers`` builds it."""
    s = model_shape(model)
    h, i, L = s.hidden, s.intermediate, s.layers
    if s.arch == "gpt2":
        per = (
            (2 * h)
            + (h * 3 * h + 3 * h)
            + (h * h + h)
            + (2 * h)
            + (h * i + i)
            + (i * h + h)
        )
        return s.vocab * h + s.positions * h + L * per + 2 * h
    attn = h * s.q_dim + 2 * h * s.kv_dim + s.q_dim * h
    if s.qkv_bias:
        attn += s.q_dim + 2 * s.kv_dim
    if s.o_bias:
        attn += h
    mlp = 3 * h * i + ((2 * i + h) if s.mlp_bias else 0)
    per = attn + mlp + 2 * h
    return s.vocab * h * (1 if s.tied else 2) + L * per + h


def _targets(lora_targets) -> tuple[str, ...]:
    if isinstance(lora_targets, str):
        return tuple(t.strip() for t in lora_targets.split(",") if t.strip())
    return tuple(lora_targets)


def lora_trainable_params(
    model: Any, rank: int = 8, targets: Iterable[str] = ("q_proj", "v_proj")
) -> int:
    """Trainable LoRA parameters: ``rank * (d_in + d_out)`` per targeted Linear, in every layer."""
    s = model_shape(model)
    shapes = s.linear_shapes()
    targets = _targets(targets)
    check_options(
        s,
        method="lora",
        precision="fp32",
        optimizer="adamw",
        batch=1,
        seq=1,
        lora_rank=rank,
        lora_targets=targets,
        attn="sdpa",
        grad_accum=1,
        zero=0,
        gpus=1,
    )
    return s.layers * sum(rank * (shapes[t][0] + shapes[t][1]) for t in targets)


def bytes_per_param(
    precision: str = "bf16-amp", optimizer: str = "adamw", convention: str = "torch-amp"
) -> float:
    """Bytes of model state per *trainable* parameter (no activations).

    ``convention``:

    * ``"torch-amp"`` — what PyTorch actually holds: fp32 parameters (master) 4 + fp32 grads 4 +
      optimizer states, plus 2 for the low-precision weight copies autocast keeps for backward
      under ``fp16-amp``/``bf16-amp``: AdamW → 4 + 2 + 4 + 8 = **18** (Hugging Face's count);
      fp32 → 4 + 4 + 8 = 16; pure ``bf16`` → 2 + 2 + 4 = 8.
    * ``"zero-paper"`` — the ZeRO paper's mixed-precision Adam: fp16 params 2 + fp16 grads 2 +
      fp32 master 4 + fp32 m 4 + fp32 v 4 = **16** (the transient copies are not counted because
      the fp16 parameters *are* the working copy).
    * ``"accelerate"`` — ``accelerate estimate-memory``: 4 x the dtype size (16 fp32, 8 half).

    Optimizer states: AdamW 8 (two fp32 moments; 4 in pure bf16), 8-bit AdamW ≈ 2, SGD with
    momentum 4 (2 in bf16), plain SGD 0.
    """
    _choice("precision", precision, PRECISIONS)
    _choice("optimizer", optimizer, OPTIMIZERS)
    _choice("convention", convention, ("torch-amp", "zero-paper", "accelerate"))
    if convention == "accelerate":
        return 16.0 if precision == "fp32" else 8.0
    p = 2 if precision == "bf16" else 4
    states = {"adamw": 2 * p, "adamw8bit": 2.0 + 8 / 256, "sgd": 0, "sgd-momentum": p}[
        optimizer
    ]
    if convention == "zero-paper":
        if precision in ("fp16-amp", "bf16-amp"):
            return (
                2
                + 2
                + 4
                + {"adamw": 8, "adamw8bit": 2 + 8 / 256, "sgd": 0, "sgd-momentum": 4}[
                    optimizer
                ]
            )
        return p + p + states
    copy = 2 if precision in ("fp16-amp", "bf16-amp") else 0
    return p + copy + p + states


def accelerate_rule_bytes(n_params: int, precision: str) -> int:
    """``accelerate estimate-memory``'s training figure: 16 B/param (fp32) or 8 B/param (half /
    mixed precision), Adam, no activations. Implemented here for comparison (bytes)."""
    return int(n_params * bytes_per_param(precision, "adamw", convention="accelerate"))


# --------------------------------------------------------------------------------------------
# the estimate
# --------------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    """Peak memory of one training step (all sizes in bytes, per GPU)."""

    total_bytes: int
    breakdown: dict[str, int]
    activation_bytes: int
    n_params: int
    n_trainable: int
    peak_phase: str
    phase_peaks: dict[str, int]
    exact: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    #: weights + gradients + optimizer states + master weights held per GPU when the optimizer
    #: step starts (bytes; not in ``to_dict``). Unlike ``breakdown`` (taken at the peak, which may
    #: fall in backward before every gradient exists) this is the resident model state that
    #: :func:`trainmem.zero.per_gpu_memory` counts.
    model_state_bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": int(self.total_bytes),
            "breakdown": {k: int(self.breakdown[k]) for k in CATEGORIES},
            "activation_bytes": int(self.activation_bytes),
            "n_params": int(self.n_params),
            "n_trainable": int(self.n_trainable),
            "peak_phase": self.peak_phase,
            "phase_peaks": {k: int(v) for k, v in self.phase_peaks.items()},
            "exact": self.exact,
            "options": self.options,
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    def table(self) -> str:
        title = f"estimated peak (peak in {self.peak_phase})"
        extra = {"activations at end of forward": self.activation_bytes}
        return format_table(
            title,
            self.breakdown,
            self.total_bytes,
            extra,
            params=(self.n_params, self.n_trainable),
        )


def format_table(
    title: str,
    rows: dict[str, int],
    total: int,
    extra: dict[str, int] | None = None,
    params: tuple[int, int] | None = None,
) -> str:
    """A plain-text table of byte counts in GiB (2**30) and GB (10**9)."""
    lines = [title, f"{'term':<32}{'GiB':>12}{'GB':>12}{'bytes':>18}"]
    for k in CATEGORIES:
        v = int(rows.get(k, 0))
        lines.append(f"{k:<32}{v / GiB:>12.3f}{v / GB:>12.3f}{v:>18,}")
    lines.append(
        f"{'total (peak)':<32}{total / GiB:>12.3f}{total / GB:>12.3f}{int(total):>18,}"
    )
    for k, v in (extra or {}).items():
        lines.append(f"{k:<32}{v / GiB:>12.3f}{v / GB:>12.3f}{int(v):>18,}")
    if params:
        lines.append(f"parameters: {params[0]:,} total, {params[1]:,} trainable")
    return "\n".join(lines)


def _gpt2_estimate(
    s: Shape,
    *,
    method,
    precision,
    optimizer,
    batch,
    seq,
    lora_rank,
    lora_targets,
    lora_dtype,
    checkpointing,
    attn,
    zero,
    gpus,
    grad_accum,
) -> dict:
    """Closed-form estimate (not replayed): model states exact, activations after Korthikanti et
    al. 2022 (34·s·b·h + 5·a·s²·b bytes per layer in 16-bit, the s² term only for eager)."""
    n = count_params(s)
    p = 2 if precision == "bf16" else 4
    amp = precision in ("fp16-amp", "bf16-amp")
    if method == "full":
        nt = n
    else:
        nt = lora_trainable_params(s, lora_rank, lora_targets)
    ldt = 4 if (lora_dtype in (None, "fp32")) else 2
    tp = p if method == "full" else ldt
    weights = n * p if method != "qlora" else int(n * 0.55)
    master = nt * 4 if amp and method == "full" else 0
    if amp and method == "full":
        weights = 2 * n  # low-precision working copies
    grads = nt * tp
    states = int(
        nt
        * {"adamw": 2 * tp, "adamw8bit": 2 + 8 / 256, "sgd": 0, "sgd-momentum": tp}[
            optimizer
        ]
    )
    if amp and zero >= 1:  # ZeRO/DeepSpeed layout: 16-bit module, fp32 master + states
        weights = 2 * n if method != "qlora" else int(n * 0.55)
        grads, master = 2 * nt, 4 * nt
        states = int(
            nt
            * {"adamw": 8, "adamw8bit": 2 + 8 / 256, "sgd": 0, "sgd-momentum": 4}[
                optimizer
            ]
        )
    act_scale = 1.0 if precision != "fp32" else 2.0
    b, sq, h, a = batch, seq, s.hidden, s.heads
    per_layer = 34 * sq * b * h + (5 * a * sq * sq * b if attn == "eager" else 0)
    per_layer = int(per_layer * act_scale / 2) * 2
    if checkpointing:
        acts = s.layers * sq * b * h * 2 * act_scale + per_layer
    else:
        acts = s.layers * per_layer
    acts += b * sq * s.vocab * 4 * 2
    temps = b * sq * s.vocab * 4
    if zero >= 1:
        states //= gpus
        master //= gpus
    if zero >= 2:
        grads //= gpus
    if zero >= 3:
        weights //= gpus
    bd = {
        "weights": int(weights),
        "gradients": int(grads),
        "optimizer_states": int(states),
        "master_weights": int(master),
        "activations": int(acts),
        "temporaries": int(temps),
    }
    return {
        "peak": sum(bd.values()),
        "breakdown": bd,
        "activations": int(acts),
        "model_states": int(weights + grads + states + master),
        "phase_peaks": {"backward": sum(bd.values())},
        "n_params": n,
        "n_trainable": nt,
    }


def estimate(
    model: Any = "llama-7b",
    method: str = "full",
    precision: str = "bf16-amp",
    optimizer: str = "adamw",
    batch: int = 1,
    seq: int = 512,
    lora_rank: int = 8,
    lora_alpha: int = 16,
    lora_targets=("q_proj", "v_proj"),
    lora_dtype: str | None = None,
    qlora_double_quant: bool = True,
    checkpointing: bool = False,
    attn: str = "sdpa",
    zero: int = 0,
    gpus: int = 1,
    grad_accum: int = 1,
    optimizer_impl: str = "foreach",
) -> MemoryEstimate:
    """Estimate the peak memory (bytes, per GPU) of one training step; see the module docstring.

    Raises ``ValueError`` naming the argument and the allowed values for bad input.
    """
    s = model_shape(model)
    targets = _targets(lora_targets)
    check_options(
        s,
        method=method,
        precision=precision,
        optimizer=optimizer,
        batch=batch,
        seq=seq,
        lora_rank=lora_rank,
        lora_targets=targets,
        attn=attn,
        grad_accum=grad_accum,
        zero=zero,
        gpus=gpus,
        lora_dtype=lora_dtype,
        optimizer_impl=optimizer_impl,
    )
    if attn == "flash":
        attn = "sdpa"
    opts = dict(
        model=s.name,
        method=method,
        precision=precision,
        optimizer=optimizer,
        batch=batch,
        seq=seq,
        lora_rank=lora_rank,
        lora_alpha=lora_alpha,
        lora_targets=list(targets),
        lora_dtype=lora_dtype,
        qlora_double_quant=qlora_double_quant,
        checkpointing=checkpointing,
        attn=attn,
        zero=zero,
        gpus=gpus,
        grad_accum=grad_accum,
        optimizer_impl=optimizer_impl,
    )
    kw = dict(
        method=method,
        precision=precision,
        optimizer=optimizer,
        batch=batch,
        seq=seq,
        lora_rank=lora_rank,
        lora_targets=targets,
        lora_dtype=lora_dtype,
        checkpointing=checkpointing,
        attn=attn,
        grad_accum=grad_accum,
        zero=zero,
        gpus=gpus,
    )
    n = count_params(s)
    if s.arch == "gpt2":
        r = _gpt2_estimate(s, **kw)
        exact = False
        nt = r["n_trainable"]
    else:
        from .simulate import simulate_step

        r = simulate_step(
            s,
            qlora_double_quant=qlora_double_quant,
            optimizer_impl=optimizer_impl,
            **kw,
        )
        exact = True
        nt = n if method == "full" else lora_trainable_params(s, lora_rank, targets)
    phase_peaks = r["phase_peaks"]
    peak_phase = max(phase_peaks, key=lambda k: (phase_peaks[k], k))
    return MemoryEstimate(
        int(r["peak"]),
        {k: int(r["breakdown"][k]) for k in CATEGORIES},
        int(r["activations"]),
        n,
        nt,
        peak_phase,
        phase_peaks,
        exact,
        opts,
        int(r["model_states"]),
    )


def activation_bytes_per_layer(
    model: Any = "llama-7b",
    batch: int = 1,
    seq: int = 512,
    precision: str = "bf16-amp",
    attn: str = "sdpa",
    method: str = "full",
    lora_targets=("q_proj", "v_proj"),
    checkpointing: bool = False,
) -> int:
    """Bytes one (non-first) decoder layer holds for backward at the end of the forward pass.

    Computed by the replay as the difference between models with 3 and 2 layers, so it is exactly
    what autograd keeps for one more layer (e.g. fp32, SDPA, full fine-tuning:
    ``b·s·(24h + 8·q_dim + 8·kv_dim + 16·I + 8) + 4·b·heads·s`` bytes).
    """
    from .simulate import simulate_step

    s = model_shape(model)
    if s.arch != "llama":
        raise ValueError(
            "activation_bytes_per_layer models Llama-family configs (llama, mistral, qwen2)"
        )
    vals = []
    for L in (2, 3):
        sl = Shape(**{**s.__dict__, "layers": L})
        vals.append(
            simulate_step(
                sl,
                method=method,
                precision=precision,
                optimizer="sgd",
                batch=batch,
                seq=seq,
                lora_targets=_targets(lora_targets),
                checkpointing=checkpointing,
                attn=attn,
            )["activations"]
        )
    return vals[1] - vals[0]


# --------------------------------------------------------------------------------------------
# from what a Hugging Face Trainer user has
# --------------------------------------------------------------------------------------------
#: ``TrainingArguments.optim`` -> (optimizer, optimizer_impl). Trainer builds ``torch.optim.AdamW``
#: with ``fused=True`` for ``adamw_torch_fused`` (the default of transformers 5 with torch >= 2.8)
#: and with no implementation flag for ``adamw_torch``, which on CUDA is ``foreach``.
HF_OPTIMS = {
    "adamw_torch_fused": ("adamw", "fused"),
    "adamw_torch": ("adamw", "foreach"),
    "adamw_bnb_8bit": ("adamw8bit", "foreach"),
    "adamw_8bit": ("adamw8bit", "foreach"),
    "paged_adamw_8bit": ("adamw8bit", "foreach"),
    "sgd": ("sgd", "foreach"),
}
#: target_modules="all-linear": every Linear of the decoder blocks (peft leaves lm_head out)
ALL_LINEAR = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


_HF_NAMES = {
    "lora_rank": ("peft_config", "r"),
    "lora_targets": ("peft_config", "target_modules"),
    "batch": ("training_args", "per_device_train_batch_size"),
    "grad_accum": ("training_args", "gradient_accumulation_steps"),
}


def _field(obj, name: str, default=None):
    """``obj.name`` or ``obj[name]`` (objects and the dicts of their JSON files alike)."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _as_config(model: Any):
    """A config dict (``config.json`` contents) becomes an object :func:`model_shape` reads."""
    if isinstance(model, dict):
        from types import SimpleNamespace

        return SimpleNamespace(**{"name_or_path": "config", **model})
    return model


def hf_options(
    model: Any,
    training_args: Any = None,
    peft_config: Any = None,
    *,
    seq: int | None = None,
    quantization_config: Any = None,
) -> dict[str, Any]:
    """The :func:`estimate` keyword arguments a Hugging Face ``Trainer`` run corresponds to.

    ``training_args``: a ``transformers.TrainingArguments`` (or ``trl.SFTConfig``), or a dict of
    its fields (its JSON); ``None`` means Trainer's defaults. Read: ``optim`` (see
    :data:`HF_OPTIMS`), ``bf16``/``fp16`` (autocast over the fp32 weights: ``bf16-amp``/
    ``fp16-amp``; neither: ``fp32``), ``gradient_checkpointing`` or ``activation_checkpointing``
    (transformers 5's name; non-reentrant, its default), ``per_device_train_batch_size``, ``gradient_accumulation_steps`` and, for
    ``SFTConfig``, ``max_length`` (``max_seq_length`` in older trl). ``peft_config``: a
    ``peft.LoraConfig`` or its ``adapter_config.json`` dict (``r``, ``lora_alpha``,
    ``target_modules``; ``"all-linear"`` allowed), ``None`` for full fine-tuning. A 4-bit
    ``quantization_config`` (``BitsAndBytesConfig(load_in_4bit=True, ...)``, or the model config's
    own) makes it QLoRA. ``seq``: tokens per sequence, when the arguments do not fix a length.

    Raises ``ValueError`` naming the field and the allowed values.
    """
    optim = _field(training_args, "optim", "adamw_torch_fused")
    optim = str(getattr(optim, "value", optim))  # OptimizerNames -> its string
    if optim not in HF_OPTIMS:
        raise OptionError(
            "training_args",
            f"optim must be one of {', '.join(HF_OPTIMS)}, got {optim!r}",
        )
    optimizer, impl = HF_OPTIMS[optim]
    bf16, fp16 = (
        bool(_field(training_args, "bf16", False)),
        bool(_field(training_args, "fp16", False)),
    )
    if bf16 and fp16:
        raise OptionError(
            "training_args",
            "bf16 and fp16 cannot both be set in the training arguments",
        )
    precision = "bf16-amp" if bf16 else ("fp16-amp" if fp16 else "fp32")
    # transformers 5 renames gradient_checkpointing to activation_checkpointing (keeps both)
    ckpt = bool(
        _field(training_args, "activation_checkpointing", False)
        or _field(training_args, "gradient_checkpointing", False)
    )
    ck_kwargs = (
        _field(training_args, "activation_checkpointing_kwargs", None)
        or _field(training_args, "gradient_checkpointing_kwargs", None)
        or {}
    )
    if ckpt and ck_kwargs.get("use_reentrant", False):
        raise OptionError(
            "training_args",
            "gradient_checkpointing_kwargs: use_reentrant=True is not modelled; "
            "allowed: use_reentrant=False (the default of transformers 5)",
        )
    batch = _field(training_args, "per_device_train_batch_size", 8)
    accum = _field(training_args, "gradient_accumulation_steps", 1)
    length = seq
    if length is None:
        length = _field(training_args, "max_length", None) or _field(
            training_args, "max_seq_length", None
        )
    if length is None:
        raise OptionError(
            "seq",
            "seq must be given (tokens per sequence): the training arguments set no "
            "max_length",
        )
    opts: dict[str, Any] = dict(
        method="full",
        precision=precision,
        optimizer=optimizer,
        optimizer_impl=impl,
        batch=batch,
        seq=length,
        grad_accum=accum,
        checkpointing=ckpt,
    )
    attn = _field(model, "_attn_implementation", None) or _field(
        model, "attn_implementation", None
    )
    if attn in ATTN_IMPLS:
        opts["attn"] = attn
    elif attn in ("flash_attention_2", "flash_attention_3"):
        opts["attn"] = "flash"
    quant = (
        quantization_config
        if quantization_config is not None
        else _field(model, "quantization_config", None)
    )
    four_bit = bool(_field(quant, "load_in_4bit", False))
    if peft_config is not None:
        ptype = str(_field(peft_config, "peft_type", "LORA")).split(".")[-1].upper()
        if ptype != "LORA":
            raise OptionError(
                "peft_config", f"peft_config: peft_type must be LORA, got {ptype!r}"
            )
        if _field(peft_config, "use_dora", False):
            raise OptionError(
                "peft_config",
                "peft_config: use_dora=True is not modelled; allowed: use_dora=False",
            )
        targets = _field(peft_config, "target_modules", None)
        if targets is None:
            targets = ("q_proj", "v_proj")  # peft's default for Llama-family models
        elif isinstance(targets, str):
            targets = ALL_LINEAR if targets == "all-linear" else (targets,)
        opts.update(
            method="qlora" if four_bit else "lora",
            lora_rank=_field(peft_config, "r", 8),
            lora_alpha=_field(peft_config, "lora_alpha", 8),
            lora_targets=tuple(
                sorted(targets, key=lambda t: (ALL_LINEAR + (t,)).index(t))
            ),
        )
        if four_bit:
            opts["qlora_double_quant"] = bool(
                _field(quant, "bnb_4bit_use_double_quant", False)
            )
    elif four_bit:
        raise OptionError(
            "peft_config",
            "a 4-bit quantized model needs a peft_config (QLoRA): full fine-tuning "
            "of 4-bit weights is not possible",
        )
    return opts


def estimate_from_hf(
    model: Any,
    training_args: Any = None,
    peft_config: Any = None,
    *,
    seq: int | None = None,
    quantization_config: Any = None,
    **overrides: Any,
) -> MemoryEstimate:
    """:func:`estimate` from a model config, ``TrainingArguments`` and a ``LoraConfig``.

    ``model``: a preset name, a ``config.json`` path or dict, or a ``transformers`` config. The
    other arguments are those of :func:`hf_options`; ``overrides`` are passed to
    :func:`estimate` last (e.g. ``precision="bf16"`` for a model loaded in bf16, ``zero``,
    ``gpus``). Example::

        from transformers import AutoConfig, TrainingArguments
        from peft import LoraConfig
        est = estimate_from_hf(AutoConfig.from_pretrained(path),
                               TrainingArguments("out", bf16=True, gradient_checkpointing=True,
                                                 per_device_train_batch_size=4),
                               LoraConfig(r=16, target_modules="all-linear"), seq=1024)
    """
    model = _as_config(model)
    opts = hf_options(
        model,
        training_args,
        peft_config,
        seq=seq,
        quantization_config=quantization_config,
    )
    opts.update(overrides)
    try:
        est = estimate(model, **opts)
    except OptionError as e:  # name the Hugging Face field the bad value came from
        if e.option in _HF_NAMES and e.option not in overrides:
            source, field_name = _HF_NAMES[e.option]
            rest = str(e)[len(e.option) :] if str(e).startswith(e.option) else f": {e}"
            raise OptionError(source, f"{source} {field_name}{rest}") from None
        raise
    est.options["source"] = "hf"
    return est
