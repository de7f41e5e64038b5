"""The `orthoptim` command. Each subcommand lives in its own module, which exposes
`add_parser(subparsers)`; the parser it adds sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import signal
import sys
from collections.abc import Sequence
from typing import NoReturn

from orthoptim import __version__

# Modules that contribute subcommands, in the order `orthoptim --help` lists them.
SUBCOMMAND_MODULES = (
    "orthoptim.demo",
    "orthoptim.train.cli",
    "orthoptim.train.verify",
    "orthoptim.bench.cli",
    "orthoptim.plan",
    "orthoptim.train.routing_cli",
)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose subcommands (which get this class too) refuse an unknown flag
    themselves, with their own usage and the nearest flag they know. Plain argparse hands the
    leftovers up to `orthoptim`, which prints the top-level usage and no suggestion."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if extras:
            self.unrecognized(extras)
        return ns, extras

    def unrecognized(self, extras: list[str]) -> NoReturn:
        """Exit 2 with this parser's usage, naming `extras` and the closest known flag of each
        unknown one ("did you mean --steps?")."""
        known = [s for s in self._option_string_actions if s.startswith("--")]
        flags = [arg.partition("=")[0] for arg in extras if arg.startswith("-")]
        hints = []
        for flag in flags:
            if close := difflib.get_close_matches(flag, known, n=1):
                hints.append(f"{flag}: " * (len(flags) > 1) + f"did you mean {close[0]}?")
        self.error("; ".join([f"unrecognized arguments: {' '.join(extras)}", *hints]))


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = Parser(
        prog="orthoptim",
        description="Matrix-aware optimizers (Muon, SOAP) at data- and tensor-parallel scale.",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"orthoptim {__version__}",
        help="print the installed orthoptim version and exit",
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
