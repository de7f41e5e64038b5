"""The `orthoptim` command. Each subcommand lives in its own module, which exposes
`add_parser(subparsers)`; the parser it adds sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from collections.abc import Sequence

# Modules that contribute subcommands, in the order `orthoptim --help` lists them.
SUBCOMMAND_MODULES = (
    "orthoptim.demo",
    "orthoptim.train.cli",
    "orthoptim.bench.cli",
    "orthoptim.plan",
    "orthoptim.train.routing_cli",
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="orthoptim",
        description="Matrix-aware optimizers (Muon, SOAP) at data- and tensor-parallel scale.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `orthoptim` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        # a second Ctrl-C during interpreter shutdown would print a traceback
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("orthoptim: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
