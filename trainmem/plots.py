"""Static figures for the number-format chapter (matplotlib; figure text in English/math
only).

Each function draws on a given ``ax`` (or a new figure) and returns the figure, so a
notebook cell can ``plt.show()`` it and a widget can redraw it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from .formats import get_format, ulp_array

DEFAULT_FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8_e5m2", "fp8_e4m3")
COLORS = {
    "fp32": "#1f77b4",
    "tf32": "#17becf",
    "bf16": "#2ca02c",
    "fp16": "#d62728",
    "fp8_e5m2": "#9467bd",
    "fp8_e4m3": "#ff7f0e",
}


def _axes(ax, figsize=(6.4, 3.6)):
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
    return ax.figure, ax


def plot_spacing(
    formats: Iterable[str] = DEFAULT_FORMATS,
    ax=None,
    xlim=(1e-12, 1e6),
    points: int = 4000,
):
    """Grid spacing (ulp) versus magnitude |x| on log-log axes, one staircase per
    format.

    A line stops at the format's largest finite value; where it turns flat on the left,
    the format has entered its subnormal range (constant spacing = smallest subnormal).
    """
    fig, ax = _axes(ax)
    x = np.logspace(np.log10(xlim[0]), np.log10(xlim[1]), points)
    for name in formats:
        f = get_format(name)
        keep = (x <= f.max_normal) & (x >= f.min_subnormal)
        ax.loglog(
            x[keep],
            ulp_array(x[keep], f),
            label=name,
            color=COLORS.get(name),
            lw=1.4,
            ls="--" if name == "tf32" else "-",
        )
        if f.max_normal < xlim[1]:
            ax.plot(
                [f.max_normal],
                [ulp_array([f.max_normal], f)[0]],
                "o",
                color=COLORS.get(name),
                ms=4,
            )
    ax.set_xlabel("|x|")
    ax.set_ylabel("spacing to next value (ulp)")
    ax.set_title("Precision: spacing grows with magnitude; dots = largest finite value")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    return fig


def plot_ranges(formats: Iterable[str] = DEFAULT_FORMATS, ax=None):
    """Representable positive range per format: subnormals (light) and normals (solid),
    log scale."""
    fig, ax = _axes(ax)
    names = list(formats)
    for i, name in enumerate(names):
        f = get_format(name)
        lo, mid, hi = np.log10([f.min_subnormal, f.min_normal, f.max_normal])
        ax.barh(i, mid - lo, left=lo, color=COLORS.get(name), alpha=0.3, height=0.6)
        ax.barh(i, hi - mid, left=mid, color=COLORS.get(name), height=0.6)
        ax.text(
            hi + 0.5,
            i,
            f"max {f.max_normal:,.0f}"
            if f.max_normal < 1e6
            else f"max {f.max_normal:.3g}",
            va="center",
            fontsize=8,
        )
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(-50, 48)
    ax.set_xlabel(r"$\log_{10}|x|$   (light: subnormal, solid: normal)")
    ax.set_title("Range: where each format can represent a nonzero finite value")
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def format_overview(formats: Iterable[str] = DEFAULT_FORMATS):
    """Two panels: range bars (top) and spacing versus magnitude (bottom)."""
    import matplotlib.pyplot as plt

    formats = list(formats)
    fig, (a, b) = plt.subplots(2, 1, figsize=(7.5, 7.5))
    plot_ranges(formats, a)
    plot_spacing(formats, b)
    fig.tight_layout()
    return fig


def plot_magnitude_histogram(
    values, thresholds: Sequence[tuple[str, float]], ax=None, bins: int = 80
):
    """Histogram of log10|values| with labelled vertical lines at ``thresholds`` (label,
    value)."""
    fig, ax = _axes(ax)
    v = np.abs(np.asarray(values, dtype=np.float64))
    v = v[v > 0]
    ax.hist(np.log10(v), bins=bins, color="#888888", alpha=0.7)
    for k, (label, t) in enumerate(thresholds):
        ax.axvline(
            np.log10(t), color=f"C{k + 1}", ls="--", lw=1.2, label=f"{label} = {t:.3g}"
        )
    ax.set_xlabel(r"$\log_{10}|g|$")
    ax.set_ylabel("count")
    ax.legend(fontsize=8)
    return fig
