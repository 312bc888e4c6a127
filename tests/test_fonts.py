"""coursekit.fonts: Chinese figure labels where a CJK font exists, English ones
elsewhere."""

from __future__ import annotations

import warnings

import matplotlib
import pytest

matplotlib.use("Agg")

from coursekit import fonts  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_rc():
    with matplotlib.rc_context():
        yield
    fonts._active = None


def test_chinese_label_drawn_without_missing_glyphs():
    name = fonts.use_cjk_font()
    if name is None:
        pytest.skip("no CJK font on this machine (Debian: fonts-noto-cjk)")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.set_title(fonts.zh("峰值显存（GiB）", "peak memory (GiB)") + " 2⁻¹⁰ −1 µs")
    ax.semilogy([-2, 2], [1e-8, 1e3])
    with warnings.catch_warnings():
        # "Glyph ... missing from font(s)" is a UserWarning
        warnings.simplefilter("error")
        fig.canvas.draw()
    plt.close(fig)
    assert fonts.cjk_available() and fonts.zh("显存", "memory") == "显存"
    assert matplotlib.rcParams["font.family"][-1] == name


def test_without_a_cjk_font_labels_fall_back_to_english(monkeypatch):
    monkeypatch.setattr(fonts, "find_cjk_font", lambda: None)
    before = list(matplotlib.rcParams["font.family"])
    assert fonts.use_cjk_font() is None
    assert list(matplotlib.rcParams["font.family"]) == before
    assert fonts.zh("显存", "memory") == "memory"
