"""The `orthoptim` command. Each subcommand lives in its own module, which exposes
`add_parser(subparsers)`; the parser it adds sets `func(args) -> int`. Only the module of the
command given is imported (`main`), so `orthoptim --help`, `--version` and usage errors of the
top level import no torch (`import orthoptim` imports none either).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import signal
import sys
from collections.abc import Collection, Sequence
from typing import NoReturn

from orthoptim import __version__

# Every subcommand: the module whose `add_parser` adds it (a module may add several) and its
# line in `orthoptim --help`, in the order listed there.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("orthoptim.demo", "optimize a small model with Muon and AdamW, print the loss"),
    "train": ("orthoptim.train.cli", "train a small byte-level GPT on N ranks"),
    "compare": (
        "orthoptim.train.cli",
        "train with several optimizers (AdamW and Muon by default), report, plot",
    ),
    "verify": (
        "orthoptim.train.verify",
        "train the same short run at several --nproc and compare the results bit for bit",
    ),
    "bench": ("orthoptim.bench.cli", "benchmarks, measured side by side and reported as ratios"),
    "plan": (
        "orthoptim.plan",
        "a real model's optimizer at 8-1024 GPUs: load balance, bytes, memory, TP modes",
    ),
    "routing": (
        "orthoptim.train.routing_cli",
        "print where build_optimizer sends each parameter of a model, and why",
    ),
}
# Modules that contribute subcommands, in the order `orthoptim --help` lists them.
SUBCOMMAND_MODULES = tuple(dict.fromkeys(module for module, _ in COMMANDS.values()))


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


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered: those of `commands` (None: all)
    by their modules, the rest by name and help only (their modules not imported)."""
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
    wanted = set(COMMANDS if commands is None else commands)
    modules = [m for m in SUBCOMMAND_MODULES if any(COMMANDS[c][0] == m for c in wanted)]
    for name, (module, summary) in COMMANDS.items():
        if module not in modules:
            subparsers.add_parser(name, help=summary, add_help=False)
    for module_name in modules:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand `argv` names (its first word that is not a flag), if it is one."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `orthoptim` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    parser = build_parser([command] if command else [])
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
