"""The book as a reader meets it: built with -W, then loaded in headless Chromium.

The site is served from 127.0.0.1; every other host is cut off, so nothing may depend on
a CDN. Full-page screenshots of every chapter and lab (desktop 1366×900, phone 390×844)
are written to _build/screenshots/ with ``COURSE_SCREENSHOTS=1`` (``python -m
tests.screenshots`` writes them for every page without the tests).
"""

from __future__ import annotations

import json
import os
import re
from urllib.parse import unquote, urlparse

import nbformat
import pytest

from tests import page_audit
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
    settle,
    toc_files,
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


def _ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def cjk_font_missing() -> str | None:
    """Why the browser would draw Chinese as boxes (None when a CJK font is there)."""
    import shutil
    import subprocess

    if shutil.which("fc-list") is None:
        return "fontconfig (fc-list) is not installed"
    out = subprocess.run(
        ["fc-list", ":lang=zh", "family"], capture_output=True, text=True
    ).stdout
    return None if out.strip() else "no font with Chinese glyphs (fc-list :lang=zh)"


BROWSER_FIX = (
    "apt-get install -y chromium chromium-driver fonts-noto-cjk "
    "(or `make browser-deps`)"
)


@pytest.fixture(scope="module")
def browser(build):
    """Headless Chromium on the built site. Under CI=true a missing browser or CJK font
    is an error naming the fix, not a skip: the widths and screenshots the tests check
    depend on both."""
    exe = chromium_path()
    why = "chromium is not installed" if exe is None else cjk_font_missing()
    if why:
        message = f"{why}: {BROWSER_FIX}"
        if _ci():
            pytest.fail(message)
        pytest.skip(message)
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
    seen = _desktop(browser, doc)
    assert not seen["problems"], "\n".join(seen["problems"])
    if _has_math(doc):
        assert seen["math"] > 0, "math not typeset"
        assert "$$" not in seen["body"], "raw $$ left in the page"
    # glue: no missing keys, no empty pasted values
    body = seen["body"]
    assert "{glue" not in body and "missing key" not in body.lower()
    assert seen["empty_pasted"] == 0, (
        f"{seen['empty_pasted']} glued values rendered empty"
    )
    # images that are present actually loaded
    assert not seen["broken_images"], f"broken images: {seen['broken_images']}"


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
    seen = _desktop(browser, doc)
    # a figure in a cell's output, or a glued, captioned one ({glue:figure})
    assert seen["figures"] >= 1, (
        "a page with an ipywidgets demo must show a static figure of the same sweep"
    )
    assert "interactive(children" not in seen["body"], (
        "live widget repr leaked into HTML"
    )


@pytest.mark.parametrize("doc", [d for d in DOCS if source_of(d).suffix == ".ipynb"])
def test_colab_launch_link(browser, doc):
    hrefs = _desktop(browser, doc)["colab"]
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


def _search(browser, query, snippets=False):
    """Run the book's search page for ``query``; return (result paths in order,
    snippet texts, problems). ``snippets``: wait until every result has its summary."""
    page, problems = _open(browser, f"search.html?q={query}")
    try:
        page.wait_for_function(
            "() => document.querySelector('ul.search li a') || "
            "(document.querySelector('#search-results p') && "
            "!document.querySelector('#search-progress')?.textContent.trim())",
            timeout=30000,
        )
        # the results are added one by one: wait for the status line that ends the list
        page.wait_for_function(
            "() => /\\d/.test(document.querySelector('p.search-summary')?.textContent"
            " || '')",
            timeout=30000,
        )
        if snippets:
            page.wait_for_function(
                "() => [...document.querySelectorAll('ul.search li')]"
                ".every(li => li.querySelector('p.context'))",
                timeout=30000,
            )
        links = page.evaluate(
            "() => [...document.querySelectorAll('ul.search li > a')].map(a => a.href)"
        )
        texts = page.evaluate(
            "() => [...document.querySelectorAll('ul.search li p.context')]"
            ".map(p => p.textContent)"
        )
    finally:
        page.context.close()
    paths = [unquote(urlparse(h).path).lstrip("/") for h in links]
    return paths, texts, problems


# a term, and the page that teaches it: it must be the first result (before the summary
# chapter, which names every term)
SEARCHES = {
    "LoRA": "book/05_lora_principles",
    "GradScaler": "book/02_mixed_precision",
    "显存": "book/03_training_memory",
    "梯度累积": "book/04_accumulation_checkpointing",
    "混合精度": "book/02_mixed_precision",
    "混合精度的损失缩放": "book/02_mixed_precision",  # a phrase: cut into indexed words
    # the chapter that teaches it, before the chapter that uses it and the lab that
    # practises it
    "优化器状态": "book/03_training_memory",
    "梯度检查点": "book/04_accumulation_checkpointing",
    "损失缩放": "book/02_mixed_precision",
}
SUMMARY = "book/10_summary.html"


@pytest.mark.parametrize("term", list(SEARCHES))
def test_search_ranks_the_teaching_chapter_first(browser, term):
    paths, _, problems = _search(browser, term)
    assert not problems, "\n".join(problems)
    assert paths, f"search found nothing for {term}"
    for path in paths:
        assert (HTML / path).exists(), f"search result {path} does not resolve"
    assert len(paths) == len(set(paths)), f"{term}: a page listed twice: {paths}"
    want = f"{SEARCHES[term]}.html"
    assert paths[0] == want, f"{term}: first result {paths[0]}, not {want}: {paths[:6]}"
    if SUMMARY in paths:
        assert paths.index(SUMMARY) > paths.index(want)


# page chrome and hidden code a snippet must not quote
SNIPPET_NOISE = [
    ".pdf",
    "pdf ",
    "显示代码",
    "显示准备代码",
    "import ",
    "from coursekit",
    "setup()",
    "COURSE_GPU=",
    "hf-auto",  # the calculator's form
]
PAGE_TOC = re.compile(r"目录\s*\d+\.\d")  # the page-contents list: "目录 3.1 …"


@pytest.mark.parametrize("term", ["显存", "LoRA", "计算器"])
def test_search_snippets_are_prose(browser, term):
    paths, texts, problems = _search(browser, term, snippets=True)
    assert not problems, "\n".join(problems)
    assert texts and len(texts) == len(paths), (len(texts), len(paths))
    for path, text in zip(paths, texts):
        assert text.strip(), f"{path}: empty snippet"
        noise = [w for w in SNIPPET_NOISE if w in text]
        assert not noise, f"{path}: snippet quotes {noise}: {text[:160]!r}"
        assert not PAGE_TOC.search(text), f"{path}: page contents: {text[:160]!r}"
        assert "\\(" not in text and "\\)" not in text and "$" not in text, (
            f"{path}: raw TeX in the snippet: {text[:160]!r}"
        )


def test_chinese_words_in_search_index(build):
    """jieba is installed and used: the index holds the course's Chinese terms as
    words."""
    text = (HTML / "searchindex.js").read_text(encoding="utf-8")
    index = json.loads(text[text.index("(") + 1 : text.rindex(")")])
    for word in ("显存", "梯度累积", "混合精度", "主权重", "梯度"):
        assert word in index["terms"], f"{word} is not a word of the search index"


CHAPTERS = [d for d in DOCS if d.startswith("book/") and d[5:7].isdigit()]
PAGES = [d for d in DOCS if d.startswith("book/") or d.startswith("labs/")]


@pytest.mark.parametrize("doc", [CHAPTERS[1], "book/intro"])
def test_phone_menu_opens_chapter_list(browser, doc):
    page, problems = _open(browser, f"{doc}.html", viewport=PHONE)
    try:
        # loaded at the phone size, the page is as wide as _visit measures it after
        # resizing a desktop load (the phone-layout test of every page relies on it)
        _settle(page, doc)
        assert page.evaluate(PHONE_OVER) == _visit(browser, doc, "phone")["phone_over"]
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


def test_phone_page_contents_drawer_closes_after_a_tap(browser):
    """A tap on a section in the phone's page-contents drawer closes the drawer and
    lands on that section."""
    page, problems = _open(browser, "book/03_training_memory.html", viewport=PHONE)
    try:
        page.locator(".bd-header-article .secondary-toggle").click()
        dialog = page.locator("#pst-secondary-sidebar-modal[open]")
        dialog.wait_for(state="visible", timeout=5000)
        links = dialog.locator("a.nav-link:visible")
        assert links.count() >= 3, "page contents drawer is empty"
        link = links.nth(2)
        target = unquote(link.get_attribute("href").split("#", 1)[1])
        link.click()
        page.wait_for_selector(
            "#pst-secondary-sidebar-modal[open]", state="detached", timeout=5000
        )
        page.wait_for_function(
            "id => { const r = document.getElementById(id)?.getBoundingClientRect();"
            " return r && r.top >= -2 && r.top < window.innerHeight / 2; }",
            arg=target,
            timeout=5000,
        )
        assert page.evaluate("() => window.scrollY") > 100, "did not scroll"
        # the drawer's list went back to its sidebar: it opens again
        page.locator(".bd-header-article .secondary-toggle").click()
        dialog.wait_for(state="visible", timeout=5000)
        assert dialog.locator("a.nav-link:visible").count() >= 3
        assert not problems, "\n".join(problems)
    finally:
        page.context.close()


def test_phone_figure_opens_full_size(browser):
    """On a phone a figure is shown scaled down; a tap opens it at its full size, a
    second tap closes it."""
    page, problems = _open(browser, "book/03_training_memory.html", viewport=PHONE)
    try:
        page.wait_for_selector("img.course-zoomable", state="attached", timeout=10000)
        img = page.locator("img.course-zoomable").first
        img.scroll_into_view_if_needed()
        shown, natural = img.evaluate("i => [i.clientWidth, i.naturalWidth]")
        assert shown < natural, (shown, natural)
        img.click()
        big = page.locator(".course-lightbox img")
        big.wait_for(state="visible", timeout=5000)
        width = big.evaluate("i => i.getBoundingClientRect().width")
        assert width >= natural - 1, f"opened at {width}px, the figure is {natural}px"
        page.locator(".course-lightbox").click(position={"x": 5, "y": 5})
        page.wait_for_selector(".course-lightbox", state="detached", timeout=5000)
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
    seen = _desktop(browser, doc)
    found = [t for t in ENGLISH_UI if t in seen["html"]]
    assert not found, f"English interface strings on the page: {found}"
    hints = seen["toggle_hints"]
    assert all("点击" in h for h in hints), (
        f"togglebutton hints not in Chinese: {hints[:3]}"
    )


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


def _code_cells_text(doc: str) -> list[str]:
    """The text of every code cell's source shown on a built page."""
    import html as html_lib

    page = (HTML / f"{doc}.html").read_text(encoding="utf-8")
    out = []
    for m in re.finditer(
        r'<div class="cell_input[^"]*"[^>]*>(.*?)</pre>', page, flags=re.S
    ):
        out.append(html_lib.unescape(re.sub(r"<[^>]+>", "", m.group(1))))
    return out


ENV_LINE = re.compile(r"COURSE_GPU=\w+; CUDA:")


@pytest.mark.parametrize("doc", PAGES)
def test_no_authoring_plumbing_on_pages(build, doc):
    """Machinery is not the lesson: no page shows (open or collapsed) a glue call, an
    nbval marker or comment, a setup cell or its environment line, a ``with
    measured(...)`` wrapper or a table's ``rtol=``, or a GPU cell's skip line; every GPU
    cell's output starts with the note saying where it ran."""
    from coursekit.gpu import SKIP_PREFIX

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
    assert SKIP_PREFIX not in text, (
        f"a GPU cell shows its skip line: re-execute {source_of(doc).name} "
        "(make nb NB=...) so it stores the cell's CPU small-size run"
    )
    assert not ENV_LINE.search(text), "a setup cell's environment line is shown"
    page = (HTML / f"{doc}.html").read_text(encoding="utf-8")
    assert not re.search(r'class="cell[^"]*\btag_(colab-)?setup\b', page)
    for code in _code_cells_text(doc):
        assert "with measured(" not in code, code[:200]
        assert "nbval" not in code.lower(), code[:200]
        for line in code.splitlines():
            if "md_table(" in line:
                assert not re.search(r"\b[ar]tol=", line), line
    if doc.startswith("book/"):  # labs are shown without outputs
        gpu_cells = len(re.findall(r'class="cell[^"]*\btag_gpu\b', page))
        notes = len(re.findall(r'<p class="gpu-run-note">', page))
        assert notes == gpu_cells, f"{gpu_cells} GPU cell(s), {notes} run note(s)"


def test_footer_is_chinese(build):
    page = (HTML / "book/03_training_memory.html").read_text(encoding="utf-8")
    footer = re.sub(r"<[^>]+>", " ", page[page.index('class="bd-footer-content') :])
    footer = re.sub(r"\s+", " ", footer)[:400]
    assert "Copyright" not in footer and "By " not in footer, footer
    assert "课程贡献者" in footer and "©" in footer, footer


def test_prose_text_leaves_code_math_and_outputs_out():
    from docutils.core import publish_doctree

    ui = _course_ui()
    doctree = publish_doctree(
        "Title\n=====\n\nProse :math:`\\Psi` here.\n\n.. code-block:: python\n\n"
        "   import secret_code\n\n.. math::\n\n   x^2\n\nMore prose.\n"
    )
    text = ui.prose_text(doctree)
    assert "Prose" in text and "More prose." in text and "Title" in text
    assert "secret_code" not in text and "Psi" not in text and "x^2" not in text


def test_heading_text_is_titles_and_opening_bold_words():
    from docutils.core import publish_doctree

    ui = _course_ui()
    doctree = publish_doctree(
        "Book\n====\n\nSection one\n-----------\n\n**优化器状态。** AdamW 的 m、v。\n\n"
        "在句中的 **加粗** 不算。\n\nSection two\n-----------\n\nText.\n"
    )
    heads = ui.heading_text(doctree).splitlines()
    assert "Section one" in heads and "优化器状态。" in heads
    assert "加粗" not in heads


def test_search_data_counts_prose_words(build):
    text = (HTML / "_static" / "course-search-data.js").read_text(encoding="utf-8")
    data = json.loads(text[text.index("=") + 1 : text.rindex(";")])
    docs = data["docs"]
    ch3 = docs.index("book/03_training_memory")
    assert data["tf"]["显存"][str(ch3)] >= 10
    assert len(data["len"]) == len(docs) == len(data["titles"])
    # headings and synonyms for the ranking; each synonym is a whole word of the index
    assert len(data["heads"]) == len(docs)
    assert "优化器状态。" in data["heads"][ch3].splitlines()
    assert data["synonyms"]["梯度检查点"] == ["激活检查点"]
    terms = (ROOT / "_ext" / "zh_terms.txt").read_text(encoding="utf-8").split()
    assert all(w in terms for w in data["synonyms"])
    # words only in code (the setup cell's imports) are not counted
    assert "coursekit" not in data["tf"] or str(ch3) not in data["tf"]["coursekit"]
    # loaded by the search page only
    assert "course-search-data.js" in (HTML / "search.html").read_text("utf-8")
    assert "course-search-data.js" not in page_text("book/03_training_memory")


def page_text(doc: str) -> str:
    return (HTML / f"{doc}.html").read_text(encoding="utf-8")


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


# every block of code or output on a page that scrolls sideways (scrollWidth beyond
# clientWidth): code and output <pre>, tables (display math scrolls in its own box)
WIDE_BLOCKS = """() => [...document.querySelectorAll(
    'article pre, article table, article .pst-scrollable-table-container,'
    + ' article div.cell_output > div')]
    .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)
    .map(e => ({what: e.closest('.cell_output') ? 'output' :
                      e.closest('.cell_input') ? 'code' : e.tagName.toLowerCase(),
               over: e.scrollWidth - e.clientWidth,
               text: e.textContent.trim().slice(0, 70)}))"""
# what the read-only checks of a page need, gathered in one visit per page (a visit —
# load, MathJax, fonts — costs seconds; the checks cost nothing)
PAGE_FACTS = """() => ({
  body: document.querySelector('article')?.innerText ?? '',
  html: document.documentElement.outerHTML,
  math: document.querySelectorAll('mjx-container').length,
  empty_pasted: [...document.querySelectorAll('[class*="pasted"]')]
      .filter(e => e.textContent.trim() === '' && !e.querySelector('img')).length,
  broken_images: [...document.images]
      .filter(i => i.complete && i.naturalWidth === 0).map(i => i.src),
  figures: [...document.querySelectorAll('.cell_output img, figure img')]
      .filter(i => i.naturalWidth > 0).length,
  colab: [...document.querySelectorAll('a')].map(a => a.href)
      .filter(h => h.includes('colab.research.google.com')),
  toggle_hints: [...document.querySelectorAll('.toggle-button')]
      .map(b => b.textContent + (b.dataset.toggleHint || '')),
})"""
_VISITS: dict[tuple[str, str], dict] = {}
PHONE_OVER = (
    "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
)


def _settle(page, doc: str) -> None:
    """:func:`tests.site.settle` (loaded, fonts, images, MathJax), then this page's
    typeset math and course-ui.js's refit of the outputs."""
    settle(page)
    if _has_math(doc):
        page.wait_for_selector("mjx-container", state="attached", timeout=120000)
    page.wait_for_timeout(300)  # course-ui.js refits outputs 50 ms after a change


def _visit(browser, doc: str, label: str) -> dict:
    """What the checks read of ``doc`` at a size (``desktop`` 1366×900 or ``phone``
    390×844): the failed requests and console errors of the visit, the article's text,
    the typeset math, (desktop) the blocks that scroll sideways and (both) how far the
    page is wider than the screen.

    One load serves both sizes: the page is opened at the desktop size, read, then
    resized to the phone and read again (a load — MathJax, fonts — costs seconds,
    a resize a fraction; the layout follows CSS media queries and course-ui.js refits
    on resize, and ``test_phone_menu_opens_chapter_list`` checks that a page loaded at
    the phone size measures the same). With ``COURSE_SCREENSHOTS=1`` it also saves a
    full-page screenshot per size to look at (it costs more than the checks;
    ``python -m tests.screenshots`` takes them too)."""
    key = (doc, label)
    if key in _VISITS:
        return _VISITS[key]
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page, problems = _open(browser, f"{doc}.html", viewport=DESKTOP)
    try:
        for size, viewport in (("desktop", DESKTOP), ("phone", PHONE)):
            if size == "phone":
                page.set_viewport_size({"width": viewport[0], "height": viewport[1]})
            _settle(page, doc)
            if os.environ.get("COURSE_SCREENSHOTS") == "1":  # to look at them
                page.screenshot(
                    path=str(SCREENSHOTS / screenshot_name(doc, size)), full_page=True
                )
            seen = page.evaluate(PAGE_FACTS)
            seen["wide"] = page.evaluate(WIDE_BLOCKS) if size == "desktop" else []
            seen["phone_over"] = page.evaluate(PHONE_OVER)
            if size == "phone":  # what a phone reader meets (tests/page_audit.py)
                seen["audit"] = page_audit.counts(
                    page.evaluate(page_audit.AUDIT_JS), HTML
                )
            seen["problems"] = list(problems)
            _VISITS[(doc, size)] = seen
    finally:
        page.context.close()
    return _VISITS[key]


def _desktop(browser, doc: str) -> dict:
    return _visit(browser, doc, "desktop")


@pytest.mark.parametrize("doc", PAGES)
def test_screenshots_and_phone_layout(browser, doc):
    over = _visit(browser, doc, "phone")["phone_over"]
    assert over <= 1, f"page is {over}px wider than a phone screen"


@pytest.mark.parametrize("doc", PAGES)
def test_no_block_scrolls_sideways_on_desktop(browser, doc):
    """At 1366×900 no code block, output or table hides part of itself behind a
    sideways scroll."""
    wide = _desktop(browser, doc)["wide"]
    assert not wide, f"{len(wide)} block(s) scroll sideways at {DESKTOP}: " + "; ".join(
        f"{w['what']} +{w['over']}px {w['text']!r}" for w in wide[:6]
    )


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
    # coursekit.fonts.zh(chinese, english): the Chinese text is what the figure shows
    zh_src = 'ax.set_title(zh("每卡激活", "per GPU"))\nax.set_xlabel(zh("序列", "seq"))'
    assert ui.figure_alt(zh_src) == "图：每卡激活；横轴 序列"
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


def test_flat_dict_reprs_become_tables():
    ui = _course_ui()
    assert ui.repr_rows("{'7B': 6738415616, '13B': 1.5, 'ok': True}") == [
        ("7B", "6,738,415,616"),
        ("13B", "1.5"),
        ("ok", "True"),
    ]
    assert ui.repr_rows("{'a': [1, 2]}") is None  # nested: left as printed
    assert ui.repr_rows("{1: 2}") is None
    assert ui.repr_rows("{'use_reentrant': True} -> backward fails") is None
    assert ui.repr_rows("tensor([1, 2])") is None


def test_printed_and_measured_text_are_one_output_box():
    from types import SimpleNamespace

    from docutils import nodes
    from docutils.utils import new_document

    ui = _course_ui()
    doc = new_document("<test>")
    out = nodes.container(nb_element="cell_code_output")
    for text, kind in (("a = 1\n", "stream"), ("b = 2.5\n", "text_plain")):
        out += nodes.literal_block(text, text, classes=["output", kind])
    out += nodes.image(uri="fig.png")
    out += nodes.literal_block("c\n", "c\n", classes=["output", "stream"])
    doc += out
    ui.MergeOutputs.run(
        SimpleNamespace(document=doc, _text_block=ui.MergeOutputs._text_block)
    )
    kinds = [type(c).__name__ for c in out.children]
    assert kinds == ["literal_block", "image", "literal_block"]
    assert out.children[0].astext() == "a = 1\nb = 2.5\n"


def test_fast_chinese_stem_gives_sphinx_stems():
    """The linear-time stem (course_ui.fast_chinese_stem) answers as Sphinx's own,
    including the rule that keeps a known Latin word whole when stemming would leave
    fewer than three letters."""
    from sphinx.search import zh

    _course_ui().fast_chinese_stem()
    fast = zh.SearchChinese.stem
    original = fast._course_original
    lang = zh.SearchChinese({})
    lang.split("LoRA 的 rank 与 QLoRA、FSDP 和 ZeRO：ties tied ies as is bf16 显存")
    words = ["LoRA", "ties", "ies", "tied", "running", "as", "is", "bf16", "ZeRO", "x"]
    assert [fast(lang, w) for w in words] == [original(lang, w) for w in words]
    # "ies" and "ers" stem to "ie" and "er": kept whole when the pages had it
    assert fast(lang, "ies") == "ies" and fast(lang, "ers") == original(lang, "ers")
    assert "ers" not in lang.latin_terms and fast(lang, "ers") == "er"


# ------------------------------------------------------------- a phone reader's page
# Each class of tests/page_audit.py, page by page at 390 px (the counts before and after
# a change: `python -m tests.page_audit`).


def _audit(browser, doc: str, what: str) -> list:
    return _visit(browser, doc, "phone")["audit"][what]


@pytest.mark.parametrize("doc", PAGES)
def test_titled_boxes_keep_their_title_apart(browser, doc):
    """A 误区 box is headed "误区 N：标题" and a note with a title of its own is headed
    by it: no box is headed 警告/备注 with its title run into the text."""
    runon = _audit(browser, doc, "runon")
    assert not runon, f"{len(runon)} box(es) run their title into the text: {runon[:3]}"


@pytest.mark.parametrize("doc", PAGES)
def test_table_cells_keep_numbers_and_words_whole_on_a_phone(browser, doc):
    broken = _audit(browser, doc, "broken")
    assert not broken, (
        f"{len(broken)} number(s)/word(s) drawn over two lines in table cells at "
        f"{PHONE}: {broken[:8]}"
    )


@pytest.mark.parametrize("doc", PAGES)
def test_column_printouts_keep_their_columns_on_a_phone(browser, doc):
    wrapped = _audit(browser, doc, "printout")
    assert not wrapped, f"{len(wrapped)} column printout(s) wrap: {wrapped[:3]}"


@pytest.mark.parametrize("doc", PAGES)
def test_display_equations_fit_a_phone(browser, doc):
    """No display equation is wider than the column at 390 px (it would scroll in its
    own box): long ones break over lines (``aligned``/``gathered``)."""
    over = _audit(browser, doc, "math")
    assert not over, f"{len(over)} equation(s) wider than the column by {over} px"


@pytest.mark.parametrize("doc", PAGES)
def test_figures_are_legible_and_chinese_on_a_phone(browser, doc):
    """Every figure carries the sizes of its texts (coursekit.figures.record_figures,
    run by setup()); at 390 px the smallest renders at 9 px or more, and no title,
    label, legend or tick is English only."""
    a = _visit(browser, doc, "phone")["audit"]
    assert not a["fig_unrecorded"], (
        f"figures without a size record (re-execute {source_of(doc).name} with "
        f"make nb): {a['fig_unrecorded']}"
    )
    assert not a["fig_small"], f"figure text under 9 px at {PHONE}: {a['fig_small']}"
    assert not a["fig_english"], f"English figure text: {a['fig_english']}"


# the one page that documents the GPU switch for those who run the notebooks
PLUMBING_ALLOWED = {"book/how_to_use": {"COURSE_GPU"}}


@pytest.mark.parametrize("doc", PAGES)
def test_no_plumbing_words_on_the_page(browser, doc):
    """No test/CI talk, GPU switch or decorator, source-material cell types, pointers
    to cells the page hides, magics or escaped TeX in the text a reader sees (the
    GPU badge included)."""
    found = [
        w
        for w in _audit(browser, doc, "plumbing")
        if w not in PLUMBING_ALLOWED.get(doc, ())
    ]
    assert not found, f"plumbing on the page: {found[:6]}"


def test_audit_classes_catch_what_they_name():
    """The page-audit rules on known texts (the browser side is checked page by page
    above)."""
    assert page_audit.english("training step")
    assert not page_audit.english("训练步数（step）")
    assert not page_audit.english("fp16") and not page_audit.english("LoRA r=8")
    assert not page_audit.english("$\\alpha/r$ = 2")
    assert page_audit.english_phrase("峰值出现在 forward 阶段") == ["forward"]
    assert page_audit.english_phrase("峰值出现在前向（forward）阶段") == []
    assert page_audit.PLUMBING.search("这台（没有 GPU 的）机器")
    assert page_audit.PLUMBING.search("由 tests/test_lora.py 检查")
    assert page_audit.PLUMBING.search("ℓ\\*")
    assert not page_audit.PLUMBING.search("CIFAR 与 CUDA")
