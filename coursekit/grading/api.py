"""What a hidden-test module (``tests/grading/labNN.py``) declares, and how it is
loaded.

A lab author writes :class:`Question` objects. The preferred form grades **case types**:
each :class:`CaseType` draws a fixed quota of inputs and carries a weight; the probe
defines ``CASE(x)``, which the kernel calls once per input; :attr:`Question.expect`
gives the reference answer, computed in the grader's process; :attr:`Question.compare`
type-checks and compares. The older form (``make_inputs`` + ``check`` over the whole
result) is still accepted for questions whose cases are whole models (labs 04–06 use
it).

The partial-credit policy these declarations feed is in :mod:`coursekit.grading.scoring`
and tests/grading/README.md.
"""

from __future__ import annotations

import hashlib
import importlib.util
import random
import re
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any, Callable

from .checks import equal

NAME_RE = re.compile(r"^[a-z0-9_]+$")
DEFAULTS = dict(CELL_TIMEOUT=30, NOTEBOOK_TIMEOUT=300, PROBE_TIMEOUT=10, MEMORY_MB=4096)
# The most a stub (NotImplementedError, a constant, the input handed back) may earn on
# any question, as a share of its points; tests/test_grader.py checks every lab against
# it.
STUB_LIMIT = 0.10


@dataclass(frozen=True)
class CaseType:
    """One kind of input a question grades, with a fixed quota drawn per grading run.

    ``make(rng)`` returns the list of inputs of this type (JSON data); ``weight`` is its
    share of the question (relative to the other types); ``label`` names it in the
    feedback and ``fix`` tells a student what to change when a case of this type fails
    (both Chinese).
    """

    name: str
    label: str
    weight: float
    make: Callable[[random.Random], list]
    fix: str = ""

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ValueError(f"CaseType name must match [a-z0-9_]+, got {self.name!r}")
        if not self.weight > 0:
            raise ValueError(
                f"CaseType {self.name}: weight must be > 0, got {self.weight}"
            )


def _show(x: Any) -> str:
    return repr(x)


@dataclass
class Question:
    """One graded question of a lab (tests/grading/README.md §4)."""

    name: str
    _: KW_ONLY
    points: float
    probe: str
    cases: list[CaseType] = field(default_factory=list)
    expect: Callable[[Any], Any] | None = None
    compare: Callable[[Any, Any], Any] = equal
    show_input: Callable[[Any], str] = _show
    show_value: Callable[[Any], str] = _show
    make_inputs: Callable[[random.Random], Any] | None = None
    check: Callable[[Any, Any], Any] | None = None
    description: str = ""
    timeout: float | None = None

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ValueError(f"Question name must match [a-z0-9_]+, got {self.name!r}")
        if self.points <= 0:
            raise ValueError(
                f"Question {self.name}: points must be > 0, got {self.points}"
            )
        typed = bool(self.cases) and self.expect is not None
        legacy = self.make_inputs is not None and self.check is not None
        if typed == legacy:
            raise ValueError(
                f"Question {self.name}: give either cases= and expect= (case types) "
                "or make_inputs= and check= (whole-result check), not both or neither"
            )
        names = [c.name for c in self.cases]
        if len(set(names)) != len(names):
            raise ValueError(f"Question {self.name}: duplicate case types {names}")

    @property
    def typed(self) -> bool:
        return bool(self.cases)

    def draw(self, seed: int) -> list[tuple[str, Any]]:
        """``(case type, input)`` pairs for this run: every type draws its own quota
        from its own generator seeded by (seed, question, type), so adding a type never
        shifts the others."""
        if not self.typed:
            return [("", self.make_inputs(random.Random(f"{seed}:{self.name}")))]
        out = []
        for ct in self.cases:
            drawn = ct.make(random.Random(f"{seed}:{self.name}:{ct.name}"))
            if not drawn:
                raise ValueError(
                    f"Question {self.name}: case type {ct.name} drew no inputs"
                )
            out += [(ct.name, x) for x in drawn]
        return out


@dataclass
class LabTests:
    """A loaded hidden-test module."""

    lab: str
    path: Path
    notebook: str
    questions: list[Question]
    cell_timeout: float
    notebook_timeout: float
    probe_timeout: float
    memory_mb: int
    digest: str

    @property
    def max_points(self) -> float:
        return sum(q.points for q in self.questions)

    @property
    def default_seed(self) -> int:
        """A seed fixed by the lab and its hidden tests, for tests and benchmarks.
        ``grade`` never uses it: anyone with the repository could derive it, so a class
        gets a secret seed of its own (:func:`coursekit.grading.core.class_seed`)."""
        return int(
            hashlib.sha256(f"{self.lab}:{self.digest}".encode()).hexdigest()[:8], 16
        )


def load_tests(lab: str, tests_dir: str | Path) -> LabTests:
    """Import ``tests_dir/<lab>.py`` in this process (never in a student's kernel)."""
    if not re.fullmatch(r"lab\d\d", lab):
        raise ValueError(f"--lab must look like lab01, got {lab!r}")
    path = Path(tests_dir) / f"{lab}.py"
    if not path.exists():
        raise FileNotFoundError(f"no hidden tests for {lab}: {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"_hidden_tests_{lab}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    qs = list(getattr(mod, "QUESTIONS", []))
    if not qs:
        raise ValueError(f"{path}: QUESTIONS is empty")
    names = [q.name for q in qs]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: duplicate question names {names}")

    def setting(key: str):
        return getattr(mod, key, DEFAULTS[key])

    return LabTests(
        lab=lab,
        path=path,
        notebook=getattr(mod, "NOTEBOOK", ""),
        questions=qs,
        cell_timeout=setting("CELL_TIMEOUT"),
        notebook_timeout=setting("NOTEBOOK_TIMEOUT"),
        probe_timeout=setting("PROBE_TIMEOUT"),
        memory_mb=int(setting("MEMORY_MB")),
        digest=hashlib.sha256(path.read_bytes()).hexdigest(),
    )
