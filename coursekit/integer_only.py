"""Run a lab function with the float conversions its lab forbids taken away.

Lab 1 asks for the FP16/BF16 decoders in integer bit operations and ``math.ldexp``
only, "不要用 np.float16 / torch 转换". :func:`integer_only` returns a version of a
function whose module globals (and those of the notebook's other functions it calls)
see numpy, torch, struct and ctypes as stubs that raise :class:`ConversionForbidden`
on any use, and whose ``import`` of those modules raises too. The lab's self-check
and the grader's hidden tests call the decoder through it, so a decoder that converts
with numpy fails both, with a message that names what it used.

Standard library only (it runs in the student's kernel, inside the grader's sandbox).
"""

from __future__ import annotations

import builtins
import types

#: the modules that convert bit patterns to floats for you
FORBIDDEN = ("numpy", "torch", "struct", "ctypes", "array", "jax")


class ConversionForbidden(RuntimeError):
    """A forbidden module was used inside an :func:`integer_only` call."""


def _forbidden_root(name: str) -> str | None:
    root = name.split(".", 1)[0]
    return root if root in FORBIDDEN else None


class _Stub:
    def __init__(self, fn_name: str, module: str):
        self._fn_name, self._module = fn_name, module

    def _refuse(self, what: str):
        raise ConversionForbidden(
            f"{self._fn_name} 用到了 {self._module}{what}：本实验只用整数位运算与 "
            "math.ldexp（或 2.0 ** k），不要用 numpy / torch / struct 的类型转换"
        )

    def __getattr__(self, attr):
        self._refuse(f".{attr}")

    def __call__(self, *args, **kwargs):
        self._refuse("(...)")


def integer_only(fn):
    """``fn`` rebuilt over a copy of its globals in which every module of
    :data:`FORBIDDEN` (bound under any name) is a stub that raises
    :class:`ConversionForbidden`, ``__import__`` of those modules raises too, and the
    other plain functions of the same namespace are rebuilt the same way (a helper
    cannot reach numpy either)."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"integer_only needs a function, got {type(fn).__name__}")
    name = fn.__name__
    source = fn.__globals__
    guarded: dict = dict(source)
    for key, value in source.items():
        if isinstance(value, types.ModuleType):
            root = _forbidden_root(value.__name__)
            if root:
                guarded[key] = _Stub(name, key)
        elif key not in ("__builtins__",) and isinstance(value, types.FunctionType):
            if getattr(value, "__globals__", None) is source:
                guarded[key] = _rebuild(value, guarded)
    real_import = builtins.__import__

    def guarded_import(mod, globals=None, locals=None, fromlist=(), level=0):
        root = _forbidden_root(mod) if level == 0 else None
        if root:
            raise ConversionForbidden(
                f"{name} 导入了 {mod}：本实验只用整数位运算与 math.ldexp，"
                "不要用 numpy / torch / struct 的类型转换"
            )
        return real_import(mod, globals, locals, fromlist, level)

    base = source.get("__builtins__", builtins)
    base = base if isinstance(base, dict) else vars(base)
    guarded["__builtins__"] = {**base, "__import__": guarded_import}
    return _rebuild(fn, guarded)


def _rebuild(fn: types.FunctionType, globals_: dict) -> types.FunctionType:
    new = types.FunctionType(
        fn.__code__, globals_, fn.__name__, fn.__defaults__, fn.__closure__
    )
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    return new


def check_integer_only(fn, samples) -> None:
    """Call ``integer_only(fn)`` on each of ``samples``; an ``AssertionError`` in
    Chinese names the forbidden use (the lab's self-check)."""
    guarded = integer_only(fn)
    for x in samples:
        try:
            guarded(x)
        except ConversionForbidden as e:
            raise AssertionError(str(e)) from None
