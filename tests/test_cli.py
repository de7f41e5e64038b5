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
