"""pytest plugin loaded with ``-p tests.nbval_plugin`` for the strict nbval run (DESIGN.md §5).

* Output types that only exist on Colab or in a live widget front end are never compared.
* Glued figures/HTML (``application/papermill.record/image/png`` …) follow nbval's own rule
  for images: not compared. Glued text — the worked numbers — always is.
* Every notebook runs with ``COURSE_GPU=auto`` (the stored outputs were made that way) unless the
  caller set it, and with a fixed hash seed.
"""
from __future__ import annotations

import os

IGNORED_MIME = (
    "application/vnd.jupyter.widget-view+json",
    "application/vnd.jupyter.widget-state+json",
    "application/vnd.colab-display-data+json",
    "application/vnd.google.colaboratory.intrinsic+json",
    "application/papermill.record/image/png",
    "application/papermill.record/image/jpeg",
    "application/papermill.record/image/svg+xml",
    "application/papermill.record/text/html",
    "image/svg+xml",
    "text/html",
)

os.environ.setdefault("COURSE_GPU", "auto")
os.environ.setdefault("PYTHONHASHSEED", "0")


def pytest_collectstart(collector):
    skip = getattr(collector, "skip_compare", None)
    if skip is not None:
        collector.skip_compare = tuple(skip) + tuple(m for m in IGNORED_MIME if m not in skip)


def _execute_like_jupyter(self, cell_input, allow_stdin=None):
    """nbval runs cells with ``store_history=False``, and then IPython decides whether a trailing
    ``;`` silences a cell by looking at the *previous* cell in its history. Jupyter, nbclient and
    ``make nb`` store history, so run cells the same way here: a ``;`` means what it means there."""
    return self.kc.execute(cell_input, store_history=True, allow_stdin=allow_stdin, stop_on_error=False)


def pytest_configure(config):
    try:
        from nbval.kernel import RunningKernel
    except ImportError:  # pragma: no cover
        return
    RunningKernel.execute_cell_input = _execute_like_jupyter
