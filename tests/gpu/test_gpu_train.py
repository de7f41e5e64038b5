"""`orthoptim train` on the suite's device: the tiny GPT for a few steps on one GPU in bf16
(eager, and with --compile), and on 2 ranks sharing the GPU (--shared-gpu: every rank on
cuda:0 over "cuda:gloo"). Each run is a separate `python -m orthoptim train` process, as a
user starts it; the checks read its result.json, metrics.jsonl and per-rank logs.

In CPU mode (ORTHOPTIM_GPU_TESTS_ON_CPU=1) the bf16 run uses the CPU (CUDA hidden from it);
--shared-gpu and --compile are CUDA-only here and skip, saying why.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from orthoptim.train.args import TrainArgs

STEPS = 6
# Seconds one run may take (the tiny GPT: 20–45 s on 2 CPU cores in bf16; compiling the
# blocks adds about a minute on a GPU machine), so a stuck run cannot eat the GPU slot.
RUN_TIMEOUT = 180
COMPILE_TIMEOUT = 240


def _require_flags(*names: str) -> None:
    """Fail (not skip) when `orthoptim train` lacks a flag this suite is written against."""
    have = {f.name for f in dataclasses.fields(TrainArgs)}
    missing = [n for n in names if n not in have]
    if missing:
        flags = ", ".join("--" + n.replace("_", "-") for n in missing)
        pytest.fail(f"orthoptim train has no {flags} (TrainArgs fields {missing}) in this tree")


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(none)"


def _train(env, out: Path, *flags: str, timeout: int = RUN_TIMEOUT) -> tuple[dict, list[dict]]:
    """Run `python -m orthoptim train` on the tiny config; return (result.json, metrics rows)."""
    cmd = [
        sys.executable, "-m", "orthoptim", "train", "--config", "tiny", "--steps", str(STEPS),
        "--batch", "4", "--warmup", "1", "--eval-every", str(STEPS), "--eval-batches", "2",
        "--ckpt-every", str(STEPS), "--out", str(out), "--no-progress", *flags,
    ]  # fmt: skip
    environ = dict(os.environ)
    if not env.cuda:
        environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU mode: the run must not find a GPU
    # its own session, so a run past `timeout` is ended with every rank it started
    proc = subprocess.Popen(
        cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        status = f"exited {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        status = f"ran past {timeout} s and was killed"
    logs = "\n".join(f"--- {p.name} ---\n{_tail(p)}" for p in sorted(out.glob("logs/*.log")))
    assert proc.returncode == 0, (
        f"{' '.join(cmd)} {status}\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}\n{logs}"
    )
    result = json.loads((out / "result.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, rows


def _check_learning(rows: list[dict], precision: str) -> None:
    """Finite losses that go down over the run, every row in `precision`."""
    train = [r["train_loss"] for r in rows if "train_loss" in r]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(train) == STEPS and len(val) >= 2, rows
    assert all(math.isfinite(v) for v in train + val), rows
    assert train[-1] < train[0] and val[-1] < val[0], (train, val)
    assert {r.get("precision") for r in rows} == {precision}, rows


def _cuda_only(env, what: str) -> None:
    if not env.cuda:
        pytest.skip(f"CPU mode: {what}")


def test_one_device_bf16(env, tmp_path):
    _require_flags("precision")
    result, rows = _train(env, tmp_path / "bf16", "--nproc", "1", "--precision", "bf16")
    assert result["world_size"] == 1
    assert result["device"] == ("cuda:0" if env.cuda else "cpu")
    assert result["precision"] == "bf16" and result["args"]["precision"] == "bf16"
    _check_learning(rows, "bf16")


def test_one_gpu_bf16_compiled(env, tmp_path):
    _cuda_only(
        env,
        "--compile runs on CPU too, but torch.compile's C++ build of the blocks takes minutes "
        "on 2 CPU cores; the GPU run checks it",
    )
    _require_flags("precision", "compile")
    result, rows = _train(
        env, tmp_path / "compiled", "--nproc", "1", "--precision", "bf16", "--compile",
        timeout=COMPILE_TIMEOUT,
    )  # fmt: skip
    assert result["world_size"] == 1 and result["device"] == "cuda:0"
    assert result["compiled"] is True and result["args"]["compile"] is True
    _check_learning(rows, "bf16")


def test_two_ranks_sharing_one_gpu(env, tmp_path):
    _cuda_only(
        env,
        "--shared-gpu puts every rank on cuda:0 and needs a GPU (orthoptim train refuses it "
        "without one); 2 gloo ranks on CPU are tests/test_train.py's",
    )
    _require_flags("precision", "shared_gpu")
    out = tmp_path / "shared"
    result, rows = _train(env, out, "--nproc", "2", "--shared-gpu")
    assert result["world_size"] == 2 and result["device"] == "cuda:0"
    assert result["args"]["shared_gpu"] is True
    assert "cuda:gloo" in (result["backend"] or ""), result["backend"]
    # every rank ran on cuda:0 (the loop logs each rank's device and backend)
    for rank in range(2):
        log = (out / "logs" / f"rank{rank}.log").read_text()
        assert "device cuda:0 (cuda:gloo)" in log, log[-2000:]
    # "auto" precision is bf16 on CUDA
    assert result["precision"] == "bf16"
    _check_learning(rows, "bf16")
