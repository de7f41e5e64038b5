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
  once, packed where the cost model says the link is the bottleneck (`CostModel.packs`: the
  upper triangle by row blocks, p(p+1)/2 elements instead of p²). B·W_i is applied in
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
- ``auto``: a cost model (`tp_model.CostModel`: bytes ÷ bandwidth + rounds × latency +
  flops ÷ throughput, symmetric products discounted where a SYRK computes them, + bytes
  moved ÷ memory bandwidth), with the figures of the shards' device unless one is given,
  picks duplicated, distributed or gram per batch, identically on every rank. Never
  blockwise.

The modes are one table, `TP_MODES` (at the end): each maps to its cost (`tp_cost`), its run
(a method below), its transient bytes (`tp_model`) and whether `auto` may pick it
(`pick_auto`); the planner, `orthoptim plan --tp-mode` and `orthoptim bench tp` read it too.

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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from orthoptim import collectives, host, kernels
from orthoptim._validate import check_choice, check_dtype_or_auto, check_member, check_positive
from orthoptim.comm_bytes import CommStats
from orthoptim.newton_schulz import (
    CoefficientsLike,
    NSDtype,
    coefficient_schedule,
    gram_form_run,
    newton_schulz,
    resolve_ns_dtype,
    squared_frobenius,
)
from orthoptim.ns_cost import GRAM_FORM_RESTART, NS_STEPS, gram_runs, ns_flops
from orthoptim.parallel.tp_model import (
    CostModel,
    TPBatch,
    TPCost,
    TPShape,
    distributed_transient,
    duplicated_transient,
    local_transient,
    pack_cost,
)
from orthoptim.shards import (
    is_dtensor,
    pack_block_row,
    shard_sizes,
    triangle_block_size,
    triangle_blocks,
    unpack_upper,
)

#: the shipped modes and "auto" (tests/test_mode_table.py: equal to ("auto", *TP_MODES))
TPMode = Literal["auto", "duplicated", "distributed", "gram", "blockwise"]
MODES: tuple[TPMode, ...] = get_args(TPMode)


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


# (the batch, distributed's form) → a rank's cost (`tp_cost`)
ModeCost = Callable[[TPShape, str], TPCost]


@dataclass(frozen=True)
class TPModeSpec:
    """One entry of TP_MODES: a tensor-parallel mode.

    `cost` prices a batch per rank (`ModeCost`); `run(orthogonalizer, shards, layout)` runs
    it (a method of `TensorParallelOrthogonalizer`); `transient` is the bytes a batch holds
    while it runs (`tp_model.TPBatch`), for the planner's memory model; `auto`: whether `auto`
    may pick it, for Newton-Schulz dtypes of at least `auto_min_bytes`; `form(orthogonalizer,
    shape, cost model)` the form it takes for a batch (None: it has none), and `forms` those
    `form=` can force, each benchmarked apart.
    """

    cost: ModeCost
    run: Callable[[TensorParallelOrthogonalizer, Tensor, _Layout], Tensor]
    transient: Callable[[TPBatch], int]
    auto: bool = True
    auto_min_bytes: int = 0
    form: Callable[[TensorParallelOrthogonalizer, TPShape, CostModel], str] | None = None
    forms: tuple[str, ...] = ()


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


def gram_restarts(steps: int) -> int:
    """All-reduces of the Gram matrix gram mode makes per batch: one per run of the Gram form
    (`ns_cost.gram_runs`)."""
    return len(gram_runs(steps))


def _norm_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype norms are summed in: float64 for a float64 iteration, else float32."""
    return torch.float64 if compute == torch.float64 else torch.float32


def tp_cost(
    mode: str,
    k: int,
    rows: int,
    cols: int,
    shard_dim: int,
    world_size: int,
    steps: int,
    element_size: int,
    form: str = "apply",
    packed: bool = True,
) -> TPCost:
    """Per-rank cost of `mode` (a key of TP_MODES) on k global rows×cols matrices sharded
    along `shard_dim` (0/1) over `world_size` ranks: the table's cost function.

    `form` is distributed mode's way of applying B (apply, square, split or rows); gram
    mode's form follows from the shape (`gram_mode_form`). `packed`: the Gram all-reduces
    send the packed upper triangle (`CostModel.packs` decides it for the runtime).

    Flops count plain matmuls (2·m·n·k each), those of symmetric products apart. Bytes are
    what one rank sends under the ring algorithm, as `comm_bytes.CommStats` records them;
    bytes moved, what packing and the reassembly of gathered pieces read and write.
    """
    if mode not in TP_MODES:
        raise ValueError(f"mode must be one of {tuple(TP_MODES)}, got {mode!r}")
    shape = TPShape(k, rows, cols, shard_dim, world_size, steps, element_size, packed)
    return TP_MODES[mode].cost(shape, form)


def _duplicated_cost(s: TPShape, form: str) -> TPCost:
    """duplicated: one all-gather of the shards, the whole plain iteration on every rank."""
    m, n = min(s.rows, s.cols), max(s.rows, s.cols)
    sent = (s.world_size - 1) * s.k * s.q_local * s.p * s.element_size
    flops = s.k * int(ns_flops(s.rows, s.cols, s.steps))
    symmetric = s.steps * s.k * (2 * m * m * n + 2 * m**3)  # X·Xᵀ and b·A + c·A·A
    moved = 2.0 * s.k * s.rows * s.cols * s.element_size  # the gathered blocks joined, once
    return TPCost(sent, 1 if s.world_size > 1 else 0, flops, symmetric, moved)


def _distributed_cost(s: TPShape, form: str) -> TPCost:
    """distributed, applying B in `form`: a Gram all-reduce per step (and the split form's or
    the rows form's all-gathers), one norm all-reduce."""
    if form == "auto":
        raise ValueError("tp_cost needs a concrete form (apply, square, split or rows)")
    per_step, symmetric, gathered = _distributed_flops(s.p, s.q, s.q_local, s.world_size, form)
    gram = 0.0 if form == "rows" else s.gram_bytes()
    split = (s.world_size - 1) * s.k * gathered * s.element_size
    norm = s.ring * s.k * max(4, s.element_size)  # the norm is summed in fp32 (fp64 for fp64)
    rounds = s.steps * (2 if form in ("split", "rows") else 1) + 1 if s.world_size > 1 else 0
    packing = s.packing() if form != "rows" else TPCost(0.0, 0, 0.0)
    if form == "split":  # B's pieces are packed, gathered and unpacked every step too
        pieces = pack_cost(s.k, s.p, s.element_size)
        packing = TPCost(
            0.0, 0, 0.0, moved=packing.moved + pieces.moved, ops=packing.ops + pieces.ops
        )
    joined = 2.0 * s.world_size * s.k * gathered * s.element_size  # gathered pieces joined
    return TPCost(
        s.steps * (gram + split) + norm,
        rounds,
        s.steps * s.k * per_step,
        s.steps * s.k * symmetric,
        s.steps * (joined + packing.moved),
        s.steps * packing.ops,
    )


def _gram_cost(s: TPShape, form: str) -> TPCost:
    """gram: a Gram all-reduce per run of the Gram form and the small iteration on every
    rank, or the rows form when split along the short side (`gram_mode_form`; `form` is not
    read)."""
    p, q_local, T = s.p, s.q_local, s.world_size
    if gram_mode_form(s.rows, s.cols, s.shard_dim) == "rows":
        per_step, _, gathered = _distributed_flops(p, s.q, q_local, T, "rows")
        sent = s.steps * (T - 1) * s.k * gathered * s.element_size
        moved = s.steps * 2.0 * T * s.k * gathered * s.element_size
        return TPCost(sent, 2 * s.steps if T > 1 else 0, s.steps * s.k * per_step, 0.0, moved)
    runs = gram_runs(s.steps)
    # per run of L steps: the Gram and the apply (2·p²·q_i each), then Q (L p×p products),
    # R (L − 1) and A ← A·Q·Q (2·(L − 1)): all but the apply symmetric
    flops = sum(4 * p * p * q_local + (8 * L - 6) * p**3 for L in runs)
    symmetric = sum(2 * p * p * q_local + (8 * L - 6) * p**3 for L in runs)
    packing = s.packing()
    return TPCost(
        len(runs) * s.gram_bytes(),
        len(runs) if T > 1 else 0,
        s.k * flops,
        s.k * symmetric,
        len(runs) * packing.moved,
        len(runs) * packing.ops,
    )


def _blockwise_cost(s: TPShape, form: str) -> TPCost:
    """blockwise: the plain iteration on the widest local shard, nothing sent."""
    local = [s.rows, s.cols]
    local[s.shard_dim] = s.q_local
    ml, nl = min(local), max(local)
    flops = s.k * int(ns_flops(local[0], local[1], s.steps))
    return TPCost(0.0, 0, flops, s.steps * s.k * (2 * ml * ml * nl + 2 * ml**3))


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
    inputs, whose device mesh and placements say it. `mode` is "auto" or a key of TP_MODES;
    `form` how distributed mode applies B·W (FORMS); `cost_model` drives `auto`. `ns_dtype`
    is the dtype of the iteration and of the shards and Grams on the wire, resolved per batch
    from the device of the local shards (`resolve_ns_dtype`): "auto" (default) is bfloat16 on CUDA,
    float32 elsewhere, float64 stays float64; a torch dtype forces it; None is float32. The
    last batch's choices are in `last_modes` / `last_forms`; bytes are counted in `stats`.
    """

    def __init__(
        self,
        group: ProcessGroup | None = None,
        mode: TPMode = "auto",
        shard_dim: int | None = None,
        steps: int = NS_STEPS,
        coefficients: CoefficientsLike = "quintic",
        ns_dtype: NSDtype = "auto",
        eps: float = 1e-7,
        form: TPForm = "auto",
        cost_model: CostModel | None = None,
        stats: CommStats | None = None,
    ) -> None:
        check_choice("mode", mode, tp_mode_names())
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
        """The cost model `auto`, the form and the Gram packing decide by: the one given (or
        calibrated), else `CostModel.for_device(device)` (None: CUDA)."""
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
        if mode == "local":
            out = self._newton_schulz(flat)
        else:
            out = TP_MODES[mode].run(self, flat, layout)
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
        (`pick_auto`) of the cost model for `device` (`model_for`). The bytes on the wire are
        priced in the Newton-Schulz dtype there; `device` None assumes CUDA."""
        if layout.dim is None or layout.world_size == 1:
            return "blockwise" if self.mode == "blockwise" else "local"
        if self.mode != "auto":
            return self.mode
        shard = 0 if layout.dim == -2 else 1
        on = torch.device("cuda") if device is None else device
        elem = resolve_ns_dtype(self.ns_dtype, on, torch.float32).itemsize
        args = (k, rows, cols, shard, layout.world_size, elem, on)
        model = self.model_for(on)
        return pick_auto(lambda mode: self.mode_cost(mode, *args)[0], elem, model)[0]

    def mode_cost(
        self,
        mode: str,
        k: int,
        rows: int,
        cols: int,
        shard_dim: int,
        world_size: int,
        element_size: int,
        device: torch.device | str | None = None,
    ) -> tuple[TPCost, str]:
        """Per-rank cost of `mode` (a key of TP_MODES) on k global rows×cols matrices split
        along `shard_dim` (0/1) over `world_size` ranks in `element_size`-byte elements on
        `device` (None: CUDA), and the form it takes there ("" for a mode without forms): the
        table's form and cost, at this orthogonalizer's steps, `form` and cost model, the
        Gram packed where that model says (`CostModel.packs`)."""
        spec = TP_MODES[mode]
        model = self.model_for(device)
        shape = self._shape(k, rows, cols, shard_dim, world_size, element_size, model)
        form = spec.form(self, shape, model) if spec.form is not None else ""
        return spec.cost(shape, form or "apply"), form

    def choose_form(
        self,
        k: int,
        rows: int,
        cols: int,
        shard_dim: int,
        world_size: int,
        element_size: int,
        device: torch.device | str | None = None,
    ) -> str:
        """Distributed mode's form for this shape on `device` (None: CUDA): `form`, or the
        cheapest by the cost model there."""
        model = self.model_for(device)
        shape = self._shape(k, rows, cols, shard_dim, world_size, element_size, model)
        return _distributed_form(self, shape, model)

    def _shape(
        self, k: int, rows: int, cols: int, shard_dim: int, world_size: int, elem: int,
        model: CostModel,
    ) -> TPShape:  # fmt: skip
        packed = model.packs(k, (cols, rows)[shard_dim], world_size, elem)
        return TPShape(k, rows, cols, shard_dim, world_size, self.steps, elem, packed)

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

    # -- modes (each the run of an entry of TP_MODES) ------------------------------------------

    def _blockwise(self, X: Tensor, layout: _Layout) -> Tensor:
        """Each rank its own shards, no communication."""
        return self._newton_schulz(X)

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
        """Sharded iteration: one partial-Gram all-reduce per step (packed where it pays)."""
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
        model = self.model_for(W.device)
        shape = self._shape(k, rows, cols, shard, layout.world_size, elem, model)
        form = _distributed_form(self, shape, model)
        self.last_forms.append(form)
        if form == "rows":
            out = self._rows_iteration(W.mT, layout)
            return (out.mT if layout.dim == -1 else out).to(X.dtype).contiguous()
        for a, b, c in self.schedule:
            A = collectives.all_reduce_symmetric(
                kernels.gram(W), layout.group, self.stats, GRAM_KIND, shape.packed
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
        """The Gram form over the ranks: per run of steps one all-reduce of the small
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
            Z = gram_form_run(Z, run, syrk, sym_matmul, A)
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


def _distributed_form(orth: TensorParallelOrthogonalizer, s: TPShape, model: CostModel) -> str:
    """Distributed mode's form: the orthogonalizer's `form`, or the cheapest under `model`."""
    if orth.form != "auto":
        return orth.form
    costs = {f: model.seconds(_distributed_cost(s, f)) for f in FORMS[1:]}
    return min(costs, key=costs.__getitem__)


def _gram_form(orth: TensorParallelOrthogonalizer, s: TPShape, model: CostModel) -> str:
    """Gram mode's form, from the shape alone (`gram_mode_form`)."""
    return gram_mode_form(s.rows, s.cols, s.shard_dim)


# The modes. A new one is an entry here and its run, a method of the orthogonalizer; the
# orthogonalizer, `auto`, the planner (its rows, picks and memory), `orthoptim plan
# --tp-mode` and `orthoptim bench tp` all read this table.
TP_MODES: dict[str, TPModeSpec] = {
    "duplicated": TPModeSpec(
        _duplicated_cost, TensorParallelOrthogonalizer._duplicated, duplicated_transient
    ),
    "distributed": TPModeSpec(
        _distributed_cost,
        TensorParallelOrthogonalizer._distributed,
        distributed_transient,
        form=_distributed_form,
        forms=FORMS[1:],
    ),
    # The Gram form squares the condition number, so in half precision it is several times
    # less accurate than the step form (as single-device Newton-Schulz keeps its Gram form to
    # float32/float64): `auto` takes it from float32 on; `mode="gram"` still forces it. Its
    # memory is priced as duplicated's.
    "gram": TPModeSpec(
        _gram_cost,
        TensorParallelOrthogonalizer._gram,
        duplicated_transient,
        auto_min_bytes=4,
        form=_gram_form,
    ),
    # not the same iteration as the whole matrix's: never `auto`'s pick
    "blockwise": TPModeSpec(
        _blockwise_cost, TensorParallelOrthogonalizer._blockwise, local_transient, auto=False
    ),
}


def tp_mode_names() -> tuple[str, ...]:
    """Every mode the orthogonalizer takes: "auto" and the table's."""
    return ("auto", *TP_MODES)


def auto_modes(dtype_bytes: int) -> tuple[str, ...]:
    """The modes `auto` chooses among for a Newton-Schulz dtype of `dtype_bytes`: the table's
    entries marked `auto`, each from its `auto_min_bytes` on (gram: float32 and wider)."""
    return tuple(
        name for name, spec in TP_MODES.items() if spec.auto and dtype_bytes >= spec.auto_min_bytes
    )


def pick_auto(
    cost: Callable[[str], TPCost], dtype_bytes: int, model: CostModel
) -> tuple[str, TPCost]:
    """`auto`'s pick, for the orthogonalizer and the planner alike: of `auto_modes(dtype_bytes)`
    the mode whose `cost(mode)` takes the fewest seconds under `model` (the first listed on a
    tie), and that cost."""
    costs = {mode: cost(mode) for mode in auto_modes(dtype_bytes)}
    best = min(costs, key=lambda mode: model.seconds(costs[mode]))
    return best, costs[best]


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
