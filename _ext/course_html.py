"""Small fixes to the HTML that Jupyter Book 1 emits, found by the browser tests (tests/test_site.py).

* sphinx-thebe registers its inline config script once per read pass, so pages carried two
  ``const THEBE_JS_URL = ...`` scripts and the browser threw "Identifier 'THEBE_JS_URL' has
  already been declared". Identical scripts are de-duplicated.
* pydata-sphinx-theme logs "Got invalid theme mode" on every first visit when ``default_mode`` is
  empty; it is set to ``auto`` (follow the reader's system setting).
"""


def _dedupe_scripts(app, pagename, templatename, context, doctree):
    seen, out = set(), []
    for js in context.get("script_files", []):
        # the same inline script arrives once with filename None and once with '' (both inline)
        key = (getattr(js, "filename", js) or "",
               tuple(sorted((k, str(v)) for k, v in getattr(js, "attributes", {}).items())))
        if key in seen:
            continue
        seen.add(key)
        out.append(js)
    context["script_files"] = out
    if not context.get("default_mode"):
        context["default_mode"] = "auto"


def setup(app):
    app.connect("html-page-context", _dedupe_scripts, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
