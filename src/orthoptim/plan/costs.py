"""Flop and byte formulas of one optimizer step, per rank.

Bytes follow the accounting of `orthoptim.collectives` (its module docstring; the
formulas are its `ring_*_bytes`, `reduce_bytes` and `broadcast_bytes`): per rank, what the
ring / pipelined-chain algorithm sends and receives, so that summed over the ranks sent =
received for every collective. With S = a collective's bytes over N ranks:

    all_reduce      2·(N−1)/N · S each way
    reduce_scatter  (N−1)/N · S_in each way (equal chunks)
    all_gather      (N−1)/N · S_out each way (equal chunks)
    reduce          S sent by every rank but the destination, received by all but the next
    broadcast       S received by every rank but the root, sent by all but the one before it

Layer-wise optimizer, per bucket b of the assignment: gradients are reduce-scattered over a
flat buffer of N equal shards, each padded to the largest rank's share w_b of that bucket,
then the updated parameters are all-gathered with the same padding; a bucket with a single
owner is reduced to it and broadcast from it instead (S_b = the bucket's elements):

    sent ≈ received ≈ Σ_b (N−1)·w_b·(grad_bytes + gather_bytes)   (shared buckets)
                    + Σ_b S_b·(grad_bytes + gather_bytes)         (single-owner buckets,
                      less S_b·grad_bytes on its owner and S_b·gather_bytes on owner−1)

so over all ranks both paths move 2·(N−1)·S per byte of gradient and parameter. Without the
padding (the "unpadded" figures: reduce-scatter-v / all-gather-v of the true shares) rank r
sends (S_b − share_r)·grad_bytes + (S_b − share_{r+1})·gather_bytes per bucket, which for a
single owner is exactly the reduce + broadcast above.

ZeRO-1 AdamW has the same two collectives over equal element shards of all P parameters:

    sent = received = (N−1)·⌈P/N⌉·(grad_bytes + gather_bytes)

Newton-Schulz on one matrix is costed by `orthoptim.ns_cost`; the tensor-parallel modes by
the orthogonalizer's own table (`orthoptim.parallel.tensor_parallel.TP_MODES`), the model its
`auto` mode itself uses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from orthoptim.comm_bytes import (
    broadcast_bytes,
    ordered_reduce_bytes,
    reduce_bytes,
    ring_all_gather_bytes,
    ring_reduce_scatter_bytes,
)
from orthoptim.ns_cost import ns_flops
from orthoptim.parallel.tensor_parallel import (
    TP_MODES,
    CostModel,
    TensorParallelOrthogonalizer,
    TPCost,
)


def layerwise_bytes(
    owners: Sequence[int],
    buckets: Sequence[Sequence[int]],
    numels: Sequence[int],
    world: int,
    grad_bytes: int,
    gather_bytes: int,
    padded: bool = True,
    split: Sequence[Sequence[int]] = (),
    rank_major: Sequence[bool] = (),
    ordered: bool = False,
) -> tuple[list[float], list[float]]:
    """(sent, received) bytes of every rank in one layer-wise step, per the bucket layout.

    A rank-major bucket (`rank_major[b]`, from `Assignment.rank_major`: several owners,
    padding to the largest share w at most `MAX_PADDING`) is one reduce-scatter of N
    shards of w and one all-gather: (N−1)·w·(grad_bytes + gather_bytes) each way on every rank; with
    `padded=False` every shared bucket counts so, with the true shares (reduce-scatter-v /
    all-gather-v on the ring). Any other bucket is reduced to and broadcast from each owner
    (pipelined chains, `comm_bytes.reduce_bytes` / `broadcast_bytes`).
    Units sharded element-wise (owner -1, AdamW) count by `split[b][r]`, the elements of
    bucket b rank r holds (`Assignment.adamw_split`). `ordered` (`reproducible=True`): every
    bucket's reduction is one all-to-all of the owners' shares (`ordered_reduce_bytes`).
    """
    sent = [0.0] * world
    received = [0.0] * world
    if world == 1:
        return sent, received
    for b, bucket in enumerate(buckets):
        share = [0] * world
        for i in bucket:
            if owners[i] >= 0:
                share[owners[i]] += numels[i]
        if b < len(split) and split[b]:
            share = [s + x for s, x in zip(share, split[b])]
        holders = [r for r in range(world) if share[r]]
        if ordered and holders:
            nothing = [(0.0, 0.0)] * world
            if rank_major[b]:
                chunks = [max(share)] * world
                gather = ring_all_gather_bytes([c * gather_bytes for c in chunks])
                moves = [(ordered_reduce_bytes(chunks, grad_bytes), gather)]
            else:
                moves = [(ordered_reduce_bytes(share, grad_bytes), nothing)]
                moves += [
                    (nothing, broadcast_bytes(share[o] * gather_bytes, world, o)) for o in holders
                ]
        elif len(holders) > 1 and (not padded or rank_major[b]):
            chunks = share if not padded else [max(share)] * world
            moves = [
                (
                    ring_reduce_scatter_bytes([c * grad_bytes for c in chunks]),
                    ring_all_gather_bytes([c * gather_bytes for c in chunks]),
                )
            ]
        else:
            moves = [
                (
                    reduce_bytes(share[o] * grad_bytes, world, o),
                    broadcast_bytes(share[o] * gather_bytes, world, o),
                )
                for o in holders
            ]
        for rs, ag in moves:
            for r in range(world):
                sent[r] += rs[r][0] + ag[r][0]
                received[r] += rs[r][1] + ag[r][1]
    return sent, received


def layerwise_unpadded_bytes(
    owners: Sequence[int],
    buckets: Sequence[Sequence[int]],
    numels: Sequence[int],
    world: int,
    grad_bytes: int,
    gather_bytes: int,
    split: Sequence[Sequence[int]] = (),
) -> tuple[list[float], list[float]]:
    """(sent, received) of every rank if shared buckets used true variable-size collectives
    (no padding): the floor a ring reduce-scatter-v / all-gather-v reaches. Single-owner
    buckets as in `layerwise_bytes`."""
    return layerwise_bytes(owners, buckets, numels, world, grad_bytes, gather_bytes, False, split)


def zero1_bytes(numel: int, world: int, grad_bytes: int, gather_bytes: int) -> float:
    """Bytes one rank sends (and receives) per step under ZeRO-1: reduce-scatter grads,
    all-gather params, over `world` equal shards of ⌈numel / world⌉ elements."""
    shard = math.ceil(numel / world)
    if world == 1:
        return 0.0
    rs = ring_reduce_scatter_bytes([shard * grad_bytes] * world)[0]
    ag = ring_all_gather_bytes([shard * gather_bytes] * world)[0]
    return rs[0] + ag[0]


@lru_cache(maxsize=4096)
def tp_ns_cost(
    shape: tuple[int, ...],
    tp_dim: int | None,
    tp: int,
    mode: str,
    steps: int,
    dtype_bytes: int,
    cost_model: CostModel,
    k: int = 1,
) -> tuple[TPCost, str]:
    """Per-TP-rank cost of orthogonalizing a stack of `k` same-shape matrices in one call
    (as Muon hands the orthogonalizer each shape's stack), and the form it takes.

    The tensor-parallel orthogonalizer's own cost model (`mode_cost`, from its table of
    modes): `shape` is the full matrix, split along `tp_dim` over `tp` ranks, each mode in the
    form an orthogonalizer with `cost_model` would take (distributed: apply, square, split or
    rows, its cost model's pick; gram: gram, or rows when split along the short side; ""
    for a mode without forms). A replicated matrix (`tp_dim` None) or tp = 1 costs the full
    single-device plain iteration and no bytes.
    """
    if mode not in TP_MODES:
        raise ValueError(f"mode must be one of {tuple(TP_MODES)}, got {mode!r}")
    if tp_dim is None or tp == 1:
        return TPCost(0.0, 0, k * ns_flops(*shape[-2:], steps)), ""
    rows, cols = shape[-2:]
    chooser = TensorParallelOrthogonalizer(shard_dim=tp_dim, steps=steps, cost_model=cost_model)
    return chooser.mode_cost(mode, k, rows, cols, tp_dim, tp, dtype_bytes)
