"""Whether a run folder's checkpoint may be continued by this run, and with what: the flags
that must match, those a resumed run may change, the layout changes a checkpoint reshards to,
and the format a checkpoint was written in (`checkpoint_format`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from orthoptim.train.args import TrainArgs

RESUME_MUST_MATCH = (
    "optimizer", "elementwise", "config", "hf_config", "batch", "seed", "data", "steps",
    "warmup", "min_lr_ratio", "state_dtype", "global_batch", "reproducible",
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
    if saved.state_dtype == "bf16" and (args.fsdp or args.tp > 1):
        flag = "--fsdp" if args.fsdp else f"--tp {args.tp}"
        raise ValueError(
            f"--resume: this checkpoint holds bf16 optimizer state (--state-dtype bf16), which "
            f"cannot resume under {flag}: {flag} steps DTensor parameters and bf16 state takes "
            f"plain tensors, and fp32 state would not match the checkpoint; resume it without "
            f"{flag}"
        )
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
    does not: the changed flags, and the global batch: with --global-batch the same
    micro-batches, each rank's share of them following the data-parallel size, e.g.
    "--nproc 2 → 4: global batch unchanged (8 sequences; micro-batches per rank 2 → 1)";
    without it `--batch` sequences on each data-parallel rank, so it follows the
    data-parallel size nproc / (pp · tp), e.g. "--nproc 2 → 3: global batch 32 → 48
    sequences (3 data-parallel ranks × --batch 16)"."""
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
    if args.global_batch is not None:  # the checkpoint's too (`RESUME_MUST_MATCH`)
        micro = args.global_batch // args.batch
        share = f"micro-batches per rank {micro // dp_before} → {micro // dp_after}"
        same = dp_before == dp_after
        return ", ".join(flags) + (
            f": global batch unchanged ({args.global_batch} sequences"
            + ("" if same else f"; {share}")
            + ")"
        )
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


# What a run writes under --out (--overwrite removes these, and their ".tmp" leftovers); the
# first three mark a folder that holds a run.
RUN_FILES = ("metrics.jsonl", "result.json", "checkpoints", "logs")


def holds_run(out: Path) -> bool:
    """Whether `out` holds a run: its metrics.jsonl, result.json or checkpoints/."""
    return any((out / name).exists() for name in RUN_FILES[:3])
