"""The book's interface in Chinese, working menus, and authoring plumbing kept off the
page.

* **Chinese search.** Sphinx's Chinese index splitter uses ``jieba`` (a build
  dependency); the course's own terms (``zh_terms.txt``: 显存, 混合精度, 梯度累积 …) are
  loaded as a user dictionary so they are indexed as whole words as well as their parts.
  ``course-search.js`` cuts a Chinese query into the words the index knows.
* **Search ranking and snippets.** At the end of the build the prose of every page
  (no code cells, outputs, math or raw HTML), cut into the index's own words (Sphinx's
  Chinese splitter), is written as term counts to ``_static/course-search-data.js``,
  which only the search page loads; ``course-search.js`` ranks the pages found by BM25
  over those counts plus a bonus for a word in the page title, lists each page once,
  and builds snippets from the prose only.
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
* **Raw reprs.** A cell whose value is a flat ``dict`` of names to numbers or strings
  (``{'7B': 6738415616, ...}``) is shown as a two-column table, not as Python's repr.
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
SYNONYMS = HERE / "zh_synonyms.txt"


def synonyms(path: Path = SYNONYMS) -> dict[str, list[str]]:
    """Each word of a group in ``zh_synonyms.txt`` → the other words of its group."""
    out: dict[str, list[str]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        group = line.split("#", 1)[0].split()
        for w in group:
            out[w] = [o for o in group if o != w]
    return out


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


MAX_REPR_ROWS = 40


def repr_rows(text: str) -> list[tuple[str, str]] | None:
    """``[(key, value), ...]`` when ``text`` is the repr of a flat dict of str keys to
    numbers, bools or short strings (what a table shows better); else None."""
    import ast

    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(value, dict) or not 0 < len(value) <= MAX_REPR_ROWS:
        return None
    rows = []
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, (int, float, str, bool)):
            return None
        if isinstance(v, str) and len(v) > 80:
            return None
        if isinstance(v, bool) or isinstance(v, str):
            shown = str(v)
        elif isinstance(v, int):
            shown = f"{v:,}"
        else:
            shown = repr(v)
        rows.append((k, shown))
    return rows


def _table(rows: list[tuple[str, str]]) -> nodes.table:
    table = nodes.table(classes=["repr-table"])
    group = nodes.tgroup(cols=2)
    table += group
    group += nodes.colspec(colwidth=1)
    group += nodes.colspec(colwidth=1)
    body = nodes.tbody()
    group += body
    for k, v in rows:
        row = nodes.row()
        for text in (k, v):
            entry = nodes.entry()
            entry += nodes.paragraph("", "", nodes.Text(text))
            row += entry
        body += row
    return table


def _tables_for_reprs(cell) -> None:
    for out in [c for c in cell.children if c.get("nb_element") == "cell_code_output"]:
        for block in list(out.findall(nodes.literal_block)):
            if "text_plain" not in block.get("classes", []):
                continue
            rows = repr_rows(block.astext())
            if rows:
                block.parent.replace(block, _table(rows))


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
        _tables_for_reprs(cell)
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
        if (  # coursekit.fonts.zh("中文", "English"): the Chinese text the page shows
            isinstance(arg, ast.Call)
            and isinstance(arg.func, ast.Name)
            and arg.func.id == "zh"
            and arg.args
        ):
            return text_of(arg.args[0])
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


class MergeOutputs(SphinxPostTransform):
    """A cell's printed text and its ``measured`` (or value) text, one after the other,
    are one output box on the page, as they are one run of text in Jupyter. Runs after
    myst-nb has chosen each output's mime type (priority 4)."""

    default_priority = 890
    formats = ("html",)

    @staticmethod
    def _text_block(node) -> bool:
        classes = node.get("classes", []) if isinstance(node, nodes.Element) else []
        return (
            isinstance(node, nodes.literal_block)
            and "output" in classes
            and ("stream" in classes or "text_plain" in classes)
        )

    def run(self, **kwargs):
        for out in list(self.document.findall(nodes.container)):
            if out.get("nb_element") != "cell_code_output":
                continue
            kids = list(out.children)
            i = 0
            while i + 1 < len(kids):
                a, b = kids[i], kids[i + 1]
                if self._text_block(a) and self._text_block(b):
                    text = a.astext().rstrip("\n") + "\n" + b.astext()
                    a.children = [nodes.Text(text)]
                    a.rawsource = text
                    out.remove(b)
                    kids.pop(i + 1)
                    continue
                i += 1


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


def fast_chinese_stem() -> bool:
    """Make Sphinx's Chinese search language stem in linear time, with the same result.

    ``SearchChinese.stem`` (Sphinx 7) asks ``word in self.latin_terms`` for every
    word of every page, and that list holds every Latin word split so far in the whole
    build, repeats included: the index took a quarter of the book's build. Here the
    membership is asked of a set kept up to date with the list. Returns whether the
    patch applies (a Sphinx without that list or method is left alone)."""
    from sphinx.search import zh

    cls = zh.SearchChinese
    if getattr(cls, "_course_fast_stem", False):
        return True
    original = getattr(cls, "stem", None)
    if original is None or not isinstance(getattr(cls, "latin_terms", None), list):
        return False

    def stem(self, word: str) -> str:
        terms = self.latin_terms
        seen = self.__dict__.setdefault("_course_latin", [0, set()])
        if seen[0] != len(terms):
            seen[1].update(terms[seen[0] :])
            seen[0] = len(terms)
        low = self.stemmer.stemWord(word.lower())
        if word in seen[1] and len(word) >= 3 and len(low) < 3:
            return word.lower()
        return low

    stem._course_original = original
    cls.stem = stem
    cls._course_fast_stem = True
    return True


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


SEARCH_DATA = "course-search-data.js"
_PROSE_SKIP = (
    nodes.literal_block,
    nodes.math,
    nodes.math_block,
    nodes.raw,
    nodes.comment,
    nodes.doctest_block,
    nodes.system_message,
)


def prose_text(doctree) -> str:
    """The text of a page a reader reads as prose: titles, paragraphs, lists, tables
    and admonitions, without code cells and their outputs, code blocks, math and raw
    HTML."""
    parts: list[str] = []
    stack = [doctree]
    while stack:
        node = stack.pop()
        if isinstance(node, _PROSE_SKIP):
            continue
        if isinstance(node, nodes.container) and str(
            node.get("nb_element", "")
        ).startswith("cell_code"):
            continue
        if isinstance(node, nodes.Text):
            parts.append(str(node))
            continue
        if isinstance(node, (nodes.paragraph, nodes.title, nodes.term)):
            parts.append("\n")
        stack.extend(reversed(node.children))
    return "".join(parts)


def heading_text(doctree) -> str:
    """What a page names as its subjects: its section titles and the bold words that
    open a paragraph (a definition: "**优化器状态。** AdamW 的 m、v …"), one per line.
    The search page ranks a page whose headings name a word above one that only
    mentions it (``course-search.js``)."""
    out = []
    for node in doctree.findall(nodes.title):
        if isinstance(node.parent, nodes.section):
            out.append(node.astext())
    for node in doctree.findall(nodes.strong):
        parent = node.parent
        if not isinstance(parent, nodes.paragraph):
            continue
        lead = next(
            (c for c in parent.children if not isinstance(c, nodes.Text) or c.strip()),
            None,
        )
        if lead is node:
            out.append(node.astext())
    return "\n".join(out)


def search_data(docs: dict[str, tuple[str, ...]], lang, root: str = "") -> dict:
    """Term counts per page for the search page's ranking: ``docs`` maps a docname to
    (title, prose text[, heading text: :func:`heading_text`]); ``lang`` is the
    builder's search language. Words are cut and stemmed as the search index cuts
    them (Sphinx's Chinese language: jieba's ``cut_for_search`` plus Latin words,
    stemmed unless too short after stemming), with the stems memoised (Sphinx's own
    ``stem`` scans a growing list per word).
    ``root``: the root document (its title is the book's title)."""
    import functools

    split = getattr(lang, "split")
    latin_re = getattr(lang, "latin1_letters", None)
    stemmer = getattr(lang, "stemmer", None)
    latin_words: set[str] = set()

    @functools.cache
    def stem(word: str) -> str:
        if stemmer is None:
            return lang.stem(word).lower()
        low = word.lower()
        stemmed = stemmer.stemWord(low)
        if word in latin_words and len(word) >= 3 and len(stemmed) < 3:
            return low
        return stemmed.lower()

    def words_of(text: str) -> list[str]:
        if latin_re is None:
            return split(text)
        import jieba

        latin = [t.strip() for t in latin_re.findall(text)]
        latin_words.update(latin)
        return list(jieba.cut_for_search(text)) + latin

    names = sorted(docs)
    tf: dict[str, dict[int, int]] = {}
    lengths = []
    for i, name in enumerate(names):
        n = 0
        for w in words_of(docs[name][1]):
            stemmed = stem(w)
            if not lang.word_filter(stemmed):
                if not lang.word_filter(w):
                    continue
                stemmed = w.lower()
            n += 1
            counts = tf.setdefault(stemmed, {})
            counts[i] = counts.get(i, 0) + 1
        lengths.append(n)
    avg = sum(lengths) / len(lengths) if lengths else 1.0
    return {
        "docs": names,
        "root": root,
        "titles": [docs[n][0] for n in names],
        "heads": [docs[n][2] if len(docs[n]) > 2 else "" for n in names],
        "synonyms": synonyms(),
        "len": lengths,
        "avg": avg or 1.0,
        "tf": tf,
    }


def _write_search_data(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    indexer = getattr(app.builder, "indexer", None)
    if indexer is None:
        return
    import json

    docs = {}
    for name in sorted(app.env.found_docs):
        try:
            doctree = app.env.get_doctree(name)
        except Exception:  # a document that was not read (excluded)
            continue
        title = app.env.titles.get(name)
        docs[name] = (
            title.astext() if title is not None else name,
            prose_text(doctree),
            heading_text(doctree),
        )
    data = search_data(docs, indexer.lang, root=app.config.root_doc)
    out = Path(app.outdir) / "_static" / SEARCH_DATA
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        "window.COURSE_SEARCH = "
        + json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        + ";\n",
        encoding="utf-8",
    )


def _search_page_scripts(app, pagename, templatename, context, doctree):
    if pagename == "search":
        app.add_js_file(SEARCH_DATA)


def setup(app):
    fast_chinese_stem()
    app.connect("config-inited", _search_options)
    app.connect("builder-inited", _wrap_renderer)
    app.connect("doctree-read", _hide_plumbing)
    app.connect("html-page-context", _search_page_scripts)
    app.connect("build-finished", _write_search_data)
    app.add_post_transform(ChinesePrompts)
    app.add_post_transform(FigureAlt)
    app.add_post_transform(MergeOutputs)
    app.add_js_file("course-nav.js")
    app.add_js_file("course-search.js")
    app.add_js_file("course-ui.js")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
