"""Checkpoints a run can trust (`Checkpointer`): written aside and committed by their sealed
records (`orthoptim.train.records`), loaded from the newest intact one, a failed save said and
cleaned up."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from orthoptim import checkpoint, collectives
from orthoptim.parallel.layout import ParallelDims
from orthoptim.shards import cut_like, is_dtensor, local_shard
from orthoptim.train.args import TrainArgs
from orthoptim.train.diskfull import (
    FULL_BELOW_BYTES,
    CheckpointSaveError,
    free_bytes,
    is_disk_full,
    no_space,
)
from orthoptim.train.records import (
    STEP_FOLDER,
    STEP_RECORD,
    damage,
    disagreement,
    read_record,
    record_files,
    write_record,
)
from orthoptim.train.resume import (
    CheckpointFormat,
    check_resumable,
    checkpoint_format,
    holds_run,
)

# Step folders passed over as damaged are renamed `*.damaged` for inspection; the newest
# this many (by step) are kept, older ones removed after the next save.
DAMAGED_KEPT = 2


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
        free = free_bytes(folder)
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
        local = local_shard(t)
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

    Formats, by the run's parallel sizes `dims`: `model.pt` and `optim.pt` (the optimizer's
    full state dict, gathered to rank 0, which every rank loads on resume); `sharded` (FSDP2)
    or tp > 1: model and optimizer by `orthoptim.checkpoint.save_sharded` under `dcp/` (each
    rank writes its shards and what it owns; keys free of world and tp size). Pipeline
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
        dims: ParallelDims | None = None,
    ) -> None:
        self.dir = out / "checkpoints"
        self.rank, self.world_size = rank, world_size
        self.keep = keep
        self.dims = dims or ParallelDims(dp=world_size)
        self._format = self._format_of(self.dims, sharded)

    @staticmethod
    def _format_of(dims: ParallelDims, sharded: bool) -> CheckpointFormat:
        """The format a run of parallel sizes `dims` writes its checkpoints in (see the class)."""
        if dims.pp > 1 or dims.ep > 1:
            return "stages"
        return "dcp" if dims.tp > 1 or sharded else "full"

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
                keys = disagreement(latest, own)
                if not keys:
                    return latest
                why = f"disagrees with {latest['folder']}/{STEP_RECORD} ({', '.join(keys)})"
        records, _ = self._step_records()
        if records:
            self.notices.append(f"checkpoints/latest.json, which {why}")
            return records[0]
        out = self.dir.parent
        if holds_run(out):
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
                record = dict(info, files=record_files(folder))
                write_record(record, folder / STEP_RECORD)
                write_record(record, self.dir / "latest.json")

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
        coord = self.dims.coordinate(self.rank)
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
                write_record(info, self.dir / "latest.json")
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
        stage = self.dims.coordinate(self.rank).pp
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
            k: cut_like(v.to(local_shard(here[k]).device), here[k])
            if k in here and is_dtensor(here[k])
            else v
            for k, v in full.items()
        }
    )
