"""The grader: ``python -m coursekit grade --lab labNN SUBMISSIONS_DIR --out OUT_DIR``.

Parts, each with one job (imports go downwards in this list):

* :mod:`.api` — what hidden tests declare (:class:`Question`, :class:`CaseType`) and
  loading them;
* :mod:`.checks` — type-checked comparisons the hidden tests use;
* :mod:`.submissions` — finding each student's notebook (Colab download names included);
* :mod:`.scoring` — inputs drawn once per run from the seed, per-type credit, constant
  correction;
* :mod:`.worker` — runs in a subprocess: the student's cells and the probes in a kernel;
* :mod:`.runner` — one submission: start the worker, kill its process tree (psutil),
  score;
* :mod:`.report` — ``grades.csv`` and the feedback page (Jinja2 template in
  ``templates/``);
* :mod:`.cache` — content-hash cache; :mod:`.core` — :func:`grade`, the whole run.

Formats, statuses and the partial-credit policy: ``tests/grading/README.md``.
"""

from .api import STUB_LIMIT, CaseType, LabTests, Question, load_tests
from .core import grade
from .report import total
from .scoring import prepare, score
from .submissions import colab_base, discover

__all__ = [
    "STUB_LIMIT",
    "CaseType",
    "LabTests",
    "Question",
    "colab_base",
    "discover",
    "grade",
    "load_tests",
    "prepare",
    "score",
    "total",
]
