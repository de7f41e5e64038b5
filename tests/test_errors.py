"""Failures as the user sees them (issue 22, item 7): one failure, one clear message.

A failing rank's exception (type, message, rank, phase) is the one line on the terminal and
its traceback is in that rank's log, torch's launcher reports go to OUT/logs/launcher.log; a
stalled rank is named once --pg-timeout passes; Ctrl-C ends the run with one line and exit
status 130; every refused flag is named as the user typed it. The multi-rank cases run
`python -m orthoptim` as a subprocess, so stderr is the terminal's, launcher logs included.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orthoptim.cli import main
from orthoptim.train import launcher

TINY = ["--config", "tiny", "--batch", "2", "--eval-batches", "1", "--no-progress"]
# Learning rates that blow the tiny model up within two steps: a real failure a user can
# cause, raised by the optimizer on every rank (NonFiniteGradientError, which the loop turns
# into advice on flags).
DIVERGING = ["--lr", "1e12", "--adamw-lr", "1e12"]
GUARD_S = 120  # the most a subprocess may take before the test gives up on it


def _orthoptim(*argv: str) -> subprocess.Popen:
    """`python -m orthoptim ARGV` in its own session (so a signal can reach every rank)."""
    return subprocess.Popen(
        [sys.executable, "-m", "orthoptim", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen) -> str:
    """Wait for `proc` (killing its session if it overruns GUARD_S) and return its stderr."""
    try:
        return proc.communicate(timeout=GUARD_S)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"`orthoptim {' '.join(proc.args[3:])}` did not end within {GUARD_S} s")


def _wait_for_steps(proc: subprocess.Popen, out: Path, steps: int) -> None:
    """Return once rank 0 logged `steps` training steps in metrics.jsonl."""
    rows = out / "metrics.jsonl"
    deadline = time.monotonic() + GUARD_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before step {steps}: {proc.communicate()[1]}")
        done = rows.read_text().count('"train_loss"') if rows.exists() else 0
        if done >= steps:
            return
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"no step {steps} within {GUARD_S} s")


def _rank_pid(out: Path, parent: int, rank: int) -> int:
    """The pid of `rank`, as its heartbeat gives it, checked to be a child of `parent`."""
    beat = json.loads((out / "logs" / launcher.HEARTBEAT_FILE.format(rank=rank)).read_text())
    children = {
        int(c)
        for t in Path(f"/proc/{parent}/task").iterdir()
        for c in (t / "children").read_text().split()
    }
    assert beat["pid"] in children
    return beat["pid"]


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "argv, named",
    [
        (["train", "--weight-decay", "-1"], "--weight-decay must be a finite number >= 0"),
        (["train", "--weight-decay", "nan"], "--weight-decay must be a finite number >= 0"),
        (["train", "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
        (["train", "--adamw-lr", "nan"], "--adamw-lr must be a finite number > 0, got nan"),
        (["train", "--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
        (["train", "--pg-timeout", "0"], "--pg-timeout must be a finite number of seconds > 0"),
        (["compare", "--muon-lr", "nan"], "--muon-lr must be a finite number > 0, got nan"),
        (["compare", "--adamw-lr", "-1"], "--adamw-lr must be a finite number > 0, got -1"),
    ],
)
def test_a_refused_value_names_the_flag_typed(tmp_path, capsys, argv, named):
    out = tmp_path / "run"
    assert main([*argv, "--nproc", "1", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"orthoptim: error: {named}") and err.count("\n") == 1
    assert not out.exists()  # refused before anything was written


def test_an_unusable_out_or_plot_path_is_named_with_the_os_reason(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    for command in ("train", "compare"):
        assert main([command, "--nproc", "1", "--out", str(afile), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"orthoptim: error: --out {afile} is a file; pass a folder (it is created if missing)\n"
        )
    # /proc refuses new entries: the OS's reason is given, whatever it is on this system.
    virtual = Path("/proc/orthoptim-test/run")
    try:
        virtual.mkdir(parents=True)
    except OSError as e:
        reason = e.strerror
    else:  # pragma: no cover - only on a system whose /proc takes folders
        pytest.skip("/proc takes new folders here")
    assert main(["train", "--nproc", "1", "--out", str(virtual), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"orthoptim: error: --out {virtual}: cannot write a run folder there ({reason}); "
        "pass a writable folder\n"
    )
    png = virtual / "plan.png"
    assert main(["plan", "--model", "gpt-small", "--dp", "4", "--plot", str(png)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"orthoptim plan: error: --plot {png}: cannot write it (")
    assert err.count("\n") == 1


# ---------------------------------------------------------------- failing ranks


def _one_line_report(err: str, out: Path) -> re.Match:
    """The failure report: at most a few short lines, the last naming the rank, where it
    was, the exception and the log holding the traceback."""
    assert len(err.splitlines()) < 5 and len(err) < 700, err
    line = err.splitlines()[-1]
    found = re.fullmatch(
        r"orthoptim: error: rank (\d) failed (.+?): FloatingPointError: non-finite gradient at "
        r"step \d; no checkpoint was saved yet: start again with --overwrite and a lower --lr or "
        r"--grad-clip \(in .*…? \(full traceback: (.+)\)",
        line,
    )
    assert found, line
    log = Path(found[3])
    assert log == out / "logs" / f"rank{found[1]}.log"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text
    assert "orthoptim.optim.base.NonFiniteGradientError: non-finite gradient" in text
    return found


def test_a_failing_rank_in_process_is_one_line_and_in_its_log(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", *TINY, *DIVERGING, "--steps", "3", "--nproc", "1", "--out", str(out)]
    assert main(argv) == 2
    found = _one_line_report(capsys.readouterr().err, out)
    assert found[1] == "0"
    assert re.fullmatch(r"in the optimizer step of step \d", found[2])


def test_divergence_after_a_checkpoint_says_which_one_to_resume(tmp_path, capsys):
    """The advice to resume "the last checkpoint" used to be given before any was saved (the
    runs above); once one is saved, or the run resumed one, it is named."""
    out = tmp_path / "run"
    argv = ["train", *TINY, *DIVERGING, "--steps", "3", "--ckpt-every", "1", "--nproc", "1"]
    for resume in ([], ["--resume"]):  # saved at step 1, then resumed from it
        assert main([*argv, "--out", str(out), *resume]) == 2
        line = capsys.readouterr().err.splitlines()[-1]
        assert (
            "FloatingPointError: non-finite gradient at step 2; the checkpoint of step 1 is "
            "intact: --resume it with a lower --lr or --grad-clip (in "
        ) in line, line


@pytest.mark.slow
def test_a_failing_rank_of_two_is_one_line_and_the_launcher_report_goes_to_its_log(tmp_path):
    out = tmp_path / "run"
    proc = _orthoptim("train", *TINY, *DIVERGING, "--steps", "3", "--nproc", "2", "--out", str(out))
    err = _finish(proc)
    assert proc.returncode == 2, err
    _one_line_report(err, out)
    # torch's launcher saw the failed rank and wrote its traceback to the launcher log.
    assert "Traceback (most recent call last)" in (out / "logs" / "launcher.log").read_text()


def test_the_report_prefers_the_cause_to_its_knock_on_effects(tmp_path):
    """A rank whose collective failed because a peer died is reported only when nothing
    else is known, even when its record is older; a rank whose heartbeat is older than the
    limit is named as stalled."""
    logs = tmp_path / "logs"
    logs.mkdir()

    def record(rank: int, type_: str, knock_on: bool, at: float) -> None:
        r = dict(rank=rank, type=type_, message=f"m{rank}", phase="after step 3",
                 knock_on=knock_on, time=at, log=str(logs / f"rank{rank}.log"))  # fmt: skip
        (logs / launcher.FAILURE_FILE.format(rank=rank)).write_text(json.dumps(r))

    now = time.time()
    record(0, "CollectiveError", True, now - 5)
    assert launcher._failure_message(logs, 2, 60.0).startswith("rank 0 failed after step 3: ")
    record(1, "ValueError", False, now)
    msg = launcher._failure_message(logs, 2, 60.0)
    assert msg == f"rank 1 failed after step 3: ValueError: m1 (full traceback: {logs}/rank1.log)"
    beat = dict(pid=1, step=7, time=now - 100)
    (logs / launcher.HEARTBEAT_FILE.format(rank=0)).write_text(json.dumps(beat))
    stalled = launcher._stalled(logs, 2, 60.0)
    assert stalled is not None and stalled[:2] == (0, beat) and stalled[2] >= 100
    assert launcher._failure_message(logs, 2, 60.0, stalled=stalled).startswith(
        "rank 0 stalled after step 7: no progress for 100 s (--pg-timeout 60)"
    )


@pytest.mark.slow
def test_a_stopped_rank_is_named_once_the_pg_timeout_passes(tmp_path):
    out = tmp_path / "run"
    proc = _orthoptim(
        "train", *TINY, "--steps", "10000", "--nproc", "2", "--pg-timeout", "15", "--out", str(out)
    )
    _wait_for_steps(proc, out, 2)
    pid = _rank_pid(out, proc.pid, 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        err = _finish(proc)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 2, err
    assert len(err.splitlines()) < 5 and len(err) < 400, err
    assert re.fullmatch(
        r"orthoptim: error: rank 1 stalled after step \d+: no progress for \d+ s "
        rf"\(--pg-timeout 15\), so the run was stopped; logs: {re.escape(str(out / 'logs'))}",
        err.splitlines()[-1],
    ), err


@pytest.mark.slow
def test_ctrl_c_stops_the_ranks_with_one_line(tmp_path):
    out = tmp_path / "run"
    proc = _orthoptim("train", *TINY, "--steps", "10000", "--nproc", "2", "--out", str(out))
    _wait_for_steps(proc, out, 1)
    os.killpg(proc.pid, signal.SIGINT)  # what the terminal sends on Ctrl-C
    err = _finish(proc)
    assert proc.returncode == 130
    # The last line is ours and nothing of ours comes before it. (Under heavy load the signal
    # can land inside one of the interpreter's weakref callbacks, which then prints
    # "Exception ignored in ..." itself before the interrupt is handled.)
    assert err.endswith("orthoptim: interrupted\n"), err
    assert "orthoptim" not in err[: -len("orthoptim: interrupted\n")], err
    assert not (out / ".lock").exists()
