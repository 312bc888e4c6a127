"""``python -m coursekit`` — course machinery from the command line."""

from __future__ import annotations

import argparse
import sys

from . import labs_cli


def _cmd_execute(args: argparse.Namespace) -> int:
    from .execute import execute_notebook

    for nb in args.notebooks:
        dt = execute_notebook(nb, timeout=args.timeout, gpu=args.gpu)
        print(f"executed {nb} in {dt:.1f} s")
    return 0


def _cmd_tidy(args: argparse.Namespace) -> int:
    from .tidy import tidy_paths

    reports = tidy_paths(args.paths, check=args.check)
    for r in reports:
        for line in r.changes if args.verbose or args.check else []:
            print(line)
        for line in r.left if args.verbose else []:
            print("left:", line)
    changed = [r for r in reports if r.changed]
    verb = "would change" if args.check else "changed"
    print(f"tidy: {verb} {len(changed)} of {len(reports)} notebooks")
    return 1 if args.check and changed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m coursekit", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser(
        "execute", help="re-execute notebooks in place (fresh stored outputs)"
    )
    e.add_argument("notebooks", nargs="+")
    e.add_argument(
        "--timeout", type=int, default=600, help="per-cell timeout in seconds"
    )
    e.add_argument(
        "--gpu",
        choices=("auto", "on", "off"),
        default="auto",
        help="GPU cells: real GPU output when a CUDA device is visible (auto), "
        "required (on), or always their labelled CPU small-size run (off)",
    )
    e.set_defaults(func=_cmd_execute)
    t = sub.add_parser(
        "tidy", help="move authoring plumbing (glue, nbval markers, setup) off the page"
    )
    t.add_argument("paths", nargs="*", default=["book", "solutions"])
    t.add_argument(
        "--check",
        action="store_true",
        help="change nothing; exit 1 if a notebook would change",
    )
    t.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="list every change and every glue call left",
    )
    t.set_defaults(func=_cmd_tidy)
    labs_cli.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
