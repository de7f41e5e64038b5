"""The pinned test environment: `.ci/constraints.txt` pins, exactly, every package the
extras CI installs name (setuptools included), and both CI and the README's test command
install through it, so a new release of a test tool cannot turn a fresh clone red."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CI_EXTRAS = ("test", "triton", "integrations", "docs")  # what .ci/run installs
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci/constraints.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep and version.strip() and " " not in name, f"not an exact pin: {line!r}"
        pins[_canonical(name)] = version.strip()
    return pins


def _extra_packages(extras: dict[str, list[str]], names: tuple[str, ...]) -> set[str]:
    """The packages `names` install, `orthoptim[...]` self-references followed."""
    out: set[str] = set()
    for extra in names:
        for req in extras[extra]:
            inner = re.fullmatch(r"orthoptim\[(.+)\]", req.replace(" ", ""))
            if inner:
                out |= _extra_packages(extras, tuple(inner[1].split(",")))
            else:
                out.add(_canonical(NAME.match(req)[1]))
    return out


def test_every_package_of_the_ci_extras_is_pinned_exactly() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = _extra_packages(extras, CI_EXTRAS) | {
        _canonical(NAME.match(d)[1]) for d in project["dependencies"] if "torch" not in d
    }
    wanted.add("setuptools")  # tests/test_packaging.py builds the wheel with it
    pins = _pins()
    assert not wanted - pins.keys(), f"not pinned in .ci/constraints.txt: {wanted - pins.keys()}"
    assert {"mkdocs", "mkdocstrings"} <= _extra_packages(extras, ("docs",))


def test_ci_and_the_readme_install_through_the_constraints() -> None:
    ci = (ROOT / ".ci/run").read_text()
    assert re.search(
        r"pip install .*-c \.ci/constraints\.txt -e '\.\[test,triton,integrations,docs\]'", ci
    )
    readme = (ROOT / "README.md").read_text()
    assert "pip install -c .ci/constraints.txt -e '.[test" in readme
    assert "pip freeze" in (ROOT / ".ci/lock").read_text()  # .ci/lock writes the pins


def _bash_lines(text: str) -> list[str]:
    """The lines of `text`'s ```bash blocks."""
    return [
        line
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
    ]


def test_ci_runs_the_readme_test_commands_word_for_word() -> None:
    """The README's test command is the default stage (not the whole suite, an hour on 2
    cores), its second command the slow stage, and `.ci/run` runs exactly those two."""
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set up") : readme.index("### On GPUs")]
    commands = [c.split("&& ")[-1] for c in _bash_lines(setup) if "-m pytest" in c]
    assert commands == ['python -m pytest -q -m "not slow"', "python -m pytest -q -m slow"]
    stages = [
        line.split(maxsplit=2)[2]
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line.startswith("stage ") and "-m pytest" in line
    ]
    assert stages == commands
