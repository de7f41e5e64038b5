"""What `orthoptim train` checks before its ranks start and says on the terminal: a bad
--tensorboard folder is refused and leaves nothing behind; the event files say what
metrics.jsonl says after a resume and after --overwrite; a last line of metrics.jsonl that is
JSON but not a row is dropped, with a word; a checkpoint that cannot resume under a layout
says so first; a --param-dtype change on resume is said. One rank (two where a layout needs
them, refused before they start), tiny config, a few steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orthoptim.cli import main
from orthoptim.train import launcher, loop, runfolder
from orthoptim.train.args import TrainArgs


def _argv(out: Path, *extra: str) -> list[str]:
    return [
        "train", "--nproc", "1", "--config", "tiny", "--steps", "4", "--batch", "2",
        "--eval-every", "2", "--eval-batches", "1", "--ckpt-every", "2", "--warmup", "1",
        "--log-every", "0", "--out", str(out), "--no-progress", *extra,
    ]  # fmt: skip


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _no_ranks(args: TrainArgs, nproc: int) -> dict:
    raise AssertionError("the ranks started")


@pytest.mark.parametrize("bad", ["a_file", "a_file/below"])
def test_a_bad_tensorboard_folder_is_refused_before_the_ranks_start(
    tmp_path, monkeypatch, capsys, bad
):
    """A --tensorboard that is a file, or a folder that cannot be made under one: one line
    naming the flag, no rank started, and no --out folder left to block the next run."""
    (tmp_path / "a_file").write_text("not a folder\n")
    monkeypatch.setattr(launcher, "_launch_ranks", _no_ranks)
    out = tmp_path / "run"
    assert main(_argv(out, "--tensorboard", str(tmp_path / bad))) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"orthoptim: error: --tensorboard {tmp_path / bad}"), err
    assert len(err.splitlines()) == 1, err
    assert not out.exists()


def test_a_tensorboard_that_fails_in_a_rank_leaves_no_run_behind(tmp_path, monkeypatch):
    """Should the event files fail inside the rank all the same, the run never stepped and
    --out holds no run: the next start needs no --overwrite."""

    def failing(logdir: str, start: int = 0) -> None:
        raise OSError(f"cannot write {logdir}")

    monkeypatch.setattr(loop, "Board", failing)
    out = tmp_path / "run"
    args = TrainArgs.from_dict(dict(config="tiny", steps=2, batch=2, out=str(out)))
    args.tensorboard = str(tmp_path / "tb")
    with pytest.raises(launcher.RankFailedError, match="cannot write"):
        launcher.launch(args, nproc=1)
    assert runfolder.held_run(out) is None


def _scalars(logdir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of every `tag` event TensorBoard's own reader keeps, in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return sorted((e.step, e.value) for e in events.Scalars(tag))


def _said(rows: list[dict], tag: str) -> list[tuple[int, float]]:
    return [(r["step"], pytest.approx(r[tag], rel=1e-6)) for r in rows if tag in r]


def test_tensorboard_drops_the_rows_a_resume_replaces(tmp_path):
    """Resumed from step 2 (step 4's checkpoint lost), steps 3 and 4 are trained again: the
    event files hold each step once, with metrics.jsonl's values."""
    out, tb = tmp_path / "run", tmp_path / "tb"
    assert main(_argv(out, "--tensorboard", str(tb))) == 0
    (out / "checkpoints" / "step_000004" / "model.pt").unlink()
    # another LR from step 2 on, so the replaced rows differ from the new ones
    assert main(_argv(out, "--tensorboard", str(tb), "--resume", "--lr", "0.02")) == 0
    rows = _rows(out)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert _scalars(tb, "train_loss") == _said(rows, "train_loss")
    assert _scalars(tb, "val_loss") == _said(rows, "val_loss")


def test_overwrite_replaces_the_tensorboard_rows(tmp_path):
    """--overwrite with the same --tensorboard: only the new run's rows remain."""
    out, tb = tmp_path / "run", tmp_path / "tb"
    assert main(_argv(out, "--tensorboard", str(tb), "--steps", "2")) == 0
    assert main(_argv(out, "--tensorboard", str(tb), "--overwrite", "--seed", "1")) == 0
    rows = _rows(out)
    assert _scalars(tb, "train_loss") == _said(rows, "train_loss")
    assert len(list(tb.glob("events.out.tfevents.*"))) == 1


@pytest.mark.parametrize("last", ['{"foo": 1}', "7", '{"step": 9, "train_l'])
def test_a_last_metrics_line_that_is_no_row_is_dropped_with_a_word(tmp_path, capsys, last):
    """A last line that is JSON but not a row, or half-written: the resume drops it and
    says so on the terminal, naming the file and the line."""
    out = tmp_path / "run"
    assert main(_argv(out, "--stop-after", "2")) == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write(last + "\n")
    capsys.readouterr()
    assert main(_argv(out, "--resume")) == 0
    err = capsys.readouterr().err
    assert f"{out / 'metrics.jsonl'}, line 4, is not a metrics row" in err, err
    assert [r["step"] for r in _rows(out)] == [0, 1, 2, 3, 4]


def test_a_metrics_line_before_the_last_that_is_no_row_is_refused_by_line(tmp_path, capsys):
    """Such a line before the last: refused before any rank starts, naming file and line."""
    out = tmp_path / "run"
    assert main(_argv(out, "--stop-after", "2")) == 0
    lines = (out / "metrics.jsonl").read_text().splitlines()
    lines.insert(1, "[1, 2]")
    (out / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(_argv(out, "--resume")) == 2
    err = capsys.readouterr().err
    assert f"{out / 'metrics.jsonl'}, line 2, is not a metrics row" in err, err


@pytest.fixture(scope="module")
def bf16_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of bf16 optimizer state stopped after its checkpoint of step 2."""
    out = tmp_path_factory.mktemp("bf16_state") / "run"
    assert main(_argv(out, "--state-dtype", "bf16", "--stop-after", "2")) == 0
    return out


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--fsdp"]])
@pytest.mark.parametrize("state", [[], ["--state-dtype", "bf16"]])
def test_bf16_state_refused_under_tp_or_fsdp_says_it_cannot_resume_there(
    bf16_state, monkeypatch, capsys, layout, state
):
    """Resuming bf16 optimizer state under --tp or --fsdp, with --state-dtype bf16 or
    without: one line saying the checkpoint cannot resume under that layout (no advice that
    leads to the other refusal), before any rank starts."""
    monkeypatch.setattr(launcher, "_launch_ranks", _no_ranks)
    argv = _argv(bf16_state, "--resume", *layout, *state)
    argv[argv.index("--nproc") + 1] = "2"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    flag = " ".join(layout)
    assert len(err.splitlines()) == 1, err
    assert f"cannot resume under {flag}" in err, err
    assert "pass --state-dtype fp32" not in err, err


def test_a_param_dtype_change_on_resume_is_said_on_the_terminal(tmp_path, capsys):
    """fp32 parameters resumed as bf16: said on the terminal, as a --nproc change is."""
    out = tmp_path / "run"
    assert main(_argv(out, "--stop-after", "2", "--param-dtype", "fp32")) == 0
    capsys.readouterr()
    assert main(_argv(out, "--resume", "--stop-after", "3", "--param-dtype", "bf16")) == 0
    err = capsys.readouterr().err
    assert "orthoptim: --param-dtype fp32 → bf16 from step 2" in err, err
