"""Static figures for the number-format chapter (matplotlib; figure text in English/math
only).

Each function draws on a given ``ax`` (or a new figure) and returns the figure, so a
notebook cell can ``plt.show()`` it and a widget can redraw it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..formats import get_format, ulp_array

DEFAULT_FORMATS = ("fp32", "tf32", "bf16", "fp16", "fp8_e5m2", "fp8_e4m3")
COLORS = {
    "fp32": "#1f77b4",
    "tf32": "#17becf",
    "bf16": "#2ca02c",
    "fp16": "#d62728",
    "fp8_e5m2": "#9467bd",
    "fp8_e4m3": "#ff7f0e",
}


def _en(cn: str, en: str) -> str:
    """The default label translator: English (``tr=coursekit.fonts.zh`` gives Chinese
    where a CJK font exists; trainmem does not import coursekit)."""
    return en


def _axes(ax, figsize=(5.5, 3.6)):
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=figsize)
    return ax.figure, ax


def plot_spacing(
    formats: Iterable[str] = DEFAULT_FORMATS,
    ax=None,
    xlim=(1e-12, 1e6),
    points: int = 4000,
    tr=_en,
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
    ax.set_ylabel(tr("相邻两数的间隔（ulp）", "spacing to next value (ulp)"))
    ax.set_title(
        tr(
            "精度（precision）：间隔随数量级增长\n圆点：最大有限值",
            "Precision: spacing grows with magnitude\ndots = largest finite value",
        )
    )
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(ncol=2)
    return fig


def plot_ranges(formats: Iterable[str] = DEFAULT_FORMATS, ax=None, tr=_en):
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
            f"{f.max_normal:,.0f}" if f.max_normal < 1e6 else f"{f.max_normal:.2g}",
            va="center",
        )
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(-50, 62)
    ax.set_xlabel(
        tr(
            # no mathtext here: it has no CJK fallback font
            "log₁₀|x|（浅色：次正规数，深色：正规数）",
            r"$\log_{10}|x|$ (light: subnormal, solid: normal)",
        )
    )
    ax.set_title(
        tr(
            "量程（range）：能表示的正数范围\n右侧数字：最大有限值",
            "Range of positive values\nright: largest finite value",
        )
    )
    ax.grid(True, axis="x", alpha=0.3)
    return fig


def format_overview(formats: Iterable[str] = DEFAULT_FORMATS, tr=_en):
    """Two panels stacked (narrow enough for a phone): range bars (top) and spacing
    versus magnitude (bottom). ``tr(chinese, english)`` picks each label's language."""
    import matplotlib.pyplot as plt

    formats = list(formats)
    fig, (a, b) = plt.subplots(2, 1, figsize=(5.5, 8.5))
    plot_ranges(formats, a, tr=tr)
    plot_spacing(formats, b, tr=tr)
    fig.tight_layout()
    return fig


def plot_magnitude_histogram(
    values, thresholds: Sequence[tuple[str, float]], ax=None, bins: int = 80, tr=_en
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
    ax.set_ylabel(tr("个数（count）", "count"))
    ax.legend()
    return fig
