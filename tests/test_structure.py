"""The shape of the two packages: no import cycles, ``trainmem`` never imports
``coursekit``, the three kinds of ``trainmem`` code in their folders (the estimator at
the top, standard library only; ``measuring/`` and ``demos/`` with torch), and one
option list (``StepConfig``) with the same defaults everywhere."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (at module level or inside a
    function, ``TYPE_CHECKING`` blocks left out), from the source with ``ast``."""
    modules = {_module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        is_pkg = path.name == "__init__.py"
        base = name.split(".") if is_pkg else name.split(".")[:-1]
        deps: set[str] = set()

        def visit(node):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                return
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    stem = base[: len(base) - node.level + 1]
                    mod = ".".join(stem + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                # "from pkg import sub" imports the submodule; a name is from pkg
                subs = {f"{mod}.{a.name}" for a in node.names} & set(modules)
                deps.update(subs)
                if len(subs) < len(node.names):
                    deps.add(mod)
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(tree)
        # a module's own packages run first whatever it imports: not an edge
        ancestors = {
            ".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)
        }
        graph[name] = {d for d in deps if d in modules and d != name} - ancestors
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node):
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return stack[stack.index(dep) :] + [dep]
            if dep not in state and (found := walk(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


@pytest.mark.parametrize("package", ["trainmem", "coursekit"])
def test_no_import_cycle(package):
    graph = import_graph(package)
    assert len(graph) > 10
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_trainmem_never_imports_coursekit():
    for path in (ROOT / "trainmem").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "coursekit" for n in names), path


# --------------------------------------------------------------------------------------
# the three kinds: estimator (top level), measuring/, demos/
# --------------------------------------------------------------------------------------
#: the subpackages that may import torch at import time, and what each holds
TORCH_KINDS = {
    "trainmem.measuring": "measurement with torch (checks the estimator)",
    "trainmem.demos": "the chapters' demonstrations with torch",
}


def import_time_imports(source: str, package: str) -> set[str]:
    """The modules ``source`` (a module of ``package``) imports when it is imported:
    not inside a function, not under ``if TYPE_CHECKING``; relative imports made
    absolute, ``from a import b`` giving ``a`` and ``a.b``."""
    found: set[str] = set()

    def visit(node):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            if node.level:
                parts = package.split(".")
                stem = parts[: len(parts) - node.level + 1]
                mod = ".".join(stem + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source))
    return found


def _trainmem_modules() -> dict[str, tuple[Path, str]]:
    """Module name -> (file, the package its relative imports start from)."""
    out = {}
    for path in sorted((ROOT / "trainmem").rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        out[name] = (path, package)
    return out


def _kind(module: str) -> str:
    for sub in TORCH_KINDS:
        if module == sub or module.startswith(sub + "."):
            return sub
    return "trainmem"


def three_kinds_violations(modules: dict[str, tuple[str, str]]) -> list[str]:
    """What breaks the three kinds, given module name -> (source, package):

    * a top-level module (the estimator, shipped to the in-page calculator) imports a
      package outside the standard library at import time;
    * a top-level module imports ``measuring`` or ``demos`` at import time (a function
      may import them when it runs);
    * ``measuring`` imports ``demos`` at all (the demos use the measurement, not the
      other way round).
    """
    stdlib = set(sys.stdlib_module_names)
    bad = []
    for name, (source, package) in sorted(modules.items()):
        eager = import_time_imports(source, package)
        if _kind(name) == "trainmem":
            third = sorted({m.split(".")[0] for m in eager} - stdlib - {"trainmem"})
            if third:
                bad.append(f"{name} imports {', '.join(third)} at import time")
            torch_side = sorted(
                m for m in eager if m.startswith("trainmem.") and _kind(m) != "trainmem"
            )
            if torch_side:
                bad.append(f"{name} imports {torch_side[0]} at import time")
    graph = import_graph("trainmem")  # imports inside functions too
    for name, deps in sorted(graph.items()):
        if name in modules and _kind(name) == "trainmem.measuring":
            demos = sorted(d for d in deps if _kind(d) == "trainmem.demos")
            if demos:
                bad.append(f"{name} imports {demos[0]}")
    return bad


def test_trainmem_shows_its_three_kinds():
    """The estimator stays at the top of ``trainmem`` and imports only the standard
    library at import time (``_ext/calculator.py`` ships it to the page); torch code
    lives in ``trainmem/measuring/`` or ``trainmem/demos/``."""
    modules = {
        name: (path.read_text(encoding="utf-8"), package)
        for name, (path, package) in _trainmem_modules().items()
    }
    kinds = {_kind(name) for name in modules}
    assert kinds == {"trainmem", *TORCH_KINDS}, kinds
    for sub in TORCH_KINDS:
        members = [n for n in modules if n.startswith(sub + ".")]
        assert len(members) >= 5, (sub, members)
    assert three_kinds_violations(modules) == []


def test_the_three_kinds_check_finds_a_violation():
    bad = three_kinds_violations(
        {
            "trainmem.fake_estimator": (
                "import numpy\nfrom .demos import lora",
                "trainmem",
            ),
            "trainmem.lazy_ok": ("def f():\n    import torch", "trainmem"),
            "trainmem.typed_ok": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch",
                "trainmem",
            ),
            "trainmem.demos.ok": (
                "import torch\nfrom ..measuring import tracker",
                "trainmem.demos",
            ),
        }
    )
    assert bad == [
        "trainmem.fake_estimator imports numpy at import time",
        "trainmem.fake_estimator imports trainmem.demos at import time",
    ]


def _step_defaults():
    from trainmem.config import StepConfig

    return {f.name: f.default for f in dataclasses.fields(StepConfig)}


def test_one_option_list_with_the_same_defaults_everywhere():
    """estimate, measure, measure_memtracker and both CLI commands take exactly the
    fields of StepConfig, with its defaults; the model defaults of the CLI are the
    functions' own."""
    from trainmem.cli import MODEL_DEFAULTS, build_parser
    from trainmem.estimate import estimate
    from trainmem.measuring.measure import measure, measure_memtracker

    step = _step_defaults()
    funcs = {"estimate": estimate, "measure": measure, "memtracker": measure_memtracker}
    for name, func in funcs.items():
        params = inspect.signature(func).parameters
        got = {k: p.default for k, p in params.items() if k in step}
        assert got == step, name
    assert inspect.signature(estimate).parameters["model"].default == "llama-7b"
    assert inspect.signature(measure).parameters["model"].default == "tiny"
    sub = build_parser()._subparsers._group_actions[0].choices
    for command in ("estimate", "measure"):
        args = sub[command].parse_args([])
        for k, v in step.items():
            if hasattr(args, k):
                shown = ",".join(v) if k == "lora_targets" else v
                assert getattr(args, k) == shown, (command, k)
        assert args.model == MODEL_DEFAULTS[command]
    assert MODEL_DEFAULTS["measure"] == "tiny"  # not a 7B model on real CPU tensors
    est_args = vars(sub["estimate"].parse_args([]))
    assert set(step) <= set(est_args)


def test_an_unknown_option_is_an_option_error():
    from trainmem.config import OptionError
    from trainmem.estimate import estimate

    with pytest.raises(OptionError, match="batch_size is not an option") as e:
        estimate("tiny", batch_size=2)
    assert e.value.option == "batch_size"


# --------------------------------------------------------------------------------------
# precision, sharding and framework are registries: no string test over their names
# --------------------------------------------------------------------------------------
#: the option fields whose values are registry names
REGISTRY_FIELDS = {"precision", "zero_impl", "framework"}
#: where those names may be tested: the registries themselves
REGISTRY_MODULES = {
    "trainmem/precisions.py",
    "trainmem/sharding.py",
    "trainmem/frameworks.py",
}


def _strings(node):
    """The string constants of ``node`` (a constant or a tuple/list/set of them),
    ``None`` when it is something else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        found = [_strings(e) for e in node.elts]
        return None if None in found else set().union(*found)
    return None


def _names_a_field(node) -> bool:
    """``step.precision``, ``precision`` or ``c["precision"]`` (any of the fields)."""
    if isinstance(node, ast.Attribute):
        return node.attr in REGISTRY_FIELDS
    if isinstance(node, ast.Name):
        return node.id in REGISTRY_FIELDS
    if isinstance(node, ast.Subscript):
        return _strings(node.slice) is not None and bool(
            _strings(node.slice) & REGISTRY_FIELDS
        )
    return False


def registry_name_tests(source: str) -> list[int]:
    """Lines that test a precision, sharding or framework name: a comparison of one
    of :data:`REGISTRY_FIELDS` with strings (``step.precision == "bf16"``,
    ``framework in ("hf", "litgpt")``), or its ``startswith``/``endswith``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(_names_a_field(o) for o in operands) and any(
                _strings(o) for o in operands
            ):
                lines.append(node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith")
            and _names_a_field(node.func.value)
        ):
            lines.append(node.lineno)
    return lines


def test_the_registry_name_counter_finds_string_tests():
    src = (
        'a = step.precision == "bf16"\n'
        'b = framework in ("hf", "litgpt")\n'
        'c = cond["precision"].startswith("bf16")\n'
        'd = step.zero_impl != "deepspeed"\n'
        "e = entry.autocast is not None\n"
        'f = lib == "litgpt"\n'
    )
    assert registry_name_tests(src) == [1, 2, 3, 4]


def test_no_string_test_over_registry_names_outside_the_registries():
    found = {}
    for package in ("trainmem", "coursekit"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in REGISTRY_MODULES or rel.startswith("coursekit/grading/"):
                continue
            lines = registry_name_tests(path.read_text(encoding="utf-8"))
            if lines:
                found[rel] = lines
    assert found == {}, (
        "precision/zero_impl/framework names tested outside their registries "
        "(trainmem/precisions.py, sharding.py, frameworks.py): read the entry's "
        f"attributes instead: {found}"
    )
