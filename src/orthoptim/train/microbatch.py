"""The global batch of one step as micro-batches: which of them a rank runs, its accumulation
loop, and the means a step logs.

A step trains on M = global batch / --batch micro-batches, micro-batch j of step s being
`get_batch(..., seed, s, j)` whatever the layout: the same sequences at every --nproc. At
data-parallel size dp rank r runs the contiguous block [r·k, (r+1)·k), k = M / dp, the first
k - 1 backward passes inside `opt.no_sync()` and the last outside it, each loss divided by k
(the loop `LayerwiseDistributedOptimizer(reproducible=True)` is bitwise the same for at every
power-of-two dp). Without --global-batch M = dp and k = 1: rank r's one micro-batch is
(seed, step, r), the batch it always had.

Under --reproducible the logged means do not depend on the layout either: every rank's
per-micro-batch losses are gathered into the M-vector ordered by global index and summed in
float64 in that order (`ordered_sum`); each validation batch's loss is counted by one rank
and summed likewise (`ordered_evaluate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from orthoptim import collectives
from orthoptim.train.data import get_batch
from orthoptim.train.devices import autocast

# Intra-op threads of every rank under --reproducible, at every --nproc: a CPU reduction's
# (and a matmul's) blocking follows torch's thread count, and so may its rounding; one thread
# is the count every --nproc can give each rank on any machine.
REPRODUCIBLE_THREADS = 1


def rank_block(dp_rank: int, accumulation: int) -> range:
    """The global micro-batch indices data-parallel rank `dp_rank` runs in a step."""
    return range(dp_rank * accumulation, (dp_rank + 1) * accumulation)


def micro_batches(
    data: Tensor,
    batch: int,
    seq_len: int,
    seed: int,
    step: int,
    block: Iterable[int],
    device: torch.device,
) -> list[tuple[Tensor, Tensor]]:
    """Micro-batches `block` (global indices) of step `step`, on `device`."""
    out = []
    for j in block:
        x, y = get_batch(data, batch, seq_len, seed, step, j)
        out.append((x.to(device), y.to(device)))
    return out


def forward_backward(
    model: nn.Module,
    opt: Any,
    batches: list[tuple[Tensor, Tensor]],
    device: torch.device,
    precision: str,
    pipeline: Any = None,
) -> list[float]:
    """Forward and backward over this rank's micro-batches: all but the last inside
    `opt.no_sync()` (where the optimizer has one), each loss divided by their number before
    backward (not when it is 1: the step without accumulation is the one it always was).
    Returns each micro-batch's mean loss, in order. A `pipeline` steps its batch itself
    (one micro-batch per step: `TrainArgs.accumulation` refuses more)."""
    k = len(batches)
    no_sync = getattr(opt, "no_sync", None)
    losses = []
    for i, (x, y) in enumerate(batches):
        quiet = no_sync() if no_sync is not None and i < k - 1 else contextlib.nullcontext()
        with quiet:
            with autocast(device, precision):
                if pipeline is not None:  # its mean loss, on every stage
                    losses.append(float(pipeline.step(x, y)))
                    continue
                out = model(x, y)
            (out / k if k > 1 else out).backward()
        losses.append(out.item())
    return losses


def ordered_sum(values: Iterable[float]) -> float:
    """`values` summed one after the other in float64, in the order given."""
    total = 0.0
    for v in values:
        total += v
    return total


def step_loss(
    losses: list[float], asked: float, dp_rank: int, world_size: int, ordered: bool
) -> tuple[float, float]:
    """(the step's training loss over every rank, the sum of the ranks' stop flags `asked`).

    `ordered` (--reproducible): every rank's micro-batch losses gathered, ordered by global
    index and summed in that order, over M; otherwise each rank's mean over its micro-batches,
    summed over the ranks by all-reduce and divided by `world_size` (every rank of one
    data-parallel index holds its loss)."""
    if not ordered:
        mine = ordered_sum(losses) / len(losses)
        train_loss, stops = collectives.sum_floats([mine / world_size, asked])
        return train_loss, stops
    rows = collectives.gather_floats([float(dp_rank), *losses, asked])
    rows.sort(key=lambda row: row[0])  # by data-parallel index: blocks in global order
    every = [v for row in rows for v in row[1:-1]]
    return ordered_sum(every) / len(every), ordered_sum(row[-1] for row in rows)


@torch.no_grad()
def ordered_evaluate(
    model: nn.Module,
    batches: list[tuple[Tensor, Tensor]],
    rank: int,
    world_size: int,
    precision: str,
) -> float:
    """Mean validation loss over the fixed batches, the same bits at every `world_size`:
    batch j counted by rank j mod world_size alone, each batch's loss × tokens and tokens in
    the slot of its index (the all-reduce adds exact zeros to them), summed in index order."""
    n = len(batches)
    slots = [0.0] * (2 * n)
    model.eval()
    for j in range(rank, n, world_size):
        x, y = batches[j]
        with autocast(x.device, precision):
            slots[j] = model(x, y).item() * y.numel()
        slots[n + j] = float(y.numel())
    model.train()
    with collectives.phase("validation loss (all-reduce of the per-batch losses)"):
        summed = collectives.sum_floats(slots)
    return ordered_sum(summed[:n]) / ordered_sum(summed[n:])


@contextlib.contextmanager
def reproducible_rank(reproducible: bool) -> Iterator[None]:
    """The block (a rank's training) under --reproducible's REPRODUCIBLE_THREADS intra-op
    threads, the count before restored after; nothing without `reproducible`. (Newton-Schulz's
    path the driver pins itself under reproducible=True: `kernels.unraced`.)"""
    if not reproducible:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(REPRODUCIBLE_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)
