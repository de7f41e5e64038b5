"""`python -m orthoptim` as a subprocess the tests can wait on, signal and find the ranks of,
and a small tmpfs disk to fill."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from orthoptim.train import launcher

GUARD_S = 120  # the most a subprocess may take before the test gives up on it


def orthoptim_process(*argv: str) -> subprocess.Popen:
    """`python -m orthoptim ARGV` in its own session (so a signal can reach every rank)."""
    return subprocess.Popen(
        [sys.executable, "-m", "orthoptim", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(proc: subprocess.Popen) -> str:
    """Wait for `proc` (killing its session if it overruns GUARD_S) and return its stderr."""
    try:
        return proc.communicate(timeout=GUARD_S)[1]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"`orthoptim {' '.join(proc.args[3:])}` did not end within {GUARD_S} s")


def wait_for_steps(proc: subprocess.Popen, out: Path, steps: int) -> None:
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


def rank_pid(out: Path, parent: int, rank: int) -> int:
    """The pid of `rank`, as its heartbeat gives it, checked to be a child of `parent`."""
    beat = json.loads((out / "logs" / launcher.HEARTBEAT_FILE.format(rank=rank)).read_text())
    children = {
        int(c)
        for t in Path(f"/proc/{parent}/task").iterdir()
        for c in (t / "children").read_text().split()
    }
    assert beat["pid"] in children
    return beat["pid"]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs mount of a given size (root only: skipped where mounting is not allowed)."""
    mounts = []

    def mount(size: int) -> Path:
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            capture_output=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", "-l", str(path)], check=False)
