"""An output folder belongs to one run: `orthoptim train` refuses a folder that holds a run
unless --resume or --overwrite is given, a lock keeps a second run out, and resuming a
finished run changes nothing. One rank, tiny config, a few steps (the checks happen in the
launcher, before any rank starts, whatever --nproc is)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from orthoptim.cli import main
from orthoptim.train import launcher, runfolder
from orthoptim.train.args import TrainArgs


def _argv(out: Path, *extra: str) -> list[str]:
    return [
        "train", "--nproc", "1", "--config", "tiny", "--steps", "4", "--batch", "2",
        "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2", "--warmup", "1",
        "--out", str(out), "--no-progress", *extra,
    ]  # fmt: skip


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _snapshot(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under `out` with its bytes and modification time."""
    return {
        str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A finished 4-step run and one left after step 2 (checkpoints every 2 steps)."""
    base = tmp_path_factory.mktemp("runs")
    assert main(_argv(base / "finished")) == 0
    assert main(_argv(base / "partial", "--stop-after", "2")) == 0
    return {"finished": base / "finished", "partial": base / "partial"}


def test_new_run_refuses_a_folder_holding_a_run_unless_overwrite(tmp_path, runs, capsys):
    """Issue case 1: leaving off --resume used to wipe the previous run."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    before = _snapshot(out)
    assert main(_argv(out, "--stop-after", "1")) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds a run (checkpoint at step 2)" in err, err
    assert "--resume" in err and "--overwrite" in err
    assert _snapshot(out) == before and not (out / ".lock").exists()
    # Any trace of a run counts (here a metrics file alone).
    lone = tmp_path / "B"
    lone.mkdir()
    (lone / "metrics.jsonl").write_text("")
    assert main(_argv(lone)) == 2
    assert "holds a run (no checkpoint)" in capsys.readouterr().err
    # --overwrite removes the previous run's files and starts afresh; others stay.
    (out / "notes.txt").write_text("mine")
    (out / "logs" / "rank1.log").write_text("an old rank's log")
    assert main(_argv(out, "--overwrite", "--stop-after", "1")) == 0
    assert _steps(out) == [0, 1]
    assert json.loads((out / "checkpoints" / "latest.json").read_text())["step"] == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest.json", "step_000001"]
    assert not (out / "logs" / "rank1.log").exists() and (out / "notes.txt").read_text() == "mine"
    assert main(_argv(out, "--overwrite", "--resume")) == 2
    assert "--resume continues" in capsys.readouterr().err


def test_resume_without_checkpoint_gives_the_right_advice(tmp_path, capsys):
    """The latest.json-missing error used to recommend running without --resume, which
    (issue case 1) wiped the run: it now says which flag fits the folder."""
    assert main(_argv(tmp_path / "empty", "--resume")) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "holds no run: drop --resume" in err
    assert not (tmp_path / "empty").exists()
    out = tmp_path / "crashed"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    assert main(_argv(out, "--resume")) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "pass --overwrite instead of --resume" in err
    assert "drop --resume" not in err


def test_resuming_a_finished_run_changes_nothing(tmp_path, runs, capsys):
    """Issue case 4: resuming a finished run (or --stop-after at or below the checkpoint's
    step) used to exit 0 after overwriting result.json with final_val_loss null."""
    out = shutil.copytree(runs["finished"], tmp_path / "A")
    before = _snapshot(out)
    result = json.loads((out / "result.json").read_text())
    assert result["final_val_loss"] is not None
    for extra in ((), ("--stop-after", "3")):
        capsys.readouterr()
        assert main(_argv(out, "--resume", *extra)) == 0
        assert f"--out {out} finished at step 4; nothing to do" in capsys.readouterr().out
        assert _snapshot(out) == before
    part = shutil.copytree(runs["partial"], tmp_path / "B")
    before = _snapshot(part)
    for stop in ("1", "2"):
        assert main(_argv(part, "--resume", "--stop-after", stop)) == 0
        assert f"--out {part} is at step 2, --stop-after {stop}; nothing to do" in (
            capsys.readouterr().out
        )
        assert _snapshot(part) == before
    # What is left to do still runs.
    assert main(_argv(part, "--resume")) == 0
    assert _steps(part) == [0, 1, 2, 3, 4]
    assert json.loads((part / "result.json").read_text())["final_val_loss"] is not None


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(out: Path, host: str, pid: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / ".lock"
    path.write_text(json.dumps(dict(host=host, pid=pid, started="2026-01-01T00:00:00")))
    return path


def test_a_running_run_locks_its_folder(tmp_path, capsys, monkeypatch):
    """Issue case 3: two runs on one --out used to interleave their metrics. The launcher
    holds out/.lock (host, pid, start) while its ranks run and releases it, also on failure;
    a live holder of this host is refused by host and pid."""
    out = tmp_path / "A"
    seen = []

    def fake_ranks(args, nproc):
        seen.append(json.loads((out / ".lock").read_text()))
        # A second run while this one goes: refused, naming the holder.
        assert main(_argv(out)) == 2
        raise RuntimeError("a rank failed")

    monkeypatch.setattr(launcher, "_launch_ranks", fake_ranks)
    with pytest.raises(RuntimeError, match="a rank failed"):
        main(_argv(out))
    err = capsys.readouterr().err
    (holder,) = seen
    assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid()
    assert "started" in holder
    who = f"host {holder['host']}, pid {holder['pid']}"
    assert f"--out {out} is in use by another run ({who}" in err
    assert not (out / ".lock").exists()  # released although the ranks failed

    # A live process of this host (not this one) holds the lock.
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = _write_lock(tmp_path / "B", socket.gethostname(), sleeper.pid)
        assert main(_argv(tmp_path / "B")) == 2
        assert f"pid {sleeper.pid}" in capsys.readouterr().err
        assert json.loads(lock.read_text())["pid"] == sleeper.pid  # left alone
    finally:
        sleeper.kill()
        sleeper.wait()


def test_lock_stale_and_other_host(tmp_path, caplog):
    """The lock function: atomic, exclusive; a lock whose process is gone on this host is taken
    over with a logged notice; another host's lock is refused (its liveness is unknown)."""
    out = tmp_path / "A"
    path = runfolder.acquire_lock(out)
    me = json.loads(path.read_text())
    assert me["pid"] == os.getpid() and me["host"] == socket.gethostname()
    with pytest.raises(ValueError, match="in use by another run"):
        runfolder.acquire_lock(out)
    runfolder.release_lock(path)
    assert not path.exists()

    dead = _dead_pid()
    _write_lock(out, socket.gethostname(), dead)
    with caplog.at_level(logging.WARNING, logger="orthoptim.train.runfolder"):
        path = runfolder.acquire_lock(out)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert "stale lock" in caplog.text and f"pid {dead}" in caplog.text
    runfolder.release_lock(path)
    assert sorted(p.name for p in out.iterdir()) == []

    other = _write_lock(out, "elsewhere.example", dead)
    with pytest.raises(ValueError, match=r"another machine \(host elsewhere.example") as e:
        runfolder.acquire_lock(out)
    assert f"remove {other}" in str(e.value)
    runfolder.release_lock(other)  # not ours: left alone
    assert other.exists()


def test_run_under_torchrun_checks_the_folder(tmp_path, runs):
    """`run` (each rank under torchrun; here one process, rank 0) applies the same rules."""
    out = shutil.copytree(runs["finished"], tmp_path / "A")
    before = _snapshot(out)
    args = TrainArgs(
        config="tiny", steps=4, batch=2, warmup=1, eval_batches=1, out=str(out), progress=False
    )
    with pytest.raises(ValueError, match="holds a run"):
        launcher.run(args)
    args.resume = True
    result = launcher.run(args)
    assert result["nothing_to_do"] == f"--out {out} finished at step 4; nothing to do"
    assert result["final_val_loss"] is not None
    assert _snapshot(out) == before
