"""Run a function on N real ranks (separate processes) and collect what each returns.

    results = run_ranks(fn, world_size=2, args=(...,))   # fn(rank, world_size, *args)
    results = run_ranks(fn, 2, backend="cuda:gloo", device="cuda:0")   # ranks share one GPU

Each rank runs `fn` after `init_process_group(backend)` (default "gloo"); with a CUDA
`device` it first calls `torch.cuda.set_device(device)`, so every rank can share one GPU
("cuda:gloo": CUDA tensors only, as under NCCL, which refuses two ranks on one GPU). Its
return value (picklable) comes back in rank order. An exception on any rank fails the caller
with that rank's traceback. Ranks are forks of one server process (the "forkserver" start
method) that imported torch once, each given the caller's environment as it is at the call.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from orthoptim.collectives import backend_devices

# Ranks start as forks of one server process that has imported these already (torch's
# import and the torch._dynamo import its first optimizer triggers cost seconds per rank).
mp.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "orthoptim"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    outdir: str,
    fn: Callable,
    args: tuple,
    backend: str = "gloo",
    device: str | None = None,
    timeout: float | None = None,
    environ: dict[str, str] | None = None,
) -> None:
    if environ is not None:  # the caller's environment now, not the fork server's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        if device is not None and torch.device(device).type == "cuda":
            torch.cuda.set_device(torch.device(device))
        kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            **kw,
        )
        result = fn(rank, world_size, *args)
        # Work `fn` left in flight (a layer-wise optimizer's last parameter gathers) must end
        # before the group is destroyed: gloo's barrier waits for every pending operation
        # (a CPU barrier: not under "cuda:gloo", which serves CUDA tensors only).
        if "cpu" in backend_devices():
            dist.barrier()
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is saved: leave without the interpreter's teardown, whose C++ destructors
    # (a c10d thread still joinable) now and then abort a finished rank with "terminate
    # called without an active exception" on this 2-core machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    backend: str = "gloo",
    device: str | torch.device | None = None,
    timeout: float | None = None,
) -> list[Any]:
    """Spawn `world_size` ranks running fn(rank, world_size, *args); return their results.

    `backend` is what `init_process_group` gets ("gloo", "cuda:gloo", ...); a CUDA `device`
    is made each rank's current device before the group starts (every rank may name the same
    GPU); `timeout` (seconds) bounds every collective's wait (default: torch's).
    """
    device = None if device is None else str(device)
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        try:
            mp.start_processes(
                _worker,
                args=(
                    world_size,
                    port,
                    outdir,
                    fn,
                    args,
                    backend,
                    device,
                    timeout,
                    dict(os.environ),
                ),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
        except Exception as exc:
            errors = []
            for r in range(world_size):
                p = os.path.join(outdir, f"rank{r}.pt")
                if not os.path.exists(p):
                    errors.append(f"--- rank {r} ---\ndied before returning a result")
                    continue
                out = torch.load(p, weights_only=False)
                if not out["ok"]:
                    errors.append(f"--- rank {r} ---\n{out['error']}")
            raise AssertionError("distributed run failed:\n" + "\n".join(errors)) from exc
        return [
            torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)["result"]
            for r in range(world_size)
        ]
