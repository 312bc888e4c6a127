"""The environment's libraries are installed with their bytecode.

Every notebook kernel, grader run and test worker imports torch, transformers, peft
and (through them) sympy. Without ``.pyc`` files, and with ``PYTHONDONTWRITEBYTECODE``
set (as on CI machines), each of those processes compiles the libraries from source
again: ``make venv`` installs with ``uv pip install --compile-bytecode``, as pip does.
"""

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

HEAVY = ("torch", "transformers", "peft", "sympy", "numpy", "jupyter_client")


@pytest.mark.parametrize("name", HEAVY)
def test_library_has_bytecode(name):
    module = importlib.import_module(name)
    source = Path(module.__file__)
    files = sorted(source.parent.rglob("*.py"))
    missing = [
        f for f in files if not Path(importlib.util.cache_from_source(str(f))).exists()
    ]
    # a few files legitimately fail to compile (templates, py2-only examples)
    assert len(missing) <= max(5, len(files) // 100), (
        f"{name}: {len(missing)} of {len(files)} modules have no bytecode "
        f"(e.g. {missing[0]}); this environment was installed without it. Fix: "
        f"{sys.executable} -m compileall -q -j 0 {source.parent} "
        "(or rebuild: rm -rf .venv && make venv)"
    )
