"""The book as a reader meets it (DESIGN.md §1, §5): built with -W, then loaded in headless Chromium.

The site is served from 127.0.0.1; every other host is cut off, so nothing may depend on a CDN.
Screenshots of each chapter's first screen (desktop and phone) are written to _build/screenshots/.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import nbformat
import pytest

from tests.notebooks import ROOT
from tests.site import (CHROMIUM_ARGS, HTML, SCREENSHOTS, SiteServer, build_book, chromium_path,
                        source_of, toc_files)

DOCS = toc_files()
COLAB = re.compile(r"^https://colab\.research\.google\.com/github/([^/]+)/([^/]+)/blob/([^/]+)/(.+\.ipynb)$")


@pytest.fixture(scope="module")
def build():
    return build_book()


def test_book_builds_with_warnings_as_errors(build):
    log = build.stdout + build.stderr
    warnings = [l for l in log.splitlines() if "WARNING" in l or "ERROR" in l]
    assert build.returncode == 0, "book build failed:\n" + "\n".join(warnings[:40] or log.splitlines()[-40:])
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


def _open(browser, path, viewport=(1280, 800)):
    """Open a page with the network cut to 127.0.0.1; return (page, problems)."""
    b, base = browser
    ctx = b.new_context(viewport={"width": viewport[0], "height": viewport[1]})
    page = ctx.new_page()
    problems: list[str] = []

    def route(r):
        host = urlparse(r.request.url).hostname
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            r.continue_()
        else:
            problems.append(f"external request (network is cut): {r.request.url}")
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: r.url.startswith(base) and problems.append(f"failed: {r.url}"))
    page.on("response", lambda r: r.url.startswith(base) and r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    page.goto(f"{base}/{path}", wait_until="load")
    page.wait_for_load_state("networkidle")
    return page, problems


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
            # wait for MathJax itself to finish typesetting (slow on a loaded CI machine)
            page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise",
                                   timeout=120000)
            page.evaluate("() => MathJax.startup.promise")
            page.wait_for_selector("mjx-container", state="attached", timeout=120000)
            assert page.locator("mjx-container").count() > 0, "math not typeset"
            assert "$$" not in body, "raw $$ left in the page"
        # glue: no missing keys, no empty pasted values
        assert "{glue" not in body and "missing key" not in body.lower()
        empty = page.evaluate("""() => [...document.querySelectorAll('[class*="pasted"]')]
                                  .filter(e => e.textContent.trim() === '' && !e.querySelector('img')).length""")
        assert empty == 0, f"{empty} glued values rendered empty"
        # images that are present actually loaded
        broken = page.evaluate("() => [...document.images].filter(i => i.complete && i.naturalWidth === 0).map(i => i.src)")
        assert not broken, f"broken images: {broken}"
    finally:
        page.context.close()


def _demo_docs():
    out = []
    for doc in DOCS:
        src = source_of(doc)
        if src.suffix == ".ipynb" and "ipywidgets" in src.read_text(encoding="utf-8") and doc.startswith("book/"):
            out.append(doc)
    return out


@pytest.mark.parametrize("doc", _demo_docs())
def test_interactive_demo_has_static_figure(browser, doc):
    page, _ = _open(browser, f"{doc}.html")
    try:
        n = page.evaluate("() => [...document.querySelectorAll('.cell_output img')].filter(i => i.naturalWidth > 0).length")
        assert n >= 1, "a page with an ipywidgets demo must show a static figure of the same sweep"
        assert "interactive(children" not in page.inner_text("article"), "live widget repr leaked into HTML"
    finally:
        page.context.close()


@pytest.mark.parametrize("doc", [d for d in DOCS if source_of(d).suffix == ".ipynb"])
def test_colab_launch_link(browser, doc):
    page, _ = _open(browser, f"{doc}.html")
    try:
        hrefs = page.evaluate("() => [...document.querySelectorAll('a')].map(a => a.href).filter(h => h.includes('colab.research.google.com'))")
    finally:
        page.context.close()
    assert hrefs, "no Colab launch link"
    for h in set(hrefs):
        m = COLAB.match(h)
        assert m, f"bad Colab URL form: {h}"
        assert m.group(4) == f"{doc}.ipynb", f"Colab link points at {m.group(4)}"
        assert (ROOT / m.group(4)).exists(), f"Colab path {m.group(4)} not in the repository"
    cfg = __import__("yaml").safe_load((ROOT / "_config.yml").read_text(encoding="utf-8"))
    org_repo = urlparse(cfg["repository"]["url"]).path.strip("/")
    assert f"{m.group(1)}/{m.group(2)}" == org_repo and m.group(3) == cfg["repository"]["branch"]


@pytest.mark.parametrize("term", ["LoRA", "GradScaler"])
def test_search_finds(browser, term):
    page, problems = _open(browser, f"search.html?q={term}")
    try:
        page.wait_for_selector("#search-results ul li a, ul.search li a", timeout=20000)
        links = page.evaluate("() => [...document.querySelectorAll('ul.search li a')].map(a => a.href)")
    finally:
        page.context.close()
    assert links, f"search found nothing for {term}"
    for href in links[:10]:
        path = unquote(urlparse(href).path).lstrip("/")
        assert (HTML / path).exists(), f"search result {href} does not resolve"


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


@pytest.mark.parametrize("doc", [d for d in DOCS if d.startswith("book/") or d.startswith("labs/")])
def test_screenshots_and_phone_layout(browser, doc):
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    name = doc.replace("/", "_")
    for label, vp in (("desktop", (1280, 800)), ("phone", (390, 844))):
        page, _ = _open(browser, f"{doc}.html", viewport=vp)
        try:
            page.wait_for_timeout(300)
            page.screenshot(path=str(SCREENSHOTS / f"{name}_{label}.png"))
            if label == "phone":
                over = page.evaluate("() => document.documentElement.scrollWidth - document.documentElement.clientWidth")
                assert over <= 1, f"page is {over}px wider than a phone screen"
        finally:
            page.context.close()
