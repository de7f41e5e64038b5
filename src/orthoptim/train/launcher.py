"""Starting ranks: `run` (one rank, as torchrun starts it) and `launch` (this machine's ranks
through PyTorch's elastic launcher, the machinery behind `torchrun`).

Devices (`orthoptim.train.devices`): gloo ranks on CPU; on CUDA rank r on cuda:LOCAL_RANK over
NCCL, or with `--shared-gpu` every rank on cuda:0 over "cuda:gloo".
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from orthoptim.parallel import collectives
from orthoptim.train import devices
from orthoptim.train.args import TrainArgs
from orthoptim.train.data import load_corpus
from orthoptim.train.devices import plan_ranks
from orthoptim.train.loop import _all_sum, _setup_logging, train
from orthoptim.train.model import get_config
from orthoptim.train.runfolder import _nothing_to_do, acquire_lock, claim_out, release_lock


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
        return train(args, rank, world_size, device, out, log)
    finally:
        for h in list(log.handlers):
            log.removeHandler(h)
            h.close()


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
