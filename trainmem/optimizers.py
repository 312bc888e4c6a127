"""The optimizers the estimator and the measurement know: one entry each, declared once.

An :class:`Optimizer` entry says everything the rest of the package needs:

* ``states(shape, dtype)`` — the state tensors the optimizer keeps for one parameter of
  that shape (``dtype``: the dtype its states take, the parameter's own unless the ZeRO
  layout makes them fp32), as :class:`State` (shape, dtype). Shape-dependent states
  (Adafactor's factored second moment) fit as well as per-element ones.
* ``nominal_bytes(itemsize)`` — state bytes per parameter of a large tensor for the
  closed forms (:func:`trainmem.estimate.bytes_per_param`, the GPT-2 estimate);
  ``None`` when no such number exists (Adafactor).
* ``impls`` — torch's implementations it has (``foreach``, ``fused``, ``for-loop``),
  each with its :class:`Impl`: the keyword arguments that select it and the scratch
  rule of ``step()`` (a name of
  :data:`trainmem.memory.optimizer_step.SCRATCH_RULES`, ``None`` for none);
  ``default_impl`` is the one an unspecified ``optimizer_impl`` means.
* ``torch`` — where its torch class lives (``"torch.optim:AdamW"``) and the keyword
  arguments it is built with (:func:`trainmem.measuring.training_setup.make_optimizer`);
  ``None`` with ``unmeasurable`` saying why ``measure`` cannot run it.
* ``hf_optims`` — the ``TrainingArguments.optim`` names that run it, each with its
  implementation (:func:`trainmem.from_hf.hf_options`).

Adding an optimizer is one entry in :data:`OPTIMIZERS` (and a scratch rule in
:mod:`trainmem.memory.optimizer_step` when its ``step()`` allocates a new pattern).
Standard library only (the book's in-page calculator runs it in Pyodide).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .dtypes import BLOCKWISE8_BLOCK, blockwise8_bytes_per_value
from .errors import OptionError, lookup

IMPLS = ("foreach", "fused", "for-loop")


@dataclass(frozen=True)
class State:
    """One state tensor of one parameter: its shape and dtype (a key of
    :data:`trainmem.dtypes.DTYPES`)."""

    shape: tuple[int, ...]
    dtype: str
    #: in CUDA managed memory (``cudaMallocManaged``), outside torch's caching
    #: allocator: not in ``max_memory_allocated``
    paged: bool = False


@dataclass(frozen=True)
class Impl:
    """One torch implementation of an optimizer: the constructor's keyword arguments
    that select it, and the scratch rule of its ``step()`` (``None``: in place)."""

    flags: Mapping[str, object] | None  # None: torch cannot run it here
    scratch: str | None


@dataclass(frozen=True)
class Optimizer:
    name: str
    summary: str  # what the CLI's help says
    states: Callable[[tuple[int, ...], str], tuple[State, ...]]
    nominal_bytes: Callable[[float], float] | None
    impls: Mapping[str, Impl]
    default_impl: str
    torch: tuple[str, Mapping[str, object]] | None = None
    unmeasurable: str = ""
    hf_optims: Mapping[str, str] = field(default_factory=dict)

    def impl(self, name: str) -> Impl:
        """The implementation ``name``; one this optimizer lacks raises
        :class:`OptionError` for ``optimizer_impl``."""
        if name not in self.impls:
            raise OptionError(
                "optimizer_impl",
                f"optimizer_impl must be one of {', '.join(self.impls)} for "
                f"{self.name}, got {name!r}",
            )
        return self.impls[name]

    @property
    def keeps_states(self) -> bool:
        """Whether ``step()`` creates any state (plain SGD does not)."""
        return bool(self.states((4, 4), "fp32"))


def _step_count() -> State:
    return State((), "fp32")  # torch's ``state["step"]`` tensor


def _adamw(shape, dtype):
    return (State(shape, dtype), State(shape, dtype), _step_count())


def _adamw8bit(shape, dtype):
    numel = math.prod(shape)
    if numel < 4096:  # bitsandbytes keeps small tensors in 32-bit states
        return (State(shape, "fp32"), State(shape, "fp32"), _step_count())
    blocks = (2 * math.ceil(numel / BLOCKWISE8_BLOCK),)  # one fp32 absmax per block
    return (
        State(shape, "u8"),
        State(shape, "u8"),
        State(blocks, "fp32"),
        _step_count(),
    )


#: bitsandbytes ``optim/optimizer.py`` (0.41.1, 0.42.0) ``Optimizer8bit.
#: get_state_buffer``: ``if not self.is_paged or p.numel() < 1e5: torch.zeros_like``,
#: else ``F.get_paged`` (``cudaMallocManaged``)
PAGED_MIN_NUMEL = 100_000


def _paged_adamw(shape, dtype):
    """bitsandbytes ``PagedAdamW`` (``optim_bits=32``): ``Optimizer2State.init_state``
    makes ``state1`` and ``state2`` fp32 through ``get_state_buffer`` (paged from
    :data:`PAGED_MIN_NUMEL` elements on); ``state["step"]`` is a Python int."""
    paged = math.prod(shape) >= PAGED_MIN_NUMEL
    return (State(shape, "fp32", paged), State(shape, "fp32", paged))


def _adafactor(shape, dtype):
    if len(shape) < 2:
        return (_step_count(), State(shape, dtype))  # "variance"
    row = shape[:-1] + (1,)
    col = shape[:-2] + (1, shape[-1])
    return (_step_count(), State(row, dtype), State(col, dtype))


_TORCH_IMPLS = {
    "foreach": {"foreach": True},
    "fused": {"fused": True},
    "for-loop": {"foreach": False},
}


def _impls(scratch: Mapping[str, str | None], flags=_TORCH_IMPLS) -> dict[str, Impl]:
    return {name: Impl(flags.get(name, {}), rule) for name, rule in scratch.items()}


OPTIMIZERS: dict[str, Optimizer] = {
    o.name: o
    for o in (
        Optimizer(
            "adamw",
            "torch AdamW: exp_avg and exp_avg_sq in the parameter dtype",
            _adamw,
            lambda p: 2 * p,
            _impls(
                {
                    "foreach": "adamw-foreach",
                    "fused": None,
                    "for-loop": "adamw-for-loop",
                }
            ),
            "foreach",
            ("torch.optim:AdamW", {}),
            hf_optims={"adamw_torch_fused": "fused", "adamw_torch": "foreach"},
        ),
        Optimizer(
            "adamw8bit",
            "bitsandbytes 8-bit AdamW (blockwise-quantised states)",
            _adamw8bit,
            lambda p: 2 * blockwise8_bytes_per_value(),
            _impls(dict.fromkeys(IMPLS)),
            "foreach",
            unmeasurable="needs bitsandbytes on CUDA",
            hf_optims=dict.fromkeys(
                ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit"), "foreach"
            ),
        ),
        Optimizer(
            "paged_adamw",
            "bitsandbytes PagedAdamW (32-bit): fp32 states, those of tensors from "
            "1e5 elements in CUDA managed memory outside torch's allocator",
            _paged_adamw,
            lambda p: 8,
            _impls(dict.fromkeys(IMPLS)),  # one fused 32-bit kernel, in place
            "foreach",
            unmeasurable="needs bitsandbytes on CUDA",
            hf_optims={"paged_adamw_32bit": "foreach"},
        ),
        Optimizer(
            "sgd",
            "plain SGD (no state)",
            lambda shape, dtype: (),
            lambda p: 0,
            _impls(dict.fromkeys(IMPLS)),
            "foreach",
            ("torch.optim:SGD", {"momentum": 0.0}),
            hf_optims={"sgd": "foreach"},
        ),
        Optimizer(
            "sgd-momentum",
            "SGD with momentum (one buffer)",
            lambda shape, dtype: (State(shape, dtype),),
            lambda p: p,
            _impls(dict.fromkeys(IMPLS)),
            "foreach",
            ("torch.optim:SGD", {"momentum": 0.9}),
        ),
        Optimizer(
            "lion",
            "Lion (Chen et al. 2023): one momentum buffer; for-loop = lion-pytorch, "
            "fused = bitsandbytes' 32-bit kernel",
            lambda shape, dtype: (State(shape, dtype),),  # exp_avg
            lambda p: p,
            {"for-loop": Impl({}, "lion-for-loop"), "fused": Impl(None, None)},
            "for-loop",
            ("trainmem.measuring.lion:Lion", {}),
            hf_optims={"lion_32bit": "fused"},
        ),
        Optimizer(
            "adafactor",
            "torch Adafactor: factored second moment (a row and a column per matrix)",
            _adafactor,
            None,
            _impls({"for-loop": "adafactor-for-loop"}),
            "for-loop",
            ("torch.optim:Adafactor", {}),
            hf_optims={"adafactor": "for-loop"},
        ),
    )
}


def optimizer(name: str) -> Optimizer:
    """The entry of ``name``; an unknown name raises :class:`OptionError` for
    ``optimizer``."""
    return lookup(OPTIMIZERS, "optimizer", name)


def hf_optims() -> dict[str, tuple[str, str]]:
    """``TrainingArguments.optim`` → (optimizer, implementation), from every entry."""
    return {
        hf: (o.name, impl)
        for o in OPTIMIZERS.values()
        for hf, impl in o.hf_optims.items()
    }
