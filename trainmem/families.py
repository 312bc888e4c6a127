"""Model families and presets, declared once: what the estimator knows about a model.

* :data:`FAMILIES` — one :class:`Family` per decoder layout (``"llama"``: Llama,
  Mistral and Qwen2; ``"gpt2"``): its :class:`Shape` builder (from a config's fields),
  the Linear layers of one decoder layer (the LoRA targets), the parameter-count terms
  and how the step is estimated (``replay``: the op-by-op replay of
  :mod:`trainmem.memory`, or ``None`` for the closed form of
  :func:`trainmem.estimate.estimate_step`).
* :data:`MODEL_TYPES` — one :class:`ModelType` per ``config.json`` ``model_type``: its
  family, its ``transformers`` config class, and the defaults that class gives the
  fields the estimator reads (used where ``transformers`` is not installed: Pyodide).
* :data:`PRESETS` — published shapes by name (no downloads).
* :func:`load_model_config` — the one place a model is read; :func:`model_shape` — its
  :class:`Shape`.

Adding a Llama-like ``model_type`` is one :class:`ModelType` entry; a new layout is one
:class:`Family` entry (plus its replay module or closed form). Standard library only
(the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

from .errors import OptionError, lookup, read_json_object


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder-only transformer that decide its memory (counts, no
    units). Validated when built: every size is a positive integer."""

    arch: str  # a key of FAMILIES: "llama" (also Qwen2/Mistral-style) or "gpt2"
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

    def __post_init__(self):
        if self.arch not in FAMILIES:
            raise OptionError(
                "model",
                f"model: arch must be {' or '.join(FAMILIES)}, got {self.arch!r}",
            )
        for size in (
            "vocab",
            "hidden",
            "intermediate",
            "layers",
            "heads",
            "kv_heads",
            "head_dim",
        ):
            value = getattr(self, size)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise OptionError(
                    "model",
                    f"model {self.name!r}: {size} must be a positive integer, "
                    f"got {value!r}",
                )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def family(self) -> "Family":
        return FAMILIES[self.arch]

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(d_in, d_out) of each Linear of one decoder layer, by module name (the LoRA
        targets)."""
        return self.family.linear_shapes(self)

    def attention_linears(self) -> tuple[str, ...]:
        """The Linears of one decoder layer's attention block (q, k, v, o; Phi-3's
        qkv_proj and o_proj; GPT-2's c_attn and attn.c_proj), by module name."""
        return self.family.attention_linears(self)


# --------------------------------------------------------------------------------------
# the families
# --------------------------------------------------------------------------------------
def lora_adapter_params(d_in: int, d_out: int, rank: int) -> int:
    """Parameters of one LoRA adapter on a ``d_in → d_out`` Linear: A (r × d_in) and B
    (d_out × r), ``r·(d_in + d_out)`` — the one LoRA parameter formula."""
    return rank * (d_in + d_out)


@dataclass(frozen=True)
class Family:
    """One decoder layout: how its :class:`Shape` is read from a config, its Linear
    layers, its parameter count, and how a training step is estimated (``replay``: the
    name of the replayed decoder in :mod:`trainmem.memory`, ``None``: the closed form).
    ``required``: the size fields a ``config.json`` of it must have."""

    name: str
    shape: Callable[[Callable[[str, Any], Any], str, str], "Shape"]
    linear_shapes: Callable[["Shape"], dict[str, tuple[int, int]]]
    params_per_layer: Callable[["Shape"], int]
    other_params: Callable[["Shape"], int]  # embeddings, final norm, lm_head
    required: tuple[str, ...]
    replay: str | None = None
    #: where each Linear sits in the ``transformers`` model (``"model.layers.{i}.
    #: self_attn.q_proj"``): the names peft saves; ``None``: not modelled
    module_paths: dict[str, str] | None = None
    #: a recorded family (``replay="traced"``) whose steps outside its recorded
    #: variants (QLoRA, ZeRO, checkpointing) take the closed form (GPT-2)
    closed_form_otherwise: bool = False
    #: a recorded family's attention dropout field and attention implementation
    #: (:attr:`ModelType.attention_dropout`, :attr:`ModelType.attn`)
    attention_dropout: str | None = None
    attn: str | None = None

    def count_params(self, shape: "Shape") -> int:
        return self.other_params(shape) + shape.layers * self.params_per_layer(shape)

    def attention_linears(self, shape: "Shape") -> tuple[str, ...]:
        """The Linears whose module sits in the attention block: by
        :attr:`module_paths`, or for a recorded family by its parameters' names
        (:func:`attention_keys`)."""
        if self.module_paths is not None:
            return tuple(k for k, path in self.module_paths.items() if "attn" in path)
        return attention_keys(_traced_sizes(shape, "layer"))

    def layout(self, shape: "Shape", step) -> str | None:
        """The decoder the replay builds for ``step`` (``None``: the closed form): a
        recorded family replays the variants its data file holds."""
        if self.replay != "traced" or not self.closed_form_otherwise:
            return self.replay
        from .memory.traced import recorded

        return self.replay if recorded(shape, step) else None


@dataclass(frozen=True)
class ModelType:
    """One ``config.json`` ``model_type``: its family, its ``transformers`` config class
    and the defaults that class gives the fields the estimator reads (where
    ``transformers`` is missing, a config file is read with these)."""

    name: str
    family: str
    config_class: str
    plain_defaults: dict[str, Any] = field(default_factory=dict)
    qkv_bias: bool = False  # q/k/v projections always have a bias (Qwen2)
    #: a recorded family (:mod:`trainmem.memory.traced`): the config field of each
    #: symbol (``h``, ``i``, ``L``, ``a``, ``k``, ``d``, ``v``, ``p``, ``tied``); a
    #: symbol without a field is derived (``k = a``, ``d = h // a``)
    fields: dict[str, str] = field(default_factory=dict)
    #: size expressions of the symbols a config may leave unset (GPT-2: ``i = 4*h``)
    derived: dict[str, str] = field(default_factory=dict)
    #: config fields the probe models are built with besides the sizes
    probe_fields: dict[str, Any] = field(default_factory=dict)
    #: the LoRA targets its traces are recorded with (peft's usual choice for it)
    lora_default: tuple[str, ...] = ("q_proj", "v_proj")
    tied_default: bool = False  # where the config has no tie_word_embeddings field
    #: the shape regimes its traces are recorded in: (grouped-query attention, tied
    #: embeddings), those its published checkpoints use
    regimes: tuple[tuple[bool, bool], ...] = ((True, False),)
    #: the config field of an attention dropout the config class turns on by default
    #: (GPT-2's ``attn_pdrop``): its traces are recorded for CPU's and CUDA's SDPA
    attention_dropout: str | None = None
    #: the attention implementation of a family whose transformers module has no SDPA
    #: path (``None``: the step's; transformers 5's Gemma 2 refuses "sdpa")
    attn: str | None = None
    #: the ``layer_types`` entry every probe layer is built as, for a family whose
    #: layers alternate kinds that allocate the same tensors in another order (Gemma
    #: 2: sliding-window and full attention, the same b x heads x s x s scores and
    #: mask); the family's checks measure the alternating model
    probe_layer_type: str | None = None


def _llama_shape(get, name: str, model_type: str) -> "Shape":
    hidden = get("hidden_size", None)
    heads = get("num_attention_heads", None)
    attention_bias = bool(get("attention_bias", False))
    return Shape(
        "llama",
        get("vocab_size", None),
        hidden,
        get("intermediate_size", None),
        get("num_hidden_layers", None),
        heads,
        get("num_key_value_heads", None) or heads,
        get("head_dim", None) or hidden // heads,
        bool(get("tie_word_embeddings", False)),
        qkv_bias=attention_bias
        or (model_type in MODEL_TYPES and MODEL_TYPES[model_type].qkv_bias),
        o_bias=attention_bias,
        mlp_bias=bool(get("mlp_bias", False)),
        name=name,
    )


#: a Llama-family decoder layer's Linear modules, in torch's module order (peft's
#: ``target_modules="all-linear"`` for these families: lm_head is left out)
LLAMA_LINEARS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


def _llama_linears(s: "Shape") -> dict[str, tuple[int, int]]:
    hidden, inner, q, kv = s.hidden, s.intermediate, s.q_dim, s.kv_dim
    widths = [(hidden, q), (hidden, kv), (hidden, kv), (q, hidden)]
    widths += [(hidden, inner), (hidden, inner), (inner, hidden)]
    return dict(zip(LLAMA_LINEARS, widths))


def _llama_layer_params(s: "Shape") -> int:
    hidden, inner = s.hidden, s.intermediate
    attention = hidden * s.q_dim + 2 * hidden * s.kv_dim + s.q_dim * hidden
    if s.qkv_bias:
        attention += s.q_dim + 2 * s.kv_dim
    if s.o_bias:
        attention += hidden
    mlp = 3 * hidden * inner + ((2 * inner + hidden) if s.mlp_bias else 0)
    return attention + mlp + 2 * hidden


def _gpt2_shape(get, name: str, model_type: str) -> "Shape":
    hidden = get("n_embd", None)
    return Shape(
        "gpt2",
        get("vocab_size", None),
        hidden,
        get("n_inner", None) or 4 * hidden,
        get("n_layer", None),
        get("n_head", None),
        get("n_head", None),
        hidden // get("n_head", None),
        True,
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        positions=get("n_positions", 1024),
        name=name,
    )


def _gpt2_linears(s: "Shape") -> dict[str, tuple[int, int]]:
    hidden, inner = s.hidden, s.intermediate
    return {
        "c_attn": (hidden, 3 * hidden),
        "attn.c_proj": (hidden, hidden),
        "c_fc": (hidden, inner),
        "mlp.c_proj": (inner, hidden),
    }


def _gpt2_layer_params(s: "Shape") -> int:
    hidden, inner = s.hidden, s.intermediate
    return (
        (2 * hidden)
        + (hidden * 3 * hidden + 3 * hidden)
        + (hidden * hidden + hidden)
        + (2 * hidden)
        + (hidden * inner + inner)
        + (inner * hidden + hidden)
    )


def _traced_shape(get, name: str, model_type: str) -> "Shape":
    """The :class:`Shape` of a recorded family's config (its ``ModelType.fields``)."""
    mt = MODEL_TYPES[model_type]
    f = mt.fields
    values: dict[str, Any] = {}
    for symbol in ("v", "h", "i", "L", "a", "k", "d", "p"):
        values[symbol] = get(f[symbol], None) if symbol in f else None
    if values["k"] is None:
        values["k"] = values["a"]
    if values["d"] is None and isinstance(values["h"], int) and values["a"]:
        values["d"] = values["h"] // values["a"]
    for symbol, expr in mt.derived.items():
        if values[symbol] is None and isinstance(values["h"], int):
            from .memory.traced import evaluate

            values[symbol] = evaluate(expr, values)
    tied = bool(get(f["tied"], mt.tied_default)) if "tied" in f else mt.tied_default
    return Shape(
        model_type,
        values["v"],
        values["h"],
        values["i"],
        values["L"],
        values["a"],
        values["k"],
        values["d"],
        tied,
        positions=values["p"] or 0,
        name=name,
    )


def _structure(s: "Shape") -> dict:
    from .memory.traced import structure

    return structure(s.arch, dict(gqa=s.kv_heads < s.heads, tied=s.tied, b1=False))


def _traced_sizes(s: "Shape", part: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the parameters of ``part`` (``pre``/``layer``/``post``) of a
    recorded family's model at ``s`` (read from its full fine-tuning trace)."""
    from .memory.traced import evaluate, symbols

    sym = symbols(s)
    return [
        (name, tuple(evaluate(x, sym) for x in dims))
        for name, where, dims, _, _ in _structure(s)["params"]
        if where == part
    ]


def linear_keys(layer_params) -> list[tuple[str, tuple]]:
    """The 2-D weights among one decoder layer's ``(name, dims)``, each under the
    module name peft matches (the last component, or the last two where the last
    repeats: GPT-2's ``attn.c_proj``), in the layer's order."""
    paths = []
    for name, dims in layer_params:
        parts = name.split(".")
        if parts[-1] == "weight" and len(dims) == 2:
            n = parts.index("0")  # the layer index of layer 0's parameters
            paths.append((parts[n + 1 : -1], tuple(dims)))
    last = [p[-1] for p, _ in paths]
    return [
        (path[-1] if last.count(path[-1]) == 1 else ".".join(path[-2:]), dims)
        for path, dims in paths
    ]


def attention_keys(layer_params) -> tuple[str, ...]:
    """The keys of :func:`linear_keys` whose module sits in the layer's attention
    block: the parameter's name passes through an ``attn`` module (``self_attn``,
    GPT-2's ``attn``)."""
    weights = [
        name
        for name, dims in layer_params
        if name.split(".")[-1] == "weight" and len(dims) == 2
    ]
    return tuple(
        key
        for (key, _), name in zip(linear_keys(layer_params), weights)
        if "attn" in name
    )


def _traced_linears(s: "Shape") -> dict[str, tuple[int, int]]:
    """The 2-D weights of one decoder layer by the module name peft matches
    (:func:`linear_keys`), as (d_in, d_out)."""
    # nn.Linear's weight is (out, in); Conv1D's is (in, out)
    return {
        key: (cols, rows)
        for key, (rows, cols) in linear_keys(_traced_sizes(s, "layer"))
    }


def _count(sizes) -> int:
    total = 0
    for _, dims in sizes:
        n = 1
        for x in dims:
            n *= x
        total += n
    return total


def traced_family(name: str) -> Family:
    """The :class:`Family` of a recorded model type: everything read from its data
    file (:mod:`trainmem.memory.traced`). GPT-2 keeps its closed form for the steps
    not recorded (:mod:`trainmem.closed_form`)."""
    mt = MODEL_TYPES[name]
    return Family(
        name,
        _traced_shape,
        _traced_linears,
        lambda s: _count(_traced_sizes(s, "layer")),
        lambda s: _count(_traced_sizes(s, "pre")) + _count(_traced_sizes(s, "post")),
        tuple(mt.fields[x] for x in ("v", "h", "L", "a") if x in mt.fields)
        + ((mt.fields["i"],) if "i" in mt.fields and "i" not in mt.derived else ()),
        replay="traced",
        closed_form_otherwise=name == "gpt2",
        attention_dropout=mt.attention_dropout,
        attn=mt.attn,
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama",
            _llama_shape,
            _llama_linears,
            _llama_layer_params,
            lambda s: s.vocab * s.hidden * (1 if s.tied else 2) + s.hidden,
            (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
            ),
            replay="llama",
            module_paths={
                name: f"model.layers.{{i}}.{parent}.{name}"
                for name, parent in (
                    ("q_proj", "self_attn"),
                    ("k_proj", "self_attn"),
                    ("v_proj", "self_attn"),
                    ("o_proj", "self_attn"),
                    ("gate_proj", "mlp"),
                    ("up_proj", "mlp"),
                    ("down_proj", "mlp"),
                )
            },
        ),
    )
}

#: the config fields of the symbols in Llama-style configs
_LLAMA_FIELDS = dict(
    v="vocab_size",
    h="hidden_size",
    i="intermediate_size",
    L="num_hidden_layers",
    a="num_attention_heads",
    k="num_key_value_heads",
    d="head_dim",
    tied="tie_word_embeddings",
)

MODEL_TYPES: dict[str, ModelType] = {
    m.name: m
    for m in (
        ModelType(
            "llama",
            "llama",
            "LlamaConfig",
            dict(
                num_key_value_heads=None,
                head_dim=None,
                tie_word_embeddings=False,
                attention_bias=False,
                mlp_bias=False,
            ),
        ),
        ModelType(
            "mistral",
            "llama",
            "MistralConfig",
            dict(num_key_value_heads=8, head_dim=None, tie_word_embeddings=False),
        ),
        ModelType(
            "qwen2",
            "llama",
            "Qwen2Config",
            dict(num_key_value_heads=32, tie_word_embeddings=False),
            qkv_bias=True,
        ),
        ModelType(
            "gpt2",
            "gpt2",
            "GPT2Config",
            dict(n_inner=None, n_positions=1024, tie_word_embeddings=True),
            fields=dict(
                v="vocab_size",
                h="n_embd",
                i="n_inner",
                L="n_layer",
                a="n_head",
                p="n_positions",
            ),
            derived=dict(i="4*h"),
            lora_default=("c_attn",),
            tied_default=True,
            regimes=((False, True),),
            attention_dropout="attn_pdrop",
        ),
        ModelType(
            "qwen3",
            "qwen3",
            "Qwen3Config",
            dict(num_key_value_heads=32, head_dim=128, tie_word_embeddings=False),
            fields=_LLAMA_FIELDS,
            regimes=((True, True), (True, False)),
        ),
        ModelType(
            "gemma3_text",
            "gemma3_text",
            "Gemma3TextConfig",
            dict(num_key_value_heads=4, head_dim=256, tie_word_embeddings=True),
            fields=_LLAMA_FIELDS,
            regimes=((True, True),),
        ),
        ModelType(
            "gemma2",
            "gemma2",
            "Gemma2Config",
            dict(num_key_value_heads=4, head_dim=256, tie_word_embeddings=True),
            fields=_LLAMA_FIELDS,
            regimes=((True, True),),
            attn="eager",
            probe_layer_type="full_attention",
        ),
        ModelType(
            "phi3",
            "phi3",
            "Phi3Config",
            dict(num_key_value_heads=None, tie_word_embeddings=False),
            fields={k: v for k, v in _LLAMA_FIELDS.items() if k != "d"},
            # the probes' vocabularies are smaller than Phi-3's pad token id
            probe_fields=dict(pad_token_id=None),
            lora_default=("qkv_proj",),
            regimes=((False, False), (True, False)),
        ),
        ModelType(
            "olmo2",
            "olmo2",
            "Olmo2Config",
            dict(num_key_value_heads=None, tie_word_embeddings=False),
            fields={k: v for k, v in _LLAMA_FIELDS.items() if k != "d"},
            probe_fields=dict(pad_token_id=None),
            regimes=((False, False),),
        ),
    )
}

# every recorded model type is a family of its own, read from its data file
FAMILIES.update(
    {m.name: traced_family(m.name) for m in MODEL_TYPES.values() if m.fields}
)


def model_type(name: Any) -> ModelType:
    """The :class:`ModelType` of a ``model_type`` string (unknown: :class:`OptionError`
    for ``model``)."""
    return lookup(MODEL_TYPES, "model_type", name)


# --------------------------------------------------------------------------------------
# presets
# --------------------------------------------------------------------------------------
# Published shapes (config.json of each model). Only fields that change memory are
# listed.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-7b": dict(
        arch="llama",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    ),
    "llama2-7b": dict(
        arch="llama",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "llama2-13b": dict(
        arch="llama",
        vocab_size=32000,
        hidden_size=5120,
        intermediate_size=13824,
        num_hidden_layers=40,
        num_attention_heads=40,
        num_key_value_heads=40,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "llama2-70b": dict(
        arch="llama",
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    ),
    "qwen2.5-0.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    # Mistral-7B-v0.3: GQA with 8 key/value heads, no sliding window
    "mistral-7b": dict(
        arch="mistral",
        vocab_size=32768,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768,
        sliding_window=None,
        tie_word_embeddings=False,
    ),
    # Qwen2-7B and Qwen2-1.5B: GQA (4 and 2 key/value heads), q/k/v biases
    "qwen2-7b": dict(
        arch="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    "qwen2-1.5b": dict(
        arch="qwen2",
        vocab_size=151936,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
    "gpt2": dict(
        arch="gpt2",
        vocab_size=50257,
        n_embd=768,
        n_layer=12,
        n_head=12,
        n_positions=1024,
    ),
    # A 2-layer, 64-wide Llama for tests and CPU demos.
    "tiny": dict(
        arch="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
}


def preset_names() -> list[str]:
    return sorted(PRESETS)


class PlainConfig(SimpleNamespace):
    """The fields of a config.json as attributes (a stand-in for a transformers
    config)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def plain_config(fields: dict[str, Any], name: str) -> PlainConfig:
    """A config's ``fields`` (with ``model_type``) completed with the defaults of its
    ``transformers`` class, as a :class:`PlainConfig`."""
    mt = model_type(fields["model_type"])
    cfg = PlainConfig(**{**mt.plain_defaults, **fields})
    cfg.name_or_path = name
    return cfg


def _preset_fields(name: str) -> dict[str, Any]:
    """The fields of preset ``name`` with its ``model_type`` (:data:`PRESETS` calls it
    ``arch``)."""
    if name not in PRESETS:
        raise OptionError(
            "model",
            f"model must be one of {', '.join(preset_names())} or a config "
            f".json file, got {name!r}",
        )
    fields = dict(PRESETS[name])
    fields["model_type"] = fields.pop("arch")
    return fields


def transformers_config(fields: dict[str, Any], name: str):
    """A ``transformers`` config of ``fields`` (with ``model_type``)."""
    import transformers

    fields = dict(fields)
    cls = getattr(transformers, model_type(fields.pop("model_type")).config_class)
    cfg = cls(**fields)
    cfg.name_or_path = name
    return cfg


def get_config(name: str, **overrides: Any):
    """A ``transformers`` config for preset ``name`` (see :data:`PRESETS`), with
    ``overrides``.

    Raises :class:`OptionError` naming the allowed presets for an unknown name.
    """
    return transformers_config({**_preset_fields(name), **overrides}, name)


def load_config_file(path: str):
    """A ``transformers`` config built from an HF-style ``config.json`` file (no
    download); without ``transformers`` (the book's in-page calculator) a
    :class:`PlainConfig`.

    Supported ``model_type`` values: :data:`MODEL_TYPES`. Raises :class:`OptionError`
    with one line naming the file and what is wrong (missing, not JSON, not an object,
    unknown model_type, missing size fields).
    """

    def bad(message: str) -> OptionError:
        return OptionError("model", message)

    data = read_json_object(
        path,
        "model",
        "model config file",
        f"; model must be a preset ({', '.join(preset_names())}) or a config .json "
        "file",
    )
    mt = data.get("model_type")
    if mt not in MODEL_TYPES:
        raise bad(
            f"model config file {path!r}: model_type must be one of "
            f"{', '.join(sorted(MODEL_TYPES))}, got {mt!r}"
        )
    for k in FAMILIES[MODEL_TYPES[mt].family].required:
        v = data.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise bad(
                f"model config file {path!r}: {k} must be a positive integer, got {v!r}"
            )
    fields = {
        k: v
        for k, v in data.items()
        if k not in ("architectures", "transformers_version")
    }
    name = os.path.basename(path)
    try:
        import transformers  # noqa: F401
    except ImportError:  # the book's in-page calculator: the estimator's fields
        return plain_config(fields, name)
    try:
        return transformers_config(fields, name)
    except Exception as e:  # transformers validation
        raise bad(
            f"model config file {path!r} is not a valid {mt} config: {e}"
        ) from None


def load_model_config(model: Any):
    """``model`` as a config object with the fields of a ``transformers`` config: a
    preset name (:data:`PRESETS`), a path to a ``config.json``
    (:func:`load_config_file`, which reads it with
    :func:`~trainmem.errors.read_json_object`), a dict of a ``config.json``'s fields,
    or a config (returned as it is). Anything else raises
    :class:`OptionError` for ``model``."""
    if isinstance(model, str):
        if model.endswith(".json") or os.path.sep in model:
            return load_config_file(model)
        return get_config(model)
    if isinstance(model, dict):
        return SimpleNamespace(**{"name_or_path": "config", **model})
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
        f"model must be a preset name ({', '.join(preset_names())}), a config "
        f".json path or a transformers config, got {type(model).__name__}",
    )


def shape_of_config(config) -> Shape:
    """The :class:`Shape` of a config object (a ``model_type`` missing or unknown is
    read as Llama-like, as before)."""
    name = getattr(config, "name_or_path", "") or "config"
    mt = getattr(config, "model_type", "") or "llama"
    family = FAMILIES[MODEL_TYPES[mt].family if mt in MODEL_TYPES else "llama"]
    return family.shape(lambda k, d: getattr(config, k, d), name, mt)


def model_shape(model: Any) -> Shape:
    """The :class:`Shape` of a preset name, config .json path, config dict or
    ``transformers`` config (a :class:`Shape` is returned as it is)."""
    if isinstance(model, Shape):
        return model
    if isinstance(model, str) and model in PRESETS:
        return shape_of_config(plain_config(_preset_fields(model), model))
    return shape_of_config(load_model_config(model))
