"""Figures a phone can read.

The book shows a figure about 350 px wide on a 390 px phone, so a text of ``s`` points
in a figure ``w`` inches wide renders at ``s * 350 / (72 * w)`` px. :func:`legible`
makes a figure at most :data:`MAX_WIDTH_IN` wide and every text in it (ticks, labels,
legend, annotations) at least :data:`MIN_PT`, titles :data:`TITLE_PT` — about 9.7 and
10.6 px on that phone.
"""

from __future__ import annotations

MAX_WIDTH_IN = 5.5
MIN_PT = 11
TITLE_PT = 12
PHONE_PX = 350


def rendered_px(size_pt: float, width_in: float) -> float:
    """Pixel height of a ``size_pt`` text in a ``width_in`` wide figure on a phone."""
    return size_pt * PHONE_PX / (72 * width_in)


def legible(fig, max_width_in: float = MAX_WIDTH_IN):
    """Shrink ``fig`` to ``max_width_in`` (keeping its aspect) and raise every text
    below :data:`MIN_PT` (titles: :data:`TITLE_PT`); returns ``fig``."""
    from matplotlib.text import Text

    w, h = fig.get_size_inches()
    if w > max_width_in:
        fig.set_size_inches(max_width_in, h * max_width_in / w)
    titles = {id(fig._suptitle)} if fig._suptitle is not None else set()
    for ax in fig.axes:
        ax.tick_params(which="both", labelsize=MIN_PT)
        titles |= {id(ax.title), id(ax._left_title), id(ax._right_title)}
    for t in fig.findobj(Text):
        floor = TITLE_PT if id(t) in titles else MIN_PT
        if t.get_text() and t.get_fontsize() < floor:
            t.set_fontsize(floor)
    fig.tight_layout()
    return fig
