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


# --------------------------------------------------------------------------------------
# what a figure's PNG records about its texts
# --------------------------------------------------------------------------------------
PNG_KEY = "course-figure"  # PNG text chunk: JSON {"dpi": …, "texts": [{"text", "pt"}]}


def figure_texts(fig) -> list[dict]:
    """Every text a figure draws (titles, axis and tick labels in view, legends,
    annotations) with its size in points, after a draw."""
    from matplotlib.text import Text

    fig.canvas.draw()
    ticks, shown = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                ticks |= {id(tick.label1), id(tick.label2)}
            # the labels of the ticks in view (the others are not drawn)
            shown += [t for t in axis.get_ticklabels(which="both") if t.get_text()]
    shown += [
        t
        for t in fig.findobj(Text)
        if id(t) not in ticks and t.get_visible() and t.get_text().strip()
    ]
    seen, out = set(), []
    for t in shown:
        if id(t) in seen:
            continue
        seen.add(id(t))
        out.append({"text": t.get_text(), "pt": round(float(t.get_fontsize()), 2)})
    return out


def record(fig) -> dict:
    """What :func:`png_with_record` stores: the dpi the PNG is drawn at and the
    figure's texts with their sizes (``tests/page_audit.py`` turns them into pixels
    on a phone from the width the page shows the PNG at)."""
    import matplotlib

    dpi = matplotlib.rcParams["savefig.dpi"]
    dpi = fig.dpi if dpi == "figure" else dpi
    return {"dpi": float(dpi), "texts": figure_texts(fig)}


def png_with_record(fig):
    """IPython's inline PNG of ``fig`` (tight bounding box, base64) with
    :func:`record` in the PNG's :data:`PNG_KEY` text chunk."""
    import json

    from IPython.core.pylabtools import print_figure

    info = json.dumps(record(fig), ensure_ascii=True)
    return print_figure(
        fig, "png", bbox_inches="tight", base64=True, metadata={PNG_KEY: info}
    )


def record_figures(ip) -> None:
    """Make every figure the kernel ``ip`` displays (``plt.show()``, ``glue``) carry
    its record; re-registered before each cell, since ``%matplotlib inline`` resets
    the PNG formatter."""
    from matplotlib.figure import Figure

    def register(*_):
        ip.display_formatter.formatters["image/png"].for_type(Figure, png_with_record)

    register()
    if not getattr(ip, "_course_record_figures", False):
        ip.events.register("pre_run_cell", register)
        ip._course_record_figures = True
