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
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from orthoptim import checkpoint, collectives
from orthoptim.parallel.layout import ParallelDims
from orthoptim.train.args import TrainArgs


def atomic_write_text(text: str, path: Path, durable: bool = False) -> None:
    """Replace `path` with `text` at once: written aside to `path.tmp`, then renamed. With
    `durable` (checkpoint records) the file is flushed to disk before the rename and its
    folder after it, so a power loss leaves the old text or the new, never an empty file;
    without it (heartbeats, every second) nothing waits for the disk."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        checkpoint._fsync_dir(str(path.parent))


def read_metrics(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (those with step <= `upto` when given). A last line
    cut short (a run stopped while writing it) is left out; a damaged line before it is an
    error naming the file and line."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i == len(lines):
                continue
            raise ValueError(
                f"{path}, line {i}, is not a JSON row ({line[:60]!r}); remove or mend that "
                "line to continue the run"
            ) from None
    return [r for r in rows if upto is None or r["step"] <= upto]


RESUME_MUST_MATCH = (
    "optimizer", "elementwise", "config", "hf_config", "batch", "seed", "data", "steps",
    "warmup", "min_lr_ratio",
)  # fmt: skip
# --nproc, --tp and --fsdp (the layout) may change: the checkpoint is resharded on loading
# (`Checkpointer._read`), the change named (`layout_change`); so may --ep, whose checkpoints
# hold the full expert stacks; --pp may not (`check_layout_resumable`).
# Flags a resumed run may change (applied with a notice); left off, the checkpoint's value.
RESUME_MAY_CHANGE = ("lr", "adamw_lr", "weight_decay", "grad_clip", "qk_clip")


def saved_param_dtype(info: dict[str, Any]) -> str:
    """The parameter dtype ("bf16" or "fp32") a checkpoint's run trained with (fp32 before
    --param-dtype existed)."""
    return str(info.get("param_dtype", "fp32"))


def check_resumable(
    info: dict[str, Any], args: TrainArgs, world_size: int, param_dtype: str
) -> None:
    """Refuse to resume a checkpoint of a different run, listing every mismatch. Another
    `world_size`, --tp, --ep or --fsdp is no mismatch: a checkpoint loads at every layout
    `TrainArgs.validate` and `check_nproc` allow of the same --pp (`check_layout_resumable`;
    `Checkpointer._read`).

    `param_dtype` is this run's ("bf16" or "fp32") and may differ from the checkpoint's: under
    --fsdp the checkpoint's model weights are FSDP2's sharded parameters, the fp32 masters;
    without it a bf16 run's fp32 masters are in the layer-wise optimizer's checkpoint (a
    bf16 run resumes them exactly; an fp32 run resumed in bf16 takes its masters from the
    fp32 weights rounded to bf16 on loading, and a bf16 run resumed in fp32 continues from
    its bf16 weights)."""
    saved = TrainArgs.from_dict(info["args"])  # defaults for flags newer than the checkpoint
    mismatched = [
        f"--{k.replace('_', '-')}: checkpoint {getattr(saved, k)!r}, now {getattr(args, k)!r}"
        for k in RESUME_MUST_MATCH
        if getattr(saved, k) != getattr(args, k)
    ]
    if mismatched:
        raise ValueError(
            "--resume: the checkpoint does not match this run: " + "; ".join(mismatched)
        )
    check_layout_resumable(info, args, world_size)


def check_layout_resumable(info: dict[str, Any], args: TrainArgs, world_size: int) -> None:
    """Refuse another --pp than the checkpoint's (a stage's files hold its blocks only),
    naming both and the fix; every other layout change reshards on loading."""
    saved = TrainArgs.from_dict(info["args"])
    if saved.pp != args.pp:
        raise ValueError(
            f"--resume: the checkpoint was written with --pp {saved.pp} and this run has --pp "
            f"{args.pp}; a checkpoint is read at the pipeline size that wrote it (each stage's "
            f"files hold its own layers): resume with --pp {saved.pp}"
        )


CheckpointFormat = Literal["dcp", "full", "stages"]
CHECKPOINT_FORMATS: tuple[CheckpointFormat, ...] = ("dcp", "full", "stages")


def checkpoint_format(info: dict[str, Any]) -> CheckpointFormat:
    """How the checkpoint of record `info` was written (not how the run resuming it would
    write one): "dcp" (`checkpoint.save_sharded` under dcp/), "full" (model.pt and optim.pt,
    the full state dicts) or "stages" (model-stage{S}.pt and optim-stage{S}.pt: each
    pipeline stage's full dicts), as its record says;
    a record from before the format was recorded is "dcp" when written by a --tp > 1 or a
    multi-rank --fsdp run."""
    if info.get("format") in CHECKPOINT_FORMATS:  # recorded by the save (`Checkpointer.save`)
        return info["format"]
    saved = TrainArgs.from_dict(info["args"])
    return "dcp" if saved.tp > 1 or (saved.fsdp and info["world_size"] > 1) else "full"


def layout_change(info: dict[str, Any], args: TrainArgs, world_size: int) -> str | None:
    """How a resumed run's layout differs from its checkpoint's, in words, or None when it
    does not: the changed flags, and the global batch (`--batch` sequences on each
    data-parallel rank, so it follows the data-parallel size nproc / (pp · tp)), e.g.
    "--nproc 2 → 3: global batch 32 → 48 sequences (3 data-parallel ranks × --batch 16)"."""
    saved = TrainArgs.from_dict(info["args"])
    before, after = int(info["world_size"]), world_size
    flags = [f"--nproc {before} → {after}"] if before != after else []
    for field in ("tp", "ep", "dp_replicate"):
        if getattr(saved, field) != getattr(args, field):
            was, now = getattr(saved, field), getattr(args, field)
            flags.append(f"--{field.replace('_', '-')} {was} → {now}")
    if saved.fsdp != args.fsdp:
        flags.append("--fsdp on → off" if saved.fsdp else "--fsdp off → on")
    if not flags:
        return None
    dp_before, dp_after = before // (saved.tp * saved.pp), after // (args.tp * args.pp)
    if dp_before == dp_after:
        batch = f"global batch unchanged ({dp_after * args.batch} sequences)"
    else:
        batch = (
            f"global batch {dp_before * args.batch} → {dp_after * args.batch} sequences "
            f"({dp_after} data-parallel rank{'s' * (dp_after > 1)} × --batch {args.batch})"
        )
    return ", ".join(flags) + ": " + batch


def resumed_args(args: TrainArgs, info: dict[str, Any]) -> tuple[TrainArgs, list[str]]:
    """The arguments a resumed run continues with: each of RESUME_MAY_CHANGE left off (None)
    takes the checkpoint's value, one given applies from the step resumed. Returns them and
    each changed value in words ("--lr 0.05 → 0.02")."""
    saved = TrainArgs.from_dict(info["args"])
    now = TrainArgs.from_dict(args.to_dict())
    notices = []
    for name in RESUME_MAY_CHANGE:
        if getattr(now, name) is None:
            setattr(now, name, getattr(saved, name))
    for flag, before, after in (
        ("--lr", saved.matrix_lr, now.matrix_lr),
        ("--adamw-lr", saved.embed_lr, now.embed_lr),
        ("--weight-decay", saved.decay, now.decay),
        ("--grad-clip", saved.clip_norm, now.clip_norm),
        ("--qk-clip", saved.qk_clip_tau or 0.0, now.qk_clip_tau or 0.0),
    ):
        if before != after:
            notices.append(f"{flag} {before:g} → {after:g}")
    return now, notices


# In each step folder: the checkpoint's metadata and every file's size and SHA-256.
STEP_RECORD = "checkpoint.json"
# Below this much free space a failed write is reported as the disk being full.
FULL_BELOW_BYTES = 16 * 2**20


class CheckpointSaveError(OSError):
    """A checkpoint could not be written (no space left, an unwritable folder). The step folder
    being written is removed; the last committed checkpoint is intact. `knock_on` is True on
    a rank whose own part was written but another rank's failed: that rank's error is the
    cause, this one only its echo."""

    knock_on = False


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _record_files(folder: Path) -> dict[str, dict[str, Any]]:
    """Every file under `folder` (but the record itself): its size and SHA-256."""
    return {
        str(p.relative_to(folder)): dict(bytes=p.stat().st_size, sha256=_sha256(p))
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != STEP_RECORD
    }


def damage(folder: Path, record: dict[str, Any]) -> str | None:
    """Why step folder `folder` does not hold what its record says was written (a file
    missing, resized or changed), or None when it does. A record without checksums (written
    before they existed) is taken as it is."""
    for name, want in record.get("files", {}).items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{name} has {size} bytes where {want['bytes']} were written"
        if _sha256(path) != want["sha256"]:
            return f"{name} fails its SHA-256 check (its bytes changed after it was written)"
    return None


# A record's own checksum: the SHA-256 of its canonical JSON without this key. Records of
# runs older than it have none and are taken as they are (as `damage` takes those without
# file checksums); the step-folder name check below still applies to them.
RECORD_SHA256 = "record_sha256"
# The only folders a record may name: step folders directly under checkpoints/.
STEP_FOLDER = re.compile(r"step_\d{6,}")
# Step folders passed over as damaged are renamed `*.damaged` for inspection; the newest
# this many (by step) are kept, older ones removed after the next save.
DAMAGED_KEPT = 2


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _body(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k != RECORD_SHA256}


def sealed(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with its own checksum (`RECORD_SHA256`), which `record_problem` checks."""
    digest = hashlib.sha256(_canonical(_body(record)).encode()).hexdigest()
    return dict(_body(record), **{RECORD_SHA256: digest})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _confined(name: Any) -> bool:
    """Whether `name` (a file name from a record) stays inside its step folder."""
    parts = Path(name).parts if isinstance(name, str) and name else ("..",)
    return not Path(name).is_absolute() and ".." not in parts


def record_problem(record: Any) -> str | None:
    """What is wrong with a checkpoint record read from JSON (its checksum fails, a field
    is missing or of the wrong type, it names a folder other than its step's), in words
    that follow "which" ("fails its own SHA-256 check ..."), or None when nothing is."""
    if not isinstance(record, dict):
        return "is not a JSON object"
    if RECORD_SHA256 in record and sealed(record)[RECORD_SHA256] != record[RECORD_SHA256]:
        return "fails its own SHA-256 check (its bytes changed after it was written)"
    step, folder = record.get("step"), record.get("folder")
    if not _is_int(step) or step < 0:
        return f"holds no valid step ({step!r})"
    if folder != f"step_{step:06d}":
        return (
            f"names folder {folder!r} for step {step}, not step_{step:06d} (a record may "
            "only name its step's folder under checkpoints/)"
        )
    if not isinstance(record.get("args"), dict):
        return "holds no valid args"
    if not _is_int(record.get("world_size")) or record["world_size"] < 1:
        return f"holds no valid world_size ({record.get('world_size')!r})"
    files = record.get("files", {})
    if not isinstance(files, dict) or not all(
        _confined(name)
        and isinstance(want, dict)
        and _is_int(want.get("bytes"))
        and isinstance(want.get("sha256"), str)
        for name, want in files.items()
    ):
        return "holds a malformed file list"
    return None


def read_record(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The checkpoint record at `path` and None, or None and what is wrong with it (in
    words that follow "which": "is missing", "is not valid JSON (...)", `record_problem`)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None, "is missing"
    except OSError as exc:
        return None, f"cannot be read ({exc.strerror or exc})"
    except UnicodeDecodeError:
        return None, "is not valid JSON (it holds bytes that are not UTF-8)"
    try:
        record = json.loads(text)
    except ValueError as exc:
        return None, f"is not valid JSON ({exc})"
    why = record_problem(record)
    return (None, why) if why else (record, None)


def _free_bytes(path: Path) -> int:
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(p).free
    return 0


def no_space(path: Path) -> str:
    """What a write that ran out of space says: the path and the bytes still free on its disk."""
    return f"no space left on {path} ({_free_bytes(path)} bytes free)"


def raised_from(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, the exception it was raised from (or while handling), that one's, and so on."""
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        yield at
        at = at.__cause__ or at.__context__


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc`, or an exception it was raised from, is the OS saying the disk (or the
    user's quota) is full."""
    return any(
        isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in raised_from(exc)
    )


class DiskFullError(OSError):
    """A run's write under --out failed for want of space; the message names the path, the
    bytes free and what to do."""


def disk_full_error(exc: BaseException, out: Path) -> DiskFullError | None:
    """`exc` as a `DiskFullError` when it is a write under `out` that ran out of space (the
    file the OS names, else `out`), None otherwise. A `CheckpointSaveError` already says so."""
    if isinstance(exc, CheckpointSaveError) or not is_disk_full(exc):
        return None
    name = getattr(exc, "filename", None)
    path = Path(name) if isinstance(name, str | os.PathLike) else out
    return DiskFullError(
        f"{no_space(path)}; free space on that disk, then run again (--resume continues "
        "from the last checkpoint)"
    )


class RunLogHandler(logging.FileHandler):
    """A log file under --out that, once a write to it fails (its disk full), says so in one
    line on stderr (once per file and process) and drops its further records, instead of
    logging's traceback per record."""

    _told: ClassVar[set[str]] = set()  # the files this process said it cannot write

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self.failed = True
        path = Path(self.baseFilename)
        if self.baseFilename not in self._told:
            self._told.add(self.baseFilename)
            why = no_space(path) if is_disk_full(exc) else f"cannot write {path} ({exc})"
            print(f"orthoptim: {why}; its log lines are dropped from here on", file=sys.stderr)
        with contextlib.suppress(OSError):  # its buffer cannot be written either
            self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            super().close()


@contextlib.contextmanager
def _writing(folder: Path, step: int, last_good: str) -> Iterator[None]:
    """Report a failed checkpoint write as a `CheckpointSaveError` that says why ("no space
    left on <folder>" when the disk is full: torch's own error only says "unexpected pos")
    and what is intact."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except collectives.CollectiveError:
        raise  # another rank died or stalled: not this rank's write
    except (Exception, CheckpointException) as exc:
        free = _free_bytes(folder)
        if is_disk_full(exc) or free < FULL_BELOW_BYTES:
            why = no_space(folder)
        else:
            why = f"{type(exc).__name__}: {exc}"
        raise CheckpointSaveError(
            f"could not save the checkpoint of step {step}: {why}; {last_good}"
        ) from exc


def _first_nonfinite(model: nn.Module) -> str | None:
    """The name of a parameter or buffer of `model` holding NaN or infinity (this rank's
    shard of it), or None."""
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        local = collectives.local_shard(t)
        if local.is_floating_point() and not bool(torch.isfinite(local.detach()).all()):
            return name
    return None


class Checkpointer:
    """Checkpoints a run can trust. A step folder's files are written aside and renamed, then
    its record (`checkpoint.json`: metadata, each file's size and SHA-256), then `latest.json`
    (the commit point) is replaced to name it; the newest `keep` committed folders stay.

    Loading takes the newest committed folder whose files match their record and whose model
    is finite, and says which folders it passed over and why (a damaged one is renamed
    `*.damaged` and kept for inspection). A failed save (disk full) removes its folder and raises a
    `CheckpointSaveError` that says why; leftovers of an interrupted save are removed by
    `clean_leftovers` before a run starts.

    Formats: `model.pt` and `optim.pt` (the optimizer's full state dict, gathered to rank 0,
    which every rank loads on resume); `sharded` (FSDP2) or a `layout` with tp > 1: model and
    optimizer by `orthoptim.checkpoint.save_sharded` under `dcp/` (each rank writes its
    shards and what it owns; keys free of world and tp size). A `layout` with pipeline
    stages: "stages", each stage's full model and optimizer dicts (`model-stage{S}.pt`,
    `optim-stage{S}.pt`, by the stage's first rank, tensor-parallel weights and state
    gathered whole; the stages hold disjoint parameter names), read by every rank of that
    stage at any data- and tensor-parallel size. Expert parallelism (whose ranks hold
    different experts under the same names) writes "stages" too: the expert stacks gathered
    whole over the ep group, their optimizer state under global expert names (the layer-wise
    optimizer's `ExpertSlicesView`), so it reads at any --ep as well. A checkpoint is read in
    the format its record says it was written in (`checkpoint_format`), at whatever layout
    the resuming run has and the format allows."""

    def __init__(
        self,
        out: Path,
        rank: int,
        world_size: int,
        sharded: bool = False,
        keep: int = 2,
        layout: ParallelDims | None = None,
    ) -> None:
        self.dir = out / "checkpoints"
        self.rank, self.world_size = rank, world_size
        self.keep = keep
        self.layout = layout or ParallelDims(dp=world_size)
        self._format = self._format_of(self.layout, sharded)

    @staticmethod
    def _format_of(layout: ParallelDims, sharded: bool) -> CheckpointFormat:
        """The format a run of `layout` writes its checkpoints in (see the class)."""
        if layout.pp > 1 or layout.ep > 1:
            return "stages"
        return "dcp" if layout.tp > 1 or sharded else "full"

    def latest(self) -> dict[str, Any]:
        """The committed checkpoint's record: latest.json's when it verifies (`read_record`)
        and agrees with its folder's own `checkpoint.json`; else (latest.json missing,
        damaged, naming a folder outside checkpoints/ or disagreeing) the newest step
        folder's record that verifies, with what was wrong in `self.notices` (`load` reports
        it and rebuilds latest.json). A clear error if there is none."""
        path = self.dir / "latest.json"
        self.notices: list[str] = []
        latest, why = read_record(path)
        if latest is not None:
            own, own_why = read_record(self.dir / latest["folder"] / STEP_RECORD)
            if own is None:
                why = f"names {latest['folder']}, whose {STEP_RECORD} {own_why}"
            else:
                a, b = _body(latest), _body(own)
                keys = [
                    k for k in sorted(a.keys() | b.keys())
                    if _canonical(a.get(k)) != _canonical(b.get(k))
                ]  # fmt: skip
                if not keys:
                    return latest
                why = f"disagrees with {latest['folder']}/{STEP_RECORD} ({', '.join(keys)})"
        records, _ = self._step_records()
        if records:
            self.notices.append(f"checkpoints/latest.json, which {why}")
            return records[0]
        out = self.dir.parent
        if _holds_run(out):
            advice = (
                f"--out {out} holds a run with no verified checkpoint to continue; pass "
                "--overwrite instead of --resume to replace it"
            )
        else:
            advice = f"--out {out} holds no run: drop --resume to start one there"
        if why == "is missing":
            raise FileNotFoundError(
                f"--resume: no checkpoint in {self.dir} (latest.json is missing); {advice}"
            )
        raise FileNotFoundError(
            f"--resume: no checkpoint to continue in {self.dir}: {path} {why}, and no step "
            f"folder holds a record that verifies; {advice}"
        )

    def _step_records(self) -> tuple[list[dict[str, Any]], list[tuple[str, str]]]:
        """The verified records of the step folders, newest first, and (folder, what is
        wrong) for each whose record does not verify. Folders without a record (a save in
        progress or never committed: `clean_leftovers`) are neither."""
        good, bad = [], []
        for folder in sorted(self.dir.glob("step_*")):
            if not (STEP_FOLDER.fullmatch(folder.name) and (folder / STEP_RECORD).is_file()):
                continue
            record, why = read_record(folder / STEP_RECORD)
            if record is not None and record["folder"] != folder.name:
                record, why = None, f"names {record['folder']}"
            if record is None:
                bad.append((folder.name, f"{STEP_RECORD} {why}"))
            else:
                good.append(record)
        return sorted(good, key=lambda r: -r["step"]), bad

    def committed(self) -> list[dict[str, Any]]:
        """The records of the committed step folders, newest first: the one latest.json names
        (or `latest`'s fallback) and every older one whose record verifies; those whose
        record does not are in `self.unverified` as (folder, why)."""
        latest = self.latest()
        records = {latest["folder"]: latest}
        good, self.unverified = self._step_records()
        records.update((r["folder"], r) for r in good if r["step"] < latest["step"])
        return sorted(records.values(), key=lambda r: -r["step"])

    def save(self, step: int, model: nn.Module, opt: Any, meta: dict[str, Any]) -> None:
        """Write the checkpoint of `step` (collective: every rank calls it, with the
        optimizer's parameters current)."""
        folder = self.dir / f"step_{step:06d}"
        try:
            last_good = f"the last good checkpoint (step {self.latest()['step']}) is intact"
        except (FileNotFoundError, ValueError):
            last_good = "there is no earlier checkpoint"
        self._together(step, folder, last_good, "write", lambda: self._write(folder, model, opt))

        def commit() -> None:
            if self.rank == 0:
                info = dict(meta, step=step, folder=folder.name, world_size=self.world_size,
                            format=self._format)  # fmt: skip
                record = json.dumps(sealed(dict(info, files=_record_files(folder))), indent=1)
                atomic_write_text(record, folder / STEP_RECORD, durable=True)
                atomic_write_text(record, self.dir / "latest.json", durable=True)

        self._together(step, folder, last_good, "commit", commit)
        if self.rank == 0:
            self._prune(folder.name)
        with collectives.phase(f"checkpoint of step {step}: the ranks' last barrier"):
            collectives.barrier()

    def _together(self, step: int, folder: Path, last_good: str, what: str, work: Any) -> None:
        """Run this rank's part of a save (`what`: "write", "commit"); if it fails on any rank,
        every rank raises (the failing one its own `CheckpointSaveError`, the others one marked
        `knock_on`) and the uncommitted folder is removed."""
        error = None
        try:
            with _writing(folder, step, last_good):
                work()
        except CheckpointSaveError as exc:
            error = exc
        agreeing = f"checkpoint of step {step}: agreeing that every rank's {what} succeeded"
        with collectives.phase(agreeing):
            failed = collectives.sum_floats([float(error is not None)])[0]
        if failed:
            if self.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            if error is None:
                error = CheckpointSaveError(
                    f"could not save the checkpoint of step {step}: another rank failed to "
                    f"write its part (see its error); {last_good}"
                )
                error.knock_on = True
            raise error

    def _write(self, folder: Path, model: nn.Module, opt: Any) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        coord = self.layout.coordinate(self.rank)
        first = coord.dp == 0 and coord.tp == 0  # the stage's first rank
        if self._format == "stages":
            with collectives.phase(
                f"checkpoint {folder.name}: stage {coord.pp}'s model and optimizer state to its "
                "first rank"
            ):
                whole = _full_model_state(model)  # collective over the ep or tp group
                optim = opt.state_dict()  # collective over the stage's data-parallel group
            if first:
                checkpoint.atomic_save(whole, folder / f"model-stage{coord.pp}.pt")
                checkpoint.atomic_save(optim, folder / f"optim-stage{coord.pp}.pt")
        elif self._format == "dcp":
            with collectives.phase(f"checkpoint {folder.name}: the sharded save"):
                checkpoint.save_sharded(folder / "dcp", opt, model)
        else:
            with collectives.phase(f"checkpoint {folder.name}: the optimizer state to rank 0"):
                optim = opt.state_dict()  # collective: the full dict, on rank 0 only
            if self.rank == 0:
                checkpoint.atomic_save(model.state_dict(), folder / "model.pt")
                checkpoint.atomic_save(optim, folder / "optim.pt")

    def _prune(self, newest: str) -> None:
        """Keep the newest `keep` committed step folders (`newest` among them) and the newest
        `DAMAGED_KEPT` `*.damaged` ones."""
        kept = [r["folder"] for r in self.committed()][: self.keep]
        for old in self.dir.glob("step_*"):
            if old.is_dir() and old.name not in (*kept, newest) and old.suffix != ".damaged":
                shutil.rmtree(old, ignore_errors=True)
        damaged = sorted(
            self.dir.glob("step_*.damaged"), key=lambda p: int(p.name[5:].split(".")[0] or 0)
        )[::-1]
        for old in damaged[DAMAGED_KEPT:]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, model: nn.Module, opt: Any, args: TrainArgs, param_dtype: str) -> dict[str, Any]:
        """Load the newest intact committed checkpoint into `model` and `opt` (collective) and
        return its record, with "passed_over": what was skipped and why (a damaged
        latest.json, step folders whose record does not verify, whose files do not match it,
        cannot be loaded on some rank, or hold a non-finite model). Rank 0 checks the files
        against their record; every rank agrees on whether its load worked and checks the
        model it loaded is finite. latest.json is rebuilt from the record loaded if
        anything was passed over. `param_dtype`: this run's (`check_resumable`)."""
        damaged: list[tuple[Path, str]] = []
        candidates = self.committed()
        notices = list(self.notices)
        damaged += [(self.dir / name, why) for name, why in self.unverified]
        for info in candidates:
            folder = self.dir / info["folder"]
            why = collectives.all_gather_object(damage(folder, info) if self.rank == 0 else None)
            if why[0] is not None:
                damaged.append((folder, why[0]))
                continue
            check_resumable(info, args, self.world_size, param_dtype)
            failed = self._agreed_read(folder, model, opt, info)
            if failed is not None:
                damaged.append((folder, failed))
                continue
            names = [n for n in collectives.all_gather_object(_first_nonfinite(model)) if n]
            if names:
                damaged.append((folder, f"the model holds NaN or inf ({names[0]})"))
                continue
            if self.rank == 0 and (damaged or notices):
                # the damaged folders kept aside (never loaded; `_prune` keeps the newest
                # DAMAGED_KEPT), this one committed
                for bad, _ in damaged:
                    aside = bad.with_name(bad.name + ".damaged")
                    with contextlib.suppress(OSError):
                        shutil.rmtree(aside, ignore_errors=True)
                        os.replace(bad, aside)
                record = json.dumps(sealed(info), indent=1)
                atomic_write_text(record, self.dir / "latest.json", durable=True)
            collectives.barrier()
            passed = [*notices, *(f"{f.name}: {why}" for f, why in damaged)]
            return dict(info, passed_over=passed)
        raise checkpoint.CheckpointLoadError(
            f"--resume: no intact checkpoint in {self.dir}: "
            + "; ".join([*notices, *(f"{f.name}: {why}" for f, why in damaged)])
            + "; pass --overwrite instead of --resume to start the run afresh"
        )

    def _agreed_read(
        self, folder: Path, model: nn.Module, opt: Any, info: dict[str, Any]
    ) -> str | None:
        """`_read` this rank's part of `folder` (collective); None when it worked on every rank,
        else the first failing rank's reason in one line, on every rank. A checkpoint that
        does not match the model (`CheckpointMismatchError`, the same on every rank) is
        raised as it is: no older folder would match either."""
        try:
            self._read(folder, model, opt, info)
            mine = None
        except checkpoint.CheckpointMismatchError:
            raise
        except Exception as exc:
            mine = checkpoint.one_line(exc)
        failures = [(r, w) for r, w in enumerate(collectives.all_gather_object(mine)) if w]
        if not failures:
            return None
        rank, why = failures[0]
        where = "" if self.world_size == 1 else f" on rank {rank}"
        return f"cannot be loaded{where} ({why})"

    def _read(self, folder: Path, model: nn.Module, opt: Any, info: dict[str, Any]) -> None:
        """Load step folder `folder`, whose record is `info`, into this run's model and
        optimizer (collective), by the format the checkpoint was written in
        (`checkpoint_format`), whatever this run's world size, tp and sharding: a DCP
        checkpoint's keys are free of both, and each rank reads what it owns now; full dicts
        are read whole by every rank, which keeps what it owns (of a DTensor parameter, its
        shard)."""
        fmt = checkpoint_format(info)
        if fmt == "dcp":
            checkpoint.load_sharded(folder / "dcp", opt, model)
            return
        stage = self.layout.coordinate(self.rank).pp
        if fmt == "stages":
            _load_full_model(model, checkpoint.load_file(folder / f"model-stage{stage}.pt"))
            opt.load_state_dict(checkpoint.load_file(folder / f"optim-stage{stage}.pt"))
            return
        _load_full_model(model, checkpoint.load_file(folder / "model.pt"))
        opt.load_state_dict(checkpoint.load_file(folder / "optim.pt"))


def _full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s state dict as the full (single-process) model's, on the CPU: expert stacks
    cut by `expert_parallelize` gathered over their ep group (`full_expert_state_dict`),
    tensor-parallel DTensors over their tp group. Collective over those groups."""
    from orthoptim.train.model import full_expert_state_dict

    cut = checkpoint.expert_slices(model)
    sd = full_expert_state_dict(model) if cut else model.state_dict()  # type: ignore[arg-type]
    return {k: collectives.unshard(v).detach().cpu() for k, v in sd.items()}


@torch.no_grad()
def _load_full_model(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load a full model's state dict into `model`, each rank taking its part: its expert
    stacks' slices (`load_expert_state_dict`), its shards of tensor-parallel DTensors."""
    from orthoptim.train.model import load_expert_state_dict

    if checkpoint.expert_slices(model):
        load_expert_state_dict(model, full)  # type: ignore[arg-type]
        return
    here = model.state_dict()
    model.load_state_dict(
        {
            k: collectives.cut_like(v.to(collectives.local_shard(here[k]).device), here[k])
            if k in here and collectives.is_dtensor(here[k])
            else v
            for k, v in full.items()
        }
    )


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


# What a run writes under --out (--overwrite removes these, and their ".tmp" leftovers); the
# first three mark a folder that holds a run.
RUN_FILES = ("metrics.jsonl", "result.json", "checkpoints", "logs")


LOCK_FILE = ".lock"


_log = logging.getLogger(__name__)


def _holds_run(out: Path) -> bool:
    return any((out / name).exists() for name in RUN_FILES[:3])


def held_run(out: Path) -> str | None:
    """The run `out` holds, in words ("checkpoint at step 10"), or None when it holds none
    (no metrics.jsonl, result.json or checkpoints/)."""
    if not _holds_run(out):
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _read_lock(path: Path) -> dict[str, Any] | None:
    """The lock's holder; None if the lock is gone. A holder between creating and writing the
    file is waited for (briefly, and not for a lock older than LOCK_WRITE_S); a lock that stays
    unreadable reads as {}."""
    for _ in range(20):
        try:
            holder = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            if (_age_s(path) or 0.0) > LOCK_WRITE_S:
                return {}
            time.sleep(0.05)
            continue
        return holder if isinstance(holder, dict) else {}
    return {}


# A run writes its lock's content right after creating it: a lock still without a holder
# this long after it was created was left by a process that crashed in between.
LOCK_WRITE_S = 10.0
LOCK_TIME_FORMAT = "%Y-%m-%dT%H:%M:%S%z"


def _age_s(path: Path) -> float | None:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return None


def _started_s(pid: int) -> float | None:
    """When process `pid` started (seconds since the epoch; Linux's /proc), or None."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _not_a_run(pid: int, holder: dict[str, Any]) -> str | None:
    """Why live process `pid` cannot be the run that wrote lock `holder` (it started after
    the lock was taken, or its command line is no Python's), or None when it may be."""
    with contextlib.suppress(ValueError, TypeError):
        when = datetime.datetime.strptime(str(holder.get("started")), LOCK_TIME_FORMAT)
        locked = when.timestamp()
        started = _started_s(pid)
        # Both are whole seconds (the boot time and the lock's), and the lock is taken after
        # its process starts: a process started later is another one.
        if started is not None and started > locked + 5:
            return f"it started at {time.strftime(LOCK_TIME_FORMAT, time.localtime(started))}"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    command = " ".join(a.decode(errors="replace") for a in argv if a)
    if command and not any(w in command.lower() for w in ("orthoptim", "python")):
        return f"it runs {command[:80]!r}"
    return None


def _remove_stale(path: Path, holder: dict[str, Any]) -> None:
    """Remove the stale lock `holder`, and only it: move it aside first, so that a lock
    another process has just put in its place is put back rather than removed."""
    aside = path.with_name(f"{path.name}.stale-{os.getpid()}")
    try:
        os.replace(path, aside)
    except FileNotFoundError:
        return
    if _read_lock(aside) != holder:
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    aside.unlink()


def acquire_lock(out: Path) -> Path:
    """Take `out/.lock` (created atomically; it holds this host, pid and start time) and
    return its path. A lock left by a process of this host that is no longer running is stale:
    taken over with a logged notice, and so is one still naming no holder LOCK_WRITE_S after
    it was created (its run crashed between creating and writing it). A live holder, or one on
    another host (whose liveness cannot be checked from here), is refused with a ValueError
    naming it; a live pid that cannot be the holder (`_not_a_run`: a pid reused after a
    restart) is refused saying so. A lock whose write fails (a full disk) is removed."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    host = socket.gethostname()
    me = dict(host=host, pid=os.getpid(), started=time.strftime(LOCK_TIME_FORMAT))
    for _ in range(5):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read_lock(path)
            if holder is None:  # released meanwhile
                continue
            who = (
                f"host {holder.get('host')}, pid {holder.get('pid')}, "
                f"started {holder.get('started')}"
            )
            if not {"host", "pid"} <= holder.keys():
                age = _age_s(path)
                if age is None or age < LOCK_WRITE_S:
                    raise ValueError(
                        f"--out {out} is locked ({path} unreadable); if no run is using the "
                        f"folder, remove {path}"
                    ) from None
                _log.warning(
                    "--out %s: taking over %s, empty or unreadable %.0f s after it was "
                    "created (its run crashed while taking it)", out, path, age,
                )  # fmt: skip
                _remove_stale(path, holder)
                continue
            if holder["host"] != host:
                raise ValueError(
                    f"--out {out} is in use by a run on another machine ({who}); its liveness "
                    f"cannot be checked from {host}: if that run is gone, remove {path}"
                ) from None
            if _pid_alive(int(holder["pid"])):
                other = _not_a_run(int(holder["pid"]), holder)
                if other is not None:
                    raise ValueError(
                        f"--out {out} is locked by pid {holder['pid']} ({who}), which is alive "
                        f"but is no orthoptim run: {other}. After a restart (of a container "
                        "or the machine) another process may have that pid; if no run is "
                        f"using the folder, remove {path}"
                    ) from None
                raise ValueError(
                    f"--out {out} is in use by another run ({who}); wait for it to end or "
                    "pass another --out"
                ) from None
            _log.warning("--out %s: taking over the stale lock of a run that is gone (%s)",
                         out, who)  # fmt: skip
            _remove_stale(path, holder)
            continue
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
        except OSError as e:
            path.unlink(missing_ok=True)  # never leave a lock that names no holder
            why = no_space(out) if is_disk_full(e) else e.strerror or str(e)
            raise ValueError(
                f"--out {out}: cannot write its lock {path} ({why}); free space there or pass "
                "another --out"
            ) from e
        return path
    raise ValueError(f"--out {out}: could not take {path}; other runs keep taking it")


def release_lock(path: Path) -> None:
    """Remove the lock at `path` if this process holds it."""
    holder = _read_lock(path)
    if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
        path.unlink(missing_ok=True)


def claim_out(args: TrainArgs, world_size: int, device_type: str) -> str | None:
    """Check what this run may do with --out (call with the lock held), before any rank
    trains on `device_type` ranks ("cpu" or "cuda"). A folder holding a run is refused unless
    --resume (the checkpoint must match this run) or --overwrite (its run's files are removed
    here). Returns a message when there is nothing to do: a resumed run whose checkpoint is at
    or past its last step."""
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
    return None


def nothing_to_do(out: Path, message: str) -> dict[str, Any]:
    """The result of a run that had nothing to do: the folder's result.json as it is (if any),
    with the message under "nothing_to_do"."""
    try:
        result = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        result = {}
    return dict(result, nothing_to_do=message)
