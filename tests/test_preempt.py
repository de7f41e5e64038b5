"""Preemption and automatic restart (issue 32, items 4 and 7).

A stop signal (SIGTERM; --save-on-signal's) makes every rank finish its step, save a
checkpoint of it and stop with exit status 75 and one line; --resume then continues
bit-identically. With --max-restarts, torchelastic restarts the ranks after a failure and
each restart resumes from the last checkpoint by itself. The oracle of "bit-identically" is an
uninterrupted run. The default suite runs one rank in this process (a signal sent from an
optimizer-step hook lands in a known step) and the launcher's turn between two attempts on
planted records; the two-rank cases are subprocesses `python -m orthoptim train --nproc 2`,
signalled or SIGKILLed once it has logged a step: once each (`slow`), and repeated at seeded
random steps for the figures (probes, `-m probe`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
from pathlib import Path

import pytest
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from orthoptim.cli import main
from orthoptim.train import launcher
from orthoptim.train.args import TrainArgs
from orthoptim.train.loop import Preempted
from test_errors import _finish, _orthoptim, _rank_pid, _wait_for_steps

STEPS = 3  # of the one-rank runs, which train with AdamW (the cheapest step)
FLAGS = [
    "--config", "tiny", "--batch", "2", "--eval-batches", "1", "--eval-every", "2",
    "--ckpt-every", "4", "--warmup", "1", "--no-progress",
    "--data", str(Path(json.__file__).parent),  # 48 KB of text: a quick corpus to load
]  # fmt: skip


def _argv(out: Path, *extra: str, nproc: int = 1, steps: int = STEPS) -> list[str]:
    sizes = ["--nproc", str(nproc), "--steps", str(steps)]
    cheap = ["--optimizer", "adamw"] if nproc == 1 else []
    return ["train", *sizes, *FLAGS, *cheap, "--out", str(out), *extra]


def _losses(out: Path) -> dict[int, tuple[float | None, float | None]]:
    """Each step's (train loss, validation loss) in metrics.jsonl."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r.get("train_loss"), r.get("val_loss")) for r in rows}


def _latest_step(out: Path) -> int:
    return json.loads((out / "checkpoints" / "latest.json").read_text())["step"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted one-rank run."""
    out = tmp_path_factory.mktemp("whole") / "run"
    assert main(_argv(out)) == 0
    return out


def _signal_in_step(step: int, sig: signal.Signals) -> RemovableHandle:
    """Send this process `sig` during optimizer step `step` (the loop's optimizers nest: the
    first to reach its `step`-th step sends it, once)."""
    counts: dict[int, int] = {}
    sent: list[signal.Signals] = []

    def hook(opt, *_):
        counts[id(opt)] = n = counts.get(id(opt), 0) + 1
        if n == step and not sent:
            sent.append(sig)
            os.kill(os.getpid(), sig)

    return register_optimizer_step_post_hook(hook)


def test_sigterm_saves_the_step_it_came_in_and_resume_is_bitwise(whole, tmp_path, capsys):
    """Issue 32 item 4: SIGTERM used to end the run with rc 1, a traceback and no checkpoint
    (up to --ckpt-every steps lost). Now step 2, in which it came, is finished (evaluated
    too) and saved (--ckpt-every 4 would not have), the run stops with exit status 75 and
    one line, and --resume continues to the uninterrupted run's losses."""
    out = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    hook = _signal_in_step(2, signal.SIGTERM)
    try:
        rc = main(_argv(out))
    finally:
        hook.remove()
    err = capsys.readouterr().err
    assert rc == Preempted.EXIT_CODE == 75
    assert err == (
        "orthoptim: stopped by SIGTERM after step 2; checkpoint saved at step 2: "
        "--resume to continue\n"
    )
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the run's only
    assert _latest_step(out) == 2
    assert max(_losses(out)) == 2
    assert not (out / "result.json").exists() and not (out / ".lock").exists()
    assert main(_argv(out, "--resume")) == 0
    assert _losses(out) == _losses(whole)


def test_save_on_signal_adds_a_signal_and_refuses_one_it_cannot_take(tmp_path, capsys):
    """--save-on-signal USR1 (Slurm's --signal default) stops like SIGTERM, which stays
    handled; the handlers before are restored; a signal that cannot be caught or that means
    something else (SIGKILL, SIGINT) is refused naming the flag."""
    args = TrainArgs(save_on_signal="SIGUSR1")
    assert args.stop_signals == (signal.SIGTERM, signal.SIGUSR1)
    before = {s: signal.getsignal(s) for s in args.stop_signals}
    with launcher._stop_on_signals(args) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.signal == "SIGUSR1"  # the first to come
    assert {s: signal.getsignal(s) for s in args.stop_signals} == before
    for bad in ("KILL", "SIGINT"):
        with pytest.raises(SystemExit):
            main(_argv(tmp_path / "run", "--save-on-signal", bad))
        err = capsys.readouterr().err
        assert f"--save-on-signal: invalid choice: 'SIG{bad.removeprefix('SIG')}'" in err
    assert main(_argv(tmp_path / "run", "--max-restarts", "-1")) == 2
    assert capsys.readouterr().err == (
        "orthoptim: error: --max-restarts must be >= 0 (0: none), got -1\n"
    )
    assert not (tmp_path / "run").exists()


def test_a_restarted_rank_resumes_or_starts_afresh(whole, tmp_path, monkeypatch):
    """A rank torchelastic restarted (TORCHELASTIC_RESTART_COUNT > 0) takes the first start's
    arguments as --resume would when a checkpoint exists, afresh when none does (an
    --overwrite of the first start is not repeated); a first start's are left alone."""
    first = TrainArgs(out=str(whole), overwrite=True, lr=0.01)
    assert launcher._restarted(first) is first
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    again = launcher._restarted(first)
    assert (again.resume, again.overwrite, again.lr) == (True, False, 0.01)
    fresh = launcher._restarted(TrainArgs(out=str(tmp_path / "none"), overwrite=True))
    assert (fresh.resume, fresh.overwrite) == (False, False)


def test_between_attempts_the_restart_is_said_and_the_failed_attempts_records_go(
    whole, tmp_path, capsys
):
    """torch asks for the next attempt's logs once the failed one's ranks ended: the restart
    is said in one line naming the rank that died (its heartbeat left behind, not the knock-on
    record of its peer) and the step resumed from; the failed attempt's records and an
    uncommitted step folder are removed, so they cannot confuse the next attempt's report.
    A stop record means the ranks were stopped by a signal, not failed: no restart."""
    out = tmp_path / "run"
    shutil.copytree(whole / "checkpoints", out / "checkpoints")  # of step 3
    half = out / "checkpoints" / "step_000004"  # a save the failure cut short
    half.mkdir()
    logs = out / "logs"
    logs.mkdir()
    knock_on = dict(rank=0, type="CollectiveError", message="peer gone", phase="after step 5",
                    knock_on=True, time=0.0, log=str(logs / "rank0.log"))  # fmt: skip
    (logs / launcher.FAILURE_FILE.format(rank=0)).write_text(json.dumps(knock_on))
    beat = dict(pid=1, step=5, time=0.0)
    (logs / launcher.HEARTBEAT_FILE.format(rank=1)).write_text(json.dumps(beat))
    args = TrainArgs(out=str(out), max_restarts=2)
    watchdog = launcher._Watchdog(logs, 2, args.pg_timeout)
    attempts = launcher._Attempts(args, 2, watchdog)
    envs = {r: dict(TORCHELASTIC_RESTART_COUNT="1", RANK=str(r), TORCHELASTIC_RUN_ID="t")
            for r in range(2)}  # fmt: skip
    attempts.reify(envs)
    assert capsys.readouterr().err == (
        f"orthoptim: rank 1 died after step 5; logs: {logs}; restarting the ranks from the "
        "checkpoint of step 3 (restart 1 of 2)\n"
    )
    assert sorted(p.name for p in logs.iterdir()) == []
    assert not half.exists()
    (logs / launcher.STOP_FILE).write_text(json.dumps(dict(signal="SIGUSR1", step=5)))
    envs[0]["TORCHELASTIC_RESTART_COUNT"] = envs[1]["TORCHELASTIC_RESTART_COUNT"] = "2"
    with pytest.raises(Preempted, match=r"^stopped by SIGUSR1 after step 5; checkpoint saved"):
        attempts.reify(envs)


# ---------------------------------------------------------------- two ranks

# ~50 ms a step here: room for a signal to land under load before the run's last step
TWO_RANK_STEPS = 40
PROBE_REPEATS = int(os.environ.get("ORTHOPTIM_PROBE_REPEATS", "5"))


@pytest.fixture(scope="module")
def whole2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted two-rank run, as a subprocess like the signalled ones."""
    out = tmp_path_factory.mktemp("whole2") / "run"
    proc = _orthoptim(*_argv(out, nproc=2, steps=TWO_RANK_STEPS))
    err = _finish(proc)
    assert proc.returncode == 0, err
    return out


def _sigterm_and_resume(whole2: Path, out: Path, to: str, after: int) -> int:
    """A two-rank run under `out` sent SIGTERM once it has logged step `after`: to its
    process group (Slurm, systemd), to the launcher only (Kubernetes' PID 1: torch's agent
    forwards it) or to the ranks only (`to`). It stops with exit status 75 and one line naming
    a step, its checkpoint is of that step, and --resume ends with `whole2`'s losses, bit for
    bit. Returns the step it stopped after."""
    proc = _orthoptim(*_argv(out, nproc=2, steps=TWO_RANK_STEPS))
    _wait_for_steps(proc, out, after)
    if to == "group":
        os.killpg(proc.pid, signal.SIGTERM)
    elif to == "launcher":
        os.kill(proc.pid, signal.SIGTERM)
    else:
        for pid in [_rank_pid(out, proc.pid, r) for r in range(2)]:
            os.kill(pid, signal.SIGTERM)
    err = _finish(proc)
    assert proc.returncode == 75, err
    found = re.fullmatch(
        r"orthoptim: stopped by SIGTERM after step (\d+); checkpoint saved at step \1: "
        r"--resume to continue\n",
        err,
    )
    assert found, err
    stopped = int(found[1])
    assert after <= stopped < TWO_RANK_STEPS, err
    assert _latest_step(out) == stopped
    assert max(_losses(out)) == stopped
    proc = _orthoptim(*_argv(out, "--resume", nproc=2, steps=TWO_RANK_STEPS))
    err = _finish(proc)
    assert proc.returncode == 0, err
    assert _losses(out) == _losses(whole2), f"stopped after step {stopped}"
    return stopped


def _kill_and_restart(whole2: Path, out: Path, rank: int, after: int) -> str:
    """A two-rank run under `out` with --max-restarts 2 whose `rank` is SIGKILLed once the
    run has logged step `after`: it completes by itself (rc 0), says the restart in one line
    naming the rank (in its launcher log too), and its losses equal `whole2`'s bit for bit.
    Returns that line."""
    proc = _orthoptim(*_argv(out, "--max-restarts", "2", nproc=2, steps=TWO_RANK_STEPS))
    _wait_for_steps(proc, out, after)
    os.kill(_rank_pid(out, proc.pid, rank), signal.SIGKILL)
    err = _finish(proc)
    assert proc.returncode == 0, err
    restart = [line for line in err.splitlines() if "restarting the ranks" in line]
    assert len(restart) == 1 and restart[0].endswith("(restart 1 of 2)"), err
    assert f"rank {rank} died" in restart[0], err
    assert "restarting the ranks" in (out / "logs" / "launcher.log").read_text()
    assert _losses(out) == _losses(whole2), restart[0]
    return restart[0]


@pytest.mark.slow
@pytest.mark.parametrize("to", ["group", "launcher", "ranks"])
def test_sigterm_at_two_ranks_saves_and_resumes_bitwise(whole2, tmp_path, to):
    """SIGTERM to a real two-rank run (`_sigterm_and_resume`) once it has logged step 3:
    exit status 75, one line, the checkpoint of the step named, and a bitwise resume."""
    _sigterm_and_resume(whole2, tmp_path / "run", to, 3)


@pytest.mark.slow
def test_max_restarts_survives_a_killed_rank_bitwise(whole2, tmp_path):
    """Rank 1 of a real two-rank run with --max-restarts 2 SIGKILLed once it has logged step
    5, after its checkpoint of step 4 (--ckpt-every 4; `_kill_and_restart`): the run
    restarts its ranks from that checkpoint (or a later one) by itself, says so in one line,
    ends with rc 0 and the uninterrupted run's losses bit for bit."""
    out = tmp_path / "run"
    line = _kill_and_restart(whole2, out, 1, 5)
    found = re.search(r"restarting the ranks from the checkpoint of step (\d+) ", line)
    assert found and int(found[1]) % 4 == 0 and int(found[1]) >= 4, line
    step = int(found[1])  # the restarted ranks did resume it (a fresh start has equal losses)
    log = (out / "logs" / "rank0.log").read_text()
    assert f"resuming from step_{step:06d} (step {step})" in log, log


@pytest.mark.probe
@pytest.mark.parametrize("to", ["group", "launcher", "ranks"])
def test_probe_sigterm_at_two_ranks_saves_and_resumes_bitwise(whole2, tmp_path, to, capsys):
    """The figure: `PROBE_REPEATS` SIGTERMs (`_sigterm_and_resume`) at seeded random steps;
    prints the step each stopped after."""
    rng = random.Random(f"sigterm-{to}")
    stopped = [
        _sigterm_and_resume(whole2, tmp_path / f"run{i}", to, rng.randint(1, TWO_RANK_STEPS - 3))
        for i in range(PROBE_REPEATS)
    ]
    with capsys.disabled():
        print(f"\nSIGTERM to the {to}: {len(stopped)}/{PROBE_REPEATS} stopped with rc 75 and "
              f"resumed bitwise, after steps {stopped}")  # fmt: skip


@pytest.mark.probe
def test_probe_max_restarts_survives_a_killed_rank_bitwise(whole2, tmp_path, capsys):
    """The figure: `PROBE_REPEATS` SIGKILLs of a rank (each in turn) at seeded random steps
    under --max-restarts 2 (`_kill_and_restart`); prints each restart's line."""
    rng = random.Random("restarts")
    lines = [
        _kill_and_restart(whole2, tmp_path / f"run{i}", i % 2, rng.randint(1, TWO_RANK_STEPS - 2))
        for i in range(PROBE_REPEATS)
    ]
    with capsys.disabled():
        print(f"\n{len(lines)}/{PROBE_REPEATS} killed runs restarted and ended bitwise:")
        print("\n".join(lines))


def test_a_stop_signal_during_compare_is_one_line(tmp_path, capsys, monkeypatch):
    """`orthoptim compare` does not resume its runs, so a stop signal in one of them is one
    line saying to start it again, with the stop's exit status, not a traceback."""
    from orthoptim.train import compare

    def stopped(opts):
        raise Preempted("SIGTERM", 3)

    monkeypatch.setattr(compare, "run_compare", stopped)
    out = tmp_path / "cmp"
    argv = ["compare", "--config", "tiny", "--steps", "4", "--nproc", "1", "--out", str(out)]
    assert main(argv) == Preempted.EXIT_CODE
    assert capsys.readouterr().err == (
        "orthoptim: compare stopped by SIGTERM after step 3 of one of its runs; its runs so far "
        f"are under {out}: run the compare again to start over\n"
    )
