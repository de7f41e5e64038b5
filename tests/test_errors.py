"""Failures as the user sees them (issue 22, item 7): one failure, one clear message.

A failing rank's exception (type, message, rank, phase) is the one line on the terminal and
its traceback is in that rank's log, torch's launcher reports go to OUT/logs/launcher.log; a
stalled rank is named once --pg-timeout passes; Ctrl-C ends the run with one line and exit
status 130; every refused flag is named as the user typed it. The multi-rank cases run
`python -m orthoptim` as a subprocess, so stderr is the terminal's, launcher logs included.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from models import processes
from models.processes import GUARD_S
from models.processes import finish as _finish
from models.processes import orthoptim_process as _orthoptim
from models.processes import rank_pid as _rank_pid
from models.processes import wait_for_steps as _wait_for_steps
from orthoptim.cli import main
from orthoptim.train import launcher, runfolder
from orthoptim.train.loop import setup_logging

TINY = ["--config", "tiny", "--batch", "2", "--eval-batches", "1", "--no-progress"]
# Learning rates that blow the tiny model up within two steps: a real failure a user can
# cause, raised by the optimizer on every rank (NonFiniteGradientError, which the loop turns
# into advice on flags).
DIVERGING = ["--lr", "1e12", "--adamw-lr", "1e12"]


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


# ---------------------------------------------------------------- the right rank blamed (issue 32)


def _child_failure(tmp_path: Path, rank: int, exitcode: int, exception: str | None = None):
    """torch's record of a failed rank: killed by a signal (`exitcode` < 0) or ended with
    `exception` ("Type: message") in its error file, as torch's `record` writes it."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    error_file = tmp_path / f"torch-error-{rank}.json"
    if exception is not None:
        data = {"message": {"message": exception, "extraInfo": {"timestamp": "1"}}}
        error_file.write_text(json.dumps(data))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=str(error_file))  # fmt: skip


def _children_failed(*failures):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    return ChildFailedError("orthoptim", {f.local_rank: f for f in failures})


def _beat(logs: Path, rank: int, step: int) -> None:
    beat = dict(pid=1000 + rank, step=step, time=time.time())
    (logs / launcher.HEARTBEAT_FILE.format(rank=rank)).write_text(json.dumps(beat))


def _peer_gone() -> Exception:
    from orthoptim.collectives import errors

    cause = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    return errors.collective_error("all_reduce", cause, None)


def test_a_save_a_dead_peer_broke_is_its_knock_on_and_every_save_collective_is_named(
    tmp_path, monkeypatch
):
    """A save's own collectives (the state-dict gather inside its write, the agreement after
    it) failing because a peer died are knock-on failures, named by their phase; a rank whose
    part was written while another's failed says so as a knock-on; the failing rank's own
    error (disk full) is what it is."""
    from orthoptim import collectives
    from orthoptim.train.runfolder import Checkpointer, CheckpointSaveError

    folder = tmp_path / "checkpoints" / "step_000003"

    def broken():
        raise _peer_gone()

    ckpt = Checkpointer(tmp_path, 1, 2)
    with pytest.raises(collectives.CollectiveError) as e:
        ckpt._together(3, folder, "intact", "write", broken)
    assert launcher._is_knock_on(e.value)

    def agreement_fails(values, group=None):
        raise _peer_gone()

    monkeypatch.setattr(collectives, "sum_floats", agreement_fails)
    with pytest.raises(collectives.CollectiveError) as e:
        ckpt._together(3, folder, "intact", "write", lambda: None)
    assert "checkpoint of step 3: agreeing that every rank's write succeeded" in str(e.value)

    monkeypatch.setattr(collectives, "sum_floats", lambda values, group=None: [1.0])
    with pytest.raises(CheckpointSaveError, match="another rank failed") as e:
        ckpt._together(3, folder, "intact", "write", lambda: None)
    assert launcher._is_knock_on(e.value)

    def full():
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointSaveError, match=r"no space left on .*\(\d+ bytes free\)") as e:
        ckpt._together(3, folder, "intact", "write", full)
    assert not launcher._is_knock_on(e.value)

    # What a collective torch issues itself (FSDP2's gathers) raises when the peer is gone.
    gone = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1234: Connection reset by peer")
    assert launcher._is_knock_on(gone)

    def reset():
        raise gone

    with pytest.raises(CheckpointSaveError) as e:
        ckpt._together(3, folder, "intact", "write", reset)
    assert launcher._is_knock_on(e.value)
    assert not launcher._is_knock_on(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


def test_the_report_ranks_a_rank_s_own_failure_and_a_dead_rank_above_knock_ons(tmp_path):
    """The one-line report across ranks: a rank's own error (disk full) outranks another's
    "another rank failed" though that one came first; a rank killed without a record
    outranks the survivors' knock-on records, whether torch's launcher saw it die (SIGKILL)
    or only its heartbeat file is left; a rank whose own error torch kept (its record could
    not be written: disk full) outranks a knock-on record; the dead rank's step is its
    heartbeat's."""
    from orthoptim.train.runfolder import CheckpointSaveError

    logs = tmp_path / "logs"
    logs.mkdir()
    echo = CheckpointSaveError("could not save the checkpoint of step 3: another rank failed")
    echo.knock_on = True
    launcher._record_failure(tmp_path, 1, echo, "after step 3")
    full = CheckpointSaveError("could not save the checkpoint of step 3: no space left on X")
    launcher._record_failure(tmp_path, 0, full, "after step 3")
    msg = launcher._failure_message(logs, 2, 60.0)
    assert msg.startswith("rank 0 failed after step 3: CheckpointSaveError: could not save the "
                          "checkpoint of step 3: no space left on X")  # fmt: skip

    launcher._clear_records(logs)
    launcher._record_failure(tmp_path, 0, _peer_gone(), "after step 5")
    _beat(logs, 1, 5)  # rank 1 never ended its run: killed before torch's launcher saw it
    survivor = _child_failure(tmp_path, 0, 1, "CollectiveError: rank 0 of 2: all_reduce failed")
    assert launcher._failure_message(logs, 2, 60.0, _children_failed(survivor)) == (
        f"rank 1 died after step 5 (it left no record and its heartbeat behind: killed?); "
        f"logs: {logs}"
    )
    killed = _child_failure(tmp_path, 1, -signal.SIGKILL)
    assert launcher._failure_message(logs, 2, 60.0, _children_failed(killed)) == (
        f"rank 1 died after step 5 (SIGKILL); logs: {logs}"
    )

    (logs / launcher.HEARTBEAT_FILE.format(rank=1)).unlink()
    kept = _child_failure(tmp_path, 1, 1, "DiskFullError: no space left on /x (0 bytes free)")
    assert launcher._failure_message(logs, 2, 60.0, _children_failed(kept)) == (
        f"rank 1 failed: DiskFullError: no space left on /x (0 bytes free); logs: {logs}"
    )
    echoed = _child_failure(tmp_path, 1, 1, "CollectiveError: rank 1 of 2: all_reduce failed")
    assert launcher._failure_message(logs, 2, 60.0, _children_failed(echoed)).startswith(
        "rank 0 failed after step 5: CollectiveError: "
    )


def test_the_heartbeat_carries_the_step_just_done(tmp_path, monkeypatch):
    """The heartbeat is written at the end of each optimizer step, not only every HEARTBEAT_S,
    so "died after step N" names the step the rank was in."""
    monkeypatch.setattr(launcher, "HEARTBEAT_S", 3600.0)  # the thread alone would lag
    path = tmp_path / "logs" / launcher.HEARTBEAT_FILE.format(rank=0)
    progress = launcher._Progress(10)
    beat = launcher._Heartbeat(path, progress)
    try:
        w = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([w], lr=0.1)
        for done in range(1, 4):
            w.grad = torch.ones(2)
            opt.step()
            assert json.loads(path.read_text())["step"] == 10 + done
    finally:
        beat.stop()
        progress.close()
    assert not path.exists()


def _kill_in_save(proc: subprocess.Popen, out: Path, rank: int, step: int, delay: float) -> None:
    """SIGKILL `rank` `delay` s after the save of `step` began (its folder appeared)."""
    folder = out / "checkpoints" / f"step_{step:06d}"
    deadline = time.monotonic() + GUARD_S
    pid = None
    while not folder.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail(f"no save of step {step}: {proc.communicate()[1]}")
        if pid is None and (out / "logs" / launcher.HEARTBEAT_FILE.format(rank=rank)).exists():
            with contextlib.suppress(ValueError, OSError, AssertionError):
                pid = _rank_pid(out, proc.pid, rank)
        time.sleep(0.0005)
    if delay:
        time.sleep(delay)
    os.kill(pid or _rank_pid(out, proc.pid, rank), signal.SIGKILL)


def _save_kill(tmp_path: Path, rank: int, delay: float, *extra: str) -> tuple[int, str, str]:
    """A --nproc 2 run (in a new folder under `tmp_path`) whose `rank` is killed during the
    save of step 3: (rc, last line of stderr, the survivor's recorded message)."""
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    argv = ["--steps", "40", "--ckpt-every", "3", "--nproc", "2", "--out", str(out), *extra]
    proc = _orthoptim("train", *TINY, *argv)
    _kill_in_save(proc, out, rank, 3, delay)
    err = _finish(proc)
    survivor = launcher._read_json(out / "logs" / launcher.FAILURE_FILE.format(rank=1 - rank))
    return proc.returncode, err.splitlines()[-1] if err else "", (survivor or {}).get("message", "")


@pytest.mark.slow
@pytest.mark.parametrize("rank, fsdp", [(1, False), (0, True)], ids=["layerwise", "fsdp"])
def test_a_rank_killed_during_a_save_is_the_one_named_with_its_step(tmp_path, rank, fsdp):
    """A rank SIGKILLed as the save of step 3 begins (the layer-wise save, which rank 0
    writes, and the --fsdp DCP save, which every rank writes) is the one the line names, with
    its step, above its survivor's knock-on error."""
    rc, line, _ = _save_kill(tmp_path, rank, 0.0, *(("--fsdp",) if fsdp else ()))
    assert rc == 2
    pattern = rf"orthoptim: error: rank {rank} died after step 3 \(.+\); logs: .+"
    assert re.fullmatch(pattern, line), line


@pytest.mark.probe
@pytest.mark.parametrize("fsdp", [False, True], ids=["layerwise", "fsdp"])
def test_probe_save_time_kills_name_the_killed_rank(tmp_path, fsdp):
    """Issue 32's figure: 10 save-time SIGKILLs of each rank (at 0-8 ms into the save), the
    report names the killed rank every time. Prints the figures and where the survivor was."""
    extra = ("--fsdp",) if fsdp else ()
    named, phases = {0: 0, 1: 0}, []
    for trial in range(10):
        for rank in (0, 1):
            rc, line, survivor = _save_kill(tmp_path, rank, (trial % 5) * 0.002, *extra)
            ok = rc == 2 and line.startswith(f"orthoptim: error: rank {rank} died after step 3")
            named[rank] += ok
            where = re.search(r"of 2: (.+?) failed", survivor)
            phases.append(where[1] if where else survivor[:60])
            print(f"kill rank {rank}: rc {rc} {'named' if ok else 'WRONG'}: {line}")
    print(f"{'--fsdp' if fsdp else 'layer-wise'}: killed rank named {named[0]}/10 (rank 0), "
          f"{named[1]}/10 (rank 1); survivors failed in: {sorted(set(phases))}")  # fmt: skip
    assert named == {0: 10, 1: 10}


# ---------------------------------------------------------------- a full disk anywhere (issue 32)


def _fill(disk: Path) -> None:
    """Fill `disk` to its last byte."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


NO_SPACE = r"no space left on {} \(\d+ bytes free\)"
small_disk = processes.small_disk  # a fixture: a tmpfs mount of a given size


def test_a_full_disk_before_the_start_is_one_line_and_leaves_no_lock(small_disk, capsys):
    disk = small_disk(64 * 1024)
    out = disk / "run"
    out.mkdir()
    _fill(disk)
    assert main(["train", *TINY, "--nproc", "1", "--steps", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        rf"orthoptim: error: --out {re.escape(str(out))}: {NO_SPACE.format(re.escape(str(out)))}"
        r"; free space there or pass another --out\n",
        err,
    ), err
    # The lock's own write failing (where the probe got through) leaves no lock behind.
    with pytest.raises(ValueError, match=rf"cannot write its lock {re.escape(str(out))}/\.lock "
                       rf"\({NO_SPACE.format(re.escape(str(out)))}\)"):  # fmt: skip
        runfolder.acquire_lock(out)
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_lock_left_empty_or_naming_another_process_says_what_to_do(tmp_path, caplog):
    """An empty lock (a run crashed between creating and writing it) blocks only while its
    writer could still be at work (LOCK_WRITE_S); a lock whose pid is alive but is no run (the
    pid was reused after a restart: it started after the lock, or runs no Python) is refused
    naming that, and how to proceed."""
    out = tmp_path / "A"
    out.mkdir()
    lock = out / ".lock"
    lock.write_text("")
    with pytest.raises(ValueError, match=r"locked \(.*\.lock unreadable\)"):
        runfolder.acquire_lock(out)
    old = time.time() - runfolder.LOCK_WRITE_S - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="orthoptim.train.runfolder"):
        path = runfolder.acquire_lock(out)
    assert json.loads(path.read_text())["pid"] == os.getpid()
    assert "crashed while taking it" in caplog.text
    runfolder.release_lock(path)

    sleeper = subprocess.Popen(["sleep", "60"])
    while not Path(f"/proc/{sleeper.pid}/cmdline").read_bytes():  # a moment after its exec
        time.sleep(0.01)
    try:
        holder = dict(host=socket.gethostname(), pid=sleeper.pid, started="2026-01-01T00:00:00")
        lock.write_text(json.dumps(holder))
        with pytest.raises(ValueError) as e:
            runfolder.acquire_lock(out)
        assert f"is locked by pid {sleeper.pid}" in str(e.value)
        assert "is no orthoptim run: it runs 'sleep 60'" in str(e.value)
        assert f"if no run is using the folder, remove {lock}" in str(e.value)
        # A process started after the lock was taken cannot be the run that took it.
        holder["started"] = "2020-01-01T00:00:00+0000"
        lock.write_text(json.dumps(holder))
        with pytest.raises(ValueError, match=r"is no orthoptim run: it started at 20"):
            runfolder.acquire_lock(out)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert json.loads(lock.read_text()) == holder  # left alone


def test_a_full_disk_under_a_log_is_one_line(small_disk, capsys):
    disk = small_disk(64 * 1024)
    log = setup_logging(disk, 0)
    try:
        _fill(disk)
        for i in range(200):
            log.info("line %d %s", i, "x" * 100)
    finally:
        launcher._close(log)
    err = capsys.readouterr().err
    assert err == (
        f"orthoptim: no space left on {disk}/logs/rank0.log (0 bytes free); its log lines are "
        "dropped from here on\n"
    ), err


def test_a_disk_filled_mid_run_is_one_line_and_the_resume_cleans_up(small_disk, capsys):
    """The disk fills after step 2 (a metrics row, a log line or the save of step 4 is the
    first write to fail): one line naming the path and the bytes free, exit status 2, the
    checkpoint of step 2 intact; with room again, --resume finishes the run and leaves no
    half-written file behind."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    disk = small_disk(24 * 2**20)
    out = disk / "run"
    argv = ["train", *TINY, "--nproc", "1", "--steps", "4", "--ckpt-every", "2", "--out",
            str(out)]  # fmt: skip

    def fill_after_step_2(opt, *_):
        rows = out / "metrics.jsonl"
        if rows.read_text().count("train_loss") == 2 and not (disk / "filler").exists():
            _fill(disk)

    hook = register_optimizer_step_post_hook(fill_after_step_2)
    try:
        assert main(argv) == 2
    finally:
        hook.remove()
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err, err
    under_out = NO_SPACE.format(re.escape(str(out)) + r"\S*")
    assert re.fullmatch(
        rf"orthoptim: error: rank 0 failed.*: .*Error: .*{under_out}.*", err.splitlines()[-1]
    ), err
    assert len(err.splitlines()) <= 2, err  # the report, and a log's own line at most
    (disk / "filler").unlink()
    assert main([*argv, "--resume"]) == 0
    left = [p for p in out.rglob("*") if p.name.endswith(".tmp") or ".tmp." in p.name]
    assert left == [] and not (out / ".lock").exists()


def _full_disk_at_two_ranks(
    small_disk: Callable[[int], Path], in_save: bool, *extra: str
) -> tuple[bool, str]:
    """A --nproc 2 run on a disk with room for the run but not its first checkpoint
    (`in_save`), or on one filled after step 2: whether it ended with rc 2 and one line,
    "no space left on PATH (N bytes free)" naming a path under the step folder (under --out
    mid-run), by rank 0 in a layer-wise save (the one writing the files); and what it said."""
    disk = small_disk(4 * 2**20 if in_save else 24 * 2**20)
    out = disk / "run"
    argv = ["--steps", "4" if in_save else "400", "--ckpt-every", "2" if in_save else "1000",
            "--nproc", "2", "--out", str(out), *extra]  # fmt: skip
    proc = _orthoptim("train", *TINY, *argv)
    if not in_save:
        _wait_for_steps(proc, out, 2)
        _fill(disk)
    err = _finish(proc)
    line = err.splitlines()[-1] if err else ""
    where = re.escape(str(out / "checkpoints" / "step_000002") if in_save else str(out))
    pattern = rf"orthoptim: error: rank {'0' if in_save and '--fsdp' not in extra else '[01]'} .*"
    ok = (
        proc.returncode == 2
        and len(err.splitlines()) <= 2  # the report, and a log's own line at most
        and "Traceback" not in err
        and re.fullmatch(pattern + NO_SPACE.format(where + r"\S*") + ".*", line) is not None
    )
    return ok, f"{'in a save' if in_save else 'mid-run'}: rc {proc.returncode}, {err!r}"


@pytest.mark.slow
@pytest.mark.parametrize("fsdp", [False, True], ids=["layerwise", "fsdp"])
def test_a_full_disk_in_a_save_at_nproc_2_is_one_line_naming_the_path(small_disk, fsdp):
    """A disk with room for a --nproc 2 run but not its first checkpoint: rc 2 and one line
    naming the path in the step folder and the bytes free (`_full_disk_at_two_ranks`), in the
    layer-wise save (rank 0's) and in the --fsdp DCP save (both ranks writing)."""
    ok, said = _full_disk_at_two_ranks(small_disk, True, *(("--fsdp",) if fsdp else ()))
    assert ok, said


@pytest.mark.probe
@pytest.mark.parametrize("fsdp", [False, True], ids=["layerwise", "fsdp"])
def test_probe_a_full_disk_at_nproc_2_is_one_line_naming_the_path(small_disk, fsdp):
    """Issue 32's figure: a disk with room for the run but not its first checkpoint (3 times),
    and a disk filled after step 2 (twice), at --nproc 2 (`_full_disk_at_two_ranks`)."""
    extra = ("--fsdp",) if fsdp else ()
    good = 0
    for trial in range(5):
        ok, said = _full_disk_at_two_ranks(small_disk, trial < 3, *extra)
        good += ok
        print(f"{said}: {'OK' if ok else 'WRONG'}")
    print(f"{'--fsdp' if fsdp else 'layer-wise'}: {good}/5 one clear line")
    assert good == 5
