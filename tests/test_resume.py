"""Resume that means what it says, and checkpoints a run can trust (one rank, tiny config).

A changed --lr / --weight-decay on --resume applies from the step resumed, with a notice; a
checkpoint whose bytes changed, or whose model holds NaN, is passed over for the newest intact
one, from which the run continues bit-identically; a failed save (disk full) says so and
leaves the last good checkpoint; leftovers of an interrupted save and a half-written metrics
line do not block --resume. The oracle of "bit-identically" is an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from orthoptim.cli import main
from orthoptim.train import runfolder
from orthoptim.train.args import TrainArgs
from orthoptim.train.loop import lr_multiplier

STEPS = 6


def _argv(out: Path, *extra: str) -> list[str]:
    return [
        "train", "--nproc", "1", "--config", "tiny", "--steps", str(STEPS), "--batch", "2",
        "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2", "--warmup", "1",
        "--out", str(out), "--no-progress", *extra,
    ]  # fmt: skip


def _rows(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def _losses(out: Path) -> dict[int, float]:
    return {s: r["train_loss"] for s, r in _rows(out).items() if "train_loss" in r}


def _folders(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An uninterrupted 6-step run, and one left after step 4 (checkpoints every 2 steps)."""
    base = tmp_path_factory.mktemp("runs")
    assert main(_argv(base / "whole")) == 0
    assert main(_argv(base / "partial", "--stop-after", "4")) == 0
    return {"whole": base / "whole", "partial": base / "partial"}


def _rerecord(folder: Path, name: str) -> None:
    """Record `name`'s current bytes as the ones written (a checkpoint saved that way)."""
    data = (folder / name).read_bytes()
    record = json.loads((folder / "checkpoint.json").read_text())
    record["files"][name] = dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    for path in (folder / "checkpoint.json", folder.parent / "latest.json"):
        path.write_text(json.dumps(runfolder.sealed(record)))


def test_keeps_the_newest_checkpoints(runs, tmp_path):
    """The last --keep-checkpoints step folders stay (default 2), each with its record."""
    assert _folders(runs["whole"]) == ["step_000004", "step_000006"]
    record = json.loads(
        (runs["whole"] / "checkpoints" / "step_000006" / "checkpoint.json").read_text()
    )
    for name, want in record["files"].items():
        data = (runs["whole"] / "checkpoints" / "step_000006" / name).read_bytes()
        assert want == dict(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    out = tmp_path / "three"
    assert main(_argv(out, "--keep-checkpoints", "3")) == 0
    assert _folders(out) == ["step_000002", "step_000004", "step_000006"]
    assert main(_argv(tmp_path / "none", "--keep-checkpoints", "0")) == 2


def test_changed_lr_and_weight_decay_apply_from_the_step_resumed(runs, tmp_path, capsys):
    """Issue case 2: a new --lr / --weight-decay on --resume used to be replaced by the
    checkpoint's values while result.json recorded the new ones."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    capsys.readouterr()
    assert (
        main(_argv(out, "--resume", "--lr", "0.02", "--weight-decay", "0.1", "--stop-after", "5"))
        == 0
    )
    err = capsys.readouterr().err
    assert "--lr 0.05 → 0.02 from step 4" in err and "--weight-decay 0 → 0.1 from step 4" in err
    rows, whole = _rows(out), _rows(runs["whole"])
    args = TrainArgs(steps=STEPS, warmup=1)
    assert rows[4]["lr"] == whole[4]["lr"] == 0.05 * lr_multiplier(4, args)
    assert rows[5]["lr"] == pytest.approx(0.02 * lr_multiplier(5, args), rel=1e-12)
    assert rows[5]["train_loss"] == whole[5]["train_loss"]  # the new values act on step 5's update
    saved = json.loads((out / "checkpoints" / "latest.json").read_text())["args"]
    assert (saved["lr"], saved["weight_decay"]) == (0.02, 0.1)
    # Left off, the run keeps what it was given: no notice, the same LR.
    assert main(_argv(out, "--resume")) == 0
    assert "--lr" not in capsys.readouterr().err
    rows = _rows(out)
    assert rows[6]["lr"] == pytest.approx(0.02 * lr_multiplier(6, args), rel=1e-12)
    assert rows[6]["train_loss"] != whole[6]["train_loss"]
    result = json.loads((out / "result.json").read_text())["args"]
    assert (result["lr"], result["weight_decay"]) == (0.02, 0.1)
    # Schedule changes are refused, naming the flag.
    other = shutil.copytree(runs["partial"], tmp_path / "B")
    assert main(_argv(other, "--resume", "--warmup", "3")) == 2
    assert "--warmup: checkpoint 1, now 3" in capsys.readouterr().err


def test_corrupted_byte_falls_back_to_the_newest_intact_checkpoint(runs, tmp_path, capsys):
    """Issue case 5: a changed byte inside optim.pt used to load silently (different losses)."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    path = out / "checkpoints" / "step_000004" / "optim.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(_argv(out, "--resume")) == 0
    err = capsys.readouterr().err
    assert "passed over step_000004: optim.pt fails its SHA-256 check" in err, err
    assert "resuming from step_000002 (step 2)" in err
    assert _losses(out) == _losses(runs["whole"])
    assert (out / "checkpoints" / "step_000004.damaged" / "optim.pt").read_bytes() == bytes(data)


def test_no_intact_checkpoint_is_refused_naming_each(runs, tmp_path, capsys):
    """With every checkpoint's bytes changed --resume fails, naming each one and the way out
    (at 2 ranks test_train shows every rank following rank 0's check)."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    for step in ("step_000002", "step_000004"):
        path = out / "checkpoints" / step / "optim.pt"
        data = bytearray(path.read_bytes())
        data[-100] ^= 0x01
        path.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(_argv(out, "--resume")) != 0
    err = capsys.readouterr().err
    assert "no intact checkpoint" in err and "pass --overwrite" in err, err
    for step in ("step_000002", "step_000004"):
        assert f"{step}: optim.pt fails its SHA-256 check" in err, err


def test_nonfinite_model_falls_back(runs, tmp_path, capsys):
    """Issue case 5: NaN in model.pt used to surface as a gradient problem at the next step."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    folder = out / "checkpoints" / "step_000004"
    state = torch.load(folder / "model.pt", weights_only=True)
    name = next(iter(state))
    state[name].view(-1)[0] = float("nan")
    torch.save(state, folder / "model.pt")
    _rerecord(folder, "model.pt")
    capsys.readouterr()
    assert main(_argv(out, "--resume")) == 0
    err = capsys.readouterr().err
    assert f"passed over step_000004: the model holds NaN or inf ({name})" in err, err
    assert _losses(out) == _losses(runs["whole"])


def test_leftovers_and_a_cut_metrics_line_do_not_block_resume(runs, tmp_path, caplog, capsys):
    """Issue case 6: a leftover model.pt.tmp, or a half-written last line of metrics.jsonl,
    used to make every later --resume fail."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    ckpts = out / "checkpoints"
    (ckpts / "step_000004" / "model.pt.tmp").write_bytes(b"half")
    (ckpts / "step_000006").mkdir()  # a save that never committed
    (ckpts / "step_000006" / "optim.pt.tmp").write_bytes(b"half")
    (out / "result.json.tmp").write_text("{")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "train_lo')
    assert main(_argv(out, "--resume")) == 0
    assert "removed" in caplog.text and "step_000006" in caplog.text
    assert _losses(out) == _losses(runs["whole"])
    assert not list(out.rglob("*.tmp"))
    # A damaged line before the last is an error naming the file and the line.
    bad = shutil.copytree(runs["partial"], tmp_path / "B")
    lines = (bad / "metrics.jsonl").read_text().splitlines()
    lines[1] = lines[1][:10]
    (bad / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    capsys.readouterr()
    assert main(_argv(bad, "--resume")) == 2
    assert f"{bad / 'metrics.jsonl'}, line 2, is not a JSON row" in capsys.readouterr().err


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


def test_disk_full_says_so_and_keeps_the_last_good_checkpoint(runs, tmp_path, small_disk, capsys):
    """Issue case 6: a full disk used to say "enforce fail at inline_container.cc".
    The run stops naming the cause, the committed checkpoint stays intact, and once there is
    room the run continues bit-identically."""
    used = sum(p.stat().st_size for p in runs["partial"].rglob("*") if p.is_file())
    disk = small_disk(used + 2**20)  # room for the run, not for another checkpoint
    out = shutil.copytree(runs["partial"], disk / "A")
    before = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_argv(out, "--resume")) != 0
    err = capsys.readouterr().err
    assert f"no space left on {out / 'checkpoints' / 'step_000006'}" in err, err
    assert "the last good checkpoint (step 4) is intact" in err
    after = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    assert after == before
    roomy = shutil.copytree(out, tmp_path / "roomy")
    (roomy / ".lock").unlink(missing_ok=True)
    assert main(_argv(roomy, "--resume")) == 0
    assert _losses(roomy) == _losses(runs["whole"])
