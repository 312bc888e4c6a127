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

from importlib import import_module

# Loaded on first use (PEP 562): the worker and kernel processes
# (``python -m coursekit.grading.worker`` / ``.kernel_main``) import this package
# first and need none of these (core alone pulls in jinja2, nbformat and the lab
# generator).
_LAZY = {
    "STUB_LIMIT": "api",
    "CaseType": "api",
    "LabTests": "api",
    "Question": "api",
    "load_tests": "api",
    "grade": "core",
    "total": "report",
    "prepare": "scoring",
    "score": "scoring",
    "colab_base": "submissions",
    "discover": "submissions",
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
