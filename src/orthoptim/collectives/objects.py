"""Python objects across ranks: every rank's object on every rank (`all_gather_object`) or
on one (`gather_object`), serialised with torch.save into byte tensors on the backend's
device and counted like any other collective."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.collectives.devices import backends, device_for
from orthoptim.collectives.errors import issue
from orthoptim.collectives.groups import global_rank, world
from orthoptim.collectives.ops import all_gatherv, all_reduce

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from orthoptim.comm_bytes import CommStats


def _to_bytes(obj: Any, device: torch.device) -> Tensor:
    """`obj` serialised with torch.save, as a uint8 tensor on `device`."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)


def _from_bytes(t: Tensor) -> Any:
    return torch.load(io.BytesIO(t.cpu().numpy().tobytes()), weights_only=False)


def all_gather_object(
    obj: Any, group: ProcessGroup | None = None, stats: CommStats | None = None
) -> list[Any]:
    """Every rank's `obj` (tensors included, serialised with torch.save), in rank order."""
    rank, n = world(group)
    if n == 1:
        return [obj]
    device = device_for(group)
    data = _to_bytes(obj, device)
    sizes = torch.zeros(n, dtype=torch.int64, device=device)
    sizes[rank] = data.numel()
    all_reduce(sizes, group=group, stats=stats)
    parts = all_gatherv(data, sizes.tolist(), group=group, stats=stats).wait()
    return [_from_bytes(p) for p in parts]


def gather_object(
    obj: Any, dst: int = 0, group: ProcessGroup | None = None, stats: CommStats | None = None
) -> list[Any] | None:
    """Every rank's `obj` on group rank `dst` (point to point, so only `dst` holds them all);
    None on the other ranks."""
    rank, n = world(group)
    if n == 1:
        return [obj]
    device = device_for(group)
    if device.type != "cpu" and backends(group).get(device.type) == "gloo":
        # gloo's send/recv read host memory only: with CUDA tensors ("cuda:gloo") every rank
        # gathers everything and the others drop it.
        parts = all_gather_object(obj, group=group, stats=stats)
        return parts if rank == dst else None
    data = _to_bytes(obj, device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    if rank != dst:
        peer = global_rank(group, dst)
        issue("gather", group, dist.send, size, peer)
        issue("gather", group, dist.send, data, peer)
        if stats is not None:
            stats.record("gather", size.numel() * 8 + data.numel(), 0)
        return None
    out: list[Any] = []
    for r in range(n):
        if r == rank:
            out.append(obj)
            continue
        peer = global_rank(group, r)
        issue("gather", group, dist.recv, size, peer)
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        issue("gather", group, dist.recv, buf, peer)
        if stats is not None:
            stats.record("gather", 0, 8 + buf.numel())
        out.append(_from_bytes(buf))
    return out
