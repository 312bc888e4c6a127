"""Chinese text in matplotlib figures, when the machine has a CJK font.

``setup()`` calls :func:`use_cjk_font`: if a CJK font is installed (the book's machine
has ``fonts-noto-cjk``, see the Makefile), figures use it for Chinese labels. Colab and
bare machines have none, and a Chinese label would be drawn as empty boxes there, so a
figure writes its labels with :func:`zh`::

    ax.set_xlabel(zh("训练步数", "training step"))

which gives the Chinese text where it can be drawn and the English one elsewhere.
"""

from __future__ import annotations

# Simplified-Chinese fonts first; any of them draws every label of the course.
PREFERRED = (
    "Noto Sans CJK SC",
    "Source Han Sans SC",
    "Noto Sans SC",
    "WenQuanYi Zen Hei",
    "WenQuanYi Micro Hei",
    "Microsoft YaHei",
    "SimHei",
    "PingFang SC",
    "Heiti SC",
    "Noto Sans CJK JP",
    "Noto Sans CJK TC",
)

_active: str | None = None


def find_cjk_font() -> str | None:
    """The name of an installed CJK font matplotlib can use, or None."""
    try:
        from matplotlib import font_manager
    except ImportError:  # pragma: no cover
        return None
    names = {f.name for f in font_manager.fontManager.ttflist}
    return next((n for n in PREFERRED if n in names), None)


def use_cjk_font() -> str | None:
    """Add a CJK font as matplotlib's fallback font; return its name (None: none found,
    matplotlib's settings are left alone)."""
    global _active
    name = find_cjk_font()
    if name is None:
        _active = None
        return None
    import matplotlib

    # Latin text keeps matplotlib's default sans-serif (DejaVu Sans: every figure looks
    # as before, math minus and superscripts included); glyphs it lacks (CJK) fall back
    # to the CJK font.
    family = matplotlib.rcParams["font.family"]
    family = [family] if isinstance(family, str) else list(family)
    matplotlib.rcParams["font.family"] = [f for f in family if f != name] + [name]
    _active = name
    return name


def cjk_available() -> bool:
    """Whether setup() found a CJK font for the figures of this session."""
    return _active is not None


def zh(chinese: str, english: str) -> str:
    """``chinese`` if figures can draw it on this machine, else ``english``."""
    return chinese if _active is not None else english
