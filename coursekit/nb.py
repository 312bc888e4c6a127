"""Notebook helpers shared by every chapter, lab and solution.

* :func:`setup` — the first code cell of every notebook: seeds, versions, the GPU flag
  line.
* :func:`glue` — myst-nb's ``glue`` without needing myst-nb installed (Colab has none):
  it emits the very same display data (``application/papermill.record/...`` +
  ``scrapbook`` metadata), so the book's ``{glue:}`` / ``{glue:text}`` roles find it,
  and nbval compares it like any output. A measured float declares its tolerance:
  ``glue(name, x, fmt, rtol=..., atol=...)``.
* :class:`measured` — ``with measured(rtol=...): print(...)``: printed measured floats,
  compared by the nbval plugin within the tolerance (words and integers stay exact).
* :func:`md_table` — a Markdown table; ``rtol``/``atol`` make it a table of measured
  floats.
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


TOL_KEY = "coursekit"  # output metadata key: {"rtol": r, "atol": a[, "value": v]}


def _float_value(value: Any) -> float | None:
    """``value`` as a float when it is a real floating-point scalar (python, numpy, 0-d
    tensor)."""
    if isinstance(value, bool) or isinstance(value, int):
        return None
    if isinstance(value, float):
        return value
    typename = type(value).__module__ + "." + type(value).__name__
    if (
        typename.startswith("numpy.")
        and hasattr(value, "dtype")
        and value.dtype.kind == "f"
    ):
        return float(value)
    if typename == "torch.Tensor" and value.numel() == 1 and value.is_floating_point():
        return float(value.item())
    return None


def tolerance(rtol: float | None = None, atol: float | None = None) -> dict:
    """The metadata that marks an output as a measured number with a declared tolerance.

    Raises ValueError unless at least one of ``rtol``/``atol`` is given and both are >=
    0.
    """
    if rtol is None and atol is None:
        raise ValueError(
            "a measured number needs rtol=... or atol=... (its declared tolerance)"
        )
    for k, v in (("rtol", rtol), ("atol", atol)):
        if v is not None and not (isinstance(v, (int, float)) and v >= 0):
            raise ValueError(f"{k} must be a number >= 0, got {v!r}")
    return {"rtol": float(rtol or 0.0), "atol": float(atol or 0.0)}


def glue(
    name: str,
    value: Any,
    fmt: str | None = None,
    display: bool = False,
    *,
    rtol: float | None = None,
    atol: float | None = None,
) -> None:
    """Store ``value`` under ``name`` for the book's ``{glue:}`` roles.

    Returns None (like myst-nb): a value returned by the last line of a cell would be
    shown again as ``Out[]`` — and IPython ignores a trailing ``;`` when nbval runs the
    cell.

    ``fmt`` (a format spec such as ``",.0f"`` or ``".2%"``) turns the value into the
    exact text the prose shows, so ``{glue:}`name``` needs no format of its own. Figures
    are glued as images.

    Exact numbers (integers, byte counts, bit patterns, values derived from exact
    inputs) are glued without a tolerance and compared as text. A *measured*
    floating-point number (a matmul error, a loss after training, a gradient statistic:
    it depends on the CPU's kernels) declares its tolerance here: ``rtol``/``atol``. The
    raw value travels in the output's metadata and the nbval plugin compares it
    numerically: ``|new - stored| <= atol + rtol * max(|new|, |stored|)``. Choose
    ``fmt`` so the prose shows only the digits the tolerance supports.
    """
    import IPython.core.formatters
    from IPython.display import display as ipy_display

    tol = None
    if rtol is not None or atol is not None:
        tol = tolerance(rtol, atol)
        v = _float_value(value)
        if (
            v is None
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
        ):
            v = float(value)
        if v is not None:
            tol["value"] = v
    obj = Text(format(value, fmt)) if fmt is not None else value
    if isinstance(obj, str) and not isinstance(obj, Text):
        obj = Text(obj)
    mimebundle, metadata = IPython.core.formatters.format_display_data(obj)
    prefix = "" if display else GLUE_PREFIX
    metadata["scrapbook"] = dict(name=name, mime_prefix=prefix)
    if tol is not None:
        metadata[TOL_KEY] = tol
    elif _float_value(value) is not None:
        # untoleranced float: the lint asks why it is exact
        metadata[TOL_KEY] = {"float": True}
    ipy_display(
        {prefix + k: v for k, v in mimebundle.items()}, raw=True, metadata=metadata
    )


class measured:
    """Print measured floats as one output that nbval compares within a declared
    tolerance.

    ::

        with measured(rtol=0.05):
            print(f"loss after 300 steps {loss:.3e}")

    Everything printed inside the block becomes one ``text/plain`` output carrying the
    tolerance in its metadata. The plugin compares it token by token: words and
    punctuation exactly, integers exactly, every number with a decimal point or an
    exponent within ``atol + rtol * max(|a|, |b|)`` plus one unit in its last printed
    digit (the rounding of the printed text). ``atol`` is in the printed unit
    (percentage points for ``"12.5%"``).
    """

    def __init__(self, rtol: float | None = None, atol: float | None = None):
        self.tol = tolerance(rtol, atol)

    def __enter__(self):
        import contextlib
        import io

        self._buf = io.StringIO()
        self._redirect = contextlib.redirect_stdout(self._buf)
        self._redirect.__enter__()
        return self

    def __exit__(self, *exc):
        from IPython.display import display as ipy_display

        self._redirect.__exit__(*exc)
        text = self._buf.getvalue()
        if text:
            ipy_display(
                {"text/plain": text.rstrip("\n")},
                raw=True,
                metadata={TOL_KEY: dict(self.tol)},
            )
        return False


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


def versions(
    packages: tuple[str, ...] = ("torch", "transformers", "peft"),
) -> dict[str, str]:
    """Installed versions of ``packages`` ("not installed" for missing ones), plus
    python."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for p in packages:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def _inline_figures() -> None:
    """In a Jupyter kernel, store figures in the notebook (``%matplotlib inline``) even
    when the environment says ``MPLBACKEND=Agg`` — with Agg, ``plt.show()`` stores
    nothing."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover
        return
    ip = get_ipython()
    if ip is not None and getattr(ip, "kernel", None) is not None:
        ip.run_line_magic("matplotlib", "inline")


def setup(
    seed: int = 0,
    packages: tuple[str, ...] = ("torch", "transformers", "peft"),
    threads: int | None = 1,
    quiet: bool = False,
) -> None:
    """First cell of every notebook: seed, pin CPU threads (stable timings), print
    versions + GPU line.

    The printed lines are version-dependent, so this cell is tagged
    ``nbval-ignore-output``.
    """
    import logging

    import torch

    from .gpu import describe

    # bitsandbytes (>= 0.49, imported by peft when installed) logs a warning at import
    # on CPUs with AVX512-BF16 that its optional CPU inference kernel (the `kernels`
    # package) is missing; nothing here uses that kernel, and the line would land in
    # whichever cell imports peft first
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    seed_everything(seed)
    if threads is not None and not os.environ.get("COURSE_KEEP_THREADS"):
        torch.set_num_threads(threads)
    try:
        import matplotlib

        _inline_figures()
        matplotlib.rcParams.update(
            {"figure.dpi": 100, "savefig.dpi": 100, "figure.figsize": (6.4, 3.6)}
        )
        from .fonts import use_cjk_font

        # Chinese figure labels where a CJK font is installed (coursekit.fonts.zh)
        use_cjk_font()
    except ImportError:  # pragma: no cover
        pass
    if not quiet:
        print(" | ".join(f"{k} {v}" for k, v in versions(packages).items()))
        print(describe())


class MeasuredTable:
    """A Markdown table of measured floats: shown like ``md_table``, compared within a
    tolerance."""

    def __init__(self, markdown: str, tol: dict):
        self.markdown, self.tol = markdown, tol

    def _repr_mimebundle_(self, include=None, exclude=None):
        return {"text/markdown": self.markdown, "text/plain": self.markdown}, {
            TOL_KEY: dict(self.tol)
        }


def md_table(rows, headers=None, *, rtol=None, atol=None):
    """Display ``rows`` (a list of dicts, or of sequences with ``headers``) as a
    Markdown table.

    The output is ``text/markdown`` (rendered as a real table in the book, compared by
    nbval) plus a ``text/plain`` fallback. Cell values are shown with ``str``; format
    numbers before passing.

    A table of *measured* floats (losses, errors, statistics of a trained model) passes
    ``rtol``/``atol``: nbval then compares its numbers within that tolerance, token by
    token, like :class:`measured`; its words and integers stay exact.
    """
    from IPython.display import Markdown

    rows = list(rows)
    if rows and isinstance(rows[0], dict):
        headers = headers or list(rows[0].keys())
        rows = [[r.get(h, "") for h in headers] for r in rows]
    if headers is None:
        raise ValueError("md_table needs headers when rows are not dicts")
    esc = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = [
        "| " + " | ".join(esc(h) for h in headers) + " |",
        "|" + "|".join("---" for _ in headers) + "|",
    ]
    lines += ["| " + " | ".join(esc(v) for v in r) + " |" for r in rows]
    if rtol is not None or atol is not None:
        return MeasuredTable("\n".join(lines), tolerance(rtol, atol))
    return Markdown("\n".join(lines))
