"""The training loop every rank runs.

`train(args, ...)` is one rank's whole job: build the model (same seed on every rank), the
corpus and the optimizer (the layer-wise distributed optimizer when there is more than one
rank; with `--fsdp` the model is sharded by FSDP2's `fully_shard` and `FSDPOptimizer` steps
it), then train with a warmup + cosine LR schedule, evaluate on a fixed validation set, write
metrics, checkpoints and a result file (`orthoptim.train.runfolder`). Ranks are started by
`orthoptim.train.launcher`.

Parallel layout (`TrainArgs.layout`, one `ParallelMesh` built on every rank): --tp splits the
GPT's matrices over the tp group (`parallelize`), --ep keeps E/ep experts per rank and
dispatches tokens over the ep group (`expert_parallelize`), --pp keeps this rank's stage of
the blocks (`split_stage`) and steps it through a 1F1B or GPipe schedule over micro-batches
(`PipelineRunner`), training and evaluation alike. Each data-parallel index of a stage
trains on its block of the step's global micro-batches (`orthoptim.train.microbatch`; one,
(seed, step, index), without --global-batch), which its tp ranks and its stages share; the
logged loss is the mean over the micro-batches (under --reproducible summed in global
order). The layer-wise optimizer takes the
layout: dense weights over the stage's dp group, experts over their expert group, the
gradient norm and the non-finite agreement over every stage.

Devices (`orthoptim.train.devices`): gloo ranks on CPU; on CUDA rank r on cuda:LOCAL_RANK over
NCCL, or with `--shared-gpu` every rank on cuda:0 over "cuda:gloo". Forward and loss run under
bf16 autocast with `--precision bf16` (the default on CUDA); parameters, gradients and
optimizer state stay fp32. `--param-dtype bf16` (the default on CUDA) holds the parameters
forward and backward see in bf16 with fp32 masters the optimizer steps: FSDP2's mixed
precision under `--fsdp` (`shard_model`), otherwise the layer-wise optimizer's (on one rank
too). `--compile` compiles each transformer block (`compile_blocks`).
Every collective the loop itself issues (metric sums and gathers, barriers) goes through
`orthoptim.collectives` with tensors on `collectives.device_for()`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor, nn

from orthoptim import collectives
from orthoptim._extras import optional_extra
from orthoptim.optim.base import NonFiniteGradientError
from orthoptim.optim.hybrid import build_optimizer
from orthoptim.optim.qk_clip import QKClip
from orthoptim.parallel.base import DistributedOptimizer
from orthoptim.parallel.fsdp import FSDPOptimizer, shard_model
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
from orthoptim.parallel.layout import ParallelMesh
from orthoptim.parallel.routing_report import publish_routing
from orthoptim.parallel.tensor_parallel import TensorParallelOrthogonalizer
from orthoptim.telemetry import Telemetry, comm_totals
from orthoptim.train.args import TrainArgs
from orthoptim.train.board import Board
from orthoptim.train.data import load_corpus, val_batches
from orthoptim.train.devices import autocast, resolve_precision
from orthoptim.train.hf import build_hf_model
from orthoptim.train.microbatch import (
    forward_backward,
    micro_batches,
    ordered_evaluate,
    rank_block,
    step_loss,
)
from orthoptim.train.model import (
    GPT,
    compile_blocks,
    expert_parallelize,
    get_config,
    parallelize,
)
from orthoptim.train.pipeline import PipelineRunner, split_stage
from orthoptim.train.runfolder import (
    Checkpointer,
    RunLogHandler,
    atomic_write_text,
    layout_change,
    read_metrics,
    resumed_args,
    saved_param_dtype,
)


def lr_multiplier(step: int, args: TrainArgs) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to `min_lr_ratio` at `steps`."""
    if step <= args.warmup:
        return step / max(1, args.warmup)
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _optimizer_kwargs(args: TrainArgs) -> dict[str, Any]:
    """`build_optimizer`'s arguments for this run; the matrix optimizer keeps its own weight
    decay (its paper's: AdaMuon 0.01, Scion's constraint) unless --weight-decay is given.
    --state-dtype bf16: bf16 state, its stochastic rounding seeded by --seed."""
    lean = {}
    if args.state_dtype == "bf16":
        lean = dict(state_dtype=torch.bfloat16, rounding_seed=args.seed)
    if args.optimizer == "adamw":
        return dict(lr=args.matrix_lr, adamw_weight_decay=args.decay, **lean)
    given = {} if args.weight_decay is None else dict(weight_decay=args.weight_decay)
    return dict(
        **lean,
        lr=args.matrix_lr,
        adamw_lr=args.embed_lr,
        adamw_weight_decay=args.decay,
        elementwise=args.elementwise,
        **given,
    )


def low_precision(param_dtype: str) -> torch.dtype | None:
    """The torch dtype a run's parameters are held in below their fp32 masters ("bf16":
    torch.bfloat16), or None when the parameters are the fp32 masters themselves."""
    return torch.bfloat16 if param_dtype == "bf16" else None


def make_optimizer(
    model: nn.Module,
    args: TrainArgs,
    world_size: int,
    mesh: ParallelMesh | None = None,
    param_dtype: str = "fp32",
) -> Any:
    """The optimizer for this rank: `FSDPOptimizer` under --fsdp (the model already sharded,
    in `param_dtype` by `shard_model`'s mixed precision); otherwise `build_optimizer` on one
    rank and, on more, the layer-wise distributed optimizer (each matrix, and each expert of a
    mixture of experts, owned whole by one rank). All of them route the same parameters to
    AdamW. `mesh` (the run's layout) gives the layer-wise optimizer its groups: it owns over
    the data-parallel group of the rank's stage (`model` is the stage under --pp), the
    experts over the expert-data-parallel group under --ep, and with --tp it orthogonalizes
    with a `TensorParallelOrthogonalizer` (auto mode: duplicated, distributed or, for a
    float32 iteration, gram per shape, by its cost model). `param_dtype` "bf16" without
    --fsdp: the layer-wise optimizer (on one rank too) holds the parameters in bf16 and fp32
    masters of what it owns. --reproducible: the layer-wise optimizer with
    reproducible=True, on one rank too."""
    kwargs = _optimizer_kwargs(args)
    if args.fsdp:
        return FSDPOptimizer(model, optimizer=args.optimizer, **kwargs)
    low = low_precision(param_dtype)
    # The keyword only for low precision: fp32 runs build the optimizer they always built.
    masters = {} if low is None else dict(param_dtype=low)
    if world_size == 1 and low is None and not args.reproducible:
        return build_optimizer(model, optimizer=args.optimizer, **kwargs)
    groups: dict[str, Any] = dict(reproducible=True) if args.reproducible else {}
    if mesh is not None:
        groups["layout"] = mesh
        if mesh.dims.tp > 1:
            groups["orthogonalizer"] = TensorParallelOrthogonalizer(mode="auto")
    # only the parameters the model declares expert stacks are split (`optim.routing`);
    # not a tensor-parallel model's (DTensor experts are not sliced)
    experts = args.optimizer != "adamw" and args.tp == 1
    return LayerwiseDistributedOptimizer(
        model,
        optimizer=args.optimizer,
        split_experts=experts,
        state_dict_to="rank0",
        **groups,
        **masters,
        **kwargs,
    )


def clip_gradients(model: nn.Module, opt: Any, max_norm: float) -> float:
    """Clip the gradients by their global 2-norm and return the norm (before clipping): the
    distributed optimizers' `clip_grad_norm_` (gradients reduced to owners or sharded; under
    --pp over every stage's, by the layout's pp group), else
    `torch.nn.utils.clip_grad_norm_` on the model's parameters (one process)."""
    method = getattr(opt, "clip_grad_norm_", None)
    if method is not None:
        return float(method(max_norm))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))


def _params_ready(opt: Any) -> None:
    """Wait for parameter gathers still in flight (before reading parameters outside forward)."""
    if isinstance(opt, DistributedOptimizer):
        opt.wait_for_params()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


@torch.no_grad()
def evaluate(
    model: nn.Module,
    batches: list,
    rank: int,
    world_size: int,
    lockstep: bool = False,
    precision: str = "fp32",
    pipeline: PipelineRunner | None = None,
    ordered: bool = False,
) -> float:
    """Mean validation loss over the fixed batches, split across the `world_size`
    data-parallel ranks (`rank`: this one's index), in the run's `precision` ("bf16": under
    autocast, like training). Under a `pipeline` every stage runs the batches of its
    data-parallel index through it (the ranks of one index count each batch alike, which
    the mean over every rank leaves as it is).

    `lockstep`: every rank runs the same number of forwards (a rank short of batches repeats
    one and ignores it), as a sharded model's or an expert-parallel one's forward is
    collective. `ordered` (--reproducible): `ordered_evaluate`, the same bits at every size."""
    if ordered:
        return ordered_evaluate(model, batches, rank, world_size, precision)
    model.eval()
    total, count = 0.0, 0.0
    rounds = -(-len(batches) // world_size)

    def loss_of(x: Tensor, y: Tensor) -> float:
        with autocast(x.device, precision):
            return pipeline.evaluate(x, y) if pipeline is not None else model(x, y).item()

    for i in range(rounds):
        j = rank + i * world_size
        if j < len(batches):
            x, y = batches[j]
            total += loss_of(x, y) * y.numel()
            count += y.numel()
        elif lockstep:
            loss_of(*batches[0])
    model.train()
    with collectives.phase("validation loss (all-reduce)"):
        total, count = collectives.sum_floats([total, count])
    return total / count


def validate(run: Run, args: TrainArgs) -> float:
    """The run's validation loss now (`evaluate` over its fixed batches; in lockstep under
    --fsdp or expert parallelism, in global order under --reproducible)."""
    _params_ready(run.opt)
    return evaluate(
        run.model,
        run.val,
        run.dp_rank,
        run.dp_size,
        args.fsdp or run.lockstep,
        run.precision,
        run.pipeline,
        ordered=args.reproducible,
    )


def _notice(log: logging.Logger, rank: int, message: str) -> None:
    """Something the user must know about this run: in the rank's log, and on rank 0's
    stderr."""
    log.warning(message)
    if rank == 0:
        print(f"orthoptim: {message}", file=sys.stderr, flush=True)


def setup_logging(out: Path, rank: int) -> logging.Logger:
    """Rank `rank`'s logger, writing to OUT/logs/rank{rank}.log (its handlers replaced; once
    its disk is full, one line on stderr says so: `RunLogHandler`)."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    log = logging.getLogger(f"orthoptim.train.rank{rank}")
    log.setLevel(logging.INFO)
    log.propagate = False
    for h in list(log.handlers):
        log.removeHandler(h)
        h.close()
    handler = RunLogHandler(out / "logs" / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(message)s"))
    log.addHandler(handler)
    return log


class StopRequest:
    """A request to stop after the current step: the name of the signal that asked
    (`launcher` sets it from a signal handler, which may do no more), or None."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def set(self, name: str) -> None:
        self.signal = self.signal or name


class Preempted(Exception):
    """The run stopped on a signal (SIGTERM, --save-on-signal) after `step`; `saved`: with a
    checkpoint of that step, which --resume continues bit-identically. Exit status
    EXIT_CODE when saved (sysexits' EX_TEMPFAIL: try again), else 128 + the signal's
    number, the shell's for a process a signal ended."""

    EXIT_CODE = 75

    def __init__(self, signal: str, step: int, saved: bool = True, signum: int = 15) -> None:
        self.signal, self.step, self.saved, self.signum = signal, step, saved, signum
        if saved:
            text = f"checkpoint saved at step {step}: --resume to continue"
        elif step:
            text = f"no checkpoint of it was saved; --resume continues from step {step}"
        else:
            text = "no checkpoint was saved; start the run again"
        where = f"after step {step}" if saved else "before saving the step it was in"
        super().__init__(f"stopped by {signal} {where}; {text}")

    @property
    def exit_code(self) -> int:
        return self.EXIT_CODE if self.saved else 128 + self.signum


@dataclass
class Run:
    """What one rank trains, built once by `build_run`: the model (under --pp this rank's
    stage) and its optimizer, the corpus and validation batches, the layout and how the
    ranks split the data."""

    model: nn.Module
    opt: Any
    clip: QKClip | None
    corpus: Any
    seq_len: int
    batch: int  # sequences per micro-batch
    model_info: dict[str, Any]
    val: list[tuple[Tensor, Tensor]]
    precision: str
    param_dtype: str  # "bf16" (fp32 masters), "fp32" or "fp64"
    mesh: ParallelMesh
    parameters: int  # the whole model's (every stage's, every expert)
    pipeline: PipelineRunner | None = None  # this rank's stage of the pipeline under --pp
    telemetry: Telemetry | None = None  # the optimizer's, recorded every --log-every steps
    saved_step: int | None = None  # the newest checkpoint's step, once resumed or saved
    accumulation: int = 1  # micro-batches per data-parallel rank per step

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: it runs the global micro-batches
        `rank_block(dp_rank, accumulation)` of each step; the tp ranks and pipeline stages of
        one index share them."""
        return self.mesh.coord.dp

    @property
    def dp_size(self) -> int:
        return self.mesh.dims.dp

    @property
    def lockstep(self) -> bool:
        """Whether every rank must run the same number of forwards beyond --fsdp's: an
        expert-parallel model's forward is collective over its ep group."""
        return self.mesh.dims.ep > 1

    @property
    def tokens_per_step(self) -> int:
        """Tokens one step trains on over every rank (the tp ranks and the stages of a
        data-parallel index share its batch)."""
        return self.batch * self.seq_len * self.dp_size * self.accumulation


def build_run(
    args: TrainArgs, rank: int, world_size: int, device: torch.device, log: logging.Logger
) -> Run:
    """The model (same seed on every rank; sharded by FSDP2, or parallelized over the run's
    layout as the flags say: tensor parallelism over its tp group, experts over its ep group,
    then cut to this rank's pipeline stage), its optimizer, QK-clip, the corpus and the
    validation batches."""
    cfg = get_config(args.config)
    corpus = load_corpus(args.data, min_bytes=cfg.seq_len + 1)
    log.info("corpus %s", corpus.describe())
    torch.manual_seed(args.seed)
    model: nn.Module = (
        build_hf_model(args.hf_config, cfg.seq_len) if args.hf_config else GPT(cfg)
    ).to(device)
    args.check_nproc(world_size, device.type)
    accumulation = args.accumulation(world_size)
    param_dtype = args.param_dtype_on(device.type)
    if param_dtype == "fp64":
        model.to(torch.float64)
    parameters = sum(p.numel() for p in model.parameters())  # before any cut
    mesh = args.layout(world_size).build(device.type, rank)
    dims = mesh.dims
    if args.fsdp and world_size > 1:
        shard_model(model, mesh.fsdp_mesh, param_dtype=low_precision(param_dtype))
    if dims.tp > 1:
        parallelize(model, mesh.tp_mesh)
    if dims.ep > 1:
        # the load-balancing loss counts its routing over the stage's data-parallel ranks
        # (the global batch's)
        expert_parallelize(model, mesh.ep_group, mesh.coord.ep, dims.ep, mesh.dp_group)
    if dims.pp > 1:
        model = split_stage(model, dims.pp, mesh.coord.pp)
    opt = make_optimizer(model, args, world_size, mesh, param_dtype)
    pipeline = None
    if dims.pp > 1:
        pipeline = PipelineRunner(
            model,
            mesh,
            n_microbatches=args.n_microbatches,
            schedule=args.pp_schedule,
            device=device,
            # gradients reduced once a step
            no_sync=opt.no_sync if isinstance(opt, DistributedOptimizer) else None,
        )
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
        "model %s (%d params%s), optimizer %s%s, world size %d (%s, rank %s), device %s (%s), "
        "precision %s, parameters %s%s",
        f"transformers {args.hf_config}" if args.hf_config else args.config,
        sum(p.numel() for p in model.parameters()),
        f" in stage {mesh.coord.pp}" if pipeline is not None else "",
        args.optimizer,
        " (FSDP2)" if args.fsdp else "",
        world_size,
        dims.describe(),
        tuple(mesh.coord),
        device,
        collectives.backend_config() or "no process group",
        precision,
        param_dtype,
        ", blocks compiled" if args.compile else "",
    )
    info = dict(hf_config=args.hf_config) if args.hf_config else cfg.as_dict()
    return Run(
        model,
        opt,
        clip,
        corpus,
        cfg.seq_len,
        args.batch,
        info,
        val,
        precision,
        param_dtype,
        mesh,
        parameters,
        pipeline,
        accumulation=accumulation,
    )


@dataclass
class Resumed:
    """Where a resumed run continues: the checkpoint's step, the training time and tokens
    (over every rank) up to it, and the step since which the run has had its present layout
    (world size, tp, sharding: its throughput is measured over the steps after it)."""

    step: int = 0
    train_time_s: float = 0.0
    tokens: int = 0
    layout_since: int = 0


def resume(
    run: Run,
    ckpt: Checkpointer,
    args: TrainArgs,
    changes: list[str],
    rank: int,
    log: logging.Logger,
    metrics_path: Path,
) -> Resumed:
    """Load the newest intact checkpoint into the run (this run's LRs and decay, which the
    checkpoint's must not replace, kept), say so, and cut the metrics back to its step (its
    row restored from the checkpoint when the file lost it).

    At another world size, tp or sharding the checkpoint is resharded on loading and the run
    says what changed (`layout_change`): with --global-batch the step's micro-batches stay
    what they were (keyed by their global index; each rank's share, the accumulation,
    follows the data-parallel size); without it each data-parallel rank keeps `--batch`
    sequences, so the global batch follows the data-parallel size."""
    wanted = [(g["initial_lr"], g.get("weight_decay")) for g in run.opt.param_groups]
    info = ckpt.load(run.model, run.opt, args, run.param_dtype)
    start = info["step"]
    for g, (lr, decay) in zip(run.opt.param_groups, wanted):
        g["initial_lr"] = lr
        if decay is not None:
            g["weight_decay"] = decay
    layout = layout_change(info, args, ckpt.world_size)
    for message in (
        *(f"--resume: passed over {why}" for why in info["passed_over"]),
        *([f"resuming from {info['folder']} (step {start})"] if args.announce else []),
        *(f"{change} from step {start}" for change in [*changes, layout] if change),
    ):
        _notice(log, rank, message)
    # Allowed: the checkpoint holds fp32 parameters and optimizer state in either precision
    # (and, under --fsdp, at either parameter dtype: `check_resumable`).
    if info.get("precision", "fp32") != run.precision:
        log.info("checkpoint trained in %s, continuing in %s", info.get("precision"), run.precision)
    if saved_param_dtype(info) != run.param_dtype:  # on the terminal, as a layout change
        _notice(
            log,
            rank,
            f"--param-dtype {saved_param_dtype(info)} → {run.param_dtype} from step {start}",
        )
    if rank == 0:
        dropped: list[str] = []
        kept = read_metrics(metrics_path, upto=start, notes=dropped)
        for note in dropped:
            _notice(log, rank, note)
        saved_row = info.get("metrics_row")  # the row of the checkpoint's step, kept with it
        if saved_row is not None and all(r["step"] != start for r in kept):
            kept.append(saved_row)
            _notice(log, rank, f"{metrics_path} lacked the row of step {start}: restored it")
        atomic_write_text("".join(json.dumps(r) + "\n" for r in kept), metrics_path)
    # Checkpoints from before "tokens" was recorded ran at one layout from step 0.
    saved = TrainArgs.from_dict(info["args"])
    tokens = info.get(
        "tokens", start * saved.batch * run.seq_len * (info["world_size"] // saved.tp)
    )
    since = start if layout else info.get("layout_since", 0)
    return Resumed(start, info["train_time_s"], tokens, since)


def _advice(run: Run) -> str:
    """What to do about a run that diverged: resume its checkpoint, or, with none saved yet,
    start it again."""
    if run.saved_step is None:
        return (
            "no checkpoint was saved yet: start again with --overwrite and a lower --lr or "
            "--grad-clip"
        )
    return (
        f"the checkpoint of step {run.saved_step} is intact: --resume it with a lower --lr or "
        "--grad-clip"
    )


def train_step(
    run: Run,
    args: TrainArgs,
    step: int,
    device: torch.device,
    world_size: int,
    stop: StopRequest | None = None,
) -> tuple[dict[str, Any], bool]:
    """One step (LR schedule, forward and backward over the rank's micro-batches, clipping,
    optimizer step, QK-clip): its
    metrics row, with the seconds it took (`step_time_s`, `opt_time_s`), and whether a `stop`
    was requested on any rank by the end of it (agreed in the loss sum, so every rank stops
    after the same step, though a signal may reach one a step later than another)."""
    opt = run.opt
    mult = lr_multiplier(step, args)
    for g in opt.param_groups:
        g["lr"] = g["initial_lr"] * mult
    block = rank_block(run.dp_rank, run.accumulation)
    batches = micro_batches(
        run.corpus.train, args.batch, run.seq_len, args.seed, step, block, device
    )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    if args.compile:
        # Compiled blocks trace the optimizer's forward pre-hooks: finish the parameter
        # gathers here, so the hooks find nothing to do and no graph recompiles. (Under
        # NCCL the last step's loss all-reduce, queued behind the gathers, has waited
        # for them already: only their copy into the parameters moves out of forward.)
        _params_ready(opt)
    losses = forward_backward(run.model, opt, batches, device, run.precision, run.pipeline)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    norm = clip_gradients(run.model, opt, args.clip_norm) if args.clip_norm > 0 else None
    recorded = run.telemetry is not None and step % args.log_every == 0
    try:
        with run.telemetry.recording(recorded) if run.telemetry else contextlib.nullcontext():
            opt.step()
    except NonFiniteGradientError as exc:
        raise FloatingPointError(
            f"non-finite gradient at step {step}; {_advice(run)} (in {', '.join(exc.names)})"
        ) from exc
    opt.zero_grad(set_to_none=True)
    clipped = run.clip.step() if run.clip is not None else {}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t2 = time.perf_counter()
    sent, received = comm_totals(opt)
    asked = float(stop is not None and stop.signal is not None)
    with collectives.phase(f"training loss of step {step} (gathered)"):
        train_loss, stops = step_loss(losses, asked, run.dp_rank, world_size, args.reproducible)
    if not math.isfinite(train_loss):
        raise FloatingPointError(f"training loss is {train_loss} at step {step}; {_advice(run)}")
    row: dict[str, Any] = dict(
        step=step,
        train_loss=train_loss,
        lr=opt.param_groups[0]["lr"],
        step_time_s=t2 - t0,
        opt_time_s=t2 - t1,
        comm_sent_bytes=sent,
        comm_received_bytes=received,
        precision=run.precision,
        param_dtype=run.param_dtype,
        **clipped,
    )
    if norm is not None:
        row["grad_norm"] = norm
    if recorded:
        row["telemetry"] = run.telemetry.report()  # type: ignore[union-attr]
    return row, stops > 0


def train(
    args: TrainArgs,
    rank: int,
    world_size: int,
    device: torch.device,
    out: Path,
    log: logging.Logger,
    stop: StopRequest | None = None,
) -> dict[str, Any]:
    """One rank's whole run: build it, resume it if asked, train and evaluate step by step
    writing metrics, checkpoints and (rank 0) `result.json`; returns the result. Once `stop`
    is set on any rank, every rank finishes its step, saves a checkpoint of it and raises
    `Preempted` (unless that step was the last: the run then ends as usual)."""
    stop = stop or StopRequest()
    metrics_path = out / "metrics.jsonl"
    args, run, ckpt, resumed = _start_run(args, rank, world_size, device, out, log, metrics_path)
    start, train_time = resumed.step, resumed.train_time_s
    tokens_per_step = run.tokens_per_step
    last = args.stop_after or args.steps
    bar = _progress_bar(args, rank, start)
    # the event files first: a --tensorboard that fails leaves no metrics.jsonl (no run)
    board = Board(args.tensorboard, start) if args.tensorboard and rank == 0 else None
    metrics_file = open(metrics_path, "a") if rank == 0 else None  # noqa: SIM115
    run.telemetry = Telemetry(run.opt, run.model) if args.log_every else None

    val_loss = None
    if start == 0:
        val_loss = validate(run, args)
        if metrics_file:
            row0 = dict(step=0, val_loss=val_loss, train_time_s=0.0, tokens=0)
            row0.update(precision=run.precision, param_dtype=run.param_dtype)
            _write_row(metrics_file, row0)
        if board is not None:
            board.write(row0)
    row: dict[str, Any] = {}
    try:
        for step in range(start + 1, last + 1):
            row, stopping = train_step(run, args, step, device, world_size, stop)
            train_time += row["step_time_s"]
            row.update(
                train_time_s=train_time,
                tokens=resumed.tokens + (step - start) * tokens_per_step,
            )
            if step - start <= COLD_STEPS:
                row["cold"] = True
            if step % args.eval_every == 0 or step == args.steps:
                val_loss = row["val_loss"] = validate(run, args)
                log.info("step %d train %.4f val %.4f", step, row["train_loss"], val_loss)
            if metrics_file:
                _write_row(metrics_file, row)
            if board is not None:
                board.write(row)
            if bar is not None:
                _advance_bar(bar, row, val_loss, tokens_per_step)
            if step % args.ckpt_every == 0 or step == last or stopping:
                _save_checkpoint(run, ckpt, args, step, row, resumed, metrics_file, log)
            if stopping and step < last:
                log.warning("stopped by %s after step %d", stop.signal or "a signal", step)
                raise Preempted(stop.signal or "a signal to another rank", step)
    finally:
        if bar is not None:
            bar.close()
        if metrics_file:
            metrics_file.close()
        if board is not None:
            board.close()
    return _finish_run(run, args, rank, world_size, device, out, last, val_loss, row, resumed, log)


def _start_run(
    args: TrainArgs,
    rank: int,
    world_size: int,
    device: torch.device,
    out: Path,
    log: logging.Logger,
    metrics_path: Path,
) -> tuple[TrainArgs, Run, Checkpointer, Resumed]:
    """The run built and, if asked, resumed (its args as the checkpoint leaves them), its
    checkpointer and where it resumed; every rank past the barrier before the first step."""
    ckpt = Checkpointer(
        out,
        rank,
        world_size,
        sharded=args.fsdp and world_size > 1,
        keep=args.keep_checkpoints,
        dims=args.layout(world_size),
    )
    changes: list[str] = []
    if args.resume:
        args, changes = resumed_args(args, ckpt.latest())
    run = build_run(args, rank, world_size, device, log)
    resumed = Resumed()
    if args.resume:
        resumed = resume(run, ckpt, args, changes, rank, log, metrics_path)
        run.saved_step = resumed.step
    elif rank == 0:
        metrics_path.write_text("")
    # routing.json and its summary (rank 0; every stage's records under --pp), as run now
    publish_routing(run.opt, run.model, out, run.mesh, show=args.announce)
    start = resumed.step
    where = f"after resuming at step {start}" if start else "before step 1"
    with collectives.phase(f"the ranks' barrier {where}"):
        collectives.barrier()
    return args, run, ckpt, resumed


def _progress_bar(args: TrainArgs, rank: int, start: int) -> Any:
    """Rank 0's tqdm bar when `--progress` asks for one and tqdm is installed, else None."""
    wants_bar = rank == 0 and args.progress
    tqdm = optional_extra("tqdm", "orthoptim train: no progress bar") if wants_bar else None
    if tqdm is None:
        return None
    return tqdm.tqdm(
        total=args.steps,
        initial=start,
        desc=f"{args.optimizer}",
        unit="step",
        dynamic_ncols=True,
        mininterval=0.5,
    )


def _write_row(metrics_file: IO[str], row: dict[str, Any]) -> None:
    """One metrics row appended and flushed."""
    metrics_file.write(json.dumps(row) + "\n")
    metrics_file.flush()


def _advance_bar(
    bar: Any, row: dict[str, Any], val_loss: float | None, tokens_per_step: int
) -> None:
    """The progress bar one step on, showing the step's loss, the last val loss and tokens/s."""
    bar.set_postfix(
        loss=f"{row['train_loss']:.3f}",
        val=f"{val_loss:.3f}" if val_loss is not None else "-",
        tok_s=f"{tokens_per_step / row['step_time_s']:,.0f}",
    )
    bar.update(1)


def _save_checkpoint(
    run: Run,
    ckpt: Checkpointer,
    args: TrainArgs,
    step: int,
    row: dict[str, Any],
    resumed: Resumed,
    metrics_file: IO[str] | None,
    log: logging.Logger,
) -> None:
    """Step `step` checkpointed, the metrics rows up to it on disk first."""
    meta = dict(
        args=args.to_dict(),
        train_time_s=row["train_time_s"],
        tokens=row["tokens"],
        layout_since=resumed.layout_since,
        precision=run.precision,
        param_dtype=run.param_dtype,
        metrics_row=row,
    )
    if metrics_file:  # the rows up to the checkpoint on disk before it commits
        os.fsync(metrics_file.fileno())
    _params_ready(run.opt)
    ckpt.save(step, run.model, run.opt, meta)
    run.saved_step = step
    log.info("checkpoint at step %d", step)


def _finish_run(
    run: Run,
    args: TrainArgs,
    rank: int,
    world_size: int,
    device: torch.device,
    out: Path,
    last: int,
    val_loss: float | None,
    row: dict[str, Any],
    resumed: Resumed,
    log: logging.Logger,
) -> dict[str, Any]:
    """The run's result with its throughput, written (rank 0) to `result.json`; every rank
    past the last barrier."""
    tokens_per_step = run.tokens_per_step
    comm = (row.get("comm_sent_bytes", 0.0), row.get("comm_received_bytes", 0.0))
    result = _result(run, args, world_size, device, last, val_loss, comm)
    # over the steps run at this layout (the rows' tokens per step are this run's)
    rows = read_metrics(out / "metrics.jsonl") if rank == 0 else []
    timed = [r for r in rows if r["step"] > resumed.layout_since]
    result.update(throughput(timed, tokens_per_step))
    if rank == 0:
        atomic_write_text(json.dumps(result, indent=1), out / "result.json")
    log.info("done: %s", json.dumps({k: result[k] for k in ("last_step", "final_val_loss")}))
    with collectives.phase("the ranks' last barrier"):
        collectives.barrier()
    return result


def _result(
    run: Run,
    args: TrainArgs,
    world_size: int,
    device: torch.device,
    last: int,
    val_loss: float | None,
    comm: tuple[float, float],
) -> dict[str, Any]:
    """`result.json` but for the throughput: the run, its final loss, every rank's peak
    memory and last step's bytes (collective: gathered from every rank)."""
    with collectives.phase("the run's summary (all-gather)"):
        peaks = collectives.gather_floats([float(peak_memory_bytes(device))])
        comms = collectives.gather_floats(list(comm))
    return dict(
        args=args.to_dict(),
        model=run.model_info,
        parameters=run.parameters,
        world_size=world_size,
        layout=run.mesh.dims.describe(),
        device=str(device),
        backend=collectives.backend_config() or None,
        precision=run.precision,
        param_dtype=run.param_dtype,
        compiled=args.compile,
        threads_per_rank=torch.get_num_threads(),
        tokens_per_step=run.tokens_per_step,
        last_step=last,
        final_val_loss=val_loss,
        peak_memory_bytes_per_rank=[p[0] for p in peaks],
        comm_sent_bytes_per_step_per_rank=[c[0] for c in comms],
        comm_received_bytes_per_step_per_rank=[c[1] for c in comms],
        optimizer_class=type(run.opt).__name__,
    )


# The first steps a process runs pay one-off costs (allocations, first collectives): their
# rows are marked "cold" and left out of the throughput.
COLD_STEPS = 2


def timed_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The metrics rows a run's throughput is measured over: every step but the cold ones
    (the first COLD_STEPS after each start or resume), unless no other is left."""
    steps = [r for r in rows if "step_time_s" in r]
    return [r for r in steps if not r.get("cold")] or steps


def upper_median(values: list[float]) -> float | None:
    """The median (of an even count, the upper middle one); None for no values."""
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def throughput(rows: list[dict[str, Any]], tokens_per_step: int) -> dict[str, Any]:
    """Median step time, tokens/s and the optimizer's share of step time over the run's
    `timed_rows`."""
    steps = timed_rows(rows)
    if not steps:
        return {}
    step_times = [r["step_time_s"] for r in steps]
    opt_times = [r["opt_time_s"] for r in steps]
    median = upper_median(step_times)
    return dict(
        median_step_time_s=median,
        median_optimizer_time_s=upper_median(opt_times),
        tokens_per_s=tokens_per_step / median,
        optimizer_share=sum(opt_times) / sum(step_times),
    )
