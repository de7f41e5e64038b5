"""The cost model of the tensor-parallel modes, apart from the runs themselves: what a mode
costs one rank per batch (`TPShape` priced as `TPCost`: bytes sent, collective rounds,
flops, symmetric flops, bytes moved through memory), what that takes in seconds (`CostModel`,
which `auto` minimises and which decides whether a Gram travels packed), and what a batch
holds while it runs (`TPBatch` and each mode's transient bytes, which the planner's memory
model adds up).

The table of modes (`tensor_parallel.TP_MODES`) maps each mode to these and to its run.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from orthoptim import collectives, kernels
from orthoptim.ns_cost import NSForm, iterate_bytes
from orthoptim.shards import packed_triangle_size, shard_sizes, triangle_blocks


@dataclass(frozen=True)
class CostModel:
    """Seconds a mode is expected to take: bytes ÷ bandwidth + rounds·latency + flops ÷
    throughput (a symmetric product's flops weighted by `symmetric`) + bytes moved ÷
    memory_bandwidth + ops·launch.

    `bandwidth` is bytes per second one rank pushes through a collective (ring algorithm),
    `latency` the fixed cost of one collective, `throughput` the matmul flop rate,
    `symmetric` the time of a symmetric product (X·Xᵀ, b·A + c·A·A) ÷ the general product's
    (below 1 where a SYRK computes one triangle), `memory_bandwidth` the bytes per second an
    elementwise copy reads and writes, `launch` the fixed cost of one tensor operation. The
    defaults describe a GPU node with NVLink; `for_device` gives figures for a CPU process
    group instead, and `calibrate` measures the actual group.
    """

    bandwidth: float = 100e9
    latency: float = 20e-6
    throughput: float = 100e12
    symmetric: float = 1.0
    memory_bandwidth: float = 2e12
    launch: float = 5e-6

    def __post_init__(self) -> None:
        for name in (
            "bandwidth",
            "latency",
            "throughput",
            "symmetric",
            "memory_bandwidth",
            "launch",
        ):
            value = getattr(self, name)
            positive = name not in ("latency", "launch")
            if not (value >= 0.0 and math.isfinite(value)) or (positive and value == 0):
                raise ValueError(f"CostModel.{name} must be a finite positive number, got {value}")

    @classmethod
    def for_device(cls, device: torch.device | str | None) -> CostModel:
        """The default figures for ranks on `device`: the GPU node's (None or CUDA), or
        CPU_FIGURES for CPU ranks over gloo."""
        on = torch.device("cuda" if device is None else device)
        return cls() if on.type != "cpu" else cls(**CPU_FIGURES)

    def seconds(self, cost: TPCost) -> float:
        """Expected time of a mode whose per-rank cost is `cost`."""
        general = cost.flops - cost.symmetric_flops
        return (
            cost.bytes_sent / self.bandwidth
            + cost.rounds * self.latency
            + (general + self.symmetric * cost.symmetric_flops) / self.throughput
            + cost.moved / self.memory_bandwidth
            + cost.ops * self.launch
        )

    def packs(self, k: int, m: int, world_size: int, element_size: int) -> bool:
        """Whether all-reducing k symmetric m×m matrices as their packed upper triangle
        (`shards.pack_upper`) beats sending them whole: the bytes it saves on the link
        against its pass over memory and its per-block operations."""
        if world_size < 2:
            return False
        ring = 2 * (world_size - 1) / world_size
        saved = ring * k * (m * m - packed_triangle_size(m)) * element_size / self.bandwidth
        return saved > self.seconds(pack_cost(k, m, element_size))

    @classmethod
    def calibrate(
        cls,
        group: ProcessGroup | None = None,
        nbytes: int = 4 << 20,
        matmul_size: int = 512,
        repeats: int = 5,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> CostModel:
        """Measure bandwidth, latency, matmul throughput, the symmetric products' speed-up,
        memory bandwidth and launch cost on `group` with a quick probe.

        Every rank of `group` must call it. The slowest rank's figures are used on all ranks
        (a max all-reduce), so every rank's cost model, and hence `auto`'s choice, agrees.
        """
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        _, n = collectives.world(group)
        dev = collectives.device_for(group, device)
        elem = torch.empty((), dtype=dtype).element_size()

        def timed(fn: Any) -> float:
            fn()
            samples = []
            for _ in range(repeats):
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                fn()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                samples.append(time.perf_counter() - t0)
            return statistics.median(samples)

        big = torch.zeros(max(1, nbytes // elem), dtype=dtype, device=dev)
        tiny = torch.zeros(1, dtype=dtype, device=dev)
        a = torch.randn(matmul_size, matmul_size, dtype=dtype, device=dev)
        t_big = timed(lambda: collectives.all_reduce(big, group=group)) if n > 1 else 0.0
        t_tiny = timed(lambda: collectives.all_reduce(tiny, group=group)) if n > 1 else 0.0
        t_mm = timed(lambda: a @ a.mT)
        t_sym = timed(lambda: kernels.gram(a))
        t_copy = timed(lambda: big.clone())
        t_op = timed(lambda: tiny.add_(0.0))
        times = torch.tensor(
            [t_big, t_tiny, t_mm, t_sym, t_copy, t_op], dtype=torch.float64, device=dev
        )
        collectives.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        t_big, t_tiny, t_mm, t_sym, t_copy, t_op = times.tolist()
        defaults = cls.for_device(dev)
        sent = 2 * (n - 1) / n * big.numel() * elem
        return cls(
            bandwidth=sent / max(t_big - t_tiny, 1e-9) if n > 1 else defaults.bandwidth,
            latency=max(t_tiny, 0.0) if n > 1 else defaults.latency,
            throughput=2 * matmul_size**3 / max(t_mm, 1e-12),
            symmetric=min(1.0, max(t_sym / max(t_mm, 1e-12), 1e-3)),
            memory_bandwidth=2 * big.numel() * elem / max(t_copy, 1e-12),
            launch=max(t_op, 0.0),
        )


# CostModel figures for CPU ranks over gloo, one thread each, fitted on the project's 2-core
# machines to what `orthoptim bench tp --against eo` measured at 2 and 4 ranks (under them the
# model's pick of mode and form is within 1.06 of the measured fastest on each case): a
# collective's per-rank bandwidth and latency (gloo's transfers compete with the other ranks'
# products for the cores, so the effective bandwidth is a fifth of an idle link's), one rank's
# matmul rate while the others compute too, the blocked SYRK's time per symmetric product ÷
# the general product's, the bandwidth of packing's copies and gathers.
# `orth.calibrate()` measures them on the machine at hand instead.
CPU_FIGURES: dict[str, float] = {
    "bandwidth": 0.15e9,
    "latency": 2e-3,
    "throughput": 40e9,
    "symmetric": 0.8,
    "memory_bandwidth": 3e9,
    "launch": 10e-6,
}


@dataclass(frozen=True)
class TPCost:
    """Per-rank cost of orthogonalizing one batch: bytes sent, collective rounds, flops (of
    them `symmetric_flops` in symmetric products, whose SYRK computes one triangle), bytes
    moved through memory by packing and reassembly, and the tensor operations doing it."""

    bytes_sent: float
    rounds: int
    flops: float
    symmetric_flops: float = 0.0
    moved: float = 0.0
    ops: int = 0


def pack_cost(k: int, m: int, element_size: int) -> TPCost:
    """The memory traffic of packing k symmetric m×m matrices and unpacking the sum: about
    three passes over the matrices, five operations per row block (`shards.triangle_blocks`)."""
    return TPCost(
        0.0, 0, 0.0, moved=3.0 * k * m * m * element_size, ops=5 * len(triangle_blocks(m))
    )


class TPShape(NamedTuple):
    """A batch a mode is priced for: k global rows×cols matrices split along `shard_dim` (0:
    rows, 1: columns) over `world_size` ranks, `steps` iterations in `element_size`-byte
    elements; `packed`: its Gram all-reduces send the packed triangle (`CostModel.packs`)."""

    k: int
    rows: int
    cols: int
    shard_dim: int
    world_size: int
    steps: int
    element_size: int
    packed: bool = True

    @property
    def q(self) -> int:
        """The split side."""
        return (self.rows, self.cols)[self.shard_dim]

    @property
    def p(self) -> int:
        """The other side: the Gram over the split side is p×p."""
        return (self.cols, self.rows)[self.shard_dim]

    @property
    def q_local(self) -> int:
        """The busiest rank's share of the split side."""
        return max(shard_sizes(self.q, self.world_size))

    @property
    def ring(self) -> float:
        """Bytes a rank sends per byte all-reduced (ring algorithm)."""
        return 2 * (self.world_size - 1) / self.world_size

    def gram_bytes(self) -> float:
        """Bytes one rank sends all-reducing the k p×p Gram matrices once."""
        elems = packed_triangle_size(self.p) if self.packed else self.p * self.p
        return self.ring * self.k * elems * self.element_size

    def packing(self) -> TPCost:
        """The memory traffic of one Gram all-reduce's packing (none when sent whole)."""
        if not self.packed or self.world_size < 2:
            return TPCost(0.0, 0, 0.0)
        return pack_cost(self.k, self.p, self.element_size)


@dataclass(frozen=True)
class TPBatch:
    """A batch of k same-shape matrices one rank orthogonalizes, as the memory model sees it:
    its local shards `local` (rows, cols) of the global `full`, split along `shard_dim` (0:
    rows, 1: columns; None: not split), `steps` iterations in `ns_bytes` elements, updates of
    `state_bytes`; `local_form` is the form single-device Newton-Schulz takes on one local
    shard (`ns_cost.ns_path`)."""

    k: int
    local: tuple[int, int]
    full: tuple[int, int]
    shard_dim: int | None
    steps: int
    ns_bytes: int
    state_bytes: int
    local_form: NSForm = "step"


def local_transient(b: TPBatch) -> int:
    """Peak bytes of Newton-Schulz on the local shards alone (blockwise mode, and matrices
    not split): the output in the state dtype and the iteration (`ns_cost.iterate_bytes`)."""
    r, c = b.local
    m = min(r, c)
    x = b.k * r * c
    iterate = iterate_bytes(
        b.local_form, x * b.ns_bytes, b.k * m * m * b.ns_bytes, b.steps, b.ns_bytes == b.state_bytes
    )
    return x * b.state_bytes + iterate


def distributed_transient(b: TPBatch) -> int:
    """Peak bytes of distributed mode: the output copy (two when the split side is the rows:
    the transposed result is made contiguous apart), the last iterate and its p×p Gram in the
    iteration dtype (p the unsplit side), or the iteration itself (the iterate, the Gram, A·W
    and the next iterate)."""
    assert b.shard_dim is not None
    r, c = b.local
    x = b.k * r * c
    p = (r, c)[1 - b.shard_dim]
    gram = b.k * p * p * b.ns_bytes
    copies = 2 if b.shard_dim == 0 else 1
    return max(copies * x * b.state_bytes + x * b.ns_bytes + gram, 3 * x * b.ns_bytes + gram)


def duplicated_transient(b: TPBatch) -> int:
    """Peak bytes of duplicated mode: the local shard and the gathered and concatenated whole
    stack in the iteration dtype with the plain iteration on the whole stack, then the local
    slice of its output."""
    r, c = b.local
    x = b.k * r * c
    m, n = sorted(b.full)
    whole = b.k * m * n * b.ns_bytes
    iterate = iterate_bytes("step", whole, b.k * m * m * b.ns_bytes, b.steps, True)
    return x * b.ns_bytes + 2 * whole + max(iterate, whole + x * b.state_bytes)
