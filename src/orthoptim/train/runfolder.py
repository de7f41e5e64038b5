"""The output folder of a run: who may use it, what it holds, and its checkpoints.

Files under `out`:
    metrics.jsonl          one JSON line per step (rank 0); `val_loss` on evaluation steps
    result.json            the run's summary (rank 0), written at the end
    logs/rank{R}.log       every rank's log
    checkpoints/latest.json   the committed checkpoint: its step folder and metadata
    checkpoints/step_NNNNNN/  checkpoint.json (metadata, every file's size and SHA-256), and
                           model.pt and optim.pt (the full optimizer state), by rank 0; with
                           --fsdp or --tp dcp/, one torch.distributed.checkpoint of model and
                           optimizer shards; with --pp or --ep model-stage{S}.pt
                           and optim-stage{S}.pt, each pipeline stage's full dicts
    .lock                  while a run is going: its host, pid and start time

An output folder belongs to one run (`claim_out`): a new run refuses a folder that holds one
unless `--resume` (continue it) or `--overwrite` (remove its files and start afresh) is given;
the lock keeps a second run out while one is going; resuming a finished run changes nothing.

The rooms: this module (what a run folder holds, its metrics, `claim_out`), `resume` (whether
and how a checkpoint may be continued), `records` (the sealed checkpoint records),
`checkpointer` (`Checkpointer`), `runlock` (the lock) and `diskfull` (failed writes). Their
public names are importable from here too.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from orthoptim import fileio
from orthoptim.train.args import TrainArgs
from orthoptim.train.board import remove_events
from orthoptim.train.checkpointer import DAMAGED_KEPT, Checkpointer
from orthoptim.train.diskfull import (
    FULL_BELOW_BYTES,
    CheckpointSaveError,
    DiskFullError,
    RunLogHandler,
    disk_full_error,
    is_disk_full,
    no_space,
    raised_from,
)
from orthoptim.train.records import (
    RECORD_SHA256,
    STEP_FOLDER,
    STEP_RECORD,
    damage,
    read_record,
    record_problem,
    sealed,
)
from orthoptim.train.resume import (
    CHECKPOINT_FORMATS,
    RESUME_MAY_CHANGE,
    RESUME_MUST_MATCH,
    RUN_FILES,
    CheckpointFormat,
    check_layout_resumable,
    check_resumable,
    checkpoint_format,
    holds_run,
    layout_change,
    resumed_args,
    saved_param_dtype,
)
from orthoptim.train.runlock import (
    LOCK_FILE,
    LOCK_TIME_FORMAT,
    LOCK_WRITE_S,
    acquire_lock,
    release_lock,
)

__all__ = [
    "CHECKPOINT_FORMATS",
    "DAMAGED_KEPT",
    "FULL_BELOW_BYTES",
    "LOCK_FILE",
    "LOCK_TIME_FORMAT",
    "LOCK_WRITE_S",
    "RECORD_SHA256",
    "RESUME_MAY_CHANGE",
    "RESUME_MUST_MATCH",
    "RUN_FILES",
    "STEP_FOLDER",
    "STEP_RECORD",
    "CheckpointFormat",
    "CheckpointSaveError",
    "Checkpointer",
    "DiskFullError",
    "RunLogHandler",
    "acquire_lock",
    "atomic_write_text",
    "check_layout_resumable",
    "check_resumable",
    "checkpoint_format",
    "claim_out",
    "clean_leftovers",
    "damage",
    "disk_full_error",
    "forget_unstepped",
    "held_run",
    "holds_run",
    "is_disk_full",
    "latest_record",
    "layout_change",
    "no_space",
    "nothing_to_do",
    "raised_from",
    "read_metrics",
    "read_record",
    "record_problem",
    "release_lock",
    "resumed_args",
    "saved_param_dtype",
    "sealed",
]

_log = logging.getLogger(__name__)


def atomic_write_text(text: str, path: Path, durable: bool = False) -> None:
    """Replace `path` with `text` at once: written aside to `path.tmp`, then renamed
    (`fileio.atomic_write`). With `durable` (checkpoint records) the file is flushed to disk
    before the rename and its folder after it, so a power loss leaves the old text or the new,
    never an empty file; without it (heartbeats, every second) nothing waits for the disk."""
    fileio.atomic_write_text(text, path, durable=durable, tmp=path.with_name(path.name + ".tmp"))


def _is_row(value: Any) -> bool:
    """Whether `value`, read from a line of metrics.jsonl, is a metrics row: a JSON object
    with an integer step."""
    step = value.get("step") if isinstance(value, dict) else None
    return isinstance(step, int) and not isinstance(step, bool)


def read_metrics(
    path: Path, upto: int | None = None, notes: list[str] | None = None
) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (those with step <= `upto` when given). A last line
    that is no row (cut short by a run stopped while writing it, or JSON but not an object
    with a step) is left out, with a line saying so appended to `notes` (given); such a
    line before it is an error naming the file and line."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        if _is_row(row):
            rows.append(row)
            continue
        what = f"{path}, line {i}, is not a metrics row ({line[:60]!r})"
        if i < len(lines):
            raise ValueError(f"{what}; remove or mend that line to continue the run")
        if notes is not None:
            notes.append(f"{what}: dropped it, as a row cut short by a stop is")
    return [r for r in rows if upto is None or r["step"] <= upto]


def forget_unstepped(out: Path) -> bool:
    """Remove the metrics.jsonl of a fresh run that failed before its first step ended (no
    row past step 0, no checkpoint, no result), so that `out` holds no run the next start
    must --overwrite. Returns whether it did."""
    path = out / "metrics.jsonl"
    if any((out / name).exists() for name in RUN_FILES[1:3]):
        return False
    try:
        rows = read_metrics(path)
    except (OSError, ValueError):
        return False
    if any(r["step"] > 0 for r in rows):
        return False
    path.unlink(missing_ok=True)
    return True


def clean_leftovers(out: Path) -> list[str]:
    """Remove what an interrupted run left half-written under `out` (call with the lock held,
    before any rank starts): `*.tmp` and `*.tmp.PID` files (of checkpoints and logs/ too) and
    step folders that were never committed (no record, not named by latest.json). Returns
    what was removed. (`*.damaged` folders are pruned after each save: `Checkpointer._prune`.)"""
    removed = []
    ckpts = out / "checkpoints"
    named = (latest_record(out) or {}).get("folder")
    for path in sorted(ckpts.glob("step_*")):
        if path.is_dir() and path.name != named and not (path / STEP_RECORD).exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    logs = out / "logs"
    leftovers = [*out.glob("*.tmp"), *logs.glob("*.tmp"), *logs.glob("*.tmp.*")]
    for path in [*leftovers, *ckpts.rglob("*.tmp"), *ckpts.rglob("*.tmp.*")]:
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(str(path))
    return removed


def held_run(out: Path) -> str | None:
    """The run `out` holds, in words ("checkpoint at step 10"), or None when it holds none
    (no metrics.jsonl, result.json or checkpoints/)."""
    if not holds_run(out):
        return None
    record = latest_record(out)
    return f"checkpoint at step {record['step']}" if record else "no checkpoint"


def latest_record(out: Path) -> dict[str, Any] | None:
    """The committed checkpoint's record (its step, folder and metadata: `Checkpointer.latest`,
    latest.json's or, if that does not verify, the newest step folder's that does), or None
    when no record verifies."""
    try:
        return Checkpointer(out, 0, 1).latest()
    except FileNotFoundError:
        return None


def claim_out(args: TrainArgs, world_size: int, device_type: str) -> str | None:
    """Check what this run may do with --out (call with the lock held), before any rank
    trains on `device_type` ranks ("cpu" or "cuda"). A folder holding a run is refused unless
    --resume (the checkpoint must match this run) or --overwrite (its run's files are removed
    here, and the event files directly under its --tensorboard folder). Returns a message
    when there is nothing to do: a resumed run whose checkpoint is at or past its last
    step."""
    out = Path(args.out)
    if args.resume:
        for path in clean_leftovers(out):
            _log.warning("--out %s: removed %s, left by an interrupted save", out, path)
        ckpt = Checkpointer(out, 0, world_size)
        info = ckpt.latest()
        for notice in ckpt.notices:
            _log.warning("--out %s: passed over %s", out, notice)
        check_resumable(info, args, world_size, args.param_dtype_on(device_type))
        read_metrics(out / "metrics.jsonl")  # a damaged row is refused before any rank starts
        step, last = info["step"], args.stop_after or args.steps
        if step >= last and damage(ckpt.dir / info["folder"], info) is None:
            # only a verified record and its intact files say there is nothing left to do;
            # otherwise the ranks pass it over for an older checkpoint and train on
            if step >= args.steps:
                return f"--out {out} finished at step {step}; nothing to do"
            return f"--out {out} is at step {step}, --stop-after {last}; nothing to do"
        return None
    held = held_run(out)
    if held is None:
        return None
    if not args.overwrite:
        raise ValueError(
            f"--out {out} holds a run ({held}); pass --resume to continue it or --overwrite "
            "to replace it"
        )
    for name in RUN_FILES:
        for path in (out / name, out / f"{name}.tmp"):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    if args.tensorboard:  # the replaced run's rows there too
        remove_events(args.tensorboard)
    return None


def nothing_to_do(out: Path, message: str) -> dict[str, Any]:
    """The result of a run that had nothing to do: the folder's result.json as it is (if any),
    with the message under "nothing_to_do"."""
    try:
        result = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        result = {}
    return dict(result, nothing_to_do=message)
