"""`orthoptim verify`: the same short training at several layouts, compared bit for bit.

Each layout is a subprocess `orthoptim train --nproc N` into its own folder; with
`--resume-from-nproc A` a run at A stopped halfway is also resumed at every size and compared
with the uninterrupted run at A. For every pair the final weights (the last checkpoint's
model.pt), the optimizer state (optim.pt, where both runs store it alike) and each
deterministic figure of metrics.jsonl are compared on their bits: the largest |difference|
and the number of differing elements. Exit status 0 iff all are bitwise equal, 1 if any
differ, 2 when a layout is refused or a run fails.

Outside the comparison (and the guarantee): the wall-clock figures, the bytes on the wire and
the optimizer telemetry (`OUTSIDE_GUARANTEE`).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from orthoptim.safe_load import load_file
from orthoptim.train import devices
from orthoptim.train.args import TrainArgs
from orthoptim.train.runfolder import read_metrics

# metrics.jsonl fields verify leaves out: wall-clock times, the bytes each rank sent (they
# follow the layout), the optimizer telemetry (per-rank timings and bytes among it) and the
# rows a process started on ("cold", which a resume moves).
OUTSIDE_GUARANTEE = (
    "step_time_s", "opt_time_s", "train_time_s", "comm_sent_bytes", "comm_received_bytes",
    "telemetry", "cold",
)  # fmt: skip
# TrainArgs fields verify sets itself for each run, and those a flag does not spell alike.
OWN_FIELDS = ("out", "resume", "overwrite", "stop_after", "progress")
EXIT_EQUAL, EXIT_DIFFERENT, EXIT_REFUSED = 0, 1, 2


@dataclass
class Difference:
    """One compared quantity of a pair of runs: its largest |difference| and how many of its
    elements differ in their bits (`missing`: present in one run only)."""

    what: str
    max_abs: float
    differing: int
    total: int
    missing: bool = False

    @property
    def equal(self) -> bool:
        return not self.differing and not self.missing


def train_flags(args: TrainArgs) -> list[str]:
    """`args` as `orthoptim train` flags (those that differ from the defaults), without the
    ones verify sets for each run (`OWN_FIELDS`)."""
    default, flags = TrainArgs(), []
    for f in fields(TrainArgs):
        value = getattr(args, f.name)
        if f.name in OWN_FIELDS or value == getattr(default, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        flags += [flag] if isinstance(value, bool) else [flag, str(value)]
    return flags


def float_bits(value: float) -> bytes:
    """A float's float64 bits (what a metrics row holds)."""
    return struct.pack("<d", value)


def tensor_bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bits as integers of its element size (floats; others as they are)."""
    t = t.detach().cpu().contiguous()
    if t.is_floating_point():
        return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    return t


def compare_tensors(what: str, a: dict[str, Any], b: dict[str, Any]) -> Difference:
    """Every tensor of two flat {name: tensor} dicts on their bits (a name or shape in one
    only is `missing`)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return Difference(what, math.nan, 0, 0, missing=True)
    worst, differing, total = 0.0, 0, 0
    for k in a:
        bits = tensor_bits(a[k]) != tensor_bits(b[k])
        differing += int(bits.sum())
        total += a[k].numel()
        if bits.any():
            gap = (a[k].double() - b[k].double()).abs().max().item()
            worst = gap if math.isnan(gap) else max(worst, gap)
    return Difference(what, worst, differing, total)


def compare_metrics(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> list[Difference]:
    """Each numeric field of two runs' metrics rows outside `OUTSIDE_GUARANTEE`, step by step:
    one `Difference` per field over the steps (a step or field in one run only is
    `missing`)."""
    rows_a, rows_b = ({r["step"]: r for r in rows} for rows in (a, b))
    names = sorted(
        {
            k
            for r in [*a, *b]
            for k, v in r.items()
            if k not in OUTSIDE_GUARANTEE and isinstance(v, (int, float)) and k != "step"
        }
    )
    out = []
    for name in names:
        worst, differing, total, missing = 0.0, 0, 0, rows_a.keys() != rows_b.keys()
        for step in sorted(rows_a.keys() & rows_b.keys()):
            x, y = rows_a[step].get(name), rows_b[step].get(name)
            if x is None and y is None:
                continue
            if x is None or y is None:
                missing = True
                continue
            total += 1
            if float_bits(float(x)) != float_bits(float(y)):
                differing += 1
                worst = max(worst, abs(float(x) - float(y)))
        out.append(Difference(name, worst, differing, total, missing))
    return out


def flat_tensors(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(path, tensor) for every tensor in nested dicts and lists."""
    if torch.is_tensor(obj):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from flat_tensors(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from flat_tensors(v, f"{prefix}/{i}")


def final_checkpoint(out: Path) -> Path:
    """The folder of a run's last checkpoint (every run checkpoints its last step)."""
    record = json.loads((out / "checkpoints" / "latest.json").read_text())
    return out / "checkpoints" / record["folder"]


def compare_runs(a: Path, b: Path) -> list[Difference]:
    """Two run folders: final weights, optimizer state and metrics, on their bits."""
    fa, fb = final_checkpoint(a), final_checkpoint(b)
    out = [compare_tensors("weights", load_file(fa / "model.pt"), load_file(fb / "model.pt"))]
    sa, sb = (dict(flat_tensors(load_file(f / "optim.pt")["state"])) for f in (fa, fb))
    state = compare_tensors("optimizer state", sa, sb)
    if not state.missing:  # stored alike (the same driver); else not comparable: left out
        out.append(state)
    return out + compare_metrics(
        read_metrics(a / "metrics.jsonl"), read_metrics(b / "metrics.jsonl")
    )


def render(pair: str, diffs: list[Difference]) -> list[str]:
    """The lines of one pair's comparison."""
    lines = [pair]
    for d in diffs:
        if d.missing:
            lines.append(f"  {d.what:18s} MISSING in one run (or stored differently)")
            continue
        verdict = "bitwise equal" if d.equal else "DIFFERENT"
        lines.append(
            f"  {d.what:18s} max|Δ| {d.max_abs:<10.3g} differing {d.differing:>9,} of "
            f"{d.total:<9,} {verdict}"
        )
    return lines


def header(args: TrainArgs, sizes: list[int], resume_from: int | None) -> list[str]:
    """What a verify checks, and what the guarantee leaves out."""
    shares = ", ".join(f"--nproc {n}: {args.accumulation(n)}" for n in sizes)
    resumed = (
        f"yes: a run at --nproc {resume_from} stopped after step {args.steps // 2}, resumed at "
        f"each size, against the uninterrupted --nproc {resume_from} run"
        if resume_from is not None
        else "no (--resume-from-nproc A to check one)"
    )
    mode = "on" if args.reproducible else "OFF (the default mode: differences expected)"
    return [
        f"orthoptim verify: --config {args.config}, {args.steps} steps, global batch "
        f"{args.global_batch_at(sizes[0])} sequences of --batch {args.batch}"
        + ("" if args.global_batch else " per rank (no --global-batch: it follows --nproc)"),
        f"  --reproducible {mode}; sizes {', '.join(map(str, sizes))}",
        f"  micro-batches per rank: {shares}",
        f"  resume at another size: {resumed}",
        "  compared on their bits: the final weights, the optimizer state (where stored alike) "
        "and every metrics.jsonl figure but " + ", ".join(OUTSIDE_GUARANTEE),
        "  outside the guarantee: those figures (wall-clock, bytes, telemetry), another "
        "hardware type, library versions or thread count, --tp/--ep/--pp/--fsdp/--compile",
    ]


def run_train(args: TrainArgs, nproc: int, out: Path, extra: list[str]) -> None:
    """`orthoptim train` at `nproc` ranks into `out`, as a subprocess; a failure raises
    RuntimeError with the end of its output."""
    cmd = [sys.executable, "-m", "orthoptim", "train", "--nproc", str(nproc)]
    cmd += ["--out", str(out), "--no-progress", *train_flags(args), *extra]
    print(f"verify: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"--nproc {nproc} failed ({done.returncode}): {' | '.join(tail)}")


def run_layouts(
    args: TrainArgs, sizes: list[int], resume_from: int | None, root: Path
) -> dict[str, Path]:
    """Every run verify compares, by label ("--nproc N"; "--nproc A→N resumed")."""
    runs = {}
    for n in sizes:
        runs[f"--nproc {n}"] = root / f"nproc{n}"
        run_train(args, n, root / f"nproc{n}", [])
    if resume_from is not None:
        half = root / f"nproc{resume_from}-half"
        run_train(args, resume_from, half, ["--stop-after", str(max(1, args.steps // 2))])
        for n in sizes:
            folder = root / f"nproc{resume_from}-to-{n}"
            shutil.copytree(half, folder)
            run_train(args, n, folder, ["--resume"])
            runs[f"--nproc {resume_from}→{n} resumed"] = folder
    return runs


def verify(args: TrainArgs, sizes: list[int], resume_from: int | None, root: Path) -> int:
    """Run, compare, print; the exit status (`EXIT_EQUAL` iff all are bitwise equal)."""
    print("\n".join(header(args, sizes, resume_from)), flush=True)
    runs = run_layouts(args, sizes, resume_from, root)
    labels = list(runs)
    pairs = list(itertools.combinations(labels[: len(sizes)], 2))
    if resume_from is not None:
        pairs += [(f"--nproc {resume_from}", label) for label in labels[len(sizes) :]]
    equal = True
    for a, b in pairs:
        diffs = compare_runs(runs[a], runs[b])
        equal &= all(d.equal for d in diffs)
        print("\n".join(render(f"{a} vs {b}:", diffs)), flush=True)
    print("verify: all bitwise equal" if equal else "verify: DIFFERENCES found (see above)")
    return EXIT_EQUAL if equal else EXIT_DIFFERENT


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes sizes like 1,2,4, got {text!r}") from None
    if not sizes:
        raise argparse.ArgumentTypeError(f"takes at least one size, got {text!r}")
    return sizes


def _cmd(ns: argparse.Namespace) -> int:
    from orthoptim.train.cli import train_args_from

    args = train_args_from(ns)
    sizes = ns.nproc
    try:
        if args.resume or args.overwrite or args.stop_after is not None:
            raise ValueError(
                "verify runs each layout from scratch in a folder of its own; drop --resume, "
                "--overwrite and --stop-after (--resume-from-nproc A checks a resume)"
            )
        if len(sizes) + (ns.resume_from_nproc is not None) < 2:
            raise ValueError(
                f"--nproc {sizes[0]} alone compares nothing; pass two sizes or more "
                "(--nproc 1,2,4) or --resume-from-nproc A"
            )
        args.validate()
        kind = "cuda" if devices.visible_gpus() and not args.shared_gpu else "cpu"
        for n in [*sizes, *([ns.resume_from_nproc] if ns.resume_from_nproc else [])]:
            args.check_nproc(n, kind)
    except ValueError as e:
        print(f"orthoptim: error: {e}", file=sys.stderr)
        return EXIT_REFUSED
    keep = Path(ns.keep) if ns.keep else None
    root = keep or Path(tempfile.mkdtemp(prefix="orthoptim-verify-"))
    try:
        return verify(args, sizes, ns.resume_from_nproc, root)
    except RuntimeError as e:
        print(f"orthoptim: error: {e}; runs kept under {root}", file=sys.stderr)
        keep = root
        return EXIT_REFUSED
    finally:
        if keep is None:
            shutil.rmtree(root, ignore_errors=True)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim verify`."""
    from orthoptim.train.cli import add_train_arguments

    p = subparsers.add_parser(
        "verify",
        help="train the same short run at several --nproc and compare the results bit for bit",
        description="Runs `orthoptim train` with the given flags at each --nproc (each into "
        "a folder of its own) and prints, per pair, the largest |difference| and the number "
        "of differing elements (bitwise) of the final weights, the optimizer state and each "
        "deterministic metrics.jsonl figure. Exit 0 iff all are bitwise equal, 1 if any "
        "differ, 2 when a layout is refused or a run fails.",
    )
    p.add_argument(
        "--nproc",
        type=_sizes,
        default=[1, 2, 4],
        metavar="N,N,...",
        help="the sizes to compare (default 1,2,4)",
    )
    p.add_argument(
        "--resume-from-nproc",
        type=int,
        default=None,
        metavar="A",
        help="also stop a run at --nproc A after half the steps, resume it at every size and "
        "compare each with the uninterrupted run at A",
    )
    p.add_argument(
        "--keep",
        default=None,
        metavar="DIR",
        help="write the runs under DIR and keep them (default: a temporary folder, removed)",
    )
    add_train_arguments(p)
    p.set_defaults(func=_cmd)
