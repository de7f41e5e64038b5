"""The output folder of a run: who may use it, what it holds, and its checkpoints.

Files under `out`:
    metrics.jsonl          one JSON line per step (rank 0); `val_loss` on evaluation steps
    result.json            the run's summary (rank 0), written at the end
    logs/rank{R}.log       every rank's log
    checkpoints/latest.json   the committed checkpoint: its step folder and metadata
    checkpoints/step_NNNNNN/  model.pt and optim.pt (the full optimizer state), by rank 0; with
                           --fsdp dcp/, one torch.distributed.checkpoint of model and
                           optimizer shards
    .lock                  while a run is going: its host, pid and start time

An output folder belongs to one run (`claim_out`): a new run refuses a folder that holds one
unless `--resume` (continue it) or `--overwrite` (remove its files and start afresh) is given;
the lock keeps a second run out while one is going; resuming a finished run changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orthoptim import checkpoint
from orthoptim.parallel import collectives
from orthoptim.train.args import TrainArgs


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_metrics(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (those with step <= `upto` when given)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if upto is None or r["step"] <= upto]


RESUME_MUST_MATCH = ("optimizer", "config", "batch", "seed", "data", "steps", "tp", "fsdp")


def check_resumable(info: dict[str, Any], args: TrainArgs, world_size: int) -> None:
    """Refuse to resume a checkpoint of a different run, listing every mismatch."""
    saved = dict(TrainArgs().to_dict(), **info["args"])  # flags newer than the checkpoint
    mismatched = [
        f"--{k}: checkpoint {saved[k]!r}, now {getattr(args, k)!r}"
        for k in RESUME_MUST_MATCH
        if saved[k] != getattr(args, k)
    ]
    if info["world_size"] != world_size:
        mismatched.append(f"--nproc: checkpoint {info['world_size']}, now {world_size}")
    if mismatched:
        raise ValueError(
            "--resume: the checkpoint does not match this run: " + "; ".join(mismatched)
        )


class Checkpointer:
    """Atomic checkpoints: every file is written aside and renamed, then `latest.json` (the
    commit point) is replaced to name the new step folder; older folders are removed after.
    A step folder holds `model.pt` and `optim.pt`, the optimizer's full state dict (gathered
    to rank 0), which every rank loads on resume.

    `sharded`: model and optimizer are FSDP2 shards, saved and loaded together with
    torch.distributed.checkpoint (each rank writes its own shards). Under tensor parallelism
    (`tp` > 1) model and optimizer go through `orthoptim.checkpoint.save_sharded` (DCP, each
    tp rank its DTensor shards; keys free of world and tp size)."""

    def __init__(
        self, out: Path, rank: int, world_size: int, sharded: bool = False, tp: int = 1
    ) -> None:
        self.dir = out / "checkpoints"
        self.rank, self.world_size, self.sharded, self.tp = rank, world_size, sharded, tp

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

    def save(self, step: int, model: nn.Module, opt: Any, meta: dict[str, Any]) -> None:
        folder = self.dir / f"step_{step:06d}"
        if self.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        collectives.barrier()
        if self.tp > 1:
            checkpoint.save_sharded(folder / "dcp", opt, model)
        elif self.sharded:
            import torch.distributed.checkpoint as dcp

            dcp.save(_sharded_state(model, opt), checkpoint_id=folder / "dcp")
        else:
            optim = opt.state_dict()  # collective: the full dict, on rank 0 only
            if self.rank == 0:
                _atomic_save(model.state_dict(), folder / "model.pt")
                _atomic_save(optim, folder / "optim.pt")
        collectives.barrier()
        if self.rank == 0:
            info = dict(meta, step=step, folder=folder.name, world_size=self.world_size)
            _atomic_write_text(json.dumps(info, indent=1), self.dir / "latest.json")
            for old in self.dir.glob("step_*"):
                if old.name != folder.name:
                    shutil.rmtree(old, ignore_errors=True)
        collectives.barrier()

    def load(self, model: nn.Module, opt: Any, args: TrainArgs) -> dict[str, Any]:
        info = self.latest()
        check_resumable(info, args, self.world_size)
        folder = self.dir / info["folder"]
        if self.tp > 1:
            checkpoint.load_sharded(folder / "dcp", opt, model)
            return info
        if self.sharded:
            import torch.distributed.checkpoint as dcp

            state = _sharded_state(model, opt)
            dcp.load(state, checkpoint_id=folder / "dcp")
            model.load_state_dict(state["model"])
            opt.load_sharded_state_dict(state["optim"])
            return info
        model.load_state_dict(torch.load(folder / "model.pt", weights_only=True))
        # every rank reads the full dict and keeps the state of what it owns
        opt.load_state_dict(torch.load(folder / "optim.pt", weights_only=False))
        return info


def _sharded_state(model: nn.Module, opt: Any) -> dict[str, Any]:
    """The DCP layout of a sharded run: the model's and the optimizer's DTensor shards."""
    return {"model": model.state_dict(), "optim": opt.sharded_state_dict()}


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
    try:
        step = json.loads((out / "checkpoints" / "latest.json").read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no checkpoint"
    return f"checkpoint at step {step}"


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


def claim_out(args: TrainArgs, world_size: int) -> str | None:
    """Check what this run may do with --out (call with the lock held), before any rank
    trains. A folder holding a run is refused unless --resume (the checkpoint must match this
    run) or --overwrite (its run's files are removed here). Returns a message when there is
    nothing to do: a resumed run whose checkpoint is at or past its last step."""
    out = Path(args.out)
    if args.resume:
        info = Checkpointer(out, 0, world_size).latest()
        check_resumable(info, args, world_size)
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


def _nothing_to_do(out: Path, message: str) -> dict[str, Any]:
    """The result of a run that had nothing to do: the folder's result.json as it is (if any),
    with the message under "nothing_to_do"."""
    try:
        result = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        result = {}
    return dict(result, nothing_to_do=message)
