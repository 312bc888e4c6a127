"""Comparisons and helpers shared by the hidden tests (they run in the grader's
process).

Every comparison type-checks what a kernel handed back: a bool is not an int, an int is
not a bool, NaN equals NaN only where the reference is NaN, and signed zeros differ.
Anything a comparison does not recognise is simply unequal (never an exception).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def equal(got: Any, want: Any) -> bool:
    """Exact equality of JSON data, types checked at every level: a bool equals only the
    same bool (``True != 1``), numbers compare by value (``1 == 1.0``), NaN only NaN,
    lists by length and items, dicts by keys and values."""
    if isinstance(want, bool) or isinstance(got, bool):
        return isinstance(got, bool) and isinstance(want, bool) and got is want
    if isinstance(want, float) and math.isnan(want):
        return isinstance(got, float) and math.isnan(got)
    if _is_number(want):
        return _is_number(got) and got == want
    if isinstance(want, list):
        return (
            isinstance(got, list)
            and len(got) == len(want)
            and all(equal(g, w) for g, w in zip(got, want))
        )
    if isinstance(want, dict):
        return (
            isinstance(got, dict)
            and set(got) == set(want)
            and all(equal(got[k], w) for k, w in want.items())
        )
    return type(got) is type(want) and got == want


def same_float(got: Any, want: float) -> bool:
    """Equal floats, NaN == NaN, ``+0.0 != -0.0``; ``got`` must be a number, not a
    bool."""
    if not _is_number(got):
        return False
    got = float(got)
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    return got == want and math.copysign(1.0, got) == math.copysign(1.0, want)


def same_bool(got: Any, want: bool) -> bool:
    """``got`` is the bool ``want`` (``0``, ``1`` or a tensor are not bools)."""
    return isinstance(got, bool) and got is want


def hex16(x: Any) -> str:
    """A 16-bit pattern as ``0x7e14`` (non-ints as their repr) — both sides of a message
    in hex."""
    return f"{x:#06x}" if isinstance(x, int) and not isinstance(x, bool) else repr(x)


def close_floats(got, want, rtol: float, atol: float) -> bool:
    """True when ``got`` is a list of finite real numbers (not bools) of ``want``'s
    length, each within ``atol + rtol * |w|`` of its reference. Anything else a kernel
    hands back is False."""
    if not isinstance(got, list) or len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if not _is_number(g) or not math.isfinite(g):
            return False
        if abs(g - w) > atol + rtol * abs(w):
            return False
    return True


def exec_source(src: str) -> dict:
    """Run a hidden test's builder source (the same text the probe sends into the
    student's kernel) in a fresh namespace here, so the check rebuilds exactly what the
    probe built."""
    ns: dict = {}
    exec(src, ns)
    return ns


def quiet_warnings(fn):
    """Run a check without transformers/peft deprecation chatter in the grader's
    output."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)

    return wrapper


def raised_naming(got: Any, want: dict) -> tuple[bool, str]:
    """A case that must raise. ``want``: ``{"raised": "ValueError"}``, with
    ``"mentions"``: the texts its message must contain (what the lab says the message
    names: the bad value, the allowed range or values). ``got``: ``{"raised": the
    exception's class name or None, "message": str(exception)}``."""
    if not isinstance(got, dict):
        return False, "没有结果"
    if got.get("raised") != want["raised"]:
        return False, f"应抛出 {want['raised']}，得到 {got.get('raised')}"
    message = got.get("message") if isinstance(got.get("message"), str) else ""
    missing = [m for m in want.get("mentions", ()) if m not in message]
    if missing:
        return False, (
            f"{want['raised']} 的信息应写出 {'、'.join(missing)}，"
            f"得到 {message[:160]!r}"
        )
    return True, ""
