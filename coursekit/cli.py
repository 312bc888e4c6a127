"""``python -m coursekit`` — course machinery from the command line."""

from __future__ import annotations

import argparse
import sys

from . import labs_cli


def _cmd_execute(args: argparse.Namespace) -> int:
    from .execute import execute_notebook

    for nb in args.notebooks:
        dt = execute_notebook(nb, timeout=args.timeout)
        print(f"executed {nb} in {dt:.1f} s")
    return 0


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
    e.set_defaults(func=_cmd_execute)
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
