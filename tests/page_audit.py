"""What a reader meets on a page, counted by class: the checks behind the browser tests
of ``tests/test_site.py`` and a report to compare two builds.

    .venv/bin/python -m tests.page_audit                  # every chapter and lab
    .venv/bin/python -m tests.page_audit book/06_lora_in_practice --html _build/html

prints one row per page with the count of each class at 390 px (a phone):

* ``runon`` — a titled box (误区, 备注, …) whose title runs into its text: the box is
  headed by a generic word (警告, 备注) and its own title is the bold start of the first
  paragraph, or a 误区 box's heading is not "误区 N：…".
* ``broken`` — a number or a word drawn over two lines inside a table cell (split at
  underscores, which the page breaks on purpose, and at spaces).
* ``printout`` — a column-aligned printout (a code output with columns separated by two
  or more spaces) that wraps, so its columns no longer line up.
* ``math`` — a display equation wider than the column (it scrolls in its own box).
* ``fig_small`` — a figure whose smallest text renders under :data:`MIN_FIGURE_PX` px;
  ``fig_english`` — a figure with an English title, label, legend or tick text
  (English terms belong in parentheses after the Chinese); ``fig_unrecorded`` — a
  figure without the sizes ``coursekit.figures`` records in the PNG when it is made.
* ``plumbing`` — authoring machinery in the reader's text (:data:`PLUMBING`), including
  the GPU badge the theme draws.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

MIN_FIGURE_PX = 9.0

# machinery a reader should not meet: the course's test and CI setup, the GPU switch and
# decorator, the source material's cell types, cells the page does not show, magics
PLUMBING = re.compile(
    r"COURSE_GPU|@?gpu_cell\b|【Skeleton】|【Runnable】|# 类型：|tests/test_|\bCI\b|"
    r"\bnbval\b|\bpytest\b|测试套件|单元测试|没有 GPU 的）?机器|上面一格|%matplotlib|"
    r"\\\*|the seed's"
)

# in the code a page shows: the source material's cell-type line, notebook magics
CODE_PLUMBING = re.compile(r"# 类型：.*|^%matplotlib.*", re.M)

# in the browser, at the size the page is shown: one pass over the article
AUDIT_JS = r"""() => {
  const art = document.querySelector('article') || document.body;
  const shown = (e) => e.offsetParent !== null || e.getClientRects().length > 0;
  const out = {runon: [], broken: [], printout: [], math: [], figures: [], badge: []};
  // boxes whose title runs into the text
  for (const box of art.querySelectorAll('div.admonition, aside.admonition')) {
    const title = box.querySelector(':scope > .admonition-title');
    const head = title ? title.textContent.trim() : '';
    const first = [...box.children].find(
      (c) => c !== title && c.tagName === 'P' && c.textContent.trim());
    const body = first ? first.textContent.trim() : '';
    const strong = first && first.firstElementChild;
    const lead = strong && strong.tagName === 'STRONG'
      && body.startsWith(strong.textContent.trim()) ? strong.textContent.trim() : '';
    const runs = (lead && body.length > lead.length + 1)
      || (/^误区(\s*\d+)?：/.test(body) && !/^误区(\s*\d+)?：\S/.test(head))
      || (/误区/.test(head) && !/^误区(\s*\d+)?：\S/.test(head));
    if (runs) out.runon.push((head + ' | ' + body).slice(0, 90));
  }
  // numbers and words broken across lines in table cells
  const TOKEN = /[A-Za-z0-9][A-Za-z0-9.,%+\-−×:\/()]*[A-Za-z0-9%)]/g;
  for (const cell of art.querySelectorAll('td, th')) {
    if (!shown(cell)) continue;
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
      const text = n.nodeValue;
      for (const part of text.split(/[_\u200b\s]/)) {
        if (!part) continue;
        const base = text.indexOf(part);
        for (const m of part.matchAll(TOKEN)) {
          if (m[0].length < 2) continue;
          const r = document.createRange();
          r.setStart(n, base + m.index);
          r.setEnd(n, base + m.index + m[0].length);
          const tops = new Set([...r.getClientRects()].filter((q) => q.width > 0)
            .map((q) => Math.round(q.top / 4)));
          if (tops.size > 1) out.broken.push(m[0]);
        }
      }
    }
  }
  // column-aligned printouts that wrap
  for (const pre of art.querySelectorAll('div.cell_output pre')) {
    if (!shown(pre)) continue;
    // every line, blank ones included (they take a line's height too)
    const lines = pre.textContent.replace(/^\n+|\s+$/g, '').split('\n');
    if (lines.filter((l) => /\S {2,}\S/.test(l)).length < 2) continue;
    const r = document.createRange();
    r.selectNodeContents(pre);
    const tops = new Set([...r.getClientRects()].filter((q) => q.width > 0)
      .map((q) => Math.round(q.top)));
    const lh = parseFloat(getComputedStyle(pre).lineHeight) || 16;
    const span = Math.max(...tops) - Math.min(...tops);
    const visual = Math.round(span / lh) + 1;
    if (visual > lines.length) out.printout.push(lines[0].slice(0, 70));
  }
  for (const m of art.querySelectorAll('mjx-container[display="true"]')) {
    const over = m.scrollWidth - m.clientWidth;
    if (shown(m) && over > 1) out.math.push(over);
  }
  for (const img of art.querySelectorAll('img')) {
    if (!img.naturalWidth || !shown(img)) continue;
    const width = img.getBoundingClientRect().width;
    out.figures.push({src: img.currentSrc || img.src, shown: width,
      natural: img.naturalWidth});
  }
  for (const c of art.querySelectorAll('div.cell')) {
    for (const part of [c, ...c.querySelectorAll(':scope > div')]) {
      const before = getComputedStyle(part, '::before').content;
      if (before && before !== 'none' && before !== 'normal') out.badge.push(before);
    }
  }
  // the reader's text without the code cells' source; the code's first lines apart
  const clone = art.cloneNode(true);
  clone.querySelectorAll('div.cell_input, .tm-calc form').forEach((e) => e.remove());
  document.body.appendChild(clone);
  clone.style.cssText = 'position:absolute;left:-99999px;width:360px';
  out.text = clone.innerText;
  clone.remove();
  out.code = [...art.querySelectorAll('div.cell_input pre')]
    .map((p) => p.textContent.split('\n').slice(0, 2).join('\n')).join('\n');
  return out;
}"""

CJK = re.compile(r"[\u3400-\u9fff]")
# code names a figure may show as they are (optimizers, kernels, libraries)
NAMES = {
    "adamw",
    "adam",
    "sgd",
    "lion",
    "adafactor",
    "eager",
    "sdpa",
    "math",
    "flash",
    "peft",
    "torch",
    "bitsandbytes",
    "nvidia",
    "smi",
    "alpha",
    "dtype",
    "token",
    "logits",
    "softmax",
    "decoder",
    "transformers",
    "deepspeed",
}


def english(text: str) -> bool:
    """A text in English: no Chinese, and a lowercase English word of three or more
    letters outside math (``$…$``), parentheses, code-like tokens (with digits, ``_``,
    ``.``, ``=``) and :data:`NAMES`. "训练步数（step）", "fp16", "LoRA r=8", "GiB" pass;
    "training step" does not."""
    if CJK.search(text):
        return False
    t = re.sub(r"\$[^$]*\$", " ", text)
    t = re.sub(r"（[^）]*）|\([^)]*\)", " ", t)
    words = [w for w in re.split(r"[\s,;:/+×]+", t) if w]
    return any(
        re.fullmatch(r"[a-z]{3,}", w.strip("'\"")) and w.strip("'\"") not in NAMES
        for w in words
    )


def english_phrase(text: str, allowed=frozenset()) -> list[str]:
    """English wording in a Chinese interface text: lowercase English words of three
    or more letters outside parentheses, quotes and code-like tokens (see
    :func:`english`), e.g. ``forward`` in "峰值出现在 forward 阶段"."""
    t = re.sub(r"（[^）]*）|\([^)]*\)|“[^”]*”|`[^`]*`", " ", text)
    out = []
    for w in re.split(
        r"[\s,;:/+×，。；：、]+|(?<=[\u3400-\u9fff])|(?=[\u3400-\u9fff])", t
    ):
        w = w.strip("'\".")
        if re.fullmatch(r"[a-z]{3,}", w) and w not in NAMES and w not in allowed:
            out.append(w)
    return out


def figure_record(path: Path) -> dict | None:
    """The sizes and texts ``coursekit.figures`` stored in a figure's PNG, or None."""
    from PIL import Image

    from coursekit.figures import PNG_KEY

    try:
        with Image.open(path) as im:
            raw = im.info.get(PNG_KEY)
    except OSError:
        return None
    return json.loads(raw) if raw else None


def image_path(src: str, html: Path) -> Path | None:
    u = urlparse(src)
    if u.scheme == "data":
        return None
    parts = Path(unquote(u.path).lstrip("/"))
    return html / parts


def figure_px(fig: dict, html: Path) -> tuple[float | None, list[str]]:
    """(smallest text size in px as the figure is shown, English texts) for one image
    seen by :data:`AUDIT_JS`; (None, []) when the PNG carries no record."""
    path = image_path(fig["src"], html)
    rec = figure_record(path) if path is not None else None
    if rec is None or not rec.get("texts"):
        return None, []
    scale = fig["shown"] / fig["natural"]
    px = min(t["pt"] for t in rec["texts"]) / 72 * rec["dpi"] * scale
    return px, [t["text"] for t in rec["texts"] if english(t["text"])]


def counts(seen: dict, html: Path) -> dict:
    """The per-class counts (and examples) of one page seen at phone size."""
    small, eng, unrecorded = [], [], []
    for fig in seen["figures"]:
        if "_static" in fig["src"] or fig["natural"] < 120:
            continue  # badges and icons
        px, en = figure_px(fig, html)
        name = Path(urlparse(fig["src"]).path).name[:16]
        if px is None:
            unrecorded.append(name)
            continue
        if px < MIN_FIGURE_PX:
            small.append(f"{name} {px:.1f}px")
        if en:
            eng.append(f"{name}: {en[:3]}")
    plumbing = [m.group(0) for m in PLUMBING.finditer(seen["text"])]
    plumbing += [m.group(0) for m in CODE_PLUMBING.finditer(seen["code"])]
    plumbing += [b for b in seen["badge"] if PLUMBING.search(b)]
    return {
        "runon": seen["runon"],
        "broken": seen["broken"],
        "printout": seen["printout"],
        "math": seen["math"],
        "fig_small": small,
        "fig_english": eng,
        "fig_unrecorded": unrecorded,
        "plumbing": plumbing,
    }


CLASSES = (
    "runon",
    "broken",
    "printout",
    "math",
    "fig_small",
    "fig_english",
    "fig_unrecorded",
    "plumbing",
)


def audit(docs: list[str], html: Path) -> dict[str, dict]:
    from tests.site import PHONE, open_page, served_browser, settle, wait_for_math

    out = {}
    with served_browser(html) as (browser, base):
        for doc in docs:
            page, _ = open_page(browser, base, f"{doc}.html", viewport=PHONE)
            try:
                settle(page)
                wait_for_math(page)
                page.wait_for_timeout(400)
                out[doc] = counts(page.evaluate(AUDIT_JS), html)
            finally:
                page.context.close()
    return out


def table(result: dict[str, dict]) -> str:
    rows = ["| page | " + " | ".join(CLASSES) + " |", "|---" * (len(CLASSES) + 1) + "|"]
    total = dict.fromkeys(CLASSES, 0)
    for doc, c in result.items():
        rows.append(f"| {doc} | " + " | ".join(str(len(c[k])) for k in CLASSES) + " |")
        for k in CLASSES:
            total[k] += len(c[k])
    rows.append("| **total** | " + " | ".join(str(total[k]) for k in CLASSES) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from tests.site import HTML, toc_files

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("docs", nargs="*", help="pages (as in _toc.yml); default: all")
    ap.add_argument("--html", type=Path, default=HTML)
    ap.add_argument("--json", type=Path, help="also write the details here")
    ap.add_argument("-v", action="store_true", help="print examples of each class")
    a = ap.parse_args(argv)
    docs = a.docs or [
        d for d in toc_files() if d.startswith("book/") or d.startswith("labs/")
    ]
    result = audit(docs, a.html.resolve())
    print(table(result))
    if a.v:
        for doc, c in result.items():
            for k in CLASSES:
                if c[k]:
                    print(f"{doc} {k}: {c[k][:4]}")
    if a.json:
        a.json.write_text(json.dumps(result, ensure_ascii=False, indent=1), "utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
