"""LoRA, written out in full: a low-rank adapter around a frozen ``nn.Linear``.

    h = W0 x + (alpha / r) * B (A (dropout(x)))

Shapes (PyTorch convention, ``nn.Linear`` stores ``weight`` as ``(out_features,
in_features)``):

* ``W0``: ``(d, k)`` = ``(out_features, in_features)``, frozen;
* ``A`` : ``(r, k)``, Kaiming-uniform (default, as loralib/peft) or Gaussian ``N(0,
  1/r^2)``;
* ``B`` : ``(d, r)``, zeros, so ``ΔW = B A = 0`` at step 0 and the model starts
  unchanged;
* ``x`` : ``(..., k)`` → ``h``: ``(..., d)``.

The layer stores ``lora_A`` / ``lora_B`` as bias-free ``nn.Linear`` modules, the way
peft does, so the same seed draws the same random numbers in the same order and the two
implementations agree numerically (tests/test_lora.py). Parameter counts:
:func:`lora_param_count` (one matrix), :func:`lora_param_count_for_config` (a whole
Llama-shaped model, from its config only).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..estimate import lora_trainable_params
from ..families import lora_adapter_params

INITS = ("kaiming", "gaussian")


def lora_param_count(d_in: int, d_out: int, r: int) -> int:
    """Trainable parameters of one LoRA adapter on a ``d_out × d_in`` weight: ``r·(d_in
    + d_out)``."""
    for name, v in (("d_in", d_in), ("d_out", d_out), ("r", r)):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be an integer ≥ 1, got {v!r}")
    return lora_adapter_params(int(d_in), int(d_out), int(r))


def llama_linear_shapes(config) -> dict[str, tuple[int, int]]:
    """``{module_suffix: (in_features, out_features)}`` of one Llama decoder layer, from
    its config.

    ``k_proj``/``v_proj`` have ``num_key_value_heads · head_dim`` outputs (grouped-query
    attention). The shapes come from the library's one reading of a config,
    ``trainmem.estimate.model_shape(config).linear_shapes()`` (a GPT-2 config gives
    GPT-2's names).
    """
    from ..estimate import model_shape

    return model_shape(config).linear_shapes()


def lora_param_count_for_config(config, target_modules: Iterable[str], r: int) -> int:
    """Trainable LoRA parameters for a Llama-shaped ``config`` (formula only, nothing is
    built).

    Sum over layers and targets of ``r·(in + out)``. ``target_modules`` are module-name
    suffixes from :func:`llama_linear_shapes`; an unknown name raises ``ValueError``
    listing the allowed ones.
    """
    shapes = llama_linear_shapes(config)
    targets = list(target_modules)
    unknown = [t for t in targets if t not in shapes]
    if unknown or not targets:
        raise ValueError(
            f"target_modules must be a non-empty subset of {sorted(shapes)}, got "
            f"{targets!r}"
        )
    for name, v in (("r", r),):
        if int(v) != v or v < 1:
            raise ValueError(f"{name} must be an integer ≥ 1, got {v!r}")
    return lora_trainable_params(config, int(r), targets)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts (elements, not bytes); works on the meta
    device."""
    trainable = total = 0
    for p in model.parameters():
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total


class LoRALinear(nn.Module):
    """``h = base(x) + (alpha / r) · lora_B(lora_A(dropout(x)))`` with ``base`` frozen.

    Args:
        base: the ``nn.Linear`` to adapt; its weight (and bias) get
            ``requires_grad=False``.
        r: rank, ``1 ≤ r ≤ min(in_features, out_features)``.
        alpha: scaling numerator; the adapter output is multiplied by ``alpha / r``.
        dropout: dropout probability on the adapter input only (the base path never
            drops).
        init: ``"kaiming"`` (A ~ Kaiming-uniform, a=√5, as nn.Linear/peft) or
            ``"gaussian"`` (A ~ N(0, (1/r)²), peft's ``init_lora_weights="gaussian"``).
            B is always zeros.
    """

    def __init__(
        self,
        base: nn.Linear,
        r: int,
        alpha: float = 1.0,
        dropout: float = 0.0,
        init: str = "kaiming",
    ):
        super().__init__()
        if not isinstance(base, nn.Linear):
            raise TypeError(f"base must be an nn.Linear, got {type(base).__name__}")
        d_in, d_out = base.in_features, base.out_features
        if not isinstance(r, int) or not 1 <= r <= min(d_in, d_out):
            raise ValueError(
                f"r (lora rank) must be an integer ≥ 1 and ≤ min(d_in, d_out)="
                f"{min(d_in, d_out)}, got {r!r}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {init!r}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.r, self.alpha, self.scaling = r, alpha, alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        dev, dt = base.weight.device, base.weight.dtype
        # weight: (r, k)
        self.lora_A = nn.Linear(d_in, r, bias=False, device=dev, dtype=dt)
        # weight: (d, r)
        self.lora_B = nn.Linear(r, d_out, bias=False, device=dev, dtype=dt)
        self.reset_parameters(init)
        self.merged = False

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def reset_parameters(self, init: str = "kaiming") -> None:
        """A random (``init``), B zero → ΔW = 0: the adapted model starts as the base
        model."""
        if init == "kaiming":
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        else:
            nn.init.normal_(self.lora_A.weight, std=1 / self.r)
        nn.init.zeros_(self.lora_B.weight)

    def delta_weight(self) -> torch.Tensor:
        """``ΔW = (alpha / r) · B @ A``, shape ``(out_features, in_features)``."""
        return self.scaling * (self.lora_B.weight @ self.lora_A.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x)  # W0 x (+ bias): never materialises W0 + ΔW
        if self.merged:
            return h
        return h + self.scaling * self.lora_B(self.lora_A(self.dropout(x)))

    @torch.no_grad()
    def merge(self) -> None:
        """Fold ΔW into the base weight (``W0 ← W0 + ΔW``) for inference with zero
        overhead."""
        if self.merged:
            raise RuntimeError(
                "merge() called on an already merged LoRALinear (would add ΔW twice)"
            )
        self.base.weight += self.delta_weight().to(self.base.weight.dtype)
        self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        """Undo :meth:`merge` (``W0 ← W0 − ΔW``); exact up to floating-point
        rounding."""
        if not self.merged:
            raise RuntimeError("unmerge() called on a LoRALinear that is not merged")
        self.base.weight -= self.delta_weight().to(self.base.weight.dtype)
        self.merged = False

    def extra_repr(self) -> str:
        return (
            f"r={self.r}, alpha={self.alpha}, scaling={self.scaling:g}, "
            f"merged={self.merged}"
        )


def _linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def inject_lora(
    model: nn.Module,
    target_modules: Iterable[str],
    r: int,
    alpha: float = 1.0,
    dropout: float = 0.0,
    init: str = "kaiming",
) -> list[str]:
    """Replace every ``nn.Linear`` whose name ends with a target by a
    :class:`LoRALinear`, in place.

    All other parameters are frozen (only A and B train), as peft does; adapters
    injected by an earlier call stay trainable, so two calls can give different ranks to
    different modules. Modules are visited in ``model.named_modules()`` order, like
    peft, so the same seed gives the same A matrices. Returns the replaced module names.
    Raises ``ValueError`` when a target matches no linear module (listing the available
    suffixes) or when ``target_modules`` is empty.
    """
    targets = (
        [target_modules] if isinstance(target_modules, str) else list(target_modules)
    )
    if not targets:
        raise ValueError("target_modules must name at least one module suffix, got []")
    names = _linear_names(model)
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in names})
    missing = [
        t for t in targets if not any(n == t or n.endswith("." + t) for n in names)
    ]
    if missing:
        raise ValueError(
            f"target_modules {missing} match no nn.Linear in the model; "
            f"allowed suffixes: {suffixes}"
        )
    for pname, p in model.named_parameters():
        if (
            ".lora_A." not in pname and ".lora_B." not in pname
        ):  # keep earlier adapters trainable
            p.requires_grad_(False)
    replaced = []
    for name in names:
        if ".lora_A" in name or ".lora_B" in name:
            continue
        if any(name == t or name.endswith("." + t) for t in targets):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(
                parent,
                child,
                LoRALinear(getattr(parent, child), r, alpha, dropout, init),
            )
            replaced.append(name)
    return replaced


def lora_layers(model: nn.Module) -> list[LoRALinear]:
    """Every :class:`LoRALinear` in ``model``."""
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def merge_lora(model: nn.Module) -> int:
    """Merge every adapter into its base weight; returns how many were merged."""
    layers = lora_layers(model)
    for m in layers:
        m.merge()
    return len(layers)


def unmerge_lora(model: nn.Module) -> int:
    """Undo :func:`merge_lora`; returns how many were unmerged."""
    layers = lora_layers(model)
    for m in layers:
        m.unmerge()
    return len(layers)


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Only the adapter tensors (``…lora_A.weight``, ``…lora_B.weight``): what needs
    saving."""
    return {
        k: v
        for k, v in model.state_dict().items()
        if ".lora_A." in k or ".lora_B." in k
    }


def rank_sweep(delta: torch.Tensor, ranks: Iterable[int]) -> list[dict]:
    """How well a rank-``r`` LoRA *could* represent a weight change ``delta`` (``d ×
    k``).

    For each ``r`` the best rank-``r`` approximation is the truncated SVD
    (Eckart–Young), so ``rel_error = ‖ΔW − ΔW_r‖_F / ‖ΔW‖_F = sqrt(Σ_{i>r} σ_i² / Σ_i
    σ_i²)`` is the smallest error any ``B A`` of rank ``r`` reaches. Rows: ``{"r",
    "lora_params" (r·(d+k)), "full_params" (d·k), "rel_error", "energy" (1 −
    rel_error²)}``. ``r`` must be an integer in ``1..min(d, k)``.
    """
    if delta.ndim != 2:
        raise ValueError(f"delta must be a 2-D matrix, got shape {tuple(delta.shape)}")
    d, k = delta.shape
    s2 = torch.linalg.svdvals(delta.detach().double()) ** 2
    total = s2.sum().item()
    if total == 0:
        raise ValueError("delta is all zeros: its relative error is undefined")
    tail = s2.flip(0).cumsum(0).flip(0)  # tail[i] = Σ_{j ≥ i} σ_j²
    rows = []
    for r in ranks:
        if int(r) != r or not 1 <= r <= min(d, k):
            raise ValueError(
                f"rank must be an integer in 1..min(d, k)={min(d, k)}, got {r!r}"
            )
        r = int(r)
        rest = tail[r].item() if r < len(s2) else 0.0
        err = math.sqrt(max(rest, 0.0) / total)
        rows.append(
            {
                "r": r,
                "lora_params": lora_param_count(k, d, r),
                "full_params": d * k,
                "rel_error": err,
                "energy": 1 - err**2,
            }
        )
    return rows
