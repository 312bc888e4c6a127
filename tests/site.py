"""Build the book once per test session and serve it on 127.0.0.1 (helpers for
tests/test_site.py)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import yaml

from tests.notebooks import ROOT

HTML = ROOT / "_build" / "html"
SCREENSHOTS = ROOT / "_build" / "screenshots"


def toc_files() -> list[str]:
    """Document paths (no suffix) listed in _toc.yml, root first."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text(encoding="utf-8"))
    out = [toc["root"]]

    def walk(node):
        if isinstance(node, dict):
            if "file" in node:
                out.append(node["file"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(toc.get("parts", []) or toc.get("chapters", []))
    return out


def source_of(doc: str) -> Path:
    for ext in (".ipynb", ".md"):
        p = ROOT / (doc + ext)
        if p.exists():
            return p
    raise FileNotFoundError(doc)


_BUILT: dict[str, subprocess.CompletedProcess] = {}


def build_book() -> subprocess.CompletedProcess:
    """``jupyter-book build . -W --keep-going`` (what ``make book`` runs), once per test
    run.

    Several test modules need the built site (tests/test_site.py,
    tests/test_calculator.py) and pytest-xdist may run them in two processes at once: a
    lock file serialises the builds (two builds writing _build/html at the same time
    corrupt each other) and the result of this run's build is reused — in-process, and
    across the workers of one xdist run (same testrun uid).
    """
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    if "book" in _BUILT:
        return _BUILT["book"]
    (ROOT / "_build").mkdir(exist_ok=True)
    marker = ROOT / "_build" / ".book-build-result.json"
    with open(ROOT / "_build" / ".book-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if run_id and marker.exists():
                saved = json.loads(marker.read_text(encoding="utf-8"))
                if saved.get("run_id") == run_id:
                    _BUILT["book"] = subprocess.CompletedProcess(
                        saved["args"],
                        saved["returncode"],
                        saved["stdout"],
                        saved["stderr"],
                    )
                    return _BUILT["book"]
            jb = Path(sys.executable).parent / "jupyter-book"
            # --all: an incremental build re-reads only changed pages and would hide
            # their earlier warnings
            r = subprocess.run(
                [str(jb), "build", ".", "--all", "-W", "--keep-going"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=900,
            )
            marker.write_text(
                json.dumps(
                    {
                        "run_id": run_id,
                        "args": r.args,
                        "returncode": r.returncode,
                        "stdout": r.stdout,
                        "stderr": r.stderr,
                    }
                ),
                encoding="utf-8",
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _BUILT["book"] = r
    return r


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # pragma: no cover
        pass


class SiteServer:
    """A static HTTP server for the built site on 127.0.0.1 and a free port."""

    def __init__(self, root: Path):
        handler = functools.partial(_QuietHandler, directory=str(root))
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


PHONE = (390, 844)
DESKTOP = (1366, 900)

CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def open_offline(
    browser, base: str, path: str, viewport=DESKTOP, wait: str = "load", serve=None
):
    """Open ``base/path`` in a new context with every request to another host aborted.

    ``serve``: optional ``{url suffix: local file}`` answered from those files instead
    of the site (a benchmark swaps a file this way). Returns ``(page, problems)``;
    ``problems`` collects external requests, console errors, page errors and failed or
    >= 400 responses from the site.
    """
    ctx = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]})
    page = ctx.new_page()
    problems: list[str] = []

    def route(r):
        for suffix, local in (serve or {}).items():
            if r.request.url.startswith(base) and r.request.url.endswith(suffix):
                r.fulfill(path=str(local))
                return
        if r.request.url.startswith(base) or r.request.url.startswith("data:"):
            r.continue_()
        else:
            problems.append(f"external request (network is cut): {r.request.url}")
            r.abort()

    page.route("**/*", route)
    page.on(
        "console",
        lambda m: m.type == "error" and problems.append(f"console error: {m.text}"),
    )
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on(
        "requestfailed",
        lambda r: r.url.startswith(base) and problems.append(f"failed: {r.url}"),
    )
    page.on(
        "response",
        lambda r: (
            r.url.startswith(base)
            and r.status >= 400
            and problems.append(f"HTTP {r.status}: {r.url}")
        ),
    )
    page.goto(f"{base}/{path}", wait_until=wait)
    return page, problems


@contextlib.contextmanager
def served_browser(root: Path = HTML):
    """Serve ``root`` on 127.0.0.1 and launch headless Chromium; yield ``(browser,
    base_url)``."""
    exe = chromium_path()
    if exe is None:
        raise RuntimeError("chromium is not installed (make browser-deps installs it)")
    from playwright.sync_api import sync_playwright

    with SiteServer(root) as server, sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        try:
            yield b, server.url
        finally:
            b.close()


# What a page needs before its layout is checked: the document and its stylesheets
# (the load event), the web fonts, and every image that is not lazy. Network idleness
# is not waited for: it is not what the checks need, and a page may go on fetching
# what the reader has not asked for yet (chapter 1's format explorer fetches Pyodide
# once it comes near the viewport). Waiting for it timed out at 120 s on chapter 1
# in a full run on a loaded 2-core machine.
_SETTLED = """() => document.readyState === "complete"
  && document.fonts.status === "loaded"
  && [...document.images].every((img) => img.complete || img.loading === "lazy")"""


def settle(page, timeout_ms: int = 120_000) -> None:
    """Wait until ``page`` is laid out as a reader sees it: loaded, fonts and eager
    images in, MathJax (if the page loads it) done typesetting."""
    page.wait_for_function(_SETTLED, timeout=timeout_ms)
    wait_for_math(page, timeout_ms)


def open_page(browser, base: str, path: str, viewport=DESKTOP):
    """:func:`open_offline`, then :func:`settle`."""
    page, problems = open_offline(browser, base, path, viewport=viewport)
    settle(page)
    return page, problems


def wait_for_math(page, timeout_ms: int = 120000) -> None:
    """Wait until MathJax (if the page loads it) has finished typesetting."""
    if page.evaluate("() => !!document.querySelector('script[src*=\"mathjax\" i]')"):
        page.wait_for_function(
            "() => window.MathJax && MathJax.startup && MathJax.startup.promise",
            timeout=timeout_ms,
        )
        page.evaluate("() => MathJax.startup.promise")


def screenshot_name(doc: str, label: str) -> str:
    return f"{doc.replace('/', '_')}_{label}.png"
