"""The one error type of the estimator and the measurement, the checks that raise it,
and the one function that reads a JSON file (model configs, training arguments, adapter
configs). Standard library only."""

from __future__ import annotations

import json
import os
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


def read_json_object(
    path: str, option: str, what: str = "file", missing_hint: str = ""
) -> dict[str, Any]:
    """The JSON object in the file ``path`` — the only place a JSON file is read.

    ``option`` names the argument the path came from and ``what`` describes the file
    (``"model config file"``); a missing file (with ``missing_hint`` appended), invalid
    JSON or anything but an object raises :class:`OptionError` with one line naming the
    file and the problem."""
    if not os.path.isfile(path):
        raise OptionError(option, f"{what} {path!r} does not exist{missing_hint}")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        reason = e.msg if hasattr(e, "msg") else e
        raise OptionError(
            option, f"{what} {path!r} is not valid JSON ({reason})"
        ) from None
    if not isinstance(data, dict):
        raise OptionError(
            option,
            f"{what} {path!r} must hold a JSON object, got {type(data).__name__}",
        )
    return data
