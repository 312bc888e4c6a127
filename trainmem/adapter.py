"""What a LoRA configuration costs, from a model's config alone: trainable parameters,
the size of the saved adapter file, and the training memory the estimator predicts.

* :func:`adapter_tensors` — the tensors peft's ``save_pretrained`` writes for a
  Llama-shaped model (names as peft saves them, shapes ``A: (r, d_in)``, ``B: (d_out,
  r)``);
* :func:`safetensors_bytes` — the exact size of a ``.safetensors`` file holding given
  tensors: 8 bytes (header length) + the JSON header (padded with spaces to a multiple
  of 8) + the data;
* :func:`lora_costs` — one row of the chapter-6 demo (parameters, file bytes, estimated
  peak).

Nothing is built or allocated: shapes come from :func:`trainmem.estimate.model_shape`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from .config import split_targets
from .dtypes import DTYPES as _DTYPES
from .dtypes import FLOAT_DTYPES
from .estimate import estimate, lora_trainable_params, model_shape

#: bytes per element and safetensors dtype tag of the adapter dtypes the demo offers
#: (from the one table, :data:`trainmem.dtypes.DTYPES`)
DTYPES: dict[str, tuple[int, str]] = {
    name: (int(_DTYPES[name].bytes), _DTYPES[name].safetensors) for name in FLOAT_DTYPES
}


def _targets(targets: Iterable[str] | str) -> list[str]:
    return list(split_targets(targets))


def _dtype(dtype: str) -> tuple[int, str]:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def adapter_tensors(
    model: Any, targets: Iterable[str] | str, rank: int
) -> dict[str, tuple[int, int]]:
    """``{name: shape}`` of the LoRA tensors peft saves for ``model`` (a preset name,
    config ``.json`` path or transformers config of a Llama-shaped model).

    Names follow ``PeftModel.save_pretrained``:
    ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` (shape ``(r,
    d_in)``) and ``...lora_B.weight`` (shape ``(d_out, r)``). Raises ``ValueError`` for
    a GPT-2 model, an unknown target or a rank outside ``1..min(d_in, d_out)``.
    """
    s = model_shape(model)
    paths = s.family.module_paths
    if paths is None:
        raise ValueError(
            f"adapter_tensors needs a Llama-shaped model (llama, qwen2, mistral), "
            f"got arch {s.arch!r}"
        )
    targets = _targets(targets)
    # validates targets and rank (one error line)
    lora_trainable_params(s, rank, targets)
    shapes = s.linear_shapes()
    out: dict[str, tuple[int, int]] = {}
    for i in range(s.layers):
        for t in targets:
            d_in, d_out = shapes[t]
            stem = "base_model.model." + paths[t].format(i=i)
            out[f"{stem}.lora_A.weight"] = (rank, d_in)
            out[f"{stem}.lora_B.weight"] = (d_out, rank)
    return out


def safetensors_header(
    tensors: dict[str, tuple[int, ...]],
    dtype: str = "fp32",
    metadata: dict[str, str] | None = None,
) -> bytes:
    """The JSON header a ``.safetensors`` file of ``tensors`` (all of ``dtype``) starts
    with, as the ``safetensors`` library writes it: ``__metadata__`` first, then the
    tensors in name order with their byte ``data_offsets``, no spaces, padded with
    spaces to a multiple of 8."""
    size, tag = _dtype(dtype)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in sorted(tensors):
        shape = [int(x) for x in tensors[name]]
        n = size
        for x in shape:
            n *= x
        header[name] = {
            "dtype": tag,
            "shape": shape,
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text + b" " * (-len(text) % 8)


def safetensors_bytes(
    tensors: dict[str, tuple[int, ...]],
    dtype: str = "fp32",
    metadata: dict[str, str] | None = None,
) -> int:
    """Size in bytes of a ``.safetensors`` file of ``tensors``: 8 + header + elements ×
    dtype size."""
    size, _ = _dtype(dtype)
    data = 0
    for shape in tensors.values():
        n = 1
        for x in shape:
            n *= int(x)
        data += n * size
    return 8 + len(safetensors_header(tensors, dtype, metadata)) + data


#: the metadata ``PeftModel.save_pretrained`` stores in ``adapter_model.safetensors``
PEFT_METADATA = {"format": "pt"}


def adapter_file_bytes(
    model: Any, targets: Iterable[str] | str, rank: int, dtype: str = "fp32"
) -> int:
    """Size of peft's ``adapter_model.safetensors`` for this LoRA configuration
    (bytes)."""
    return safetensors_bytes(
        adapter_tensors(model, targets, rank), dtype, PEFT_METADATA
    )


def lora_costs(
    model: Any,
    targets: Iterable[str] | str,
    rank: int,
    dtype: str = "fp32",
    precision: str = "bf16",
    batch: int = 1,
    seq: int = 512,
) -> dict[str, Any]:
    """One configuration's costs (counts and bytes, all exact):

    ``trainable`` (LoRA parameters), ``total`` (base parameters), ``adapter_bytes`` (the
    saved file), ``data_bytes`` (``trainable`` × dtype size, the file without its
    header), ``lora_peak_bytes`` / ``full_peak_bytes`` (estimated training peak per GPU,
    :func:`trainmem.estimate.estimate` with ``precision``, AdamW, ``batch`` × ``seq``).
    """
    targets = _targets(targets)
    size, _ = _dtype(dtype)
    s = model_shape(model)
    trainable = lora_trainable_params(s, rank, targets)
    kw = dict(precision=precision, optimizer="adamw", batch=batch, seq=seq)
    lora = estimate(
        model,
        method="lora",
        lora_rank=rank,
        lora_targets=targets,
        lora_dtype=dtype,
        **kw,
    )
    full = estimate(model, method="full", **kw)
    return {
        "trainable": trainable,
        "total": lora.n_params,
        "adapter_bytes": adapter_file_bytes(model, targets, rank, dtype),
        "data_bytes": trainable * size,
        "lora_peak_bytes": lora.total_bytes,
        "full_peak_bytes": full.total_bytes,
    }
