"""Flop and byte formulas of one optimizer step, per rank.

Bytes follow the ring accounting of `orthoptim.parallel.collectives` (bytes a rank sends;
it receives the same amount):

    all_reduce      2·(N−1)/N · S
    reduce_scatter  (N−1)/N · S_in
    all_gather      (N−1)/N · S_out

Layer-wise optimizer, per bucket b of the assignment: gradients are reduce-scattered over a
flat buffer of N equal shards, each padded to the largest rank's share w_b of that bucket,
then the updated parameters are all-gathered with the same padding; a bucket with a single
owner is reduced to it and broadcast from it instead (S_b = the bucket's elements):

    sent = Σ_b (N−1)·w_b·(grad_bytes + gather_bytes)      (shared buckets)
         + Σ_b S_b·(gather_bytes if owner else grad_bytes) (single-owner buckets)

ZeRO-1 AdamW has the same two collectives over equal element shards of all P parameters:

    sent = (N−1)·⌈P/N⌉·(grad_bytes + gather_bytes)

Newton-Schulz on an m×n matrix (a = min, b = max), plain matmuls, per step: 4a²b + 2a³.
Tensor-parallel modes are costed by `orthoptim.parallel.tensor_parallel.tp_cost`, the model
the orthogonalizer's `auto` mode itself uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from orthoptim.parallel.tensor_parallel import (
    CostModel,
    TensorParallelOrthogonalizer,
    TPCost,
    tp_cost,
)

TP_MODES = ("duplicated", "distributed", "blockwise")


@lru_cache(maxsize=4096)
def ns_flops(shape: tuple[int, ...], steps: int) -> float:
    """Flops of `steps` plain-matmul Newton-Schulz iterations on one matrix."""
    a, b = sorted(shape[-2:])
    return float(steps * (4 * a * a * b + 2 * a**3))


def ring_all_reduce(nbytes: float, n: int) -> float:
    return 2 * (n - 1) / n * nbytes if n > 1 else 0.0


def ring_reduce_scatter(in_bytes: float, n: int) -> float:
    return (n - 1) / n * in_bytes if n > 1 else 0.0


def ring_all_gather(out_bytes: float, n: int) -> float:
    return (n - 1) / n * out_bytes if n > 1 else 0.0


def layerwise_bytes(
    owners: Sequence[int],
    buckets: Sequence[Sequence[int]],
    numels: Sequence[int],
    world: int,
    grad_bytes: int,
    gather_bytes: int,
) -> tuple[list[float], list[float]]:
    """(sent, received) bytes of every rank in one layer-wise step, per the bucket layout.

    A bucket shared by several owners is one reduce-scatter of N shards padded to the largest
    share w and one padded all-gather: (N−1)·w·(grad_bytes + gather_bytes) each way on every
    rank. A bucket with a single owner is reduced to it and broadcast from it: the owner
    receives S·grad_bytes and sends S·gather_bytes, every other rank the reverse (S = the
    bucket's elements).
    """
    sent = [0.0] * world
    received = [0.0] * world
    if world == 1:
        return sent, received
    for bucket in buckets:
        share = [0] * world
        for i in bucket:
            share[owners[i]] += numels[i]
        holders = [r for r in range(world) if share[r]]
        if len(holders) == 1:
            owner, size = holders[0], share[holders[0]]
            for r in range(world):
                mine = r == owner
                sent[r] += size * (gather_bytes if mine else grad_bytes)
                received[r] += size * (grad_bytes if mine else gather_bytes)
            continue
        width = max(share)
        each = ring_reduce_scatter(world * width * grad_bytes, world) + ring_all_gather(
            world * width * gather_bytes, world
        )
        for r in range(world):
            sent[r] += each
            received[r] += each
    return sent, received


def layerwise_unpadded_bytes(
    owners: Sequence[int],
    buckets: Sequence[Sequence[int]],
    numels: Sequence[int],
    world: int,
    grad_bytes: int,
    gather_bytes: int,
) -> list[float]:
    """Bytes every rank sends per step if shared buckets used true variable-size collectives
    (no padding): the shares of the other ranks, S_b − share_r, once each way. Single-owner
    buckets as in `layerwise_bytes`. The floor a reduce-scatter-v / all-gather-v reaches."""
    sent = [0.0] * world
    if world == 1:
        return sent
    for bucket in buckets:
        share = [0] * world
        for i in bucket:
            share[owners[i]] += numels[i]
        size = sum(share)
        holders = [r for r in range(world) if share[r]]
        for r in range(world):
            if len(holders) == 1:
                sent[r] += size * (gather_bytes if r == holders[0] else grad_bytes)
            else:
                sent[r] += (size - share[r]) * (grad_bytes + gather_bytes)
    return sent


def zero1_bytes(numel: int, world: int, grad_bytes: int, gather_bytes: int) -> float:
    """Bytes one rank sends per step under ZeRO-1: reduce-scatter grads, all-gather params."""
    shard = math.ceil(numel / world)
    return ring_reduce_scatter(world * shard * grad_bytes, world) + ring_all_gather(
        world * shard * gather_bytes, world
    )


@lru_cache(maxsize=4096)
def tp_ns_cost(
    shape: tuple[int, ...],
    tp_dim: int | None,
    tp: int,
    mode: str,
    steps: int,
    dtype_bytes: int,
    cost_model: CostModel,
) -> tuple[TPCost, str]:
    """Per-TP-rank cost of orthogonalizing one matrix, and distributed mode's form.

    The tensor-parallel orthogonalizer's own cost model (`tp_cost`): `shape` is the full
    matrix, split along `tp_dim` over `tp` ranks; distributed mode uses the form (apply,
    square, split) the orthogonalizer's `cost_model` would choose. A replicated matrix
    (`tp_dim` None) or tp = 1 costs the full single-device iteration and no bytes.
    """
    if mode not in TP_MODES:
        raise ValueError(f"mode must be one of {TP_MODES}, got {mode!r}")
    if tp_dim is None or tp == 1:
        return TPCost(0.0, 0, ns_flops(shape, steps)), ""
    rows, cols = shape[-2:]
    form = "apply"
    if mode == "distributed":
        chooser = TensorParallelOrthogonalizer(
            mode="distributed", shard_dim=tp_dim, steps=steps, cost_model=cost_model
        )
        form = chooser.choose_form(1, rows, cols, tp_dim, tp, steps, dtype_bytes)
    return tp_cost(mode, 1, rows, cols, tp_dim, tp, steps, dtype_bytes, form=form), form
