"""The book as a reader meets it: built with -W, then loaded in headless Chromium.

The site is served from 127.0.0.1; every other host is cut off, so nothing may depend on
a CDN. Full-page screenshots of every chapter and lab (desktop 1280×800, phone 390×844)
are written to _build/screenshots/ (``python -m tests.screenshots`` writes them for
every page without the tests).
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import unquote, urlparse

import nbformat
import pytest

from tests.notebooks import ROOT
from tests.site import (
    CHROMIUM_ARGS,
    DESKTOP,
    HTML,
    PHONE,
    SCREENSHOTS,
    SiteServer,
    build_book,
    chromium_path,
    open_page,
    screenshot_name,
    source_of,
    toc_files,
    wait_for_math,
)

DOCS = toc_files()
COLAB = re.compile(
    r"^https://colab\.research\.google\.com/github/([^/]+)/([^/]+)/blob/([^/]+)/(.+\.ipynb)$"
)


@pytest.fixture(scope="module")
def build():
    return build_book()


def test_book_builds_with_warnings_as_errors(build):
    log = build.stdout + build.stderr
    warnings = [ln for ln in log.splitlines() if "WARNING" in ln or "ERROR" in ln]
    assert build.returncode == 0, "book build failed:\n" + "\n".join(
        warnings[:40] or log.splitlines()[-40:]
    )
    assert (HTML / "index.html").exists()
    for doc in DOCS:
        assert (HTML / f"{doc}.html").exists(), f"{doc}.html not built"


@pytest.fixture(scope="module")
def browser(build):
    exe = chromium_path()
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make browser-deps installs it)")
        pytest.skip("chromium not installed; run `make browser-deps`")
    if not (HTML / "index.html").exists():
        pytest.fail("the book was not built")
    from playwright.sync_api import sync_playwright

    with SiteServer(HTML) as server, sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        yield b, server.url
        b.close()


def _open(browser, path, viewport=DESKTOP):
    """Open a page with the network cut to 127.0.0.1; return (page, problems)."""
    b, base = browser
    return open_page(b, base, path, viewport)


def _has_math(doc: str) -> bool:
    src = source_of(doc)
    text = src.read_text(encoding="utf-8")
    if src.suffix == ".ipynb":
        nb = nbformat.reads(text, as_version=4)
        text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    return bool(re.search(r"\$[^$\n]+\$|\$\$", text))


@pytest.mark.parametrize("doc", DOCS)
def test_page_loads_offline_and_renders(browser, doc):
    page, problems = _open(browser, f"{doc}.html")
    try:
        assert not problems, "\n".join(problems)
        body = page.inner_text("article")
        if _has_math(doc):
            # wait for MathJax itself to finish typesetting (slow on a loaded CI
            # machine)
            page.wait_for_function(
                "() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                timeout=120000,
            )
            page.evaluate("() => MathJax.startup.promise")
            page.wait_for_selector("mjx-container", state="attached", timeout=120000)
            assert page.locator("mjx-container").count() > 0, "math not typeset"
            assert "$$" not in body, "raw $$ left in the page"
        # glue: no missing keys, no empty pasted values
        assert "{glue" not in body and "missing key" not in body.lower()
        empty = page.evaluate("""() => [
            ...document.querySelectorAll('[class*="pasted"]')]
            .filter(e => e.textContent.trim() === '' && !e.querySelector('img'))
            .length""")
        assert empty == 0, f"{empty} glued values rendered empty"
        # images that are present actually loaded
        broken = page.evaluate(
            "() => [...document.images].filter(i => i.complete && i.naturalWidth === "
            "0).map(i => i.src)"
        )
        assert not broken, f"broken images: {broken}"
    finally:
        page.context.close()


def _demo_docs():
    out = []
    for doc in DOCS:
        src = source_of(doc)
        if (
            src.suffix == ".ipynb"
            and "ipywidgets" in src.read_text(encoding="utf-8")
            and doc.startswith("book/")
        ):
            out.append(doc)
    return out


@pytest.mark.parametrize("doc", _demo_docs())
def test_interactive_demo_has_static_figure(browser, doc):
    page, _ = _open(browser, f"{doc}.html")
    try:
        # a figure in a cell's output, or a glued, captioned one ({glue:figure})
        n = page.evaluate(
            "() => [...document.querySelectorAll('.cell_output img, figure img')]"
            ".filter(i => i.naturalWidth > 0).length"
        )
        assert n >= 1, (
            "a page with an ipywidgets demo must show a static figure of the same sweep"
        )
        assert "interactive(children" not in page.inner_text("article"), (
            "live widget repr leaked into HTML"
        )
    finally:
        page.context.close()


@pytest.mark.parametrize("doc", [d for d in DOCS if source_of(d).suffix == ".ipynb"])
def test_colab_launch_link(browser, doc):
    page, _ = _open(browser, f"{doc}.html")
    try:
        hrefs = page.evaluate(
            "() => [...document.querySelectorAll('a')].map(a => a.href).filter(h => "
            "h.includes('colab.research.google.com'))"
        )
    finally:
        page.context.close()
    assert hrefs, "no Colab launch link"
    for h in set(hrefs):
        m = COLAB.match(h)
        assert m, f"bad Colab URL form: {h}"
        assert m.group(4) == f"{doc}.ipynb", f"Colab link points at {m.group(4)}"
        assert (ROOT / m.group(4)).exists(), (
            f"Colab path {m.group(4)} not in the repository"
        )
    cfg = __import__("yaml").safe_load(
        (ROOT / "_config.yml").read_text(encoding="utf-8")
    )
    org_repo = urlparse(cfg["repository"]["url"]).path.strip("/")
    assert (
        f"{m.group(1)}/{m.group(2)}" == org_repo
        and m.group(3) == cfg["repository"]["branch"]
    )


def _search(browser, query):
    """Run the book's search page for ``query``; return (result hrefs, problems)."""
    page, problems = _open(browser, f"search.html?q={query}")
    try:
        page.wait_for_function(
            "() => document.querySelector('ul.search li a') || "
            "(document.querySelector('#search-results p') && "
            "!document.querySelector('#search-progress')?.textContent.trim())",
            timeout=30000,
        )
        links = page.evaluate(
            "() => [...document.querySelectorAll('ul.search li a')].map(a => a.href)"
        )
    finally:
        page.context.close()
    return links, problems


# a term, and a page that must be among its results (the page about it)
SEARCHES = {
    "LoRA": "book/05_lora_principles",
    "GradScaler": "book/02_mixed_precision",
    "显存": "book/03_training_memory",
    "梯度累积": "book/04_accumulation_checkpointing",
    "混合精度": "book/02_mixed_precision",
    "混合精度的损失缩放": "book/02_mixed_precision",  # a phrase: cut into indexed words
}


@pytest.mark.parametrize("term", list(SEARCHES))
def test_search_finds(browser, term):
    links, problems = _search(browser, term)
    assert not problems, "\n".join(problems)
    assert links, f"search found nothing for {term}"
    paths = []
    for href in links:
        path = unquote(urlparse(href).path).lstrip("/")
        assert (HTML / path).exists(), f"search result {href} does not resolve"
        paths.append(path)
    assert f"{SEARCHES[term]}.html" in paths, (
        f"{term}: {SEARCHES[term]} not among {paths[:12]}"
    )


def test_chinese_words_in_search_index(build):
    """jieba is installed and used: the index holds the course's Chinese terms as
    words."""
    text = (HTML / "searchindex.js").read_text(encoding="utf-8")
    index = json.loads(text[text.index("(") + 1 : text.rindex(")")])
    for word in ("显存", "梯度累积", "混合精度", "主权重", "梯度"):
        assert word in index["terms"], f"{word} is not a word of the search index"


CHAPTERS = [d for d in DOCS if d.startswith("book/") and d[5:7].isdigit()]


@pytest.mark.parametrize("doc", [CHAPTERS[1], "book/intro"])
def test_phone_menu_opens_chapter_list(browser, doc):
    page, problems = _open(browser, f"{doc}.html", viewport=PHONE)
    try:
        assert page.locator("#pst-primary-sidebar-modal[open]").count() == 0
        button = page.locator(".bd-header-article .primary-toggle")
        assert button.is_visible(), "no visible chapter-list button on a phone"
        button.click()
        dialog = page.locator("#pst-primary-sidebar-modal[open]")
        dialog.wait_for(state="visible", timeout=5000)
        titles = page.evaluate("""() => [...document.querySelectorAll(
            '#pst-primary-sidebar-modal[open] nav a')]
            .filter(a => a.offsetParent).map(a => a.href)""")
        for chapter in CHAPTERS:
            assert any(
                unquote(urlparse(h).path).endswith(f"{chapter}.html")
                or (chapter == doc and h.endswith("#"))
                for h in titles
            ), f"{chapter} not in the phone chapter list"
        page.keyboard.press("Escape")
        page.wait_for_selector(
            "#pst-primary-sidebar-modal[open]", state="detached", timeout=5000
        )
        # the theme moves the list back into the sidebar after the drawer's close event
        # "list not restored" otherwise
        page.wait_for_function(
            "n => document.querySelectorAll('#pst-primary-sidebar nav a').length >= n",
            arg=len(CHAPTERS),
            timeout=10000,
        )
        # the page-contents button opens this page's sections
        toc = page.locator(".bd-header-article .secondary-toggle")
        if toc.is_visible():
            toc.click()
            page.locator("#pst-secondary-sidebar-modal[open]").wait_for(
                state="visible", timeout=5000
            )
            links = page.locator(
                "#pst-secondary-sidebar-modal[open] a.nav-link"
            ).count()
            assert links >= 1, "page contents dialog is empty"
        assert not problems, "\n".join(problems)
    finally:
        page.context.close()


def test_desktop_menu_collapses_sidebar(browser):
    page, problems = _open(browser, f"{CHAPTERS[0]}.html", viewport=DESKTOP)
    left = "() => document.querySelector('.bd-article').getBoundingClientRect().left"
    try:
        sidebar = page.locator("#pst-primary-sidebar")
        assert sidebar.is_visible()
        x0 = page.evaluate(left)
        page.locator(".bd-header-article .primary-toggle").click()
        sidebar.wait_for(state="hidden", timeout=5000)
        page.wait_for_timeout(600)  # the theme animates the collapse
        assert page.evaluate(left) < x0 - 50, (
            "the article did not widen when the list collapsed"
        )
        assert page.locator("#pst-primary-sidebar-modal[open]").count() == 0, (
            "opened a dialog"
        )
        page.locator(".bd-header-article .primary-toggle").click()
        sidebar.wait_for(state="visible", timeout=5000)
        assert not problems, "\n".join(problems)
    finally:
        page.context.close()


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_one_search_box(browser, viewport):
    page, problems = _open(browser, f"{CHAPTERS[0]}.html", viewport=viewport)
    try:
        fields = page.evaluate("""() => [...document.querySelectorAll(
            '.search-button-field, .search-button, input[type=search]')]
            .filter(e => e.offsetParent !== null
                         && e.getBoundingClientRect().width > 0).length""")
        assert fields == 1, f"{fields} search boxes/buttons visible"
        assert not page.locator("#pst-header").is_visible(), (
            "the extra top navbar is shown"
        )
        # the reader's path: click it, type a Chinese word, press Enter, land on the
        # results
        page.locator(
            ".search-button-field:visible, .search-button:visible"
        ).first.click()
        box = page.locator("#pst-search-dialog input[type=search]")
        box.wait_for(state="visible", timeout=5000)
        box.fill("混合精度")
        box.press("Enter")
        page.wait_for_url("**/search.html?q=*", timeout=10000)
        page.wait_for_selector("ul.search li a", timeout=30000)
        hrefs = page.evaluate(
            "() => [...document.querySelectorAll('ul.search li a')].map(a => a.href)"
        )
        assert any("02_mixed_precision.html" in h for h in hrefs), hrefs[:5]
        assert not problems, "\n".join(problems)
    finally:
        page.context.close()


ENGLISH_UI = [
    "Click to show",
    "Click to hide",
    "Show code cell",
    "Hide code cell",
    "Toggle primary sidebar",
    "Toggle secondary sidebar",
    "Launch on Colab",
    "Color mode",
    "System Settings",
    "Link to this",
    "Launch interactive content",
    "Toggle hidden content",
    "Search this book",
]


@pytest.mark.parametrize("doc", CHAPTERS)
def test_interface_in_chinese(browser, doc):
    page, problems = _open(browser, f"{doc}.html")
    try:
        html = page.content()
        found = [s for s in ENGLISH_UI if s in html]
        assert not found, f"English interface strings on the page: {found}"
        hints = page.evaluate(
            "() => [...document.querySelectorAll('.toggle-button')].map(b => "
            "b.textContent + (b.dataset.toggleHint || ''))"
        )
        assert all("点击" in h for h in hints), (
            f"togglebutton hints not in Chinese: {hints[:3]}"
        )
    finally:
        page.context.close()


def _article_text(doc: str) -> str:
    """All text of a built page's article, collapsed parts included (what a reader can
    open)."""
    from html.parser import HTMLParser

    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.depth, self.out = 0, []

        def handle_starttag(self, tag, attrs):
            if self.depth or (tag == "article"):
                self.depth += 1

        def handle_endtag(self, tag):
            if self.depth:
                self.depth -= 1

        def handle_data(self, data):
            if self.depth:
                self.out.append(data)

    p = P()
    p.feed((HTML / f"{doc}.html").read_text(encoding="utf-8"))
    return "".join(p.out)


@pytest.mark.parametrize("doc", [d for d in DOCS if d.startswith(("book/", "labs/"))])
def test_no_authoring_plumbing_on_pages(build, doc):
    """glue calls and nbval markers are machinery: no page shows them (open or
    collapsed)."""
    text = _article_text(doc)
    lines = [line.strip() for line in text.splitlines()]
    glue = [line for line in lines if re.search(r"\bglue\(", line)]
    nbval = [line for line in lines if "nbval-ignore-output" in line]
    assert not glue and not nbval, (
        f"{len(glue)} line(s) with glue( and {len(nbval)} with nbval-ignore-output, "
        f"e.g. "
        f"{(glue + nbval)[:3]} (run `python -m coursekit tidy`, or move the call out "
        f"of the code)"
    )


# "## 1. 标题", "### 2.1 标题", "## 3、标题" — not "## 8 位优化器" (a quantity, not a
# number)
HAND_NUMBER = re.compile(r"^#{1,6}\s+(\d+(\.\d+)+\.?|\d+[.、．)）])\s*\S")


def test_no_hand_typed_heading_numbers():
    """Sphinx numbers chapters and sections (``numbered: true``); a heading that starts
    with its own number is shown twice-numbered ("2.1. 1. 两种配方")."""
    bad = []
    for path in sorted((ROOT / "book").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "markdown":
                continue
            in_fence = False
            for line in cell.source.splitlines():
                if line.lstrip().startswith(("```", "~~~")):
                    in_fence = not in_fence
                if not in_fence and HAND_NUMBER.match(line):
                    bad.append(f"{path.name} cell {i}: {line.strip()}")
    assert not bad, f"{len(bad)} hand-numbered heading(s):\n" + "\n".join(bad)


def test_internal_links_and_anchors_resolve(build):
    from html.parser import HTMLParser

    class P(HTMLParser):
        def __init__(self):
            super().__init__()
            self.ids, self.hrefs = set(), []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if "id" in a:
                self.ids.add(a["id"])
            if tag == "a" and a.get("href"):
                self.hrefs.append(a["href"])

    pages = {}
    for f in HTML.rglob("*.html"):
        if "_static" in f.parts:
            continue
        p = P()
        p.feed(f.read_text(encoding="utf-8"))
        pages[f.resolve()] = p
    bad = []
    for f, p in pages.items():
        for h in p.hrefs:
            u = urlparse(h)
            if u.scheme or h.startswith("//") or h.startswith("mailto:"):
                continue
            target = (f.parent / unquote(u.path)).resolve() if u.path else f
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                bad.append(f"{f.relative_to(HTML.resolve())}: {h} (missing file)")
                continue
            if u.fragment and target.suffix == ".html":
                ids = pages.get(target).ids if target in pages else set()
                if unquote(u.fragment) not in ids:
                    bad.append(f"{f.relative_to(HTML.resolve())}: {h} (missing anchor)")
    assert not bad, "\n".join(sorted(set(bad))[:50])


@pytest.mark.parametrize(
    "doc", [d for d in DOCS if d.startswith("book/") or d.startswith("labs/")]
)
def test_screenshots_and_phone_layout(browser, doc):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for label, vp in (("desktop", DESKTOP), ("phone", PHONE)):
        page, _ = _open(browser, f"{doc}.html", viewport=vp)
        try:
            wait_for_math(page)
            page.wait_for_timeout(200)
            page.screenshot(
                path=str(SCREENSHOTS / screenshot_name(doc, label)), full_page=True
            )
            if label == "phone":
                over = page.evaluate(
                    "() => document.documentElement.scrollWidth - "
                    "document.documentElement.clientWidth"
                )
                assert over <= 1, f"page is {over}px wider than a phone screen"
        finally:
            page.context.close()


@pytest.mark.parametrize("doc", CHAPTERS)
def test_figures_have_alt_text(build, doc):
    """Every figure has alt text: its own (``{glue:figure}`` ``:alt:``) or one made from
    the titles and axis labels its code writes (_ext/course_ui.py). A bare file name is
    not alt text."""
    html = (HTML / f"{doc}.html").read_text(encoding="utf-8")
    imgs = re.findall(r"<img\b[^>]*>", html)
    bare = [
        i for i in imgs if not re.search(r'alt="(?![^"]*\.(png|svg|jpe?g)")[^"]+"', i)
    ]
    assert not bare, (
        f"{len(bare)} of {len(imgs)} images without alt text (give the figure a title "
        f"in its code, or glue it with a caption and :alt:): "
        + "; ".join(re.sub(r'src="data:[^"]*"', "", b)[:120] for b in bare[:3])
    )


def _course_ui():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "course_ui", ROOT / "_ext" / "course_ui.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_figure_alt_from_titles_and_labels():
    ui = _course_ui()
    src = (
        'fig, ax = plt.subplots()\nax.set_title(f"rank {r}: loss")\n'
        'ax.set(xlabel="step", ylabel="loss")\nplt.suptitle("LoRA")'
    )
    assert ui.figure_alt(src) == "图：rank …: loss；LoRA；横轴 step；纵轴 loss"
    assert ui.figure_alt("plt.plot(x)\nplt.show()") is None
    assert ui.figure_alt("%matplotlib inline") is None


def test_ui_strings_translated_in_attributes_only():
    ui = _course_ui()
    html = (
        '<button title="Toggle primary sidebar">Toggle primary sidebar</button>'
        '<a title="Link to this heading2" aria-label="Color mode">'
    )
    assert ui.translate_attributes(html) == (
        '<button title="章节目录">Toggle primary sidebar</button>'
        '<a title="Link to this heading2" aria-label="颜色模式">'
    )
