"""Run a function on N real gloo ranks (separate processes) and collect what each returns.

    results = run_ranks(fn, world_size=2, args=(...,))   # fn(rank, world_size, *args)

Each rank runs `fn` after `init_process_group("gloo")`; its return value (picklable) comes
back in rank order. An exception on any rank fails the caller with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, outdir: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    path = os.path.join(outdir, f"rank{rank}.pt")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, path)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = ()) -> list[Any]:
    """Spawn `world_size` gloo ranks running fn(rank, world_size, *args); return their results."""
    with tempfile.TemporaryDirectory() as outdir:
        port = free_port()
        try:
            mp.spawn(
                _worker, args=(world_size, port, outdir, fn, args), nprocs=world_size, join=True
            )
        except Exception as exc:
            errors = []
            for r in range(world_size):
                p = os.path.join(outdir, f"rank{r}.pt")
                if os.path.exists(p):
                    out = torch.load(p, weights_only=False)
                    if not out["ok"]:
                        errors.append(f"--- rank {r} ---\n{out['error']}")
            raise AssertionError("distributed run failed:\n" + "\n".join(errors)) from exc
        return [
            torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False)["result"]
            for r in range(world_size)
        ]
