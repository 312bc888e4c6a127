"""Build the book once per test session and serve it on 127.0.0.1 (helpers for tests/test_site.py)."""
from __future__ import annotations

import functools
import http.server
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


def build_book() -> subprocess.CompletedProcess:
    """``jupyter-book build . -W --keep-going`` (what ``make book`` runs)."""
    jb = Path(sys.executable).parent / "jupyter-book"
    # --all: an incremental build re-reads only changed pages and would hide their earlier warnings
    return subprocess.run([str(jb), "build", ".", "--all", "-W", "--keep-going"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)


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


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
