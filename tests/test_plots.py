"""trainmem.demos.plots: the chapter-1 figures draw one artist per format, with the
right extents."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from trainmem.demos import plots  # noqa: E402
from trainmem.formats import get_format  # noqa: E402


def test_spacing_lines_stop_at_each_max():
    fig = plots.plot_spacing(["fp16", "bf16"], xlim=(1e-10, 1e6))
    lines = {
        ln.get_label(): ln
        for ln in fig.axes[0].get_lines()
        if not ln.get_label().startswith("_")
    }
    assert set(lines) == {"fp16", "bf16"}
    assert lines["fp16"].get_xdata().max() <= get_format("fp16").max_normal
    assert lines["bf16"].get_xdata().max() > 1e5
    plt.close(fig)


def test_range_bars_span_subnormal_to_max():
    fig = plots.plot_ranges(["fp16"])
    bars = fig.axes[0].patches
    assert len(bars) == 2  # subnormal part and normal part
    f = get_format("fp16")
    left = min(b.get_x() for b in bars)
    right = max(b.get_x() + b.get_width() for b in bars)
    assert np.isclose(left, np.log10(f.min_subnormal)) and np.isclose(
        right, np.log10(f.max_normal)
    )
    plt.close(fig)


def test_overview_and_histogram():
    fig = plots.format_overview()
    assert len(fig.axes) == 2
    plt.close(fig)
    fig = plots.plot_magnitude_histogram(np.array([1e-3, 1e-5, 0.0]), [("t", 1e-4)])
    assert len(fig.axes[0].get_lines()) == 1
    plt.close(fig)
