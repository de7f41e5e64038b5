"""The training loop every rank runs, and the launcher that starts the ranks.

`run(args)` is one rank's whole job: build the model (same seed on every rank), the corpus and
the optimizer (the layer-wise distributed optimizer when there is more than one rank; with
`--fsdp` the model is sharded by FSDP2's `fully_shard` and `FSDPOptimizer` steps it), then
train with a warmup + cosine LR schedule, evaluate on a fixed validation set, write metrics,
checkpoints and a result file. `launch(args, nproc)` starts `nproc` ranks through PyTorch's
elastic launcher (the machinery behind `torchrun`) and returns rank 0's result.

Devices (`orthoptim.train.devices`): gloo ranks on CPU; on CUDA rank r on cuda:LOCAL_RANK over
NCCL, or with `--shared-gpu` every rank on cuda:0 over "cuda:gloo". Forward and loss run under
bf16 autocast with `--precision bf16` (the default on CUDA); parameters, gradients and
optimizer state stay fp32. `--compile` compiles each transformer block (`compile_blocks`).
Every collective the loop itself issues (metric sums and gathers, barriers) goes through
`orthoptim.parallel.collectives` with tensors on `collectives.device_for()`.

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
import math
import os
import resource
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from orthoptim import checkpoint
from orthoptim.optim.hybrid import build_optimizer
from orthoptim.optim.qk_clip import QKClip
from orthoptim.parallel import collectives
from orthoptim.parallel.fsdp import FSDPOptimizer, shard_model
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
from orthoptim.parallel.tensor_parallel import TensorParallelOrthogonalizer
from orthoptim.train import devices
from orthoptim.train.data import get_batch, load_corpus, val_batches
from orthoptim.train.devices import PRECISIONS, autocast, plan_ranks, resolve_precision
from orthoptim.train.model import (
    GPT,
    check_tensor_parallel,
    compile_blocks,
    get_config,
    parallelize,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

OPTIMIZERS = ("muon", "adamw", "soap")
# Learning rates tuned on the tiny config at compare's defaults (100 steps of 32 x 128 tokens;
# AdamW over {1.5e-3, 3e-3, 6e-3}, Muon over {0.02, 0.05, 0.1}, best final validation loss):
# the matrix optimizer's LR, and the AdamW LR used for everything under "adamw" and for
# embeddings / head / gains otherwise. SOAP's is AdamW's (it runs Adam in a rotated basis).
DEFAULT_LR = {"muon": 0.05, "adamw": 3e-3, "soap": 3e-3}
DEFAULT_ADAMW_LR = 3e-3


@dataclass
class TrainArgs:
    """Everything one training run needs; the CLI flags map one to one onto these fields."""

    optimizer: str = "muon"
    config: str = "tiny"
    steps: int = 200
    batch: int = 16  # sequences per rank per step
    lr: float | None = None  # None → DEFAULT_LR[optimizer]
    adamw_lr: float | None = None  # None → DEFAULT_ADAMW_LR (embeddings, head, gains)
    weight_decay: float = 0.0
    warmup: int = 10
    min_lr_ratio: float = 0.1
    eval_every: int = 10
    eval_batches: int = 8
    ckpt_every: int = 50
    out: str = "runs/train"
    resume: bool = False
    overwrite: bool = False  # remove the run --out holds and start afresh
    stop_after: int | None = None  # leave after this step (as if interrupted)
    seed: int = 0
    data: str | None = None
    tp: int = 1
    fsdp: bool = False  # shard the model with FSDP2 and step it with FSDPOptimizer
    qk_clip: float | None = None  # MuonClip τ; None → the config's default, 0 → off
    grad_clip: float = 1.0  # global gradient-norm clipping threshold; 0 → off
    precision: str = "auto"  # "bf16" autocast, "fp32", or "auto": bf16 on CUDA, fp32 on CPU
    compile: bool = False  # torch.compile every transformer block
    shared_gpu: bool = False  # every rank on cuda:0 over "cuda:gloo" (multi-rank tests, 1 GPU)
    progress: bool = True

    def validate(self) -> None:
        """Reject bad values up front, naming the flag."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        get_config(self.config)
        for name in ("steps", "batch", "eval_every", "eval_batches", "ckpt_every", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.qk_clip is not None and self.qk_clip < 0:
            raise ValueError(f"--qk-clip must be >= 0 (0: off), got {self.qk_clip}")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ValueError(
                f"--grad-clip must be a finite number >= 0 (0: off), got {self.grad_clip}"
            )
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        for name in ("lr", "adamw_lr"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
        if self.resume and self.overwrite:
            raise ValueError(
                "--resume continues the run in --out and --overwrite replaces it; pass one"
            )
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(
                f"--stop-after must be in [1, --steps={self.steps}], got {self.stop_after}"
            )
        if self.fsdp and self.optimizer == "soap":
            raise ValueError(
                "--fsdp runs --optimizer muon or adamw: FSDPOptimizer steps SOAP, but its "
                "owner-held SOAP state has no sharded (DCP) checkpoint yet; drop --fsdp to train "
                "SOAP with the layer-wise optimizer"
            )
        if self.compile and (self.fsdp or self.tp > 1):
            flag = "--fsdp" if self.fsdp else f"--tp {self.tp}"
            raise ValueError(
                f"--compile with {flag}: compiling blocks whose modules carry FSDP2's or tensor "
                "parallelism's hooks is not wired into `orthoptim train`; drop --compile (it "
                "runs with the layer-wise optimizer)"
            )
        if self.fsdp and self.qk_clip_tau is not None:
            raise ValueError(
                f"--fsdp does not run QK-clip yet (it would rescale rows of sharded q/k "
                f"weights); pass --qk-clip 0 with --config {self.config}"
            )
        if self.tp > 1:
            if self.fsdp:
                raise ValueError(
                    f"--fsdp with --tp {self.tp}: FSDP2 sharding of a tensor-parallel model is "
                    "not wired into `orthoptim train`; use one of them"
                )
            if self.optimizer != "muon":
                raise ValueError(
                    f"--tp {self.tp} runs with --optimizer muon (its Newton-Schulz is tensor-"
                    f"parallel), got --optimizer {self.optimizer}; use --tp 1 for it"
                )
            check_tensor_parallel(get_config(self.config), self.tp)
            if self.qk_clip_tau is not None:
                raise ValueError(
                    f"--tp {self.tp}: MuonClip (--qk-clip {self.qk_clip_tau}) rescales whole "
                    "query/key heads and does not run on tensor-parallel shards; pass --qk-clip 0"
                )

    def check_nproc(self, nproc: int) -> None:
        """Refuse a number of ranks the tensor-parallel size does not divide."""
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        if nproc % self.tp:
            raise ValueError(
                f"--nproc {nproc} must be a multiple of --tp {self.tp} (ranks form a "
                f"(data-parallel, tensor-parallel) mesh of nproc/tp × tp)"
            )

    @property
    def matrix_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    @property
    def qk_clip_tau(self) -> float | None:
        """The MuonClip threshold of this run (None: no clipping)."""
        tau = self.qk_clip if self.qk_clip is not None else get_config(self.config).qk_clip
        return tau or None

    @property
    def embed_lr(self) -> float:
        return self.adamw_lr if self.adamw_lr is not None else DEFAULT_ADAMW_LR

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def lr_multiplier(step: int, args: TrainArgs) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_lr_ratio` at `steps`."""
    if step <= args.warmup:
        return step / max(1, args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _optimizer_kwargs(args: TrainArgs) -> dict[str, Any]:
    if args.optimizer == "adamw":
        return dict(lr=args.matrix_lr, adamw_weight_decay=args.weight_decay)
    return dict(
        lr=args.matrix_lr,
        adamw_lr=args.embed_lr,
        weight_decay=args.weight_decay,
        adamw_weight_decay=args.weight_decay,
    )


def make_optimizer(
    model: nn.Module, args: TrainArgs, world_size: int, mesh: DeviceMesh | None = None
) -> Any:
    """The optimizer for this rank: `FSDPOptimizer` under --fsdp (the model already sharded);
    otherwise `build_optimizer` on one rank and, on more, the layer-wise distributed optimizer
    (each matrix, and each expert of a mixture of experts, owned whole by one rank). All of
    them route the same parameters to AdamW. With a (dp, tp) `mesh` the layer-wise optimizer
    owns over the dp group and orthogonalizes with a `TensorParallelOrthogonalizer` (auto
    mode: duplicated or distributed per shape, by its cost model)."""
    kwargs = _optimizer_kwargs(args)
    if args.fsdp:
        return FSDPOptimizer(model, optimizer=args.optimizer, **kwargs)
    if mesh is not None:
        return LayerwiseDistributedOptimizer(
            model,
            optimizer=args.optimizer,
            process_group=mesh["dp"].get_group(),
            orthogonalizer=TensorParallelOrthogonalizer(mode="auto"),
            **kwargs,
        )
    if world_size == 1:
        return build_optimizer(model, optimizer=args.optimizer, **kwargs)
    experts = get_config(args.config).moe is not None and args.optimizer != "adamw"
    return LayerwiseDistributedOptimizer(
        model, optimizer=args.optimizer, split_experts=experts, state_dict_to="rank0", **kwargs
    )


def clip_gradients(model: nn.Module, opt: Any, max_norm: float) -> float:
    """Clip the gradients by their global 2-norm and return the norm (before clipping): the
    distributed optimizers' `clip_grad_norm_` (gradients reduced to owners or sharded), else
    `torch.nn.utils.clip_grad_norm_` on the model's parameters (one process)."""
    method = getattr(opt, "clip_grad_norm_", None)
    if method is not None:
        return float(method(max_norm))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def _params_ready(opt: Any) -> None:
    """Wait for parameter gathers still in flight (before reading parameters outside forward)."""
    wait = getattr(opt, "wait_for_params", None)
    if wait is not None:
        wait()


def _comm_totals(opt: Any) -> tuple[float, float]:
    """(bytes sent, bytes received) by this rank in the optimizer's last step."""
    if not hasattr(opt, "comm_stats"):
        return 0.0, 0.0
    stats = opt.comm_stats()
    if isinstance(stats, collectives.CommStats):
        stats = stats.as_dict()
    total = stats.get("total")
    if total is None:
        total = {
            "sent": sum(v.get("sent", 0.0) for v in stats.values()),
            "received": sum(v.get("received", 0.0) for v in stats.values()),
        }
    return float(total["sent"]), float(total["received"])


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# The loop's own collectives: small float64 tensors on the device the process group's backend
# serves (CPU under gloo, this rank's GPU under NCCL or "cuda:gloo").


def _all_sum(values: list[float], world_size: int) -> list[float]:
    """`values` summed over the ranks."""
    if world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=collectives.device_for())
    collectives.all_reduce(t)
    return t.tolist()


def _all_gather_floats(values: list[float], world_size: int) -> list[list[float]]:
    """Every rank's `values`, in rank order."""
    if world_size == 1:
        return [list(values)]
    t = torch.tensor(values, dtype=torch.float64, device=collectives.device_for())
    out = t.new_empty(world_size * t.numel())
    collectives.all_gather(out, t)
    return out.view(world_size, -1).tolist()


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list,
    rank: int,
    world_size: int,
    lockstep: bool = False,
    precision: str = "fp32",
) -> float:
    """Mean validation loss over the fixed batches, split across ranks, in the run's
    `precision` ("bf16": under autocast, like training).

    `lockstep`: every rank runs the same number of forwards (a rank short of batches repeats
    one and ignores it), as a sharded model's forward is collective."""
    model.eval()
    total, count = 0.0, 0.0
    rounds = -(-len(batches) // world_size)
    for i in range(rounds):
        j = rank + i * world_size
        if j < len(batches):
            x, y = batches[j]
            with autocast(x.device, precision):
                loss = model(x, y)
            total += loss.item() * y.numel()
            count += y.numel()
        elif lockstep:
            with autocast(batches[0][0].device, precision):
                model(*batches[0])
    model.train()
    total, count = _all_sum([total, count], world_size)
    return total / count


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
        _params_ready(opt)
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


def _setup_logging(out: Path, rank: int) -> logging.Logger:
    (out / "logs").mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"orthoptim.train.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    handler = logging.FileHandler(out / "logs" / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(message)s"))
    log.addHandler(handler)
    return log


def _init_distributed(shared_gpu: bool = False) -> tuple[int, int, torch.device]:
    """Take this rank's device (`plan_ranks` over this machine's ranks: cuda:LOCAL_RANK, cuda:0
    with `shared_gpu`, or the CPU) and join the process group the launcher described in the
    environment (if any) with the plan's backend (NCCL, "cuda:gloo" or gloo)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    plan = plan_ranks(local_world, devices.visible_gpus(), shared_gpu)
    device = plan.device(local)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        # NCCL binds the rank to its GPU at init (no guessing the device of a barrier).
        bind = {"device_id": device} if plan.backend == "nccl" else {}
        dist.init_process_group(plan.backend, **bind)
    rank, world_size = collectives.world()
    if device.type == "cuda":
        return rank, world_size, device
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    return rank, world_size, torch.device("cpu")


def read_metrics(path: Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (those with step <= `upto` when given)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if upto is None or r["step"] <= upto]


# ---------------------------------------------------------------- the output folder

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


def run(args: TrainArgs) -> dict[str, Any]:
    """Train on this rank (joining the launcher's process group if there is one), as started
    by torchrun: rank 0 takes --out's lock and checks the folder (`claim_out`), every rank
    follows its verdict. (`launch` does that once, before starting the ranks.)

    Returns the run's summary (the content of result.json) on every rank.
    """
    args.validate()
    rank, world_size, _ = _init_distributed(args.shared_gpu)
    out = Path(args.out)
    lock, done, error = None, None, None
    if rank == 0:
        try:
            lock = acquire_lock(out)
            done = claim_out(args, world_size)
        except (ValueError, FileNotFoundError) as e:
            error = e
    # rank 0's verdict: 0 train, 1 nothing to do, 2 refused
    (verdict,) = _all_sum([float(2 if error else 1 if done else 0) if rank == 0 else 0.0],
                          world_size)  # fmt: skip
    try:
        if error is not None:
            raise error
        if verdict == 2:
            raise ValueError(f"rank 0 refused --out {out} (see its error)")
        if verdict == 1:
            return _nothing_to_do(out, done or f"--out {out}: nothing to do (see rank 0)")
        return _run_rank(args)
    finally:
        if lock is not None:
            release_lock(lock)


def _run_rank(args: TrainArgs) -> dict[str, Any]:
    """One rank's training, --out already checked."""
    args.validate()
    rank, world_size, device = _init_distributed(args.shared_gpu)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    collectives.barrier()
    log = _setup_logging(out, rank)
    try:
        return _train(args, rank, world_size, device, out, log)
    finally:
        for h in list(log.handlers):
            log.removeHandler(h)
            h.close()


def _train(
    args: TrainArgs,
    rank: int,
    world_size: int,
    device: torch.device,
    out: Path,
    log: logging.Logger,
) -> dict[str, Any]:
    cfg = get_config(args.config)
    corpus = load_corpus(args.data, min_bytes=cfg.seq_len + 1)
    log.info("corpus %s", corpus.describe())
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    args.check_nproc(world_size)
    if args.fsdp and world_size > 1:
        shard_model(model)
    mesh = None
    dp_rank, dp_size = rank, world_size
    if args.tp > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device.type, (world_size // args.tp, args.tp), mesh_dim_names=("dp", "tp")
        )
        parallelize(model, mesh["tp"])
        dp_rank, dp_size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    opt = make_optimizer(model, args, world_size, mesh)
    tau = args.qk_clip_tau
    clip = QKClip(model, tau=tau, optimizer=opt) if tau is not None else None
    precision = resolve_precision(args.precision, device.type)
    if args.compile:
        compile_blocks(model)  # in place: the optimizer's parameters and hooks stay as they are
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    val = [
        (x.to(device), y.to(device))
        for x, y in val_batches(corpus.val, args.eval_batches, args.batch, cfg.seq_len, args.seed)
    ]
    log.info(
        "model %s (%d params), optimizer %s%s, world size %d (tp %d), device %s (%s), "
        "precision %s%s",
        args.config,
        sum(p.numel() for p in model.parameters()),
        args.optimizer,
        " (FSDP2)" if args.fsdp else "",
        world_size,
        args.tp,
        device,
        collectives.backend_config() or "no process group",
        precision,
        ", blocks compiled" if args.compile else "",
    )

    ckpt = Checkpointer(out, rank, world_size, sharded=args.fsdp and world_size > 1, tp=args.tp)
    metrics_path = out / "metrics.jsonl"
    start, train_time = 0, 0.0
    if args.resume:
        info = ckpt.load(model, opt, args)
        start, train_time = info["step"], info["train_time_s"]
        log.info("resumed from step %d", start)
        # Allowed: the checkpoint holds fp32 parameters and optimizer state in either precision.
        if info.get("precision", "fp32") != precision:
            log.info("checkpoint trained in %s, continuing in %s", info.get("precision"), precision)
        if rank == 0:
            kept = read_metrics(metrics_path, upto=start)
            _atomic_write_text("".join(json.dumps(r) + "\n" for r in kept), metrics_path)
    elif rank == 0:
        metrics_path.write_text("")
    collectives.barrier()

    # The tp ranks of a data-parallel rank share its batch.
    tokens_per_step = args.batch * cfg.seq_len * dp_size
    last = args.stop_after or args.steps
    bar = None
    if rank == 0 and args.progress:
        from tqdm import tqdm

        bar = tqdm(
            total=args.steps,
            initial=start,
            desc=f"{args.optimizer}",
            unit="step",
            dynamic_ncols=True,
            mininterval=0.5,
        )
    metrics_file = open(metrics_path, "a") if rank == 0 else None  # noqa: SIM115
    val_loss = None
    if start == 0:
        _params_ready(opt)
        val_loss = evaluate(model, val, dp_rank, dp_size, args.fsdp, precision)
        if metrics_file:
            row0 = dict(step=0, val_loss=val_loss, train_time_s=0.0, tokens=0, precision=precision)
            metrics_file.write(json.dumps(row0) + "\n")
            metrics_file.flush()
    comm = (0.0, 0.0)
    try:
        for step in range(start + 1, last + 1):
            mult = lr_multiplier(step, args)
            for g in opt.param_groups:
                g["lr"] = g["initial_lr"] * mult
            x, y = get_batch(corpus.train, args.batch, cfg.seq_len, args.seed, step, dp_rank)
            x, y = x.to(device), y.to(device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            if args.compile:
                # Compiled blocks trace the optimizer's forward pre-hooks: finish the parameter
                # gathers here, so the hooks find nothing to do and no graph recompiles. (Under
                # NCCL the last step's loss all-reduce, queued behind the gathers, has waited
                # for them already: only their copy into the parameters moves out of forward.)
                _params_ready(opt)
            with autocast(device, precision):
                loss = model(x, y)
            loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t1 = time.perf_counter()
            norm = clip_gradients(model, opt, args.grad_clip) if args.grad_clip > 0 else None
            opt.step()
            opt.zero_grad(set_to_none=True)
            clipped = clip.step() if clip is not None else {}
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            train_time += t2 - t0
            comm = _comm_totals(opt)
            (train_loss,) = _all_sum([loss.item() / world_size], world_size)
            if not math.isfinite(train_loss):
                raise FloatingPointError(
                    f"training loss is {train_loss} at step {step}; lower --lr"
                )
            row: dict[str, Any] = dict(
                step=step,
                train_loss=train_loss,
                lr=opt.param_groups[0]["lr"],
                step_time_s=t2 - t0,
                opt_time_s=t2 - t1,
                train_time_s=train_time,
                tokens=step * tokens_per_step,
                comm_sent_bytes=comm[0],
                comm_received_bytes=comm[1],
                precision=precision,
                **clipped,
            )
            if norm is not None:
                row["grad_norm"] = norm
            if step - start <= COLD_STEPS:
                row["cold"] = True
            if step % args.eval_every == 0 or step == args.steps:
                _params_ready(opt)
                val_loss = evaluate(model, val, dp_rank, dp_size, args.fsdp, precision)
                row["val_loss"] = val_loss
                log.info("step %d train %.4f val %.4f", step, train_loss, val_loss)
            if metrics_file:
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
            if bar is not None:
                bar.set_postfix(
                    loss=f"{train_loss:.3f}",
                    val=f"{val_loss:.3f}" if val_loss is not None else "-",
                    tok_s=f"{tokens_per_step / (t2 - t0):,.0f}",
                )
                bar.update(1)
            if step % args.ckpt_every == 0 or step == last:
                meta = dict(args=args.to_dict(), train_time_s=train_time, precision=precision)
                ckpt.save(step, model, opt, meta)
                log.info("checkpoint at step %d", step)
    finally:
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()

    peaks = _all_gather_floats([float(peak_memory_bytes(device))], world_size)
    comms = _all_gather_floats(list(comm), world_size)
    result = dict(
        args=args.to_dict(),
        model=cfg.as_dict(),
        world_size=world_size,
        device=str(device),
        backend=collectives.backend_config() or None,
        precision=precision,
        compiled=args.compile,
        threads_per_rank=torch.get_num_threads(),
        tokens_per_step=tokens_per_step,
        last_step=last,
        final_val_loss=val_loss,
        peak_memory_bytes_per_rank=[p[0] for p in peaks],
        comm_sent_bytes_per_step_per_rank=[c[0] for c in comms],
        comm_received_bytes_per_step_per_rank=[c[1] for c in comms],
        optimizer_class=type(opt).__name__,
    )
    result.update(throughput(read_metrics(metrics_path) if rank == 0 else [], tokens_per_step))
    if rank == 0:
        _atomic_write_text(json.dumps(result, indent=1), out / "result.json")
    log.info("done: %s", json.dumps({k: result[k] for k in ("last_step", "final_val_loss")}))
    collectives.barrier()
    return result


# The first steps a process runs pay one-off costs (allocations, first collectives): their
# rows are marked "cold" and left out of the throughput.
COLD_STEPS = 2


def throughput(rows: list[dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    """Median step time, tokens/s and the optimizer's share of step time over the run's
    steps, leaving out the cold ones (the first COLD_STEPS after each start or resume)
    unless nothing else is left."""
    steps = [r for r in rows if "step_time_s" in r]
    steps = [r for r in steps if not r.get("cold")] or steps
    if not steps:
        return {}
    step_times = sorted(r["step_time_s"] for r in steps)
    opt_times = sorted(r["opt_time_s"] for r in steps)
    median = step_times[len(step_times) // 2]
    return dict(
        median_step_time_s=median,
        median_optimizer_time_s=opt_times[len(opt_times) // 2],
        tokens_per_s=tokens_per_step / median,
        optimizer_share=sum(opt_times) / sum(step_times),
    )


def _elastic_entry(args_dict: dict[str, Any]) -> dict[str, Any]:
    """What each rank started by `launch` runs (module level, so it pickles)."""
    try:
        return _run_rank(TrainArgs.from_dict(args_dict))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(args: TrainArgs, nproc: int | None = None) -> dict[str, Any]:
    """Start `nproc` ranks on this machine through torch's elastic launcher and wait for them.

    `nproc` None: one per visible GPU, or 2 on CPU (or with --shared-gpu); more ranks than
    GPUs are refused here, before anything starts (`plan_ranks`), and so is an --out another
    run holds or uses (`acquire_lock`, `claim_out`; the lock is held until the ranks end). One
    rank runs in this process with no process group. Returns rank 0's result; with nothing to
    do (resuming a finished run) the folder's result.json untouched, plus "nothing_to_do".
    """
    args.validate()
    nproc = plan_ranks(nproc, devices.visible_gpus(), args.shared_gpu).nproc
    args.check_nproc(nproc)
    out = Path(args.out)
    created = not out.exists()
    lock = acquire_lock(out)
    try:
        done = claim_out(args, nproc)
        if done is not None:
            return _nothing_to_do(out, done)
        # A bad --data fails here, once, before any rank starts.
        load_corpus(args.data, min_bytes=get_config(args.config).seq_len + 1)
        return _launch_ranks(args, nproc)
    finally:
        release_lock(lock)
        if created:  # a refused run leaves no empty folder behind
            with contextlib.suppress(OSError):
                out.rmdir()


def _launch_ranks(args: TrainArgs, nproc: int) -> dict[str, Any]:
    if nproc == 1:
        return _run_rank(args)
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"orthoptim-{os.getpid()}-{time.time_ns()}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    # Ranks share this machine's cores; one thread each unless the user set OMP_NUM_THREADS.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = saved or str(max(1, (os.cpu_count() or 1) // nproc))
    try:
        results = elastic_launch(config, _elastic_entry)(args.to_dict())
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
    return results[0]
