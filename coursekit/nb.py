"""Notebook helpers shared by every chapter, lab and solution.

* :func:`setup` — the first code cell of every notebook: seeds, versions, the GPU flag line.
* :func:`glue` — myst-nb's ``glue`` without needing myst-nb installed (Colab has none): it emits the
  very same display data (``application/papermill.record/...`` + ``scrapbook`` metadata), so the
  book's ``{glue:}`` / ``{glue:text}`` roles find it, and nbval compares it like any output.
"""
from __future__ import annotations

import os
import platform
import random
from typing import Any

GLUE_PREFIX = "application/papermill.record/"


class Text(str):
    """A string whose repr is itself, so ``{glue:}`key``` renders it without quotes."""

    def __repr__(self) -> str:  # pragma: no cover - trivial
        return str(self)


def glue(name: str, value: Any, fmt: str | None = None, display: bool = False) -> None:
    """Store ``value`` under ``name`` for the book's ``{glue:}`` roles.

    Returns None (like myst-nb): a value returned by the last line of a cell would be shown
    again as ``Out[]`` — and IPython ignores a trailing ``;`` when nbval runs the cell.

    ``fmt`` (a format spec such as ``",.0f"`` or ``".2%"``) turns the value into the exact text the
    prose shows, so ``{glue:}`name``` needs no format of its own. Figures are glued as images.
    """
    import IPython.core.formatters
    from IPython.display import display as ipy_display

    obj = Text(format(value, fmt)) if fmt is not None else value
    if isinstance(obj, str) and not isinstance(obj, Text):
        obj = Text(obj)
    mimebundle, metadata = IPython.core.formatters.format_display_data(obj)
    prefix = "" if display else GLUE_PREFIX
    metadata["scrapbook"] = dict(name=name, mime_prefix=prefix)
    ipy_display({prefix + k: v for k, v in mimebundle.items()}, raw=True, metadata=metadata)


def seed_everything(seed: int = 0) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    import torch

    torch.manual_seed(seed)


def versions(packages: tuple[str, ...] = ("torch", "transformers", "peft")) -> dict[str, str]:
    """Installed versions of ``packages`` ("not installed" for missing ones), plus python."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for p in packages:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def _inline_figures() -> None:
    """In a Jupyter kernel, store figures in the notebook (``%matplotlib inline``) even when the
    environment says ``MPLBACKEND=Agg`` — with Agg, ``plt.show()`` stores nothing."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return
    ip = get_ipython()
    if ip is not None and getattr(ip, "kernel", None) is not None:
        ip.run_line_magic("matplotlib", "inline")


def setup(seed: int = 0, packages: tuple[str, ...] = ("torch", "transformers", "peft"),
          threads: int | None = 1, quiet: bool = False) -> None:
    """First cell of every notebook: seed, pin CPU threads (stable timings), print versions + GPU line.

    The printed lines are version-dependent, so this cell is tagged ``nbval-ignore-output``.
    """
    import torch

    from .gpu import describe

    seed_everything(seed)
    if threads is not None and not os.environ.get("COURSE_KEEP_THREADS"):
        torch.set_num_threads(threads)
    try:
        import matplotlib

        _inline_figures()
        matplotlib.rcParams.update({"figure.dpi": 100, "savefig.dpi": 100, "figure.figsize": (6.4, 3.6)})
        from .fonts import use_cjk_font

        use_cjk_font()  # Chinese figure labels where a CJK font is installed (coursekit.fonts.zh)
    except ImportError:  # pragma: no cover
        pass
    if not quiet:
        print(" | ".join(f"{k} {v}" for k, v in versions(packages).items()))
        print(describe())


def md_table(rows, headers=None):
    """Display ``rows`` (a list of dicts, or of sequences with ``headers``) as a Markdown table.

    The output is ``text/markdown`` (rendered as a real table in the book, compared by nbval) plus
    a ``text/plain`` fallback. Cell values are shown with ``str``; format numbers before passing.
    """
    from IPython.display import Markdown

    rows = list(rows)
    if rows and isinstance(rows[0], dict):
        headers = headers or list(rows[0].keys())
        rows = [[r.get(h, "") for h in headers] for r in rows]
    if headers is None:
        raise ValueError("md_table needs headers when rows are not dicts")
    esc = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(esc(h) for h in headers) + " |",
             "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(esc(v) for v in r) + " |" for r in rows]
    return Markdown("\n".join(lines))
