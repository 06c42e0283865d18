"""Command line: ``weightsync serve | demo | diagram``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _diagram(_: argparse.Namespace) -> int:
    from weightsync.core.diagram import render_mermaid

    sys.stdout.write(render_mermaid())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    diagram = sub.add_parser("diagram", help="print the state machine as Mermaid")
    diagram.set_defaults(func=_diagram)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
