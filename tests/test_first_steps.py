"""What a newcomer copies and tries first: a model factory in the current folder for
`orthoptim routing`, a `--data` file too short for the config, more ranks than CPU cores, the
README's Muon example on a model with biases, the docs build without its extra. Each gets a
way forward, not a trap; and the figures the commands print say what they are, in units
that agree."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from orthoptim.cli import main
from orthoptim.train import launcher
from orthoptim.train.args import TrainArgs
from orthoptim.train.data import DataError, load_corpus

ROOT = Path(__file__).resolve().parent.parent


def test_routing_imports_a_factory_from_the_current_folder(tmp_path, monkeypatch, capsys):
    """`orthoptim routing --model mymodel:build` finds mymodel.py in the current folder, as
    `python -m` does, even when the command's path does not hold that folder."""
    (tmp_path / "newcomer_model.py").write_text(
        "from torch import nn\n\ndef build():\n    return nn.Sequential(nn.Linear(8, 8))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "newcomer_model", raising=False)
    assert main(["routing", "--model", "newcomer_model:build"]) == 0
    assert "0.weight" in capsys.readouterr().out


def test_a_short_data_file_names_the_config_with_a_shorter_context(tmp_path):
    """A --data file too short for --config small's 256-byte windows: the advice names the
    flag and value that fit (`--config tiny`), not a "shorter context" train has no flag for."""
    text = tmp_path / "short.txt"
    text.write_text("x" * 400)
    with pytest.raises(DataError, match=r"or pass --config tiny \(128-byte context\)"):
        load_corpus(str(text), min_bytes=257)
    load_corpus(str(text), min_bytes=129)


def test_more_ranks_than_cores_are_announced(tmp_path, monkeypatch, capsys):
    """`--nproc 4` on a 2-core CPU machine says, before the ranks start, what it starts and
    that they will be slow; as many ranks as cores say nothing."""
    monkeypatch.setattr(launcher, "_launch_ranks", lambda args, nproc: {"last_step": 0})
    monkeypatch.setattr(launcher.devices, "visible_gpus", lambda: 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    for nproc, said in ((4, True), (2, False)):
        args = TrainArgs(config="tiny", steps=2, batch=2, out=str(tmp_path / f"run{nproc}"))
        launcher.launch(args, nproc=nproc)
        err = capsys.readouterr().err
        assert ("starting 4 ranks on 2 CPU cores" in err) is said, err


def test_the_readmes_muon_example_runs_on_a_model_with_biases():
    """The README's direct `Muon(...)` example (the lines from `matrices = ...` to the call's
    end), on a model with biases: Muon gets the parameters it takes, and a step runs."""
    from orthoptim import Muon

    readme = (ROOT / "README.md").read_text()
    example = re.search(
        r"^matrices = .*?^opt = Muon\(.*?nonfinite=\"raise\"\)", readme, re.M | re.S
    )
    assert example, "the README's Muon example is gone"
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    namespace = {"model": model, "Muon": Muon}
    exec(example.group(0), namespace)
    model(torch.randn(4, 8)).sum().backward()
    namespace["opt"].step()


def test_the_docs_build_without_the_docs_extra_says_what_to_install(tmp_path):
    """`bash .ci/docs` where mkdocs is missing: one line naming the install, not a traceback."""
    import subprocess

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python3").write_text("#!/bin/sh\nexit 1\n")  # a Python without mkdocs
    (fake / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(
        ["bash", str(ROOT / ".ci/docs")], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        ".ci/docs: mkdocs is not installed; pip install -c .ci/constraints.txt -e '.[docs]'"
    )


def test_the_fits_verdict_sets_gib_against_gib():
    """`plan`'s verdict compares like with like: the peak and the capacity both in GiB, the
    hardware's own GB beside (it set "147.1 GiB of 141 GB")."""
    from orthoptim.plan.hardware import memory_verdict

    line = memory_verdict(166.3 * 2**30, 141e9, "h200", over=256, ranks=256)
    assert line.startswith("fits: no — peak 166.3 GiB of 131.3 GiB (h200: 141 GB), 1.27x"), line


def test_plan_says_how_its_two_newton_schulz_figures_differ(capsys):
    """The per-rank table counts each matrix's path's flops (SYRK), the overhead section
    plain matmuls: the report says so where the second figure appears."""
    assert main(["plan", "--model", "gpt-small", "--dp", "8"]) == 0
    out = capsys.readouterr().out
    at = out.index("Newton-Schulz per GPU mean")
    assert "counted as plain matmuls" in out[at : at + 400], out[at : at + 400]


def test_demo_says_what_its_losses_show(capsys):
    """`orthoptim demo` ends with a line saying what the two losses are and what they do not
    show, after the figures."""
    assert main(["demo", "--steps", "3", "--width", "16"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-3].startswith("muon: loss ") and lines[-2].startswith("adamw: loss ")
    assert "the same weights, data and 3 steps" in lines[-1]
    assert "orthoptim compare" in lines[-1]


def test_the_docs_home_page_reads_as_a_page_in_the_repository():
    """docs/index.md, which the site fills with the README, is no blank page where it is
    read as a file: it says so and links the README and the other pages."""
    text = (ROOT / "docs" / "index.md").read_text()
    visible = re.sub(r"<!--.*?-->", "", text, flags=re.S).strip()
    assert "[README](../README.md)" in visible
    for page in re.findall(r"\]\(([\w-]+\.md)\)", visible):
        assert (ROOT / "docs" / page).is_file(), page
