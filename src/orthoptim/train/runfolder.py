"""The output folder of a run: who may use it, what it holds, and its checkpoints.

Files under `out`:
    metrics.jsonl          one JSON line per step (rank 0); `val_loss` on evaluation steps
    result.json            the run's summary (rank 0), written at the end
    logs/rank{R}.log       every rank's log
    checkpoints/latest.json   the committed checkpoint: its step folder and metadata
    checkpoints/step_NNNNNN/  checkpoint.json (metadata, every file's size and SHA-256), and
                           model.pt and optim.pt (the full optimizer state), by rank 0; with
                           --fsdp dcp/, one torch.distributed.checkpoint of model and
                           optimizer shards
    .lock                  while a run is going: its host, pid and start time

An output folder belongs to one run (`claim_out`): a new run refuses a folder that holds one
unless `--resume` (continue it) or `--overwrite` (remove its files and start afresh) is given;
the lock keeps a second run out while one is going; resuming a finished run changes nothing.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from orthoptim import checkpoint, collectives
from orthoptim.train.args import TrainArgs


def atomic_write_text(text: str, path: Path) -> None:
    """Replace `path` with `text` at once: written aside to `path.tmp`, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


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
# (`Checkpointer._read`), the change named (`layout_change`).
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
    layout (`world_size`, --tp, --fsdp) is no mismatch: every checkpoint format loads at
    every layout `TrainArgs.validate` and `check_nproc` allow (`Checkpointer._read`).

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


CheckpointFormat = Literal["dcp", "full"]


def checkpoint_format(info: dict[str, Any]) -> CheckpointFormat:
    """How the checkpoint of record `info` was written, from the run that wrote it (not the
    one resuming it): "dcp" (`checkpoint.save_sharded` under dcp/) by a --tp > 1 or a
    multi-rank --fsdp run, else "full" (model.pt and optim.pt, the full state dicts)."""
    saved = TrainArgs.from_dict(info["args"])
    return "dcp" if saved.tp > 1 or (saved.fsdp and info["world_size"] > 1) else "full"


def layout_change(info: dict[str, Any], args: TrainArgs, world_size: int) -> str | None:
    """How a resumed run's layout differs from its checkpoint's, in words, or None when it
    does not: the changed flags, and the global batch (`--batch` sequences on each
    data-parallel rank, so it follows the data-parallel size nproc / tp), e.g. "--nproc 2 → 3:
    global batch 32 → 48 sequences (3 data-parallel ranks × --batch 16)"."""
    saved = TrainArgs.from_dict(info["args"])
    before, after = int(info["world_size"]), world_size
    flags = [f"--nproc {before} → {after}"] if before != after else []
    if saved.tp != args.tp:
        flags.append(f"--tp {saved.tp} → {args.tp}")
    if saved.fsdp != args.fsdp:
        flags.append("--fsdp on → off" if saved.fsdp else "--fsdp off → on")
    if not flags:
        return None
    dp_before, dp_after = before // saved.tp, after // args.tp
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
    being written is removed; the last committed checkpoint is intact."""


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


def _free_bytes(path: Path) -> int:
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(p).free
    return 0


@contextlib.contextmanager
def _writing(folder: Path, step: int, last_good: str) -> Iterator[None]:
    """Report a failed checkpoint write as a `CheckpointSaveError` that says why ("no space
    left on <folder>" when the disk is full: torch's own error only says "unexpected pos")
    and what is intact."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as exc:
        free = _free_bytes(folder)
        if getattr(exc, "errno", None) == errno.ENOSPC or free < FULL_BELOW_BYTES:
            why = f"no space left on {folder} ({free} bytes free)"
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
    which every rank loads on resume); `sharded` (FSDP2) or `tp` > 1: model and optimizer by
    `orthoptim.checkpoint.save_sharded` under `dcp/` (each rank writes its shards and what it
    owns; keys free of world and tp size). A checkpoint is read in the format its record says
    it was written in (`checkpoint_format`), at whatever layout the resuming run has."""

    def __init__(
        self,
        out: Path,
        rank: int,
        world_size: int,
        sharded: bool = False,
        tp: int = 1,
        keep: int = 2,
    ) -> None:
        self.dir = out / "checkpoints"
        self.rank, self.world_size, self.sharded, self.tp = rank, world_size, sharded, tp
        self.keep = keep

    def latest(self) -> dict[str, Any]:
        """The committed checkpoint's metadata; a clear error if there is none."""
        path = self.dir / "latest.json"
        if not path.exists():
            out = self.dir.parent
            advice = (
                f"--out {out} holds a run with no checkpoint to continue; pass --overwrite "
                "instead of --resume to replace it"
                if held_run(out)
                else f"--out {out} holds no run: drop --resume to start one there"
            )
            raise FileNotFoundError(
                f"--resume: no checkpoint in {self.dir} (latest.json is missing); {advice}"
            )
        return json.loads(path.read_text())

    def committed(self) -> list[dict[str, Any]]:
        """The records of the committed step folders, newest first: the one latest.json names
        and every older one with a record."""
        latest = self.latest()
        records = {latest["folder"]: latest}
        for path in self.dir.glob(f"step_*/{STEP_RECORD}"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                record = json.loads(path.read_text())
                if record["folder"] == path.parent.name and record["step"] < latest["step"]:
                    records[record["folder"]] = record
        return sorted(records.values(), key=lambda r: -r["step"])

    def save(self, step: int, model: nn.Module, opt: Any, meta: dict[str, Any]) -> None:
        """Write the checkpoint of `step` (collective: every rank calls it, with the
        optimizer's parameters current)."""
        folder = self.dir / f"step_{step:06d}"
        try:
            last_good = f"the last good checkpoint (step {self.latest()['step']}) is intact"
        except (FileNotFoundError, ValueError):
            last_good = "there is no earlier checkpoint"
        self._together(step, folder, last_good, lambda: self._write(folder, model, opt))

        def commit() -> None:
            if self.rank == 0:
                info = dict(meta, step=step, folder=folder.name, world_size=self.world_size)
                record = json.dumps(dict(info, files=_record_files(folder)), indent=1)
                atomic_write_text(record, folder / STEP_RECORD)
                atomic_write_text(record, self.dir / "latest.json")

        self._together(step, folder, last_good, commit)
        if self.rank == 0:
            self._prune(folder.name)
        collectives.barrier()

    def _together(self, step: int, folder: Path, last_good: str, work: Any) -> None:
        """Run this rank's part of a save; if it fails on any rank, every rank raises (the
        failing one its own `CheckpointSaveError`) and the uncommitted folder is removed."""
        error = None
        try:
            with _writing(folder, step, last_good):
                work()
        except CheckpointSaveError as exc:
            error = exc
        if collectives.sum_floats([float(error is not None)])[0]:
            if self.rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            raise error or CheckpointSaveError(
                f"could not save the checkpoint of step {step}: another rank failed to write "
                f"its part (see its error); {last_good}"
            )

    def _write(self, folder: Path, model: nn.Module, opt: Any) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self.tp > 1 or self.sharded:
            checkpoint.save_sharded(folder / "dcp", opt, model)
        else:
            optim = opt.state_dict()  # collective: the full dict, on rank 0 only
            if self.rank == 0:
                checkpoint.atomic_save(model.state_dict(), folder / "model.pt")
                checkpoint.atomic_save(optim, folder / "optim.pt")

    def _prune(self, newest: str) -> None:
        """Keep the newest `keep` committed step folders (`newest` among them)."""
        kept = [r["folder"] for r in self.committed()][: self.keep]
        for old in self.dir.glob("step_*"):
            if old.is_dir() and old.name not in (*kept, newest) and old.suffix != ".damaged":
                shutil.rmtree(old, ignore_errors=True)

    def load(self, model: nn.Module, opt: Any, args: TrainArgs, param_dtype: str) -> dict[str, Any]:
        """Load the newest intact committed checkpoint into `model` and `opt` (collective) and
        return its record, with "passed_over": what was skipped and why. Rank 0 checks the
        files against their record; every rank checks the model it loaded is finite.
        `param_dtype`: this run's (`check_resumable`)."""
        damaged: list[tuple[Path, str]] = []
        for info in self.committed():
            folder = self.dir / info["folder"]
            why = collectives.all_gather_object(damage(folder, info) if self.rank == 0 else None)
            if why[0] is not None:
                damaged.append((folder, why[0]))
                continue
            check_resumable(info, args, self.world_size, param_dtype)
            self._read(folder, model, opt, info)
            names = [n for n in collectives.all_gather_object(_first_nonfinite(model)) if n]
            if names:
                damaged.append((folder, f"the model holds NaN or inf ({names[0]})"))
                continue
            if self.rank == 0 and damaged:
                # the damaged folders kept aside (never loaded or pruned), this one committed
                for bad, _ in damaged:
                    with contextlib.suppress(OSError):
                        os.replace(bad, bad.with_name(bad.name + ".damaged"))
                atomic_write_text(json.dumps(info, indent=1), self.dir / "latest.json")
            collectives.barrier()
            return dict(info, passed_over=[f"{f.name}: {why}" for f, why in damaged])
        raise checkpoint.CheckpointLoadError(
            f"--resume: no intact checkpoint in {self.dir}: "
            + "; ".join(f"{f.name}: {why}" for f, why in damaged)
            + "; pass --overwrite instead of --resume to start the run afresh"
        )

    def _read(self, folder: Path, model: nn.Module, opt: Any, info: dict[str, Any]) -> None:
        """Load step folder `folder`, whose record is `info`, into this run's model and
        optimizer (collective), by the format the checkpoint was written in
        (`checkpoint_format`), whatever this run's world size, tp and sharding: a DCP
        checkpoint's keys are free of both, and each rank reads what it owns now; full dicts
        are read whole by every rank, which keeps what it owns (of a DTensor parameter, its
        shard)."""
        if checkpoint_format(info) == "dcp":
            checkpoint.load_sharded(folder / "dcp", opt, model)
            return
        here = model.state_dict()
        full = checkpoint.load_file(folder / "model.pt")
        model.load_state_dict(
            {
                k: collectives.cut_like(v.to(collectives.local_shard(here[k]).device), here[k])
                if k in here and collectives.is_dtensor(here[k])
                else v
                for k, v in full.items()
            }
        )
        opt.load_state_dict(checkpoint.load_file(folder / "optim.pt"))


def clean_leftovers(out: Path) -> list[str]:
    """Remove what an interrupted run left half-written under `out` (call with the lock held,
    before any rank starts): `*.tmp` and `*.tmp.PID` files and step folders that were never
    committed (no record, not named by latest.json). Returns what was removed."""
    removed = []
    ckpts = out / "checkpoints"
    named = (latest_record(out) or {}).get("folder")
    for path in sorted(ckpts.glob("step_*")):
        if path.is_dir() and path.name != named and not (path / STEP_RECORD).exists():
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    for path in [*out.glob("*.tmp"), *ckpts.rglob("*.tmp"), *ckpts.rglob("*.tmp.*")]:
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(str(path))
    return removed


# What a run writes under --out (--overwrite removes these, and their ".tmp" leftovers); the
# first three mark a folder that holds a run.
RUN_FILES = ("metrics.jsonl", "result.json", "checkpoints", "logs")


LOCK_FILE = ".lock"


_log = logging.getLogger(__name__)


def held_run(out: Path) -> str | None:
    """The run `out` holds, in words ("checkpoint at step 10"), or None when it holds none
    (no metrics.jsonl, result.json or checkpoints/)."""
    if not any((out / name).exists() for name in RUN_FILES[:3]):
        return None
    record = latest_record(out)
    return f"checkpoint at step {record['step']}" if record else "no checkpoint"


def latest_record(out: Path) -> dict[str, Any] | None:
    """The committed checkpoint's record (`checkpoints/latest.json`: its step, folder and
    metadata), or None when there is none or it cannot be read."""
    try:
        record = json.loads((out / "checkpoints" / "latest.json").read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "step" in record else None


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
    file is waited for (briefly); a lock that stays unreadable reads as {}."""
    for _ in range(20):
        try:
            holder = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            time.sleep(0.05)
            continue
        return holder if isinstance(holder, dict) else {}
    return {}


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
    taken over with a logged notice. A live holder, or one on another host (whose liveness
    cannot be checked from here), is refused with a ValueError naming it."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / LOCK_FILE
    host = socket.gethostname()
    me = dict(host=host, pid=os.getpid(), started=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
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
                raise ValueError(
                    f"--out {out} is locked ({path} unreadable); if no run is using the "
                    f"folder, remove {path}"
                ) from None
            if holder["host"] != host:
                raise ValueError(
                    f"--out {out} is in use by a run on another machine ({who}); its liveness "
                    f"cannot be checked from {host}: if that run is gone, remove {path}"
                ) from None
            if _pid_alive(int(holder["pid"])):
                raise ValueError(
                    f"--out {out} is in use by another run ({who}); wait for it to end or "
                    "pass another --out"
                ) from None
            _log.warning("--out %s: taking over the stale lock of a run that is gone (%s)",
                         out, who)  # fmt: skip
            _remove_stale(path, holder)
            continue
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
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
        info = Checkpointer(out, 0, world_size).latest()
        check_resumable(info, args, world_size, args.param_dtype_on(device_type))
        read_metrics(out / "metrics.jsonl")  # a damaged row is refused before any rank starts
        step, last = info["step"], args.stop_after or args.steps
        if step >= args.steps:
            return f"--out {out} finished at step {step}; nothing to do"
        if step >= last:
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
