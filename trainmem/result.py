"""The estimate's result: :class:`MemoryEstimate` (bytes by category at the peak,
phase peaks, the device report, the options) and its plain-text table. Standard
library only."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .config import CATEGORIES
from .dtypes import GB, GiB


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
    #: weights + gradients + optimizer states + master weights held per GPU when the
    #: optimizer step starts (bytes; not in ``to_dict``). Unlike ``breakdown`` (taken at
    #: the peak, which may fall in backward before every gradient exists) this is the
    #: resident model state that :func:`trainmem.zero.per_gpu_memory` counts.
    model_state_bytes: int = 0
    #: with ``gpu``: trainmem.gpus.device_report's numbers (reserved_bytes,
    #: device_bytes, fits, headroom_bytes, ...) and the step's memory timeline
    device: dict[str, Any] | None = None
    #: with ``timeline=True``: bytes by category sampled over the step's allocation
    #: events (about 200 points: ``event``, ``phase``, ``reserved`` and the categories)
    timeline: list[dict[str, Any]] | None = None
    #: what attention runs (``kind``: sdpa, math or eager as far as memory goes;
    #: ``sdpa_backend``: the kernel torch selects, trainmem.sdpa; ``reason``)
    attention: dict[str, Any] | None = None

    @property
    def reserved_bytes(self) -> int | None:
        return None if self.device is None else self.device["reserved_bytes"]

    @property
    def device_bytes(self) -> int | None:
        return None if self.device is None else self.device["device_bytes"]

    @property
    def fits(self) -> bool | None:
        return None if self.device is None else self.device["fits"]

    def to_dict(self) -> dict[str, Any]:
        out = self._base_dict()
        if self.device is not None:
            out.update(self.device)
        if self.timeline is not None:
            out["timeline"] = self.timeline
        return out

    def _base_dict(self) -> dict[str, Any]:
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
            **({"attention": self.attention} if self.attention else {}),
        }

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **kw)

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GiB

    def table(self) -> str:
        title = f"estimated peak (peak in {self.peak_phase})"
        extra = {"activations at end of forward": self.activation_bytes}
        if self.device is not None:
            d = self.device
            extra["reserved (max_memory_reserved)"] = d["reserved_bytes"]
            extra["+ CUDA context"] = d["context_bytes"]
            if d["nccl_bytes"]:
                comms, channels = d["nccl_communicators"], d["nccl_channels"]
                extra[f"+ NCCL ({comms} comm x {channels} channels)"] = d["nccl_bytes"]
            extra["device (nvidia-smi, lower bound)"] = d["device_bytes"]
            extra[f"{d['gpu']} memory"] = d["capacity_bytes"]
        text = format_table(
            title,
            self.breakdown,
            self.total_bytes,
            extra,
            params=(self.n_params, self.n_trainable),
        )
        if self.device is not None:
            d = self.device
            verdict = "fits" if d["fits"] else "does NOT fit"
            text += (
                f"\n{d['gpu']}: {verdict}; headroom {d['headroom_bytes'] / GiB:.2f} GiB"
            )
            text += "".join(f"\nnote: {n['message']}" for n in d.get("notes", ()))
        if "recipe" in self.options:
            text += f"\nrecipe: {self.options['recipe']}"
        if self.attention and self.attention.get("sdpa_backend"):
            a = self.attention
            text += f"\nattention: SDPA runs {a['sdpa_backend']} ({a['reason']})"
        if "load_dtype_reason" in self.options:
            text += f"\nload dtype: {self.options['load_dtype_reason']}"
        return text


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
