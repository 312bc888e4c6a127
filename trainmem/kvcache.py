"""Inference memory: weights + KV cache, for MHA and GQA models (Llama-style configs).

KV cache bytes = 2 (K and V) × layers × kv_heads × head_dim × context × batch ×
bytes/element. GQA shares each K/V head among ``num_attention_heads /
num_key_value_heads`` query heads, so the cache shrinks by that factor. All results are
``int``/``float`` bytes; configs are the ``transformers`` configs of
:mod:`trainmem.measuring.models` (fields ``hidden_size``, ``num_hidden_layers``,
``num_attention_heads``, ``num_key_value_heads``, ``intermediate_size``, ``vocab_size``,
``tie_word_embeddings``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .estimate import count_params

__all__ = ["param_count", "kv_cache_bytes", "InferenceMemory", "inference_memory"]


def _kv_heads(cfg) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def param_count(cfg) -> int:
    """Parameters of the decoder described by ``cfg`` (a ``transformers`` config or
    preset name).

    The library's one config-based count, :func:`trainmem.estimate.count_params`
    (Qwen2's q/k/v biases, tied embeddings and GPT-2 included), under the name this
    module has always used.
    """
    return count_params(cfg)


def kv_cache_bytes(cfg, batch: int, context: int, bytes_per_element: float = 2) -> int:
    """Bytes of the K and V cache for ``batch`` sequences of ``context`` tokens."""
    if batch < 1 or context < 1:
        raise ValueError(
            f"batch and context must be ≥ 1, got batch={batch}, context={context}"
        )
    return int(
        2
        * cfg.num_hidden_layers
        * _kv_heads(cfg)
        * _head_dim(cfg)
        * context
        * batch
        * bytes_per_element
    )


@dataclass(frozen=True)
class InferenceMemory:
    """Bytes of weights and KV cache; ``ratio`` = total / weights (the "1.2× weights"
    check)."""

    weights: float
    kv_cache: float

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache

    @property
    def ratio(self) -> float:
        return self.total / self.weights


def inference_memory(
    cfg,
    batch: int = 1,
    context: int = 2048,
    weight_bytes: float = 2,
    kv_bytes: float = 2,
) -> InferenceMemory:
    """Weights at ``weight_bytes`` per parameter (2 = bf16, ≈0.52 = NF4) + KV cache at
    ``kv_bytes``.

    Activations of a forward pass at inference are transient and small next to these for
    decoding (one token at a time); they are not included.
    """
    return InferenceMemory(
        param_count(cfg) * weight_bytes, kv_cache_bytes(cfg, batch, context, kv_bytes)
    )
