"""Newton-Schulz for matrices split across tensor-parallel ranks.

Under tensor parallelism each rank holds a slice of every weight matrix (column-parallel:
a block of output rows; row-parallel: a block of input columns), but Newton-Schulz needs the
whole matrix. `TensorParallelOrthogonalizer` is the callable Muon takes as `orthogonalizer`;
it orthogonalizes a stacked batch [k, rows, cols] of local shards in one of five modes:

- ``duplicated``: all-gather the shards (in the Newton-Schulz dtype, so bf16 halves the
  bytes), run the full iteration on every rank, keep the local slice. One collective, T×
  the compute.
- ``distributed``: with the sharded dimension moved last, W = [W_1 | ... | W_T], the Gram
  matrix A = W·Wᵀ = Σ_i W_i·W_iᵀ is a sum over ranks, and the update W_i ← a·W_i + B·W_i with
  B = b·A + c·A·A needs only A and the local block. Each step all-reduces the partial Gram
  once, packed (the upper triangle, p(p+1)/2 elements instead of p²). B·W_i is applied in
  one of three forms: ``apply`` computes b·(A·W_i) + c·(A·(A·W_i)) (4p²q/T flops, no p³
  product, no extra communication); ``square`` forms B on every rank (2p³ + 2p²q/T);
  ``split`` has each rank form a balanced share of B's upper triangle (about p³/T) and
  all-gathers the packed pieces (one more collective of about p²/2 elements per step).
  ``rows`` is for a matrix sharded along its short side, whose Gram over the sharded
  dimension would be the large one: with X = Wᵀ (q×p, q the short, sharded side, rows
  X_i on rank i), each step all-gathers X, forms its rows A_i = X_i·Xᵀ of the small q×q
  Gram, all-gathers them, and updates X_i ← a·X_i + (b·A_i + c·A_i·A)·X: exactly 1/T of
  the single-device plain iteration's flops, for two all-gathers per step (the matrix and
  its Gram). The cost model picks the cheapest per shape; `orthoptim bench tp` measures
  the forms. The matrix is
  normalised by its global Frobenius norm (one k-element all-reduce). Since
  (X·Xᵀ)·X = X·(Xᵀ·X), using the Gram side that sums over the sharded dimension gives the
  same iteration as the single-device one whatever the global orientation.
- ``gram``: the Gram form of Newton-Schulz (`newton_schulz_gram_form`) over the ranks.
  Every iterate is X_k = R_k·X_0 with R_k a polynomial in the small s×s Gram matrix
  A = X_0·X_0ᵀ (s the unsplit side, when it is the shorter one: X_0 split along its long
  side), so A = Σ_i X_i·X_iᵀ needs one packed all-reduce; the steps then run on s×s
  matrices, the same on every rank, and each rank applies R to its own block. The
  norm is folded into A (‖X‖_F² = tr A). Where the single-device form restarts (every
  GRAM_FORM_RESTART steps, A recomputed from X_k), that is one more all-reduce: at the
  default 5 steps two per batch instead of distributed's 5 + 1, for (8L − 6)·s³ flops per
  run of L steps (28·s³ at 5 steps) of the small iteration repeated on every rank. A
  matrix split along its short side (the Gram over the split dimension would be the large
  one) takes the ``rows`` form below instead, its norm read from the first gathered matrix
  (no norm all-reduce either).
  `last_forms` says which form each batch took ("gram" or "rows").
- ``blockwise``: each rank orthogonalizes its own shard, no communication. Not the same
  as full Newton-Schulz: every shard becomes (near) orthogonal on its own, so a column-
  parallel slice gets orthonormal rows where the full result's slice would not; the
  deviation is measured by `orthoptim bench tp`.
- ``auto``: a cost model (bytes ÷ bandwidth + rounds × latency + flops ÷ throughput) picks
  duplicated, distributed or gram per batch, identically on every rank. Never blockwise.

Inputs are DTensors (as `parallelize_module` makes them: the group and shard dimension are
read from the mesh and placements, uneven shards allowed, an empty one too: a matrix with
fewer rows than ranks) or plain local shards (the group and `shard_dim` given at
construction). Plain shards carry no global shape, so every mode that communicates first
all-gathers each rank's shape (`SHAPES_KIND`, 3 integers per rank, one host read) and
refuses shards that differ, on every rank alike; blockwise takes any. An empty shard
contributes nothing and issues every collective the other ranks do. Every collective goes
through `orthoptim.collectives`, counted in `stats`.
"""

from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from orthoptim import collectives, host, kernels
from orthoptim._validate import check_choice, check_dtype_or_auto, check_member, check_positive
from orthoptim.comm_bytes import CommStats
from orthoptim.newton_schulz import (
    GRAM_FORM_RESTART,
    Coefficients,
    CoefficientsLike,
    NSDtype,
    coefficient_schedule,
    newton_schulz,
    resolve_ns_dtype,
    squared_frobenius,
)
from orthoptim.shards import (
    is_dtensor,
    pack_block_row,
    packed_triangle_size,
    shard_sizes,
    triangle_block_size,
    triangle_blocks,
    unpack_upper,
)

TPMode = Literal["auto", "duplicated", "distributed", "gram", "blockwise"]
MODES: tuple[TPMode, ...] = get_args(TPMode)


def auto_modes(dtype_bytes: int) -> tuple[TPMode, ...]:
    """The modes `auto` chooses among for a Newton-Schulz dtype of `dtype_bytes`: gram only
    for float32 and wider. The Gram form squares the condition number, so in half precision
    it is several times less accurate than the step form (as single-device Newton-Schulz
    keeps its Gram form to float32/float64); `mode="gram"` still forces it."""
    return (
        ("duplicated", "distributed", "gram") if dtype_bytes >= 4 else ("duplicated", "distributed")
    )


TPForm = Literal["auto", "apply", "square", "split", "rows"]
FORMS: tuple[TPForm, ...] = get_args(TPForm)
# the forms gram mode takes: "gram" (split along the long side), "rows" (the short side)
GramForm = Literal["gram", "rows"]

# CommStats kinds, so benchmarks and tests can tell the collectives of each mode apart.
GRAM_KIND = "all_reduce_gram"
NORM_KIND = "all_reduce_norm"
GATHER_KIND = "all_gather"
SPLIT_KIND = "all_gather_split"
ROWS_KIND = "all_gather_rows"
SHAPES_KIND = "all_gather_shapes"  # plain shards: every rank's (k, rows, cols), checked equal


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


# CostModel figures for CPU ranks over gloo, one thread each, measured on the project's 2-core
# machines with the ranks sharing the cores (`orthoptim bench tp --against eo`): a collective's
# per-rank bandwidth and latency, one rank's matmul rate while the others compute too, the
# blocked SYRK's time per symmetric product ÷ the general product's, a copy's bandwidth.
CPU_FIGURES: dict[str, float] = {
    "bandwidth": 0.5e9,
    "latency": 400e-6,
    "throughput": 25e9,
    "symmetric": 0.65,
    "memory_bandwidth": 5e9,
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


def split_plan(p: int, world_size: int) -> list[list[tuple[int, int]]]:
    """Row blocks [(start, stop), ...] of a p×p symmetric product's upper triangle, per rank.

    Block rows s..e−1 cost (e−s)·(p−s) multiply-adds (a row slab times the columns from s on);
    about 4 blocks per rank, dealt largest first to the least loaded rank, balance that work.
    """
    blocks = triangle_blocks(p, 4 * world_size)
    load = [0] * world_size
    plan: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for a, b in sorted(blocks, key=lambda blk: -(blk[1] - blk[0]) * (p - blk[0])):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += (b - a) * (p - a)
        plan[r].append((a, b))
    return [sorted(blks) for blks in plan]


def _distributed_flops(
    p: int, q: int, q_local: int, world_size: int, form: str
) -> tuple[float, float, float]:
    """(flops per step per matrix, of them in symmetric products, elements all-gathered per
    step per matrix) of a form, for a p×q matrix sharded along q (q_local on the busiest
    rank). The partial Gram and, in the square form, b·A + c·A·A are symmetric products."""
    if form == "rows":
        return 4 * q_local * q * p + 2 * q_local * q * q, 0.0, float(q_local * (p + q))
    gram = 2 * p * p * q_local
    if form == "apply":
        return gram + 4 * p * p * q_local, gram, 0.0
    if form == "square":
        return gram + 2 * p**3 + 2 * p * p * q_local, gram + 2 * p**3, 0.0
    if form == "split":
        plan = split_plan(p, world_size)
        share = max(sum(2 * (b - a) * p * (p - a) for a, b in blks) for blks in plan)
        widest = max(sum(triangle_block_size(a, b, p) for a, b in blks) for blks in plan)
        return gram + share + 2 * p * p * q_local, gram, float(widest)
    raise ValueError(f"form must be one of {FORMS[1:]}, got {form!r}")


def gram_mode_form(rows: int, cols: int, shard_dim: int) -> GramForm:
    """The form gram mode takes for a rows×cols matrix split along `shard_dim` (0/1): "gram"
    when the split side is the long one (or the matrix is square), else "rows"."""
    split, other = (rows, cols)[shard_dim], (cols, rows)[shard_dim]
    return "gram" if other <= split else "rows"


def gram_runs(steps: int) -> list[int]:
    """The lengths of the runs of steps between the restarts of the single-device Gram form
    (`newton_schulz_gram_form`: GRAM_FORM_RESTART steps each, the last what is left). Gram
    mode all-reduces the Gram matrix once per run."""
    return [min(GRAM_FORM_RESTART, steps - s) for s in range(0, steps, GRAM_FORM_RESTART)]


def gram_restarts(steps: int) -> int:
    """All-reduces of the Gram matrix gram mode makes per batch (`gram_runs`)."""
    return len(gram_runs(steps))


def _gram_run(
    A: Tensor, run: list[Coefficients], syrk: kernels.Syrk, sym_matmul: kernels.SymMatmul
) -> Tensor:
    """R = Q_{L−1}···Q_0 of one run of L steps from the Gram matrix A ([k, s, s]), the
    products of `newton_schulz_gram_form`'s run in the same order: the run takes X to R·X."""
    R: Tensor | None = None
    for i, (a, b, c) in enumerate(run):
        Q = syrk(A, A, b, c)
        Q.diagonal(dim1=-2, dim2=-1).add_(a)
        R = Q if R is None else sym_matmul(Q, R)
        if i < len(run) - 1:
            A = sym_matmul(sym_matmul(A, Q), Q)
    assert R is not None
    return R


def _norm_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype norms are summed in: float64 for a float64 iteration, else float32."""
    return torch.float64 if compute == torch.float64 else torch.float32


def tp_cost(
    mode: TPMode,
    k: int,
    rows: int,
    cols: int,
    shard_dim: int,
    world_size: int,
    steps: int,
    element_size: int,
    form: TPForm = "apply",
    packed: bool = True,
) -> TPCost:
    """Per-rank cost of `mode` on k global rows×cols matrices sharded along `shard_dim` (0/1).

    `form` is distributed mode's way of applying B (apply, square, split or rows); gram
    mode's form follows from the shape (`gram_mode_form`). `packed`: the Gram all-reduces
    send the packed upper triangle (`CostModel.packs` decides it for the runtime).

    Flops count plain matmuls (2·m·n·k each), those of symmetric products apart. Bytes are
    what one rank sends under the ring algorithm, as `comm_bytes.CommStats` records them;
    bytes moved, what packing and the reassembly of gathered pieces read and write.
    """
    shape = _CostShape(k, rows, cols, shard_dim, world_size, steps, element_size, packed)
    if mode == "duplicated":
        return _duplicated_cost(shape)
    if mode == "distributed":
        if form == "auto":
            raise ValueError("tp_cost needs a concrete form (apply, square, split or rows)")
        return _distributed_cost(shape, form)
    if mode == "gram":
        return _gram_cost(shape)
    if mode == "blockwise":
        return _blockwise_cost(shape)
    raise ValueError(f"mode must be one of {MODES[1:]}, got {mode!r}")


@dataclass(frozen=True)
class _CostShape:
    """What a mode's cost depends on: k global rows×cols matrices split along `shard_dim`
    over `world_size` ranks, `steps` iterations, `element_size` bytes on the wire."""

    k: int
    rows: int
    cols: int
    shard_dim: int
    world_size: int
    steps: int
    element_size: int
    packed: bool

    @property
    def q(self) -> int:  # the split side
        return (self.rows, self.cols)[self.shard_dim]

    @property
    def p(self) -> int:  # the other side: the Gram over the split side is p×p
        return (self.cols, self.rows)[self.shard_dim]

    @property
    def q_local(self) -> int:  # the busiest rank's share of the split side
        return max(shard_sizes(self.q, self.world_size))

    @property
    def ring(self) -> float:
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


def _duplicated_cost(c: _CostShape) -> TPCost:
    m, n = min(c.rows, c.cols), max(c.rows, c.cols)
    sent = (c.world_size - 1) * c.k * c.q_local * c.p * c.element_size
    flops = c.steps * c.k * (4 * m * m * n + 2 * m**3)
    symmetric = c.steps * c.k * (2 * m * m * n + 2 * m**3)
    moved = 2.0 * c.k * c.rows * c.cols * c.element_size  # the gathered blocks joined, once
    return TPCost(sent, 1 if c.world_size > 1 else 0, flops, symmetric, moved)


def _distributed_cost(c: _CostShape, form: str) -> TPCost:
    per_step, symmetric, gathered = _distributed_flops(c.p, c.q, c.q_local, c.world_size, form)
    gram = 0.0 if form == "rows" else c.gram_bytes()
    split = (c.world_size - 1) * c.k * gathered * c.element_size
    norm = c.ring * c.k * max(4, c.element_size)  # the norm is summed in fp32 (fp64 for fp64)
    rounds = c.steps * (2 if form in ("split", "rows") else 1) + 1 if c.world_size > 1 else 0
    packing = c.packing() if form != "rows" else TPCost(0.0, 0, 0.0)
    joined = 2.0 * c.world_size * c.k * gathered * c.element_size  # gathered pieces joined
    return TPCost(
        c.steps * (gram + split) + norm,
        rounds,
        c.steps * c.k * per_step,
        c.steps * c.k * symmetric,
        c.steps * (joined + packing.moved),
        c.steps * packing.ops,
    )


def _gram_cost(c: _CostShape) -> TPCost:
    p, q_local, T = c.p, c.q_local, c.world_size
    if gram_mode_form(c.rows, c.cols, c.shard_dim) == "rows":
        per_step, _, gathered = _distributed_flops(p, c.q, q_local, T, "rows")
        sent = c.steps * (T - 1) * c.k * gathered * c.element_size
        moved = c.steps * 2.0 * T * c.k * gathered * c.element_size
        return TPCost(sent, 2 * c.steps if T > 1 else 0, c.steps * c.k * per_step, 0.0, moved)
    runs = gram_runs(c.steps)
    # per run of L steps: the Gram and the apply (2·p²·q_i each), then Q (L p×p products),
    # R (L − 1) and A ← A·Q·Q (2·(L − 1)): all but the apply symmetric
    flops = sum(4 * p * p * q_local + (8 * L - 6) * p**3 for L in runs)
    symmetric = sum(2 * p * p * q_local + (8 * L - 6) * p**3 for L in runs)
    packing = c.packing()
    return TPCost(
        len(runs) * c.gram_bytes(),
        len(runs) if T > 1 else 0,
        c.k * flops,
        c.k * symmetric,
        len(runs) * packing.moved,
        len(runs) * packing.ops,
    )


def _blockwise_cost(c: _CostShape) -> TPCost:
    local = [c.rows, c.cols]
    local[c.shard_dim] = c.q_local
    ml, nl = min(local), max(local)
    flops = c.steps * c.k * (4 * ml * ml * nl + 2 * ml**3)
    return TPCost(0.0, 0, flops, c.steps * c.k * (2 * ml * ml * nl + 2 * ml**3))


@dataclass(frozen=True)
class _Layout:
    """Where a stacked batch lives: the TP group, which stack dim is sharded, global sizes."""

    group: ProcessGroup | None
    world_size: int
    rank: int
    dim: int | None  # -2 (matrix rows), -1 (matrix columns), None: nothing to gather
    sizes: tuple[int, ...]  # shard sizes along `dim`, by group rank


class TensorParallelOrthogonalizer:
    """Newton-Schulz on tensor-parallel shards; pass it to `Muon(..., orthogonalizer=...)`.

    `group` is the tensor-parallel process group (None: the default group) and `shard_dim`
    the matrix dimension the plain local shards are split along (0: rows, as column-parallel
    layers split their weight; 1: columns, row-parallel). Both are ignored for DTensor
    inputs, whose device mesh and placements say it. `mode` is one of MODES; `form` how
    distributed mode applies B·W (FORMS); `cost_model` drives `auto`. `ns_dtype` is the
    dtype of the iteration and of the shards and Grams on the wire, resolved per batch from
    the device of the local shards (`resolve_ns_dtype`): "auto" (default) is bfloat16 on CUDA,
    float32 elsewhere, float64 stays float64; a torch dtype forces it; None is float32. The
    last batch's choices are in `last_modes` / `last_forms`; bytes are counted in `stats`.
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        mode: TPMode = "auto",
        shard_dim: int | None = None,
        steps: int = 5,
        coefficients: CoefficientsLike = "quintic",
        ns_dtype: NSDtype = "auto",
        eps: float = 1e-7,
        form: TPForm = "auto",
        cost_model: CostModel | None = None,
        stats: CommStats | None = None,
    ) -> None:
        check_choice("mode", mode, MODES)
        check_choice("form", form, FORMS)
        if shard_dim is not None and shard_dim not in (0, 1, -1, -2):
            raise ValueError(
                f"shard_dim must be 0 (rows: column-parallel) or 1 (columns: row-parallel) of "
                f"each matrix, or None for DTensor inputs, got {shard_dim!r}"
            )
        check_dtype_or_auto("ns_dtype", ns_dtype)
        check_positive("eps", eps)
        check_member("group", group)
        self.schedule = coefficient_schedule(coefficients, steps)
        self.group = group
        self.mode = mode
        self.shard_dim = None if shard_dim is None else shard_dim % 2
        self.steps = steps
        self.coefficients = coefficients
        self.ns_dtype = ns_dtype
        self.eps = eps
        self.form = form
        self.cost_model = cost_model
        self.stats = stats if stats is not None else CommStats()
        self.last_modes: list[str] = []
        self.last_forms: list[str] = []

    def calibrate(self, **kw: Any) -> CostModel:
        """Replace the cost model by one measured on this group (`CostModel.calibrate`)."""
        self.cost_model = CostModel.calibrate(self.group, **kw)
        return self.cost_model

    def model_for(self, device: torch.device | str | None) -> CostModel:
        """The cost model `auto` and the Gram packing decide by: the one given (or
        calibrated), else `CostModel.for_device(device)`."""
        return self.cost_model if self.cost_model is not None else CostModel.for_device(device)

    # -- entry point -------------------------------------------------------------------------

    def __call__(self, mats: Tensor, name: str | None = None) -> Tensor:
        """Orthogonalize every matrix of `mats` ([..., rows, cols], shards); same shape back.
        `name` (the parameter's) is what a refusal of unequal plain shards names."""
        if mats.ndim < 2:
            raise ValueError(
                f"TensorParallelOrthogonalizer needs a batch of matrices, got shape "
                f"{tuple(mats.shape)}"
            )
        dtensor = is_dtensor(mats)
        local, layout = self._local_and_layout(mats, name)
        # not reshape(-1, ...): ambiguous for an empty shard (an uneven DTensor's last ranks)
        flat = local.reshape(math.prod(local.shape[:-2]), *local.shape[-2:])
        global_rows, global_cols = flat.shape[-2], flat.shape[-1]
        if layout.dim == -2:
            global_rows = sum(layout.sizes)
        elif layout.dim == -1:
            global_cols = sum(layout.sizes)
        mode = self.choose_mode(flat.shape[0], global_rows, global_cols, layout, flat.device)
        self.last_modes.append(mode)
        if mode == "duplicated":
            out = self._duplicated(flat, layout)
        elif mode == "distributed":
            out = self._distributed(flat, layout)
        elif mode == "gram":
            out = self._gram(flat, layout)
        else:
            out = self._newton_schulz(flat)
        out = out.reshape(local.shape)
        if dtensor:
            from torch.distributed.tensor import DTensor

            return DTensor.from_local(
                out, mats.device_mesh, mats.placements, shape=mats.shape, stride=mats.stride()
            )
        return out

    def choose_mode(
        self,
        k: int,
        rows: int,
        cols: int,
        layout: _Layout,
        device: torch.device | str | None = None,
    ) -> str:
        """The mode for k global rows×cols float32 matrices on `device`: `mode`, or the pick
        of the cost model for `device` (`model_for`). The bytes on the wire are priced in the
        Newton-Schulz dtype there; `device` None assumes CUDA."""
        if layout.dim is None or layout.world_size == 1:
            return "blockwise" if self.mode == "blockwise" else "local"
        if self.mode != "auto":
            return self.mode
        shard = 0 if layout.dim == -2 else 1
        on = torch.device("cuda") if device is None else device
        elem = resolve_ns_dtype(self.ns_dtype, on, torch.float32).itemsize
        args = (k, rows, cols, shard, layout.world_size, self.steps, elem)
        model = self.model_for(on)
        packed = model.packs(k, (cols, rows)[shard], layout.world_size, elem)
        form = self.choose_form(*args, device=on)
        costs = {
            mode: model.seconds(
                tp_cost(mode, *args, form=form if mode == "distributed" else "apply", packed=packed)
            )
            for mode in auto_modes(elem)
        }
        return min(costs, key=costs.__getitem__)

    def choose_form(
        self,
        k: int,
        rows: int,
        cols: int,
        shard_dim: int,
        world_size: int,
        steps: int,
        element_size: int,
        device: torch.device | str | None = None,
    ) -> str:
        """Distributed mode's form for this shape: `form`, or the cheapest by the cost model
        for `device` (None: CUDA)."""
        if self.form != "auto":
            return self.form
        model = self.model_for(torch.device("cuda") if device is None else device)
        args = (k, rows, cols, shard_dim, world_size, steps, element_size)
        packed = model.packs(k, (cols, rows)[shard_dim], world_size, element_size)
        costs = {
            f: model.seconds(tp_cost("distributed", *args, form=f, packed=packed))
            for f in FORMS[1:]
        }
        return min(costs, key=costs.__getitem__)

    # -- layouts -----------------------------------------------------------------------------

    def _local_and_layout(self, mats: Tensor, name: str | None) -> tuple[Tensor, _Layout]:
        if is_dtensor(mats):
            return mats.to_local(), _dtensor_layout(mats)
        if self.shard_dim is None:
            raise ValueError(
                "TensorParallelOrthogonalizer got a plain tensor but no shard_dim: pass "
                "shard_dim=0 (column-parallel: rows split) or 1 (row-parallel: columns split), "
                "or give it DTensor parameters"
            )
        rank, n = collectives.world(self.group)
        dim = -2 if self.shard_dim == 0 else -1
        if n > 1 and self.mode != "blockwise":
            self._check_equal_shards(mats, n, name)
        return mats, _Layout(self.group, n, rank, dim, (mats.shape[dim],) * n)

    def _check_equal_shards(self, mats: Tensor, n: int, name: str | None) -> None:
        """Refuse, on every rank alike, plain shards whose shapes differ across the group:
        one all-gather of each rank's (k, rows, cols) and one host read."""
        shape = (math.prod(mats.shape[:-2]), mats.shape[-2], mats.shape[-1])
        mine = torch.tensor(
            shape, dtype=torch.int64, device=collectives.device_for(self.group, mats)
        )
        every = mine.new_empty(n * 3)
        collectives.all_gather(every, mine, group=self.group, stats=self.stats, kind=SHAPES_KIND)
        shapes = host.read(every, "tensor-parallel shard shapes").view(n, 3).tolist()
        if any(s != shapes[0] for s in shapes):
            what = f"parameter {name!r}" if name else "a batch of matrices"
            listed = ", ".join("x".join(map(str, s)) for s in shapes)
            raise ValueError(
                f"TensorParallelOrthogonalizer: the plain shards of {what} differ across the "
                f"{n} tensor-parallel ranks (k x rows x cols by rank: {listed}); pass DTensor "
                f"parameters (parallelize_module), which may shard unevenly, or plain shards "
                f"of equal size along shard_dim={self.shard_dim}"
            )

    def _compute_dtype(self, X: Tensor) -> torch.dtype:
        return resolve_ns_dtype(self.ns_dtype, X.device, X.dtype)

    def _newton_schulz(self, X: Tensor) -> Tensor:
        return newton_schulz(
            X,
            steps=self.steps,
            coefficients=self.schedule,
            eps=self.eps,
            dtype=self._compute_dtype(X),
            check_finite=False,  # the optimizer checked the gradients: no host read per batch
        )

    # -- modes -------------------------------------------------------------------------------

    def _duplicated(self, X: Tensor, layout: _Layout) -> Tensor:
        """All-gather the shards in the compute dtype, full iteration, keep the local slice."""
        compute = self._compute_dtype(X)
        dim = layout.dim
        assert dim is not None
        local = X.to(compute).contiguous()
        if local.shape[dim] != layout.sizes[layout.rank]:
            raise ValueError(
                f"rank {layout.rank} holds a shard of {local.shape[dim]} along dim {dim}, "
                f"expected {layout.sizes[layout.rank]}"
            )
        other = math.prod(s for i, s in enumerate(local.shape) if i != dim % local.ndim)
        sizes = [s * other for s in layout.sizes]
        parts = collectives.all_gatherv(
            local.reshape(-1), sizes, group=layout.group, stats=self.stats
        ).wait()
        shape = list(local.shape)
        blocks = []
        for part, s in zip(parts, layout.sizes):
            shape[dim] = s
            blocks.append(part.view(shape))
        full = torch.cat(blocks, dim=dim)
        out = self._newton_schulz(full)
        offset = sum(layout.sizes[: layout.rank])
        return out.narrow(dim, offset, layout.sizes[layout.rank]).to(X.dtype).contiguous()

    def _distributed(self, X: Tensor, layout: _Layout) -> Tensor:
        """Sharded iteration: one packed partial-Gram all-reduce per step."""
        compute = self._compute_dtype(X)
        W = X if layout.dim == -1 else X.mT  # the sharded dimension last: W is [k, p, q_i]
        norm_dtype = _norm_dtype(compute)
        sq = squared_frobenius(W, norm_dtype).flatten()  # [k]: an empty shard adds zeros
        collectives.all_reduce(sq, group=layout.group, stats=self.stats, kind=NORM_KIND)
        norm = self._norm(sq)
        W = (W.to(norm_dtype) / norm).to(compute)
        k, p = W.shape[0], W.shape[-2]
        rows, cols = (p, sum(layout.sizes)) if layout.dim == -1 else (sum(layout.sizes), p)
        shard = 1 if layout.dim == -1 else 0
        elem = torch.empty((), dtype=compute).element_size()
        form = self.choose_form(k, rows, cols, shard, layout.world_size, self.steps, elem, W.device)
        packed = self.model_for(W.device).packs(k, p, layout.world_size, elem)
        self.last_forms.append(form)
        if form == "rows":
            out = self._rows_iteration(W.mT, layout)
            return (out.mT if layout.dim == -1 else out).to(X.dtype).contiguous()
        for a, b, c in self.schedule:
            A = collectives.all_reduce_symmetric(
                kernels.gram(W), layout.group, self.stats, GRAM_KIND, packed
            )
            if form == "apply":
                AW = A @ W
                W = torch.baddbmm(AW, A, AW, beta=b, alpha=c).add_(W, alpha=a)
            elif form == "square":
                W = torch.baddbmm(W, kernels.sym_poly(A, b, c), W, beta=a)
            else:
                W = torch.baddbmm(W, self._split_poly(A, b, c, layout), W, beta=a)
        out = W if layout.dim == -1 else W.mT
        return out.to(X.dtype).contiguous()

    def _norm(self, sq: Tensor) -> Tensor:
        """The Frobenius norms [k, 1, 1] of a batch from its sums of squares `sq` [k], at least
        `eps`. No host read per batch (the optimizer checked the gradients): a matrix with
        NaN or Inf entries, or whose sum of squares overflows, gets a NaN norm."""
        norm = torch.where(torch.isfinite(sq), sq.sqrt().clamp_min(self.eps), torch.nan)
        return norm[:, None, None]

    def _gram(self, X: Tensor, layout: _Layout) -> Tensor:
        """The Gram form over the ranks: per run of steps one packed all-reduce of the small
        Gram matrix, the run's polynomial R on it on every rank, then X_i ← R·X_i locally."""
        compute = self._compute_dtype(X)
        W = X if layout.dim == -1 else X.mT  # the sharded dimension last: W is [k, p, q_i]
        p, q = W.shape[-2], sum(layout.sizes)
        norm_dtype = _norm_dtype(compute)
        if p > q:  # split along the short side
            self.last_forms.append("rows")
            out = self._rows_iteration(W.mT.to(compute), layout, normalise=True)
            return (out.mT if layout.dim == -1 else out).to(X.dtype).contiguous()
        self.last_forms.append("gram")
        Z = W.to(compute)
        syrk, sym_matmul = kernels.syrk_for(Z), kernels.sym_matmul_for(Z)
        packed = self.model_for(Z.device).packs(Z.shape[0], p, layout.world_size, Z.element_size())
        restarts = range(0, len(self.schedule), GRAM_FORM_RESTART)  # as newton_schulz_gram_form
        for i, start in enumerate(restarts):
            run = self.schedule[start : start + GRAM_FORM_RESTART]
            A = collectives.all_reduce_symmetric(
                syrk(Z, None, 0.0, 1.0), layout.group, self.stats, GRAM_KIND, packed
            )
            if i == 0:  # ‖X‖_F² = tr A: normalise X and A
                norm = self._norm(A.diagonal(dim1=-2, dim2=-1).to(norm_dtype).sum(dim=-1))
                Z = (W.to(norm_dtype) / norm).to(compute)
                A = (A.to(norm_dtype) / norm.square()).to(compute)
            Z = _gram_run(A, run, syrk, sym_matmul) @ Z
        out = Z if layout.dim == -1 else Z.mT
        return out.to(X.dtype).contiguous()

    def _gather_rows(self, part: Tensor, layout: _Layout) -> Tensor:
        """All-gather [k, rows_i, n] row blocks (rows_i = the shard sizes) into [k, Σrows_i, n]."""
        k, n = part.shape[0], part.shape[-1]
        parts = collectives.all_gatherv(
            part.reshape(-1).contiguous(),
            [k * r * n for r in layout.sizes],
            group=layout.group,
            stats=self.stats,
            kind=ROWS_KIND,
        ).wait()
        return torch.cat([t.view(k, r, n) for t, r in zip(parts, layout.sizes)], dim=1)

    def _rows_iteration(self, X: Tensor, layout: _Layout, normalise: bool = False) -> Tensor:
        """The `rows` form on normalised row blocks X_i [k, q_i, p] of X [k, q, p]: the small
        q×q Gram, each rank its rows of every product, two all-gathers per step.
        `normalise`: X is not normalised yet; its norm is read from the first gathered X."""
        for step, (a, b, c) in enumerate(self.schedule):
            full = self._gather_rows(X, layout)
            if normalise and step == 0:
                norm_dtype = _norm_dtype(X.dtype)
                norm = self._norm(squared_frobenius(full, norm_dtype).flatten())
                X = (X.to(norm_dtype) / norm).to(full.dtype)
                full = (full.to(norm_dtype) / norm).to(full.dtype)
            A_i = X @ full.mT  # [k, q_i, q]: this rank's rows of X·Xᵀ
            A = self._gather_rows(A_i, layout)
            B_i = torch.baddbmm(A_i, A_i, A, beta=b, alpha=c)
            X = torch.baddbmm(X, B_i, full, beta=a)
        return X

    def _split_poly(self, A: Tensor, b: float, c: float, layout: _Layout) -> Tensor:
        """B = b·A + c·A·A with each rank computing its share of the upper triangle."""
        k, p = A.shape[0], A.shape[-1]
        plan = split_plan(p, layout.world_size)
        pieces = [
            pack_block_row(
                torch.baddbmm(A[:, lo:hi, lo:], A[:, lo:hi, :], A[:, :, lo:], beta=b, alpha=c)
            )
            for lo, hi in plan[layout.rank]
        ]
        mine = torch.cat(pieces, dim=1) if pieces else A.new_zeros(k, 0)
        counts = [sum(triangle_block_size(a, b, p) for a, b in blks) for blks in plan]
        parts = collectives.all_gatherv(
            mine.reshape(-1).contiguous(),
            [k * n for n in counts],
            group=layout.group,
            stats=self.stats,
            kind=SPLIT_KIND,
        ).wait()
        # each rank's blocks, in the order pack_upper lays out the blocks of the whole triangle
        placed: list[tuple[tuple[int, int], Tensor]] = []
        for blks, part in zip(plan, parts):
            sizes = [triangle_block_size(lo, hi, p) for lo, hi in blks]
            starts = itertools.accumulate(sizes, initial=0)
            placed += [
                (blk, part.view(k, -1).narrow(1, at, n)) for blk, at, n in zip(blks, starts, sizes)
            ]
        placed.sort(key=lambda blk_piece: blk_piece[0])
        packed = torch.cat([piece for _, piece in placed], dim=1)
        return unpack_upper(packed, p, [blk for blk, _ in placed])


def _dtensor_layout(mats: Any) -> _Layout:
    """Read the TP group and shard dim of a stacked DTensor batch from its mesh/placements."""
    from torch.distributed.tensor import Partial, Shard

    mesh, placements = mats.device_mesh, mats.placements
    sharded = [(i, pl) for i, pl in enumerate(placements) if isinstance(pl, Shard)]
    if any(isinstance(pl, Partial) for pl in placements):
        raise ValueError(
            f"TensorParallelOrthogonalizer got a DTensor with a Partial placement "
            f"({placements}); reduce it first"
        )
    if len(sharded) > 1:
        raise ValueError(
            f"TensorParallelOrthogonalizer supports one sharded mesh dimension, got placements "
            f"{placements}; shard the matrices over the tensor-parallel mesh dimension only"
        )
    if not sharded:
        return _Layout(None, 1, 0, None, ())
    mesh_dim, placement = sharded[0]
    dim = placement.dim % mats.ndim
    group = mesh.get_group(mesh_dim)
    rank, n = collectives.world(group)
    if dim < mats.ndim - 2:
        # Split along the stack (experts): every rank holds whole matrices.
        return _Layout(group, n, rank, None, ())
    size = mats.shape[dim]
    return _Layout(group, n, rank, dim - mats.ndim, tuple(shard_sizes(size, n)))
