"""Course machinery: GPU flag, notebook helpers, Colab setup, lab generation,
grading.

The notebook helpers (``from coursekit import setup, glue``) are loaded on first use
(PEP 562): the grader's worker and kernel processes (``python -m
coursekit.grading.worker`` / ``.kernel_main``), twice per graded submission, and
``python -m coursekit`` import this package first and need none of them
(``benchmarks/process_start.py``).
"""

from importlib import import_module

_LAZY = {
    "bf16_supported": "gpu",
    "choose_device": "gpu",
    "gpu_cell": "gpu",
    "gpu_mode": "gpu",
    "glue": "nb",
    "measured": "nb",
    "setup": "nb",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
