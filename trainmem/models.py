"""Model configs and builders: named presets (no downloads) and tiny models for CPU
runs.

Every preset is a plain ``transformers`` config with the published shape of that model,
so a model can be built with random weights (``build_model``), on the meta device (no
memory at all), or measured under fake tensors. Numbers that matter (hidden size,
layers, vocab) are those of the public config files of each model.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported lazily: the estimator needs no torch
    import torch

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


def get_config(name: str, **overrides: Any):
    """A ``transformers`` config for preset ``name`` (see :data:`PRESETS`), with
    ``overrides``.

    Raises ``ValueError`` naming the allowed presets for an unknown name.
    """
    if name not in PRESETS:
        from .estimate import OptionError

        raise OptionError(
            "model",
            f"model must be one of {', '.join(preset_names())} or a config "
            f".json file, got {name!r}",
        )
    fields = dict(PRESETS[name])
    fields.update(overrides)
    arch = fields.pop("arch")
    if arch == "llama":
        from transformers import LlamaConfig as C
    elif arch == "qwen2":
        from transformers import Qwen2Config as C
    elif arch == "mistral":
        from transformers import MistralConfig as C
    elif arch == "gpt2":
        from transformers import GPT2Config as C
    else:  # pragma: no cover
        raise ValueError(f"unknown arch {arch!r}")
    cfg = C(**fields)
    cfg.name_or_path = name
    return cfg


def tiny_llama_config(**overrides: Any):
    """The 2-layer, 64-wide Llama used by tests and CPU demos."""
    return get_config("tiny", **overrides)


def build_model(
    config,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    attn_implementation: str | None = None,
):
    """A causal LM from ``config`` with random weights (seeded), on ``device``
    (``"meta"`` allowed)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    if dtype is not None:
        model = model.to(dtype)
    return model


_ARCHS = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "gpt2": "gpt2"}

# Where transformers is not installed (Pyodide in the book's calculator) a config file
# becomes a PlainConfig: its own fields plus the defaults that the transformers config
# class of its model_type gives the fields the estimator reads (tests/test_calculator.py
# compares the two).
_PLAIN_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(
        num_key_value_heads=None,
        head_dim=None,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    ),
    "mistral": dict(num_key_value_heads=8, head_dim=None, tie_word_embeddings=False),
    "qwen2": dict(num_key_value_heads=32, tie_word_embeddings=False),
    "gpt2": dict(n_inner=None, n_positions=1024, tie_word_embeddings=True),
}


class PlainConfig(SimpleNamespace):
    """The fields of a config.json as attributes (a stand-in for a transformers
    config)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def load_config_file(path: str):
    """A ``transformers`` config built from an HF-style ``config.json`` file (no
    download).

    Supported ``model_type`` values: llama, mistral, qwen2, gpt2. Raises ``ValueError``
    with one line naming the file and what is wrong (missing, not JSON, not an object,
    unknown model_type, missing size fields).
    """
    from .config import OptionError, read_json_object

    def bad(message: str) -> OptionError:
        return OptionError("model", message)

    import os

    data = read_json_object(
        path,
        "model",
        "model config file",
        f"; model must be a preset ({', '.join(preset_names())}) or a config .json "
        "file",
    )
    mt = data.get("model_type")
    if mt not in _ARCHS:
        raise bad(
            f"model config file {path!r}: model_type must be one of "
            f"{', '.join(sorted(_ARCHS))}, got {mt!r}"
        )
    need = (
        ("vocab_size", "n_embd", "n_layer", "n_head")
        if mt == "gpt2"
        else (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        )
    )
    for k in need:
        v = data.get(k)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise bad(
                f"model config file {path!r}: {k} must be a positive integer, got {v!r}"
            )
    fields = {
        k: v
        for k, v in data.items()
        if k not in ("model_type", "architectures", "transformers_version")
    }
    try:
        if mt == "mistral":
            from transformers import MistralConfig as C
        elif mt == "qwen2":
            from transformers import Qwen2Config as C
        elif mt == "gpt2":
            from transformers import GPT2Config as C
        else:
            from transformers import LlamaConfig as C
    except (
        ImportError
    ):  # no transformers (the book's in-page calculator): the estimator's fields
        cfg = PlainConfig(**{**_PLAIN_DEFAULTS[mt], **fields, "model_type": mt})
        cfg.name_or_path = os.path.basename(path)
        return cfg
    try:
        cfg = C(**fields)
    except Exception as e:  # transformers validation
        raise bad(
            f"model config file {path!r} is not a valid {mt} config: {e}"
        ) from None
    cfg.name_or_path = os.path.basename(path)
    return cfg
