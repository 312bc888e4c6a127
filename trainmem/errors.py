"""The one error type of the estimator and the measurement, and the checks that raise
it. Standard library only."""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

T = TypeVar("T")


class OptionError(ValueError):
    """Bad input to the estimator or the measurement; ``option`` names the argument it
    came from (``"lora_rank"``, ``"model"``, ``"training_args"``, ...), so a front end
    can name its own flag without parsing the message."""

    def __init__(self, option: str, message: str):
        super().__init__(message)
        self.option = option


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        shown = ", ".join("None" if a is None else str(a) for a in allowed)
        raise OptionError(name, f"{name} must be one of {shown}, got {value!r}")


def check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise OptionError(name, f"{name} must be an integer ≥ 1, got {value!r}")


def lookup(registry: Mapping[Any, T], option: str, key: Any) -> T:
    """``registry[key]``; an unknown key raises :class:`OptionError` for ``option``,
    naming the allowed keys."""
    try:
        return registry[key]
    except (KeyError, TypeError):
        check_choice(option, key, tuple(registry))
        raise  # pragma: no cover - check_choice raised
