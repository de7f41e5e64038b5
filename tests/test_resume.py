"""Resume that means what it says, and checkpoints a run can trust (one rank, tiny config).

A changed --lr / --weight-decay on --resume applies from the step resumed, with a notice; a
checkpoint whose bytes changed, or whose model holds NaN, is passed over for the newest intact
one, from which the run continues bit-identically; a failed save (disk full) says so and
leaves the last good checkpoint; leftovers of an interrupted save and a half-written metrics
line do not block --resume. The oracle of "bit-identically" is an uninterrupted run.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from models import processes
from orthoptim import checkpoint, safe_load
from orthoptim.cli import main
from orthoptim.train import runfolder
from orthoptim.train.args import TrainArgs
from orthoptim.train.loop import build_run, lr_multiplier

from distributed import run_ranks

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


# -- the commit record: latest.json and each checkpoint.json verify themselves ------------------


def _records(out: Path) -> tuple[Path, dict]:
    """latest.json's path and step_000004's own record (what a fallback must return)."""
    ckpts = out / "checkpoints"
    return ckpts / "latest.json", json.loads(
        (ckpts / "step_000004" / "checkpoint.json").read_text()
    )


def _resume_args(out: Path) -> TrainArgs:
    _, record = _records(out)
    return TrainArgs.from_dict(dict(record["args"], out=str(out), resume=True, stop_after=None))


def _flip(path: Path, index: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[index] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_a_damaged_latest_json_falls_back_to_the_step_records(runs, tmp_path):
    """Issue 32: latest.json was trusted as it was read: a flipped step 4 → 6 made --resume
    say "finished at step 6; nothing to do", a changed lr changed the run, a crafted folder
    named a directory outside --out, a JSON error did not name the file. Now the record that
    does not verify (own SHA-256, types, its folder's name, agreement with its folder's
    checkpoint.json) is passed over, with a notice, for the step folder's own record."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    latest, own = _records(out)
    good = json.loads(latest.read_text())
    step_at = latest.read_text().index('"step": 4') + len('"step": ')

    def resealed(**change) -> str:
        return json.dumps(runfolder.sealed(dict(good, **change)), indent=1)

    cases = [
        ("step 4 → 6, one bit", lambda: _flip(latest, step_at, 1), "fails its own SHA-256"),
        ("a recorded lr", lambda: latest.write_text(latest.read_text().replace(
            '"lr": null', '"lr": 0.07')), "fails its own SHA-256 check"),
        ("a cut brace", lambda: latest.write_text(latest.read_text()[:-1]), "is not valid JSON"),
        ("a folder outside", lambda: latest.write_text(resealed(folder="../../x")),
         "names folder '../../x' for step 4, not step_000004"),
        ("its folder's record disagrees", lambda: latest.write_text(resealed(train_time_s=1.0)),
         "disagrees with step_000004/checkpoint.json (train_time_s)"),
        ("missing", latest.unlink, "which is missing"),
    ]  # fmt: skip
    for name, damage, notice in cases:
        latest.write_text(json.dumps(good, indent=1))
        damage()
        ckpt = runfolder.Checkpointer(out, 0, 1)
        assert ckpt.latest() == own, name
        assert len(ckpt.notices) == 1 and notice in ckpt.notices[0], (name, ckpt.notices)
        assert runfolder.claim_out(_resume_args(out), 1, "cpu") is None, name  # trains on
    # Records written before they had checksums are taken as they are, names still checked.
    old = {k: v for k, v in own.items() if k != runfolder.RECORD_SHA256}
    (out / "checkpoints" / "step_000004" / "checkpoint.json").write_text(json.dumps(old))
    latest.write_text(json.dumps(old))
    ckpt = runfolder.Checkpointer(out, 0, 1)
    assert (ckpt.latest(), ckpt.notices) == (old, [])
    latest.write_text(json.dumps(dict(old, step=6)))
    assert ckpt.latest() == old and "names folder 'step_000004' for step 6" in ckpt.notices[0]
    # No record verifies: one line naming the file, and only then the advice to start afresh.
    latest.write_text("{")
    for folder in ("step_000002", "step_000004"):
        (out / "checkpoints" / folder / "checkpoint.json").write_text("[]")
    with pytest.raises(FileNotFoundError) as info:
        ckpt.latest()
    assert f"{latest} is not valid JSON" in str(info.value) and "\n" not in str(info.value)
    assert "no step folder holds a record that verifies" in str(info.value)


def test_a_damaged_newest_checkpoint_json_resumes_bitwise_from_the_older_folder(
    runs, tmp_path, capsys
):
    """A flipped byte in the newest step folder's checkpoint.json: that folder is passed over
    (kept as `.damaged`), the run resumes from step 2 and continues bit-identically, and
    latest.json is rebuilt from the record it resumed."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    record = out / "checkpoints" / "step_000004" / "checkpoint.json"
    _flip(record, record.read_text().index('"sha256": "') + 20, 0)
    capsys.readouterr()
    assert main(_argv(out, "--resume")) == 0
    err = capsys.readouterr().err
    assert "passed over step_000004: checkpoint.json fails its own SHA-256 check" in err, err
    assert "resuming from step_000002 (step 2)" in err
    assert _losses(out) == _losses(runs["whole"])
    assert (out / "checkpoints" / "step_000004.damaged" / "checkpoint.json").exists()
    latest, own = _records(out)
    assert json.loads(latest.read_text()) == json.loads(
        (out / "checkpoints" / "step_000006" / "checkpoint.json").read_text()
    )
    assert runfolder.record_problem(own) is None


def _built(out: Path) -> tuple[TrainArgs, Any]:
    args = _resume_args(out)
    return args, build_run(args, 0, 1, torch.device("cpu"), logging.getLogger("test"))


def _same(state: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return state.keys() == want.keys() and all(torch.equal(state[k], want[k]) for k in want)


def test_a_file_that_verifies_but_cannot_be_loaded_falls_back(runs, tmp_path):
    """Issue 32 item 5: a file matching its record that fails to load (cut short before it
    was hashed, a pickle the safe loader refuses, a DCP shard) used to stop the resume; it is
    passed over like a damaged one, its reason in one line, for the older folder. And a
    record naming a folder outside checkpoints/ (which a fallback used to rename aside) is
    ignored: nothing outside is touched."""
    args, run = _built(runs["partial"])
    step2 = torch.load(
        runs["partial"] / "checkpoints" / "step_000002" / "model.pt", weights_only=True
    )
    cut = (runs["partial"] / "checkpoints" / "step_000004" / "optim.pt").read_bytes()
    cases = [
        ("optim.pt", lambda p: p.write_bytes(cut[: len(cut) // 2]), "PytorchStreamReader"),
        ("model.pt", lambda p: torch.save(datetime.date(2026, 1, 1), p), "datetime.date"),
    ]
    for i, (name, spoil, why) in enumerate(cases):
        out = shutil.copytree(runs["partial"], tmp_path / f"case{i}")
        folder = out / "checkpoints" / "step_000004"
        spoil(folder / name)
        _rerecord(folder, name)
        info = runfolder.Checkpointer(out, 0, 1).load(run.model, run.opt, args, "fp32")
        assert info["step"] == 2 and _same(run.model.state_dict(), step2)
        (passed,) = info["passed_over"]
        assert passed.startswith("step_000004: cannot be loaded (") and why in passed, passed
        assert str(folder / name) in passed and "\n" not in passed
    # A folder outside checkpoints/, named by a record whose checksum holds.
    out = shutil.copytree(runs["partial"], tmp_path / "outside")
    outside = tmp_path / "x"
    outside.mkdir()
    latest, own = _records(out)
    latest.write_text(json.dumps(runfolder.sealed(dict(own, folder="../../x"))))
    info = runfolder.Checkpointer(out, 0, 1).load(run.model, run.opt, args, "fp32")
    assert info["step"] == 4 and outside.is_dir() and not (tmp_path / "x.damaged").exists()
    assert "names folder '../../x'" in info["passed_over"][0]
    assert json.loads(latest.read_text()) == own  # rebuilt
    # A DCP shard that verifies but cannot be read.
    ckpt = runfolder.Checkpointer(tmp_path / "dcp", 0, 1, sharded=True)
    meta = dict(args=args.to_dict(), train_time_s=0.0)
    ckpt.save(1, run.model, run.opt, meta)
    saved = {k: v.clone() for k, v in run.model.state_dict().items()}
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    ckpt.save(2, run.model, run.opt, meta)
    folder = ckpt.dir / "step_000002"
    shard = next((folder / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    _rerecord(folder, str(shard.relative_to(folder)))
    info = ckpt.load(run.model, run.opt, args, "fp32")
    assert info["step"] == 1 and _same(run.model.state_dict(), saved)
    (passed,) = info["passed_over"]
    assert passed.startswith(f"step_000002: cannot be loaded (could not read checkpoint {folder}")
    assert "rank 0: could not load" in passed and "tuple" not in passed, passed


def _load_failing_on_rank_1(rank: int, world_size: int, out: str) -> tuple[int, list[str], float]:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = runfolder.Checkpointer(Path(out), rank, world_size)
    args = TrainArgs()
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(float(step))
        ckpt.save(step, model, opt, dict(args=args.to_dict(), train_time_s=0.0))
    if rank == 1:
        load_file = checkpoint.load_file

        def failing(path: Any, *a: Any, **kw: Any) -> Any:
            if "step_000002" in str(path):
                raise checkpoint.CheckpointLoadError(f"could not load {path}: EOFError")
            return load_file(path, *a, **kw)

        checkpoint.load_file = failing
    info = ckpt.load(model, opt, args, "fp32")
    return info["step"], info["passed_over"], float(model.weight[0, 0])


def test_a_load_failing_on_one_rank_is_agreed_by_every_rank(tmp_path):
    """The load is collective: a file that fails on rank 1 only makes every rank pass over
    its folder and load the same older one (it used to raise on rank 1 alone)."""
    results = run_ranks(_load_failing_on_rank_1, 2, args=(str(tmp_path),), timeout=120)
    want = tmp_path / "checkpoints" / "step_000002" / "model.pt"
    passed = [f"step_000002: cannot be loaded on rank 1 (could not load {want}: EOFError)"]
    assert results == [(1, passed, 1.0), (1, passed, 1.0)]


def test_a_dcp_read_failure_is_one_line():
    """DCP keeps each rank's failure as (exception, stack summary); the message used to be
    "rank 0: tuple: (EOFError(), [<FrameSummary ...>])" over many lines."""
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    try:
        raise EOFError()
    except EOFError as exc:
        wrapped = _wrap_exception(exc)
    with pytest.raises(checkpoint.CheckpointLoadError) as info, safe_load.reading("ck/dcp"):
        raise CheckpointException("load failed", {0: wrapped, 1: (ValueError("a\nb"), None)})
    assert (
        str(info.value)
        == "could not read checkpoint ck/dcp: rank 0: EOFError; rank 1: ValueError: a b"
    )


def test_records_are_durable_and_damaged_folders_pruned(tmp_path, monkeypatch):
    """checkpoint.json and latest.json were renamed into place unsynced (model.pt and
    optim.pt were synced): flushed to disk, then their folders. Heartbeats stay unsynced.
    Of the `*.damaged` folders only the newest DAMAGED_KEPT stay after a save."""
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd)
    )
    model = torch.nn.Linear(3, 2)
    ckpt = runfolder.Checkpointer(tmp_path, 0, 1)
    for name in ("step_000001.damaged", "step_000003.damaged", "step_000005.damaged"):
        (ckpt.dir / name).mkdir(parents=True)
    ckpt.save(6, model, torch.optim.SGD(model.parameters(), lr=0.1), dict(args={}))
    folder = ckpt.dir / "step_000006"
    for path in (folder / "checkpoint.json.tmp", folder, ckpt.dir / "latest.json.tmp", ckpt.dir):
        assert str(path) in synced, (path, synced)
    assert sorted(p.name for p in ckpt.dir.iterdir()) == [
        "latest.json", "step_000003.damaged", "step_000005.damaged", "step_000006",
    ]  # fmt: skip
    synced.clear()
    runfolder.atomic_write_text("{}", tmp_path / "beat.json")
    assert synced == []


def _byte_classes(text: str) -> dict[str, list[int]]:
    """The byte positions of a record's parts: its step's digits, its args, its folder's
    name, its SHA-256 hex digits, and its braces and quotes."""

    def value_at(key: str) -> range:
        start = text.index(f'"{key}": ') + len(f'"{key}": ')
        end = start
        while text[end] not in ",\n}":
            end += 1
        return range(start, end)

    args_start = text.index('"args": {')
    hashes = [
        i
        for key in ('"sha256": "', '"record_sha256": "')
        for at in range(len(text))
        if text.startswith(key, at)
        for i in range(at + len(key), at + len(key) + 64)
    ]
    return {
        "step": list(value_at("step")),
        "args": list(range(args_start, text.index("\n }", args_start) + 3)),
        "folder": [i for i in value_at("folder") if text[i] != '"'],
        "hashes": hashes,
        "braces/quotes": [i for i, c in enumerate(text) if c in '{}"'],
    }


@pytest.mark.probe
def test_probe_bit_flips_in_the_commit_records(runs, tmp_path, capsys):
    """Issue 32's figure: 20 seeded bit flips, two in each byte class of latest.json and of
    the newest checkpoint.json. None may give an rc-0 run that skips or changes training:
    each resumes bit-identically to the uninterrupted run or refuses in one line naming the
    file. Run: pytest -m probe tests/test_resume.py -k probe -s"""
    import random

    rng = random.Random(32)
    whole = _losses(runs["whole"])
    report = []
    for name in ("latest.json", "step_000004/checkpoint.json"):
        text = (runs["partial"] / "checkpoints" / name).read_text()
        for cls, where in _byte_classes(text).items():
            for index, bit in rng.sample([(i, b) for i in where for b in range(8)], 2):
                out = shutil.copytree(runs["partial"], tmp_path / f"flip{len(report)}")
                _flip(out / "checkpoints" / name, index, bit)
                capsys.readouterr()
                rc = main(_argv(out, "--resume"))
                got = capsys.readouterr()
                if rc == 0:
                    assert "nothing to do" not in got.out, (name, cls, index, bit, got)
                    assert _losses(out) == whole, (name, cls, index, bit, got.err)
                    resumed = [line for line in got.err.splitlines() if "resuming from" in line]
                    verdict = f"rc 0, bitwise, {resumed[0].split('resuming from ')[1]}"
                else:
                    lines = got.err.strip().splitlines()
                    assert len(lines) == 1 and Path(name).name in lines[0], (name, cls, got.err)
                    verdict = f"rc {rc}: {lines[0]}"
                report.append(f"{name:28} {cls:14} byte {index:4} bit {bit}: {verdict}")
    with capsys.disabled():
        print("\n" + "\n".join(report))
    assert len(report) == 20


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
    (out / "logs" / "rank0.heartbeat.json.tmp").write_text('{"pid"')
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
    assert f"{bad / 'metrics.jsonl'}, line 2, is not a metrics row" in capsys.readouterr().err


def test_metrics_are_synced_at_checkpoints_and_the_checkpoint_row_is_restored(
    runs, tmp_path, monkeypatch, capsys
):
    """metrics.jsonl was never fsynced, and a resumed run whose file had lost the row of the
    checkpoint's step (with the page cache, in a crash) went on without it."""
    out = shutil.copytree(runs["partial"], tmp_path / "A")
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    assert json.loads(lines[-1])["step"] == 4
    metrics.write_text("\n".join(lines[:-1]) + "\n")  # the checkpoint's row lost
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))
    )
    capsys.readouterr()
    assert main(_argv(out, "--resume")) == 0
    assert f"{metrics} lacked the row of step 4: restored it" in capsys.readouterr().err
    rows = _rows(out)
    assert sorted(rows) == list(range(STEPS + 1))
    assert rows[4] == json.loads(lines[-1])  # the row as the run had written it
    assert _losses(out) == _losses(runs["whole"])
    # Synced once, at the checkpoint of step 6, not at every step (5 and 6).
    assert synced.count(str(metrics)) == 1, synced


small_disk = processes.small_disk  # a fixture: a tmpfs mount of a given size


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
