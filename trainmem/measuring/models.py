"""Model configs and builders: named presets (no downloads) and tiny models for CPU
runs.

Every preset (:data:`trainmem.families.PRESETS`, re-exported here) is a plain
``transformers`` config with the published shape of that model, so a model can be built
with random weights (``build_model``), on the meta device (no memory at all), or
measured under fake tensors. The families, model types and presets are declared in
:mod:`trainmem.families` (standard library only); this module adds what needs
``transformers``/``torch``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..families import PRESETS as PRESETS
from ..families import PlainConfig as PlainConfig
from ..families import get_config as get_config
from ..families import load_config_file as load_config_file
from ..families import preset_names as preset_names

if TYPE_CHECKING:  # torch is imported lazily: the estimator needs no torch
    import torch


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
