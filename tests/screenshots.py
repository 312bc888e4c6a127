"""Full-page screenshots of every page of the built book, desktop and phone.

    .venv/bin/python -m tests.screenshots # uses _build/html (run `make book` first)
    .venv/bin/python -m tests.screenshots --build    # builds the book first
    .venv/bin/python -m tests.screenshots book/02_mixed_precision   # only these pages

Writes ``_build/screenshots/<page>_desktop.png`` (1366×900 viewport) and
``<page>_phone.png`` (390×844), full height, with the network cut to 127.0.0.1, and
prints one line per page with its height and any problem the browser reported (console
errors, requests to another host).
"""

from __future__ import annotations

import argparse
import sys

from tests.site import (
    DESKTOP,
    HTML,
    PHONE,
    SCREENSHOTS,
    build_book,
    open_page,
    screenshot_name,
    served_browser,
    toc_files,
    wait_for_math,
)


def take(docs: list[str], out=SCREENSHOTS) -> list[str]:
    """Write the screenshots; return the problems seen (one line each)."""
    out.mkdir(parents=True, exist_ok=True)
    problems_all = []
    with served_browser(HTML) as (browser, base):
        for doc in docs:
            sizes = []
            for label, vp in (("desktop", DESKTOP), ("phone", PHONE)):
                page, problems = open_page(browser, base, f"{doc}.html", viewport=vp)
                try:
                    wait_for_math(page)
                    page.wait_for_timeout(200)
                    page.screenshot(
                        path=str(out / screenshot_name(doc, label)), full_page=True
                    )
                    sizes.append(
                        f"{label} {page.evaluate('document.body.scrollHeight')} px"
                    )
                finally:
                    page.context.close()
                problems_all += [f"{doc} ({label}): {p}" for p in problems]
            print(f"{doc:45} " + ", ".join(sizes))
    return problems_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("docs", nargs="*", help="pages (as in _toc.yml); default: all")
    ap.add_argument("--build", action="store_true", help="build the book first")
    args = ap.parse_args(argv)
    if args.build:
        r = build_book()
        if r.returncode != 0:
            print(r.stdout[-3000:] + r.stderr[-3000:], file=sys.stderr)
            return 1
    if not (HTML / "index.html").exists():
        print(
            "error: no built book in _build/html (run `make book` or pass --build)",
            file=sys.stderr,
        )
        return 2
    docs = args.docs or toc_files()
    unknown = [d for d in docs if d not in toc_files()]
    if unknown:
        print(f"error: not pages of the book: {', '.join(unknown)}", file=sys.stderr)
        return 2
    problems = take(docs)
    for p in problems:
        print("problem:", p)
    print(f"screenshots: {SCREENSHOTS}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
