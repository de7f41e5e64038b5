"""What a user installs: the wheel carries the licence and its PEP 639 metadata and the version
`orthoptim.__version__` says; the library works without the `[cli]` extra (tqdm, matplotlib),
and the commands that use it say what to install instead of a traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import orthoptim

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
IMPORTED = Path(orthoptim.__file__).resolve().parents[1]  # the code under test, for subprocesses

# Makes tqdm and matplotlib unimportable in every Python process started with its folder on
# PYTHONPATH (the ranks `orthoptim train` starts too), as if they were not installed. The spec
# it hands out has no origin, so importlib.util.find_spec callers (torch._dynamo) skip them.
BLOCKER = """
import importlib.abc, importlib.machinery, sys

class _NotInstalled(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("tqdm", "matplotlib"):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        raise ModuleNotFoundError(f"No module named {spec.name!r}", name=spec.name)

    def exec_module(self, module):
        raise AssertionError("unreachable: create_module raised")

sys.meta_path.insert(0, _NotInstalled())
"""


def test_wheel_carries_the_licence_and_its_metadata(tmp_path):
    """Build the wheel offline from a copy of the project (no build/ or egg-info left in the
    checkout) and read it as an installer would."""
    pytest.importorskip("build", reason="the [test] extra installs build")
    setuptools = pytest.importorskip("setuptools", reason="the [test] extra installs it")
    if int(setuptools.__version__.split(".")[0]) < 77:
        pytest.skip(f"setuptools {setuptools.__version__} < 77 (PEP 639); the [test] extra pins it")
    project = tmp_path / "project"
    project.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, project / name)
    shutil.copytree(
        SRC, project / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    out = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=project,
        check=True,
        capture_output=True,
        timeout=120,
    )
    (wheel,) = out.glob("*.whl")
    version = orthoptim.__version__
    assert wheel.name == f"orthoptim-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        info = f"orthoptim-{version}.dist-info"
        names = set(z.namelist())
        assert z.read(f"{info}/licenses/LICENSE") == (REPO / "LICENSE").read_bytes()
        meta = Parser().parsestr(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert meta["Version"] == version  # pyproject's version is read from orthoptim.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert "License" not in meta  # the legacy field PEP 639 replaces
    assert "Typing :: Typed" in meta.get_all("Classifier")
    assert {"orthoptim/py.typed", "orthoptim/models/gpt-small.json"} <= names
    assert "orthoptim = orthoptim.cli:main" in entry_points
    assert (REPO / "LICENSE").read_text().lstrip().startswith("Apache License")


def _without_cli_extra(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "blocker").mkdir(exist_ok=True)
    (tmp_path / "blocker" / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join([str(tmp_path / "blocker"), str(IMPORTED)])
    env = dict(os.environ, PYTHONPATH=path)
    return subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_library_and_commands_without_the_cli_extra(tmp_path):
    """The optimizers, parallel, checkpoint and kernels import and step without tqdm and
    matplotlib; `compare` and `plan --plot` stop before any work with one line saying what to
    install."""
    script = textwrap.dedent(
        f"""
        import json, sys
        import torch
        from torch import nn

        for blocked in ("tqdm", "matplotlib"):
            try:
                __import__(blocked)
            except ModuleNotFoundError:
                pass
            else:
                raise AssertionError(blocked + " should be blocked")
        import orthoptim, orthoptim.checkpoint, orthoptim.kernels, orthoptim.parallel
        from orthoptim import Muon, build_optimizer, newton_schulz

        torch.manual_seed(0)
        w = nn.Parameter(torch.randn(8, 4))
        opt = Muon([w], lr=0.1)
        w.grad = torch.randn(8, 4)
        before = w.detach().clone()
        opt.step()
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        model(torch.randn(3, 4)).sum().backward()
        build_optimizer(model, optimizer="muon").step()
        out = dict(
            moved=bool((w.detach() - before).abs().max() > 0),
            ns=list(newton_schulz(torch.randn(4, 4)).shape),
            loaded=sorted(m for m in sys.modules if m.split(".")[0] in ("tqdm", "matplotlib")),
        )
        from orthoptim.cli import main

        for argv in (
            ["compare", "--out", {str(tmp_path / "cmp")!r}],
            ["plan", "--model", "llama3-8b", "--dp", "8", "--plot", {str(tmp_path / "p.png")!r}],
        ):
            try:
                main(argv)
            except SystemExit as exc:
                out[argv[0]] = str(exc.code)
        print(json.dumps(out))
        """
    )
    done = _without_cli_extra(tmp_path, "-c", script)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["moved"] and out["ns"] == [4, 4] and out["loaded"] == []
    assert out["compare"] == "orthoptim compare needs matplotlib: pip install 'orthoptim[cli]'"
    assert out["plan"] == "orthoptim plan --plot needs matplotlib: pip install 'orthoptim[cli]'"
    assert not (tmp_path / "cmp").exists()  # refused before the runs, not after them


def test_train_without_tqdm_runs_without_a_progress_bar(tmp_path):
    done = _without_cli_extra(
        tmp_path,
        "-m",
        "orthoptim",
        "train",
        "--nproc=1",
        "--steps=2",
        "--batch=2",
        "--eval-every=1",
        "--eval-batches=1",
        f"--out={tmp_path / 'run'}",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["last_step"] == 2
    notice = (
        "orthoptim train: no progress bar (tqdm is not installed: pip install 'orthoptim[cli]')"
    )
    assert done.stderr.count(notice) == 1, done.stderr
