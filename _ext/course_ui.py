"""The book's interface in Chinese, working menus, and authoring plumbing kept off the
page.

* **Chinese search.** Sphinx's Chinese index splitter uses ``jieba`` (a build
  dependency); the course's own terms (``zh_terms.txt``: 显存, 混合精度, 梯度累积 …) are
  loaded as a user dictionary so they are indexed as whole words as well as their parts.
  ``course-search.js`` cuts a Chinese query into the words the index knows.
* **Menus.** ``course-nav.js`` makes the article header's ☰ / ≡ buttons work (see the
  file); ``course.css`` hides the theme's extra top navbar, so the page has one search
  box.
* **Interface strings.** Toggle prompts of hidden cells ("显示代码" / "隐藏输出"), the
  togglebutton hint, and the tooltips and labels that the themes hard-code in English
  are given in Chinese (rewritten in the rendered HTML: the themes have no catalog entry
  for them).
* **Plumbing.** The setup cells (tags ``colab-setup`` and ``setup``: the Colab
  bootstrap, imports, seeds, the version and ``COURSE_GPU`` line) are not on the page;
  the notebook keeps them first, so Jupyter and Colab run them first. In the code a
  page shows, statements that only feed the prose (``glue(...)`` calls, loops made only
  of them), ``# nbval-ignore-output`` and other comments about nbval, ``with
  measured(...):`` wrappers (the body is shown, dedented), ``rtol=``/``atol=``
  arguments of ``md_table``/``glue`` and the tolerance dicts passed to them as
  ``**tol`` are left out (``coursekit.tidy.visible_source``); the notebook itself is
  unchanged. A code cell with nothing left to show is dropped from the page.
* **GPU cells.** The first line of a GPU cell's output says where it ran
  (``coursekit.gpu.CPU_LABEL``: "以下为 CPU 小规模运行的输出；在 GPU 上运行会…", or the
  GPU's name); the page shows that line as a note above the output
  (``p.gpu-run-note``).
* **Alt text.** A figure printed by a code cell gets, when it has none, an alt text made
  of the titles and axis labels its code writes ("图：…；横轴 …；纵轴 …"). Captioned
  figures set their own (``{glue:figure}`` with ``:alt:``).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from docutils import nodes
from sphinx.transforms.post_transforms import SphinxPostTransform

HERE = Path(__file__).parent
TERMS = HERE / "zh_terms.txt"

# English strings the themes hard-code in attributes (title=, aria-label=, ...), and a
# few Traditional-Chinese wordings of the zh_CN catalog.
UI_STRINGS = {
    "Toggle primary sidebar": "章节目录",
    "Toggle secondary sidebar": "本页目录",
    "Launch on Colab": "在 Colab 中打开",
    "Launch interactive content": "在线运行",
    "Colab logo": "Colab 图标",
    "Open In Colab": "在 Colab 中打开",
    "Color mode": "颜色模式",
    "System Settings": "跟随系统",
    "Link to this heading": "链接到本标题",
    "Link to this image": "链接到本图",
    "Link to this table": "链接到本表",
    "Link to this code": "链接到本代码",
    "Link to this equation": "链接到本公式",
    "Link to this definition": "链接到本定义",
    "Toggle hidden content": "展开或收起隐藏的内容",
    "Search this book...": "搜索本书…",
    "Main": "主导航",
    "Page": "本页",
    "列印成 PDF": "打印为 PDF",
}
_ATTR = re.compile(r'\b(title|aria-label|data-bs-title|placeholder|alt)="([^"]*)"')

# myst-nb fills {type} of nb_code_prompt_show/hide with these English words
PROMPT_TYPES = {
    "content": "代码与输出",
    "source": "代码",
    "outputs": "输出",
    "output": "输出",
}


def translate_attributes(html: str) -> str:
    """Replace whole attribute values listed in :data:`UI_STRINGS`."""

    def sub(m):
        value = UI_STRINGS.get(m.group(2))
        return m.group(0) if value is None else f'{m.group(1)}="{value}"'

    return _ATTR.sub(sub, html)


class ChinesePrompts(SphinxPostTransform):
    """Runs after myst-nb's ``HideInputCells`` (priority 199) has filled in
    ``{type}``."""

    default_priority = 210
    formats = ("html",)

    def run(self, **kwargs):
        try:
            from myst_nb.sphinx_ import HideCodeCellNode
        except ImportError:  # pragma: no cover
            return
        for node in self.document.findall(HideCodeCellNode):
            for key in ("prompt_show", "prompt_hide"):
                text = node.get(key, "")
                for en, zh in PROMPT_TYPES.items():
                    if text.endswith(en):
                        text = text[: -len(en)] + zh
                        break
                node[key] = text


SETUP_TAGS = ("colab-setup", "setup")


def _cell_tags(cell) -> list[str]:
    return list((cell.get("cell_metadata") or {}).get("tags") or [])


def _code_cells(doctree) -> list:
    return [
        c
        for c in doctree.findall(nodes.container)
        if c.get("nb_element") == "cell_code"
    ]


def _sources(cell) -> list:
    return [
        b
        for src in cell.children
        if src.get("nb_element") == "cell_code_source"
        for b in src.findall(nodes.literal_block)
    ]


def _label_gpu_output(cell) -> None:
    """Move the "where it ran" label line of a GPU cell's output into a note."""
    from coursekit.gpu import LABEL_PREFIXES

    for out in [c for c in cell.children if c.get("nb_element") == "cell_code_output"]:
        for block in list(out.findall(nodes.literal_block)):
            text = block.astext()
            if not text.startswith(LABEL_PREFIXES):
                continue
            label, _, rest = text.partition("\n")
            note = nodes.paragraph("", "", nodes.Text(label), classes=["gpu-run-note"])
            block.parent.insert(block.parent.index(block), note)
            if rest.strip():
                block.children = [nodes.Text(rest)]
                block.rawsource = rest
            else:
                block.parent.remove(block)
            return


def _hide_plumbing(app, doctree):
    """Leave setup cells, glue calls, nbval comments and measurement wrappers out of
    the page; label GPU cells' output."""
    from coursekit.tidy import tolerance_names, visible_source

    cells = _code_cells(doctree)
    tol_names = tolerance_names(b.astext() for c in cells for b in _sources(c))
    for cell in cells:
        tags = _cell_tags(cell)
        if any(t in SETUP_TAGS for t in tags):
            cell.parent.remove(cell)
            continue
        if "gpu" in tags:
            _label_gpu_output(cell)
        for src in [
            c for c in cell.children if c.get("nb_element") == "cell_code_source"
        ]:
            for block in list(src.findall(nodes.literal_block)):
                text = block.astext()
                shown = visible_source(text, tol_names)
                if shown == text:
                    continue
                if shown.strip():
                    block.children = [nodes.Text(shown)]
                    block.rawsource = shown
                else:
                    src.parent.remove(src)
        kinds = [c.get("nb_element") for c in cell.children]
        if "cell_code_source" not in kinds and "cell_code_output" not in kinds:
            cell.parent.remove(cell)


_TITLE_CALLS = {
    "set_title": "",
    "suptitle": "",
    "title": "",
    "set_xlabel": "横轴 ",
    "set_ylabel": "纵轴 ",
    "xlabel": "横轴 ",
    "ylabel": "纵轴 ",
}


def figure_alt(source: str) -> str | None:
    """Alt text for a figure drawn by ``source``: its titles and axis labels, as written
    in the code (string literals only), or None when the code names none."""
    import ast

    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    titles, labels = [], []

    def text_of(arg):
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return arg.value.strip()
        if isinstance(
            arg, ast.JoinedStr
        ):  # f"...{x}...": the computed parts become "…"
            return "".join(
                v.value if isinstance(v, ast.Constant) else "…" for v in arg.values
            ).strip()
        return ""

    def add(kind, arg):
        text = text_of(arg)
        if text.strip("…"):
            (labels if kind else titles).append(kind + text)

    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr == "set":  # ax.set(title=..., xlabel=..., ylabel=...)
            for kw in node.keywords:
                if kw.arg in _TITLE_CALLS:
                    add(_TITLE_CALLS[kw.arg], kw.value)
            continue
        kind = _TITLE_CALLS.get(node.func.attr)
        if kind is not None and node.args:
            add(kind, node.args[0])
    parts = list(dict.fromkeys(titles)) + list(dict.fromkeys(labels))
    return "图：" + "；".join(parts) if parts else None


class FigureAlt(SphinxPostTransform):
    """Runs after myst-nb has chosen each output's mime type (image nodes exist by
    then)."""

    default_priority = 900
    formats = ("html",)

    def run(self, **kwargs):
        for cell in self.document.findall(nodes.container):
            if cell.get("nb_element") != "cell_code":
                continue
            images = [i for i in cell.findall(nodes.image) if not i.get("alt")]
            if not images:
                continue
            src = [
                c
                for c in cell.findall(nodes.container)
                if c.get("nb_element") == "cell_code_source"
            ]
            alt = figure_alt(
                cell.get("nb_source", "") or (src[0].astext() if src else "")
            )
            for image in images:
                if alt:
                    image["alt"] = alt


def _search_options(app, config):
    opts = dict(config.html_search_options or {})
    opts.setdefault("dict", str(TERMS))
    config.html_search_options = opts
    logging.getLogger("jieba").setLevel(logging.WARNING)
    try:
        import jieba

        jieba.setLogLevel(logging.WARNING)
    except ImportError:
        from sphinx.util import logging as sphinx_logging

        sphinx_logging.getLogger(__name__).warning(
            "jieba is not installed: the search index will hold no Chinese words "
            "(pip install jieba; it is in the [dev] extras)"
        )


def _wrap_renderer(app):
    """Translate hard-coded English attributes in every rendered page."""
    templates = getattr(app.builder, "templates", None)
    if templates is None or getattr(templates, "_course_ui", False):
        return
    render = templates.render

    def render_zh(template, context):
        return translate_attributes(render(template, context))

    templates.render = render_zh
    templates._course_ui = True


def setup(app):
    app.connect("config-inited", _search_options)
    app.connect("builder-inited", _wrap_renderer)
    app.connect("doctree-read", _hide_plumbing)
    app.add_post_transform(ChinesePrompts)
    app.add_post_transform(FigureAlt)
    app.add_js_file("course-nav.js")
    app.add_js_file("course-search.js")
    app.add_js_file("course-ui.js")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
