"""CHANGELOG.md names its evidence: every bullet under an "Added", "Changed" or "Fixed"
heading ends with a `Tests:` line of pytest node ids, and every test named there exists and
is collected, not skipped, by the stages `.ci/run` runs. A claim whose test is renamed,
deleted, marked `probe` or skipped fails here, instead of resting on nothing.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEADINGS = ("### Added", "### Changed", "### Fixed")
NODE = re.compile(r"`(tests/[\w/]+\.py::[\w:]+)`")

# Run inside the collecting subprocess: each collected item's id (brackets dropped) and
# whether a skip or skipif marker would skip it, as one JSON line per item.
PLUGIN = """
import json, os
from _pytest.skipping import evaluate_skip_marks

def pytest_collection_finish(session):
    with open(os.environ["CHANGELOG_ITEMS"], "w") as f:
        for item in session.items:
            skipped = item.get_closest_marker("probe") is not None
            skipped = skipped or evaluate_skip_marks(item) is not None
            f.write(json.dumps({"id": item.nodeid.split("[")[0], "skipped": skipped}) + "\\n")
"""


def bullets(text: str) -> list[tuple[str, str]]:
    """(heading, bullet text) for every bullet under an Added, Changed or Fixed heading."""
    out, heading, current = [], None, None
    for line in text.splitlines():
        if line.startswith("#"):
            if current is not None:
                out.append((heading, current))
            current = None
            heading = line.strip() if line.strip() in HEADINGS else None
        elif heading and line.startswith("- "):
            if current is not None:
                out.append((heading, current))
            current = line
        elif heading and current is not None and line.startswith("  "):
            current += "\n" + line
        elif heading and current is not None and not line.strip():
            out.append((heading, current))
            current = None
    if current is not None:
        out.append((heading, current))
    return out


def named_tests(bullet: str) -> list[str]:
    """The node ids of a bullet's `Tests:` line (its last paragraph line onwards)."""
    at = bullet.rfind("Tests:")
    return NODE.findall(bullet[at:]) if at >= 0 else []


def ci_stages() -> list[str]:
    """The `-m` expressions of the pytest runs in `.ci/run`."""
    stages = []
    for line in (ROOT / ".ci/run").read_text().splitlines():
        if "-m pytest" not in line:
            continue
        words = shlex.split(line, comments=True)
        args = words[words.index("pytest") + 1 :]
        stages.append(args[args.index("-m") + 1] if "-m" in args else "")
    return stages


def test_every_entry_names_its_tests() -> None:
    entries = bullets((ROOT / "CHANGELOG.md").read_text())
    assert len(entries) > 20, "the changelog parser found too few entries"
    missing = [b.splitlines()[0][:90] for _, b in entries if not named_tests(b)]
    assert not missing, "entries without a `Tests:` line:\n" + "\n".join(missing)


def test_ci_runs_every_test_but_the_probes_in_two_stages() -> None:
    """`.ci/run`'s stages are the default set and the `slow` set: together every test that is
    not a probe (a probe is skipped unless `-m probe` is selected)."""
    assert sorted(ci_stages()) == ["not slow", "slow"]


def test_every_named_test_exists_and_ci_runs_it(tmp_path: Path) -> None:
    entries = bullets((ROOT / "CHANGELOG.md").read_text())
    wanted = sorted({t for _, b in entries for t in named_tests(b)})
    files = sorted({t.split("::")[0] for t in wanted})
    absent = [f for f in files if not (ROOT / f).is_file()]
    assert not absent, f"named test files that do not exist: {absent}"
    (tmp_path / "changelog_items.py").write_text(PLUGIN)
    listing = tmp_path / "items.jsonl"
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "changelog_items", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": path, "CHANGELOG_ITEMS": str(listing)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    items = [json.loads(line) for line in listing.read_text().splitlines()]
    runs = {i["id"] for i in items if not i["skipped"]}
    collected = {i["id"] for i in items}
    problems = []
    for t in wanted:
        if t not in collected:
            problems.append(f"{t}: no such test")
        elif t not in runs:
            problems.append(f"{t}: skipped in .ci/run (a probe, or a skip marker)")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "text, named",
    [
        ("- A thing.\n  Tests: `tests/test_a.py::test_b`, `tests/test_c.py::T::test_d`.",
         ["tests/test_a.py::test_b", "tests/test_c.py::T::test_d"]),
        ("- A thing with `code` and no line naming tests.", []),
    ],
)  # fmt: skip
def test_the_parser_reads_a_tests_line(text: str, named: list[str]) -> None:
    (_, bullet), = bullets(f"### Added\n\n{text}\n")  # fmt: skip
    assert named_tests(bullet) == named
