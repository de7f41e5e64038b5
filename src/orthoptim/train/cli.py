"""`orthoptim train` and `orthoptim compare`, and the flags `torchrun -m orthoptim.train` reads."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orthoptim._extras import require_extra
from orthoptim.choices import (
    CONFIG_NAMES,
    ELEMENTWISE_OPTIMIZER_NAMES,
    PARAM_DTYPES,
    PRECISIONS,
    PREEMPTED_EXIT_CODE,
)
from orthoptim.train.args import (
    DEFAULT_GRAD_CLIP,
    OPTIMIZERS,
    PP_SCHEDULES,
    SAVE_SIGNALS,
    STATE_DTYPES,
    TrainArgs,
)
from orthoptim.train.compare_args import CompareArgs, device_defaults

# The parser imports no torch (`orthoptim.choices`): the commands import the modules that
# run them.

NPROC_HELP = (
    "ranks to start on this machine (default: one per visible GPU; 2 on CPU or with "
    "--shared-gpu); more than the GPUs are refused unless --shared-gpu"
)


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    """--precision, --compile and --shared-gpu (shared by `train` and `compare`)."""
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="bf16: forward and loss under bf16 autocast (fp32 parameters, gradients and "
        "optimizer state); fp32: no autocast; auto (default): bf16 on CUDA, fp32 on CPU",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every transformer block (first steps pay the compilation)",
    )
    p.add_argument(
        "--shared-gpu",
        action="store_true",
        help="run every rank on cuda:0 over the cuda:gloo backend (testing multi-rank code on "
        "one GPU; NCCL refuses two ranks on one GPU)",
    )


def add_state_dtype_argument(p: argparse.ArgumentParser) -> None:
    """--state-dtype (shared by `train` and `compare`)."""
    p.add_argument(
        "--state-dtype",
        choices=STATE_DTYPES,
        default="fp32",
        help="the storage of Muon's (and its variants') momentum and AdamW's moments: bf16 "
        "halves it (2 bytes per element), the step computed in fp32 and stored by stochastic "
        "rounding seeded by --seed; fp32 (default)",
    )


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of one training run (everything but --nproc)."""
    d = TrainArgs()
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=d.optimizer,
        help="the optimizer of the hidden matrices (adamw: AdamW for every parameter; "
        "default %(default)s)",
    )
    p.add_argument(
        "--elementwise",
        choices=ELEMENTWISE_OPTIMIZER_NAMES,
        default=d.elementwise,
        help="the optimizer of embeddings, head and vectors next to a matrix optimizer "
        "(default %(default)s; lion takes --adamw-lr and the AdamW decay as its own)",
    )
    p.add_argument(
        "--config",
        choices=sorted(CONFIG_NAMES),
        default=d.config,
        help="the built-in GPT's size; with --hf-config its sequence length only",
    )
    p.add_argument(
        "--hf-config",
        default=None,
        metavar="PRESET|PATH",
        help="train a Hugging Face transformers causal LM built from a config, no download: "
        "gpt2, llama or qwen3_moe (small sizes), or a config.json (or its folder); the "
        "vocabulary is the corpus's 256 bytes (pip install 'orthoptim[hf]')",
    )
    p.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size (1: none)")
    p.add_argument(
        "--pp",
        type=int,
        default=d.pp,
        help="pipeline stages (1: none); each stage holds a contiguous run of the blocks and "
        "its own layer-wise optimizer over its data-parallel ranks",
    )
    p.add_argument(
        "--ep",
        type=int,
        default=d.ep,
        help="expert-parallel size (1: none; a mixture-of-experts config): each rank of an "
        "expert-parallel group holds experts/ep of every layer's experts and tokens reach "
        "them by all-to-all; it runs inside the data-parallel ranks and must divide --dp",
    )
    p.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel ranks per stage, each on its own --batch (default: nproc / (pp · "
        "tp); given, pp · dp · tp must be --nproc)",
    )
    p.add_argument(
        "--dp-replicate",
        type=int,
        default=d.dp_replicate,
        help="with --fsdp: FSDP2's replicas of the data-parallel ranks (hybrid sharding: "
        "parameters sharded over dp / dp-replicate ranks; default %(default)s)",
    )
    p.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="pipeline micro-batches per step, dividing --batch (default: --pp)",
    )
    p.add_argument(
        "--pp-schedule",
        choices=PP_SCHEDULES,
        default=d.pp_schedule,
        help="the pipeline schedule (default %(default)s)",
    )
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 (fully_shard per block) and step it with FSDPOptimizer",
    )
    p.add_argument(
        "--param-dtype",
        choices=PARAM_DTYPES,
        default=d.param_dtype,
        help="bf16: forward and backward on bf16 parameters, with fp32 master weights that the "
        "optimizer steps (with --fsdp: FSDP2's mixed precision, fp32 shards, bf16 all-gathers, "
        "gradients reduced in fp32; otherwise the layer-wise optimizer's bf16 parameters and "
        "fp32 masters of what each rank owns); fp32: fp32 parameters; fp64: everything in "
        "float64, the reference dtype of equivalence checks between layouts (CPU); auto "
        "(default): bf16 on CUDA, fp32 on CPU. Optimizer state is fp32 but under fp64",
    )
    add_state_dtype_argument(p)
    p.add_argument(
        "--steps", type=int, default=d.steps, help="optimizer steps (default %(default)s)"
    )
    p.add_argument(
        "--batch",
        type=int,
        default=d.batch,
        help="sequences per micro-batch: per rank per step without --global-batch "
        "(default %(default)s)",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="G",
        help="sequences per optimizer step whatever the layout: G / --batch micro-batches, "
        "micro-batch j of a step the same sequences at every --nproc, each data-parallel rank "
        "accumulating G / (--batch × dp) of them (a G that does not divide is refused); a run "
        "resumes at another --nproc on the same data (default: --batch × dp, no accumulation)",
    )
    p.add_argument(
        "--reproducible",
        action="store_true",
        help="bitwise the same weights and logged losses and gradient norms at every --nproc "
        "(and resumed at another): needs --global-batch (not derived: the default follows "
        "--nproc); the layer-wise optimizer with reproducible=True, each rank on 1 intra-op "
        "thread, losses summed in a fixed order. Covers a power-of-two number of micro-batches "
        "split over a power-of-two --nproc; refuses --tp, --ep, --pp, --fsdp, --compile and "
        "--hf-config. Times, tokens/s and telemetry stay outside the guarantee",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=None,
        help="LR of the matrix optimizer (of everything for adamw); "
        "default muon 0.05, adamw 3e-3, soap 3e-3",
    )
    p.add_argument(
        "--adamw-lr",
        type=float,
        default=None,
        help="AdamW LR for embeddings, head and gains under muon/soap (default 3e-3)",
    )
    p.add_argument(
        "--weight-decay",
        type=float,
        default=None,
        help="decoupled weight decay of every parameter group (default 0)",
    )
    p.add_argument(
        "--qk-clip",
        type=float,
        default=None,
        help="MuonClip threshold tau on attention logits (default: the config's, 100 for "
        "tiny-moe, none for the others; 0: off)",
    )
    p.add_argument(
        "--grad-clip",
        type=float,
        default=None,
        help="clip gradients to this global 2-norm before every step; the norm is logged as "
        f"grad_norm in metrics.jsonl (default {DEFAULT_GRAD_CLIP}; 0: off)",
    )
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear LR warmup steps")
    p.add_argument(
        "--min-lr-ratio",
        type=float,
        default=d.min_lr_ratio,
        help="the LR the cosine decay reaches at --steps, over the peak (default %(default)g)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between validation-loss evaluations (default %(default)s)",
    )
    p.add_argument(
        "--log-every",
        type=int,
        default=d.log_every,
        help="steps between optimizer telemetry rows in metrics.jsonl: per parameter class the "
        "update and weight RMS, effective LR, momentum RMS, Newton-Schulz residual; the busiest "
        "rank's optimizer time and bytes (default %(default)s; 0: off)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        default=None,
        help="also write every metrics row (telemetry included) as TensorBoard scalars under "
        "DIR (needs tensorboard: pip install 'orthoptim[tensorboard]')",
    )
    p.add_argument(
        "--eval-batches",
        type=int,
        default=d.eval_batches,
        help="validation batches per evaluation (default %(default)s)",
    )
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="checkpoint interval")
    p.add_argument(
        "--keep-checkpoints",
        type=int,
        default=d.keep_checkpoints,
        help="the newest step folders kept (default %(default)s); --resume falls back to an "
        "older one when the newest is damaged",
    )
    p.add_argument("--out", default=d.out, help="output folder (metrics, logs, checkpoints)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint in --out; --lr, --adamw-lr, "
        "--weight-decay, --grad-clip and --qk-clip left off keep the run's values, given "
        "they apply from the checkpoint's step (with a notice)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run --out holds (its metrics, result, logs and checkpoints are "
        "removed); without --resume or --overwrite a folder holding a run is refused",
    )
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="leave after this step (the LR schedule still spans --steps)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="seed of the weights and the batch order (default %(default)s)",
    )
    p.add_argument(
        "--data", default=None, help="a text file or folder (default: Python's stdlib source)"
    )
    add_device_arguments(p)
    p.add_argument(
        "--pg-timeout",
        type=float,
        default=d.pg_timeout,
        metavar="SECONDS",
        help="how long a rank waits for the others in a collective, and how long a rank may go "
        "without a heartbeat before the run is stopped naming it (default %(default)g)",
    )
    p.add_argument(
        "--save-on-signal",
        type=_signal_name,
        choices=SAVE_SIGNALS,
        default=None,
        metavar="SIG",
        help="on this signal (e.g. SIGUSR1, which Slurm's --signal sends) every rank finishes "
        "its step, saves a checkpoint of it and the run stops with exit status "
        f"{PREEMPTED_EXIT_CODE}, as on SIGTERM (always); one of {', '.join(SAVE_SIGNALS[1:])}",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def _signal_name(text: str) -> str:
    """A signal as --save-on-signal takes it: "USR1", "sigusr1" or "SIGUSR1" → "SIGUSR1"."""
    name = text.strip().upper()
    return name if name.startswith("SIG") else f"SIG{name}"


def train_args_from(ns: argparse.Namespace) -> TrainArgs:
    """TrainArgs from parsed flags."""
    return TrainArgs.from_dict(vars(ns))


def _fail(msg: str) -> int:
    print(f"orthoptim: error: {msg}", file=sys.stderr)
    return 2


def _train_cmd(ns: argparse.Namespace) -> int:
    from orthoptim.train.launcher import RankFailedError, launch
    from orthoptim.train.loop import Preempted

    args = train_args_from(ns)
    try:
        result = launch(args, ns.nproc)
    except (ValueError, FileNotFoundError, RankFailedError) as e:
        return _fail(str(e))
    except Preempted as stop:
        print(f"orthoptim: {stop}", file=sys.stderr)
        return stop.exit_code
    if "nothing_to_do" in result:
        print(result["nothing_to_do"])
        return 0
    keys = ("last_step", "final_val_loss", "tokens_per_s", "optimizer_share")
    print(json.dumps({k: result.get(k) for k in keys}))
    return 0


def _named_lrs(items: list[str]) -> dict[str, float]:
    """`--lr NAME=LR` flags as {name: lr}, refusing a malformed one by name."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--lr takes NAME=LR (e.g. --lr normuon=0.03), got {item!r}") from None
    return out


def _compare_cmd(ns: argparse.Namespace) -> int:
    from orthoptim.train import devices
    from orthoptim.train.compare import run_compare, table, written
    from orthoptim.train.launcher import RankFailedError
    from orthoptim.train.loop import Preempted

    require_extra("matplotlib", "orthoptim compare")  # its plot, before the runs
    try:
        lrs = _named_lrs(ns.lr)
    except ValueError as e:
        return _fail(str(e))
    opts = CompareArgs(
        optimizers=tuple(n.strip() for n in ns.optimizers.split(",") if n.strip()),
        lrs=lrs,
        nproc=ns.nproc,
        steps=ns.steps,
        batch=ns.batch,
        config=ns.config,
        out=ns.out,
        sweep=ns.sweep,
        data=ns.data,
        seed=ns.seed,
        eval_every=ns.eval_every,
        adamw_lr=ns.adamw_lr,
        muon_lr=ns.muon_lr,
        precision=ns.precision,
        state_dtype=ns.state_dtype,
        compile=ns.compile,
        shared_gpu=ns.shared_gpu,
        progress=ns.progress,
        segments=ns.segments,
        pp=ns.pp,
        ep=ns.ep,
        dp=ns.dp,
    )
    try:
        opts = opts.resolve(devices.visible_gpus())
        opts.validate()
        summary = run_compare(opts)
    except (ValueError, FileNotFoundError, RankFailedError) as e:
        return _fail(str(e))
    except Preempted as stop:
        # a compare does not resume: its next start replaces its runs
        print(
            f"orthoptim: compare stopped by {stop.signal} after step {stop.step} of one of its "
            f"runs; its runs so far are under {opts.out}: run the compare again to start over",
            file=sys.stderr,
        )
        return stop.exit_code
    print(table(summary))
    print(f"\nwrote {opts.out}/{', '.join(written(Path(opts.out)))}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim train` and `orthoptim compare`."""
    p = subparsers.add_parser("train", help="train a small byte-level GPT on N ranks")
    p.add_argument("--nproc", type=int, default=None, help=NPROC_HELP)
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the ranks this often after a rank fails (torchelastic), each time "
        "resuming from the last verified checkpoint, or afresh before the first "
        "(default %(default)s)",
    )
    add_train_arguments(p)
    p.set_defaults(func=_train_cmd)

    d, cpu, gpu = CompareArgs(), device_defaults("cpu"), device_defaults("cuda")

    def machine_default(name: str) -> str:
        return f"default {cpu[name]} on CPU, {gpu[name]} on CUDA"

    c = subparsers.add_parser(
        "compare", help="train with several optimizers (AdamW and Muon by default), report, plot"
    )
    c.add_argument(
        "--optimizers",
        default=",".join(d.optimizers),
        help=f"comma-separated, of {', '.join(OPTIMIZERS)} (default %(default)s); the baseline "
        "is adamw when compared, else the first",
    )
    c.add_argument("--nproc", type=int, default=None, help=NPROC_HELP)
    for flag, what in (
        ("--pp", "pipeline stages"),
        ("--ep", "expert-parallel size (dividing --dp; the MoE configs)"),
        ("--dp", "data-parallel ranks per stage (default --nproc / --pp)"),
    ):
        c.add_argument(flag, type=int, default=None, help=f"every run's {what}, as train's")
    c.add_argument("--steps", type=int, default=None, help=machine_default("steps"))
    c.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"sequences per rank per step ({machine_default('batch')})",
    )
    c.add_argument(
        "--config", choices=sorted(CONFIG_NAMES), default=None, help=machine_default("config")
    )
    c.add_argument(
        "--out",
        default=d.out,
        help="output folder: report.md, loss.png, summary.json and one run folder per "
        "optimizer (default %(default)s)",
    )
    c.add_argument(
        "--sweep",
        action="store_true",
        help="first try a small grid of matrix LRs for each optimizer given no --lr of its own, "
        "and keep the best (embeddings, head and gains stay at their LR)",
    )
    c.add_argument(
        "--data", default=None, help="a text file or folder (default: Python's stdlib source)"
    )
    c.add_argument(
        "--seed", type=int, default=d.seed, help="seed of every run (default %(default)s)"
    )
    c.add_argument("--eval-every", type=int, default=None, help=machine_default("eval_every"))
    c.add_argument(
        "--adamw-lr",
        type=float,
        default=None,
        help="the LR of the AdamW run (the baseline optimizer; default 3e-3), not of the "
        "AdamW part beside Muon and the other matrix optimizers",
    )
    c.add_argument("--muon-lr", type=float, default=None, help="Muon's LR (default 0.05)")
    c.add_argument(
        "--lr",
        action="append",
        default=[],
        metavar="NAME=LR",
        help="the LR of one compared optimizer (repeatable), e.g. --lr normuon=0.03",
    )
    c.add_argument(
        "--segments",
        type=int,
        default=d.segments,
        help="the runs take turns in this many segments (resuming), so load drifts hit all",
    )
    add_device_arguments(c)
    add_state_dtype_argument(c)
    c.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    c.set_defaults(func=_compare_cmd)
