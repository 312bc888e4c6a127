"""Small helpers shared by the hidden tests in tests/grading/ (they run in the grader's process)."""
from __future__ import annotations

import functools
import math
import warnings


def close_floats(got, want, rtol: float, atol: float) -> bool:
    """True when ``got`` is a list of finite real numbers (not bools) of ``want``'s length, each
    within ``atol + rtol * |w|`` of its reference. Anything else a kernel hands back is False."""
    if not isinstance(got, list) or len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if not isinstance(g, (int, float)) or isinstance(g, bool) or not math.isfinite(g):
            return False
        if abs(g - w) > atol + rtol * abs(w):
            return False
    return True


def exec_source(src: str) -> dict:
    """Run a hidden test's builder source (the same text the probe sends into the student's
    kernel) in a fresh namespace here, so the check rebuilds exactly what the probe built."""
    ns: dict = {}
    exec(src, ns)
    return ns


def quiet_warnings(fn):
    """Run a check without transformers/peft deprecation chatter in the grader's output."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    return wrapper
