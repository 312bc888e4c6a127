"""The in-page memory calculator: time to the first answer, time to answer a change,
bytes added.

Needs a built book (``make book``) and Chromium. Serves _build/html on 127.0.0.1 with
every other host blocked, opens book/calculator.html in a fresh browser context (cold
cache) ``--runs`` times and prints:

* the first answer: milliseconds from navigation start until the result is on screen,
  with the stages (script started, Pyodide module imported, interpreter ready, estimator
  imported) — with the site's python_stdlib.zip (bytecode added for the modules the page
  imports, see _ext/calculator_stdlib.mjs) and, as the reference, the npm package's own
  zip (sources only), alternating in the same run;
* later changes: milliseconds from an edit of a field (an ``input`` event, as typing
  fires) until the new result is rendered (includes the 120 ms the page waits for typing
  to pause);
* the bytes the calculator adds to the built site.

    python benchmarks/calculator_load.py [--runs 3] [--changes 10]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.site import CHROMIUM_ARGS, HTML, SiteServer, chromium_path, open_offline  # noqa: E402

CHANGE = """async ([name, value]) => {
  const root = document.querySelector('.tm-calc');
  const result = root.querySelector('.tm-calc-result');
  const seq = result.dataset.seq;
  const field = root.querySelector(`[name="${name}"]`);
  const t0 = performance.now();
  await new Promise((resolve) => {
    const mo = new MutationObserver(() => {
      if (result.dataset.seq !== seq) { mo.disconnect(); resolve(); }
    });
    mo.observe(result, {attributes: true});
    field.value = value;
    field.dispatchEvent(new Event('input', {bubbles: true}));
  });
  return [performance.now() - t0, Number(result.dataset.ms)];
}"""

EDITS = [
    ("batch", "2"),
    ("seq", "1024"),
    ("method", "lora"),
    ("lora-rank", "16"),
    ("batch", "8"),
    ("model", "llama2-13b"),
    ("precision", "fp32"),
    ("zero", "3"),
    ("gpus", "8"),
    ("model", "llama2-70b"),
    ("method", "qlora"),
    ("seq", "4096"),
]


def site_bytes() -> list[tuple[str, int]]:
    root = HTML / "_static" / "calculator"
    rows = []
    for sub in ("pyodide", "py"):
        size = sum(f.stat().st_size for f in (root / sub).rglob("*") if f.is_file())
        rows.append((f"_static/calculator/{sub}/", size))
    rows.append(
        (
            "_static/calculator/ (script, style, manifest)",
            sum(f.stat().st_size for f in root.iterdir() if f.is_file()),
        )
    )
    rows.append(
        ("book/calculator.html", (HTML / "book" / "calculator.html").stat().st_size)
    )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="cold page loads (default 3)")
    ap.add_argument(
        "--changes",
        type=int,
        default=len(EDITS),
        help=f"edits per load (≤ {len(EDITS)})",
    )
    args = ap.parse_args()
    exe = chromium_path()
    if exe is None or not (HTML / "book" / "calculator.html").exists():
        print("needs Chromium and a built book (make book)", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    npm_zip = ROOT / "node_modules" / "pyodide" / "python_stdlib.zip"
    variants = {
        "site (bytecode added)": None,
        "npm zip (sources only)": {"/python_stdlib.zip": npm_zip},
    }
    loads = {v: [] for v in variants}
    changes, computes = [], []
    with SiteServer(HTML) as server, sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS)
        for _, (variant, serve) in itertools.product(
            range(args.runs), variants.items()
        ):
            page, problems = open_offline(
                b, server.url, "book/calculator.html", serve=serve
            )
            page.wait_for_selector(
                ".tm-calc[data-state=ready]", state="attached", timeout=120000
            )
            loads[variant].append(
                json.loads(page.get_attribute(".tm-calc", "data-timings"))
            )
            if serve is None:  # later edits: measured on the site as built
                for name, value in EDITS[: args.changes]:
                    ms, compute = page.evaluate(CHANGE, [name, value])
                    changes.append(ms)
                    computes.append(compute)
            if problems:
                print("problems:", *problems, sep="\n  ")
            page.context.close()
        b.close()

    print(
        "## First answer (ms since navigation start; fresh browser context each run)\n"
    )
    stages = ["start", "imported", "pyodide", "estimator", "answer"]
    print("| python_stdlib.zip | run | " + " | ".join(stages) + " |")
    print("|---|---|" + "---:|" * len(stages))
    for variant, ts in loads.items():
        for i, t in enumerate(ts, 1):
            print(
                f"| {variant} | {i} | " + " | ".join(str(t[s]) for s in stages) + " |"
            )
    print()
    for variant, ts in loads.items():
        print(
            f"median first answer, {variant}: "
            f"{statistics.median(t['answer'] for t in ts) / 1000:.1f} s"
        )
    print()
    print("## Later changes (ms from the edit to the rendered result)\n")
    print("| edits | median | max | estimator call, median | estimator call, max |")
    print("|---:|---:|---:|---:|---:|")
    print(
        f"| {len(changes)} | {statistics.median(changes):.0f} | {max(changes):.0f} | "
        f"{statistics.median(computes):.0f} | {max(computes):.0f} |"
    )
    print("\n## Bytes the calculator adds to the built site\n")
    print("| path | bytes | MiB |")
    print("|---|---:|---:|")
    total = 0
    for path, n in site_bytes():
        total += n
        print(f"| {path} | {n:,} | {n / 2**20:.2f} |")
    print(f"| total | {total:,} | {total / 2**20:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
