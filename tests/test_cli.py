"""The `orthoptim` command's surface: every flag of every subcommand has help, a misspelt flag
gets its subcommand's usage and the nearest flag, `--version` prints the package's version."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

import orthoptim
from orthoptim.cli import build_parser, main


def parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("orthoptim",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the command line, with the words that reach it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


def test_every_flag_of_every_subcommand_has_help():
    all_parsers = dict(parsers(build_parser()))
    # the walk reaches the nested benchmarks, so a parser left out would not pass silently
    assert {("orthoptim", "train"), ("orthoptim", "bench", "ns"), ("orthoptim", "plan")} <= set(
        all_parsers
    )
    missing = [
        f"{' '.join(path)} {'/'.join(action.option_strings) or action.dest}"
        for path, parser in all_parsers.items()
        for action in parser._actions
        if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
        and not (action.help or "").strip()
    ]
    assert not missing, f"flags without help: {missing}"


def test_the_help_walk_would_find_a_flag_without_help():
    parser = build_parser()
    train = dict(parsers(parser))[("orthoptim", "train")]
    train.add_argument("--undocumented")
    found = [
        a
        for _, p in parsers(parser)
        for a in p._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help
    ]
    assert [a.option_strings for a in found] == [["--undocumented"]]


@pytest.mark.parametrize(
    ("argv", "usage", "suggestion"),
    [
        (["train", "--stpes", "5"], "usage: orthoptim train ", "did you mean --steps?"),
        (["compare", "--optimzers", "adamw"], "usage: orthoptim compare ", "--optimizers?"),
        (
            ["plan", "--model", "llama3-8b", "--dp", "8", "--jsn"],
            "usage: orthoptim plan ",
            "--json?",
        ),
        (["bench", "ns", "--coefficents=quintic"], "usage: orthoptim bench ns ", "--coefficients?"),
        (["bench", "tp", "--repaets", "2"], "usage: orthoptim bench tp ", "--repeats?"),
    ],
)
def test_a_misspelt_flag_gets_its_subcommands_usage_and_the_nearest_flag(
    argv, usage, suggestion, capsys
):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    prog = usage.removeprefix("usage: ").strip()
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: unrecognized arguments: "), last
    assert last.endswith(suggestion), last


def test_several_unknown_flags_each_get_their_suggestion(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--stpes", "5", "--sed", "1", "--zzzz"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(
        "unrecognized arguments: --stpes 5 --sed 1 --zzzz; "
        "--stpes: did you mean --steps?; --sed: did you mean --seed?"
    ), last


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out == f"orthoptim {orthoptim.__version__}\n"


# Runs `orthoptim.cli.main` with the given words in a fresh interpreter, then says whether
# torch was imported (the command exits first on --help, --version and usage errors).
NO_TORCH_PROBE = """
import sys
from orthoptim.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as stop:
    code = stop.code
print("torch imported:", "torch" in sys.modules, "exit:", code, file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("argv", "code"),
    [
        (["--help"], 0),
        (["--version"], 0),
        ([], 2),
        (["bogus"], 2),
        (["train", "--help"], 0),
        (["compare", "--help"], 0),
        (["demo", "--help"], 0),
        (["train", "--stpes", "5"], 2),
        (["train", "--optimizer", "sgd"], 2),
    ],
)
def test_help_version_and_usage_errors_import_no_torch(argv, code):
    """`orthoptim --help`, `--version`, `orthoptim train --help` and a usage error answer
    without importing torch (which alone takes about as long as the rest of the command)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(orthoptim.__file__).resolve().parents[1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", NO_TORCH_PROBE, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"torch imported: False exit: {code}", done.stderr[-2000:]


def test_the_parsers_names_are_the_implementations():
    """The torch-free names the parser offers (`orthoptim.choices`) are those the library
    implements."""
    from orthoptim import choices
    from orthoptim.optim.registry import ELEMENTWISE_OPTIMIZERS, MATRIX_OPTIMIZERS
    from orthoptim.train.loop import Preempted
    from orthoptim.train.model import CONFIGS

    assert tuple(MATRIX_OPTIMIZERS) == choices.MATRIX_OPTIMIZER_NAMES
    assert tuple(ELEMENTWISE_OPTIMIZERS) == choices.ELEMENTWISE_OPTIMIZER_NAMES
    assert tuple(CONFIGS) == choices.CONFIG_NAMES
    assert Preempted.EXIT_CODE == choices.PREEMPTED_EXIT_CODE


def test_the_parser_for_one_command_matches_the_whole_one(capsys):
    """`main` builds the named command's parser only (the others by name and help): its
    help is the one of the parser with every command."""
    from orthoptim.cli import COMMANDS

    for name in COMMANDS:
        helps = []
        for parser in (build_parser(), build_parser([name])):
            sub = dict(parsers(parser))[("orthoptim", name)]
            helps.append(sub.format_help())
        assert helps[0] == helps[1], name
    top = [build_parser().format_help(), build_parser([]).format_help()]
    assert top[0] == top[1]
