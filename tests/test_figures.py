"""Figures a phone can read: coursekit.figures.legible, and the chapters that use it."""

from __future__ import annotations

import re
from pathlib import Path

import matplotlib
import nbformat

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from coursekit.figures import MAX_WIDTH_IN, legible, rendered_px  # noqa: E402

BOOK = Path(__file__).resolve().parents[1] / "book"
# chapters whose every glued figure goes through legible()
LEGIBLE_CHAPTERS = ("06", "07", "08", "09")


def test_legible_narrows_the_figure_and_raises_small_text():
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3))
    a.plot([1, 2], label="x")
    a.set_title("t", fontsize=6)
    a.legend(fontsize=6)
    b.annotate("note", (1, 1), fontsize=5)
    legible(fig)
    fig.canvas.draw()
    assert fig.get_size_inches()[0] == MAX_WIDTH_IN
    sizes = [t.get_fontsize() for t in fig.findobj(Text) if t.get_text()]
    assert min(sizes) >= 11
    assert a.title.get_fontsize() >= 12
    assert min(rendered_px(s, MAX_WIDTH_IN) for s in sizes) >= 9
    plt.close(fig)


def test_chapter_figures_go_through_legible():
    for prefix in LEGIBLE_CHAPTERS:
        (path,) = BOOK.glob(f"{prefix}_*.ipynb")
        nb = nbformat.read(path, as_version=4)
        for c in nb.cells:
            if c.cell_type != "code":
                continue
            for m in re.finditer(r'glue\("(fig_\w+)", ([^)]*\)?)\)', c.source):
                assert m.group(2).startswith("legible("), (path.stem, m.group(1))


def test_no_mathtext_in_chinese_labels():
    """A label mixing CJK and $...$ is drawn in the math font, which has no CJK
    glyphs: the Chinese comes out as boxes."""
    for prefix in LEGIBLE_CHAPTERS:
        (path,) = BOOK.glob(f"{prefix}_*.ipynb")
        nb = nbformat.read(path, as_version=4)
        for c in nb.cells:
            for m in re.finditer(r'zh\(\s*f?"([^"]*)"', c.source):
                zh_text = m.group(1)
                assert not (
                    re.search(r"[\u4e00-\u9fff]", zh_text) and "$" in zh_text
                ), (
                    path.stem,
                    zh_text,
                )


def test_png_carries_the_sizes_of_its_texts():
    """The PNG the kernel stores for a figure records the dpi and each text drawn with
    its size (tests/page_audit.py turns them into pixels on a phone); tick labels out
    of view are not drawn, so not recorded."""
    import base64
    import io
    import json

    from PIL import Image

    from coursekit.figures import PNG_KEY, png_with_record

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1], [0, 1], label="训练（train）")
    ax.set_xlim(0, 1)
    ax.set_xticks([0, 0.5, 1, 5])
    ax.set_title("标题", fontsize=13)
    ax.annotate("小字", (0.5, 0.5), fontsize=7)
    ax.legend()
    png = base64.b64decode(png_with_record(fig))
    plt.close(fig)
    with Image.open(io.BytesIO(png)) as im:
        rec = json.loads(im.info[PNG_KEY])
    sizes = {t["text"]: t["pt"] for t in rec["texts"]}
    assert rec["dpi"] == plt.rcParams["savefig.dpi"] or rec["dpi"] == fig.dpi
    assert sizes["标题"] == 13 and sizes["小字"] == 7 and "训练（train）" in sizes
    assert "0.5" in sizes and "5" not in sizes  # the tick at 5 is out of view
