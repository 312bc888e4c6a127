"""Small fixes to the HTML that Jupyter Book 1 emits, found by the browser tests
(tests/test_site.py).

* sphinx-thebe registers its inline config script once per read pass, so pages carried
  two ``const THEBE_JS_URL = ...`` scripts and the browser threw "Identifier
  'THEBE_JS_URL' has already been declared". Identical scripts are de-duplicated.
* pydata-sphinx-theme logs "Got invalid theme mode" on every first visit when
  ``default_mode`` is empty; it is set to ``auto`` (follow the reader's system setting).
* The "Open in Colab" badge that notebooks embed (an image on colab.research.google.com)
  is served from the book's own ``_static/colab-badge.svg``, so pages load nothing from
  another host.
* A line break inside a Chinese paragraph of the Markdown source is a soft break, which
  browsers render as a space ("来自 那一章"). Breaks between two CJK characters are
  removed from the text.
"""

import re

from docutils import nodes

_CJK = "\u2e80-\u9fff\u3000-\u303f\uff00-\uffef"
_SOFT_BREAK = re.compile(f"(?<=[{_CJK}])\\n(?=[{_CJK}])")
_SKIP = (nodes.literal, nodes.literal_block, nodes.math, nodes.math_block, nodes.raw)


def _is_cjk(ch: str) -> bool:
    return bool(ch) and bool(re.match(f"[{_CJK}]", ch))


def _join_cjk_lines(app, doctree, docname):
    """Drop soft line breaks between CJK characters. MyST emits a soft break either
    inside a Text node or as a Text node of its own ("\\n") between two siblings."""
    for text in list(doctree.findall(nodes.Text)):
        parent = text.parent
        if parent is None or "\n" not in text or isinstance(parent, _SKIP):
            continue
        if str(text).strip() == "":
            # by identity: Text is a str, so parent.index() would find the first equal
            # "\n"
            i = next(k for k, c in enumerate(parent.children) if c is text)
            prev_ = parent[i - 1] if i > 0 else None
            next_ = parent[i + 1] if i + 1 < len(parent) else None
            before = prev_.astext()[-1:] if prev_ is not None else ""
            after = next_.astext()[:1] if next_ is not None else ""
            if _is_cjk(before) and _is_cjk(after):
                parent[i] = nodes.Text("")
            continue
        new = _SOFT_BREAK.sub("", str(text))
        if new != str(text):
            parent.replace(text, nodes.Text(new))


COLAB_BADGE = "https://colab.research.google.com/assets/colab-badge.svg"


def _local_badge(app, pagename, templatename, context, doctree):
    body = context.get("body")
    if body and COLAB_BADGE in body:
        context["body"] = body.replace(
            COLAB_BADGE, context["pathto"]("_static/colab-badge.svg", 1)
        )


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    seen, out = set(), []
    for js in context.get("script_files", []):
        # the same inline script arrives once with filename None and once with '' (both
        # inline)
        key = (
            getattr(js, "filename", js) or "",
            tuple(
                sorted((k, str(v)) for k, v in getattr(js, "attributes", {}).items())
            ),
        )
        if key in seen:
            continue
        seen.add(key)
        out.append(js)
    context["script_files"] = out
    if not context.get("default_mode"):
        context["default_mode"] = "auto"


def setup(app):
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    app.connect("doctree-resolved", _join_cjk_lines)
    app.connect("html-page-context", _local_badge)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
