"""Any matrix optimizer (Muon, SOAP, NorMuon, ...) over a model sharded by FSDP2
(`torch.distributed.fsdp.fully_shard`, HSDP), through the contract of
`orthoptim.optim.contract.MatrixOptimizer` alone.

Under FSDP2 every parameter is a DTensor sharded along dim 0 and, after backward, every rank
holds its dim-0 shard of the averaged gradient; nobody holds a full matrix. One step::

    agree      one small all-reduce and one host read: which matrices have a gradient, whether
               any gradient is non-finite (so every rank skips or raises together)
    prepare    `prepare` on the local shards (Muon's momentum: elementwise state stays a DTensor
               sharded like its parameter, so memory is spread and checkpoints reshard)
    forward    per bucket, ONE all-to-all: each rank sends its shard of every prepared update
               to that matrix's owner (cost-balanced `assign`, as the layer-wise optimizer);
               the owner concatenates the shards in rank order = the full matrix
    directions owners run `directions` on what they own, batched by group (Newton-Schulz of
               same-shape matrices in one call; whole-matrix state such as SOAP's factors
               lives on the owner only)
    back       per bucket, ONE all-to-all: the owner sends each rank the rows of each
               direction matching that rank's shard
    apply      `apply` on the local shards: decoupled weight decay and the lr-scaled update

Every rank keeps a matrix's "scalar" state (a step count) and asks `moves` before the step, so
all agree when a step leaves a matrix in place (SOAP's first step only builds its bases).

Under pipeline parallelism (`layout=`, a `ParallelMesh` whose dp group the model is sharded
over) the agreement and `clip_grad_norm_` also run across the pp group (one small all-reduce
each), so every stage skips or raises together and clips by the whole model's norm. The step
skeleton, the agreement groups and the state-dict surface are `orthoptim.parallel.base`'s.

AdamW parameters (embeddings, head, vectors) are stepped by torch's AdamW on the DTensors:
elementwise, so exact on local shards, no communication. Bytes per step for the matrices:
every rank sends (and receives) each matrix shard it does not own once each way, about
2 × (N−1)/N × its sharded matrix-gradient bytes (`expected_comm_bytes()` gives the exact
figure, `comm_stats()` the measured one).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from orthoptim import checkpoint
from orthoptim import collectives as C
from orthoptim._torch_compat import fsdp_collective_bases
from orthoptim._validate import check_choice, check_float_dtype
from orthoptim.comm_bytes import CommStats
from orthoptim.optim import telemetry
from orthoptim.optim.base import (
    NonfinitePolicy,
    state_dtype,
    step_checked,
)
from orthoptim.optim.contract import MatrixOptimizer
from orthoptim.optim.guards import mark_stepped
from orthoptim.optim.hybrid import RoutePredicate
from orthoptim.optim.registry import ELEMENTWISE_OPTIMIZERS, OPTIMIZER_NAMES, OptimizerName
from orthoptim.optim.state import StateView
from orthoptim.parallel.assignment import (
    Assignment,
    Balance,
    assign,
    units_from_model,
)
from orthoptim.parallel.base import DistributedOptimizer
from orthoptim.shards import is_dtensor, local_shard, shard_sizes


def shard_model(
    model: nn.Module,
    mesh: Any = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> nn.Module:
    """Apply FSDP2's `fully_shard` to every module in `model.blocks` (if it has them), then to
    the root, on `mesh` (default: a 1-D mesh over the default process group). Returns `model`.

    Per-block wrapping lets FSDP gather one block's parameters at a time; the root holds the
    rest (embeddings, head, final norm).

    `param_dtype` (e.g. torch.bfloat16): mixed precision by FSDP2's `MixedPrecisionPolicy`.
    The sharded parameters keep their dtype (fp32: they are the master weights, held only as
    shards, and `FSDPOptimizer` steps them and keeps its state in fp32); the all-gather casts
    them to `param_dtype`, so forward and backward compute on unsharded `param_dtype`
    parameters; gradients are reduced in `reduce_dtype` (default float32 when `param_dtype`
    is given: FSDP2's own default would reduce in `param_dtype`) into fp32 gradient shards."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_float_dtype("param_dtype", param_dtype)
    check_float_dtype("reduce_dtype", reduce_dtype)
    if reduce_dtype is None and param_dtype is not None:
        reduce_dtype = torch.float32
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if mesh is None:
        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (C.world()[1],))
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def count_fsdp_collectives(model: nn.Module, stats: CommStats) -> None:
    """Route FSDP2's own parameter all-gathers and gradient reduce-scatters, for every module of
    `model` that `fully_shard` wrapped, through `orthoptim.collectives`, counted in `stats` (as
    "fsdp_all_gather" and "fsdp_reduce_scatter"), so FSDP2's traffic can be told apart from
    the optimizer's. Uses FSDP2's `set_custom_all_gather` / `set_custom_reduce_scatter` hooks.
    (HSDP's all-reduce across replicas is not covered by these hooks.)"""
    from torch.distributed.fsdp import FSDPModule

    AllGather, ReduceScatter = fsdp_collective_bases()

    class _Gather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: Tensor,
            input_tensor: Tensor,
            group: ProcessGroup | None,
            async_op: bool = False,
        ) -> Any:
            return C.all_gather(
                output_tensor, input_tensor, group, stats, async_op, kind="fsdp_all_gather"
            )

    class _Scatter(ReduceScatter):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self,
            output_tensor: Tensor,
            input_tensor: Tensor,
            group: ProcessGroup | None,
            op: Any,
            async_op: bool = False,
        ) -> Any:
            return C.reduce_scatter(
                output_tensor, input_tensor, op, group, stats, async_op, "fsdp_reduce_scatter"
            )

    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("count_fsdp_collectives: no module of `model` is wrapped by fully_shard")
    for m in modules:
        m.set_custom_all_gather(_Gather())
        m.set_custom_reduce_scatter(_Scatter())


class _Matrix:
    """One matrix-optimizer parameter: owner, and each rank's flat shard size."""

    __slots__ = ("group", "name", "numels", "owner", "param", "unit")

    def __init__(
        self, name: str, param: Tensor, unit: int, owner: int, world_size: int, group: dict
    ) -> None:
        self.name, self.param, self.unit, self.owner, self.group = name, param, unit, owner, group
        row = param[0].numel() if param.shape[0] else 0
        self.numels = [r * row for r in shard_sizes(param.shape[0], world_size)]


class _Exchange:
    """One bucket's pair of all-to-alls: its live matrices, the split sizes each way, and
    the buffers and work in flight."""

    def __init__(self, ms: list[_Matrix], rank: int, world_size: int) -> None:
        self.ms = ms
        self.mine = [m for m in ms if m.owner == rank]
        # forward: what this rank sends each owner, and receives from each rank
        self.in_splits = [
            sum(m.numels[rank] for m in ms if m.owner == d) for d in range(world_size)
        ]
        self.out_splits = [sum(m.numels[s] for m in self.mine) for s in range(world_size)]
        self.send = self.recv = self.back = torch.empty(0)
        self.work: Any = None


class FSDPOptimizer(DistributedOptimizer):
    """A matrix optimizer (hybrid with AdamW) over parameters sharded by FSDP2's `fully_shard`.

    Build it after `fully_shard` (every trainable parameter a DTensor sharded on dim 0 of one
    mesh dimension, replicated on the others, as FSDP and HSDP lay them out)::

        fully_shard(block) for each block; fully_shard(model)
        opt = FSDPOptimizer(model, optimizer="muon", lr=0.02)
        loss.backward(); opt.step(); opt.zero_grad()

    `param_groups` and `state` are those of `build_optimizer(model, optimizer, ...)` over the
    DTensor parameters (so LR schedulers and `state_dict()` act as usual; elementwise state is
    a DTensor sharded like its parameter, whole-matrix state lives on the matrix's owner).
    Arguments: `balance` ("cost", "round_robin", "capped") and `bucket_mb` as the layer-wise
    optimizer (one all-to-all pair per bucket), `comm_dtype` (e.g. torch.bfloat16: updates
    travel in it; by default they travel in the state dtype, float32 or float64; state and
    parameters stay in their dtype), `route`,
    `nonfinite` ("raise" or "skip", agreed by all ranks),
    `state_dict_to` ("all" or "rank0": where `state_dict()` delivers the full, unsharded
    dict), `layout` (a `ParallelMesh` with ep = tp = 1, the model sharded over its dp group:
    the agreement and clipping also across its pp group); other keyword arguments go to
    `build_optimizer` (`elementwise="lion"` included). `reproducible=True` is refused (FSDP2's
    own accumulation and reduce-scatter decide the order of the sums): the layer-wise driver
    has it.
    `optimizer`: any of `orthoptim.optim.registry.MATRIX_OPTIMIZERS`, or "adamw" (the
    baseline).

    The base's `no_sync()` and `memory()` serve as they are: FSDP2's hooks reduce the
    gradients (`model.set_requires_gradient_sync(False)` accumulates without reducing), and a
    rank holds its parameter and gradient shards and the optimizer's state, no masters, and no
    buffer that outlives a step.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerName = "muon",
        lr: float | None = None,
        balance: Balance = "cost",
        bucket_mb: float = 25,
        comm_dtype: torch.dtype | None = None,
        route: RoutePredicate | None = None,
        nonfinite: NonfinitePolicy = "raise",
        state_dict_to: checkpoint.StateDictTo = "all",
        layout: Any = None,
        reproducible: bool = False,
        **inner_kwargs: Any,
    ) -> None:
        if reproducible:
            raise ValueError(
                "FSDPOptimizer(reproducible=True): FSDP2 sums the micro-batches in autograd's "
                "order and reduce-scatters shards whose bounds follow the data-parallel size, "
                "so its bits follow the layout; use LayerwiseDistributedOptimizer(model, "
                "reproducible=True) for the same bits at every data-parallel size"
            )
        check_choice("optimizer", optimizer, OPTIMIZER_NAMES)
        check_float_dtype("comm_dtype", comm_dtype)
        for name, module in model.named_modules() if isinstance(model, nn.Module) else []:
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
                raise ValueError(
                    f"FSDPOptimizer: {name or 'the model'} is an {type(module).__name__} with "
                    "sparse=True, whose sparse gradients FSDP2 cannot reduce and orthoptim's "
                    "optimizers do not take; build it with sparse=False (the default)"
                )
        self.comm_dtype = comm_dtype
        self._preamble(
            model, optimizer, lr, route, nonfinite, balance, bucket_mb, state_dict_to, inner_kwargs
        )
        group, self.mesh = _shard_group(list(self.named.items()))
        if layout is not None:
            _check_layout(layout, self.mesh)
        self._bind_groups(group if layout is None else None, layout=layout)
        # the shard group: agreement and norms over it (under HSDP the replicas hold equal
        # gradients), and the layout's pp group across stages
        self.process_group = group
        self.device = self._device()
        rule = self.rule

        # The matrix optimizer (None for plain AdamW): its contract runs on shards and owners.
        self.matrix_opt: MatrixOptimizer | None = (
            self.template.inner.get(optimizer) if optimizer != "adamw" else None
        )
        # The optimizer of the non-matrix part (AdamW or Lion): elementwise, on the local shards.
        self.elementwise: torch.optim.Optimizer | None = next(
            (self.template.inner[k] for k in ELEMENTWISE_OPTIMIZERS if k in self.template.inner),
            None,
        )
        group_of = self._matrix_groups()
        elementwise = inner_kwargs.get("elementwise", "adamw")
        units = units_from_model(model, optimizer=optimizer, route=rule, elementwise=elementwise)
        self.units = [u for u in units if u.name in group_of]
        self.assignment: Assignment = assign(
            self.units, self.world_size, balance=balance, bucket_bytes=int(bucket_mb * 2**20)
        )
        params = self.named
        self._matrices = [
            _Matrix(u.name, params[u.name], i, owner, self.world_size, group_of[u.name])
            for i, (u, owner) in enumerate(zip(self.units, self.assignment.owners))
        ]
        for m in self._matrices:
            mine = local_shard(m.param).numel()
            if mine != m.numels[self.rank]:
                raise ValueError(
                    f"{m.name}: local shard has {mine} elements but Shard(0) over "
                    f"{self.world_size} ranks gives {m.numels[self.rank]}; FSDPOptimizer expects "
                    "FSDP2's default dim-0 sharding (no custom shard_placement_fn)"
                )
        self.owner_of = {m.name: m.owner for m in self._matrices}
        self._adopt(self.template.param_groups, self.template.state, self.template.defaults)

    def copy_refusal(self) -> str | None:
        """A copy of a sharded model's optimizer would share the original's device mesh."""
        if self.process_group is not None or self.mesh is not None:
            return "its parameters are sharded over a device mesh, which a copy cannot share"
        return super().copy_refusal()

    def _matrix_groups(self) -> dict[str, dict[str, Any]]:
        """Matrix name → its (current) param group of the matrix optimizer."""
        if self.matrix_opt is None:
            return {}
        return {n: g for g in self.matrix_opt.param_groups for n in g["param_names"]}

    # -- the step (`DistributedOptimizer.step`) -----------------------------------------
    def _agreement_items(self) -> tuple[list[bool], list[Tensor], Callable[[], Tensor], list[str]]:
        """Which matrices have a gradient here, and the parameters' gradient shards: one
        check per shard, and per parameter whether its shard holds a NaN or Inf."""
        _, checks, per_param, names = super()._agreement_items()
        return [m.param.grad is not None for m in self._matrices], checks, per_param, names

    def _step_owned(self, present: list[bool]) -> None:
        """Muon on the sharded matrices via their owners, AdamW locally."""
        if self._matrices:
            self._step_matrices(present)
        if self.elementwise is not None:
            step_checked(self.elementwise)  # the gradients were checked by the agreement

    def _local(self, m: _Matrix) -> dict[str, Any]:
        """The state of matrix `m` as its contract functions see it on this rank: DTensor
        entries as their local shards (sharing storage), the rest as they are."""
        return {k: local_shard(v) for k, v in self.state[m.param].items()}

    def _keep(self, m: _Matrix, local: dict[str, Any]) -> None:
        """Write back what the contract set in `local` (scalars, new entries)."""
        state = self.state[m.param]
        for k, v in local.items():
            if not is_dtensor(state.get(k)):
                state[k] = v

    def _step_matrices(self, present: list[bool]) -> None:
        """prepare on the shards → forward all-to-alls → directions on the owners → back
        all-to-alls → apply on the shards (the module docstring's step)."""
        opt = self.matrix_opt
        assert opt is not None
        live = [m for m in self._matrices if present[m.unit]]
        stepped = [m for m in live if m.param.grad is not None]
        mark_stepped([m.param for m in stepped], type(opt).__name__, [m.name for m in stepped])
        moving: dict[int, bool] = {}
        updates: dict[int, Tensor] = {}
        for m in live:
            state = opt.state_of(m.param, m.group)
            moving[m.unit] = opt.moves(state, m.param.shape, m.group)
            if m.param.grad is not None:
                local = self._local(m)
                u = opt.prepare(local_shard(m.param.grad), local, m.group)
                self._keep(m, local)
                updates[m.unit] = u.reshape(-1)
        buckets = []
        for unit_ids in self.assignment.buckets:
            ms = [self._matrices[i] for i in unit_ids if present[i]]
            if ms:
                buckets.append(_Exchange(ms, self.rank, self.world_size))
        for x in buckets:
            self._send(x, updates)
        full = {}
        for x in buckets:
            full.update(self._receive(x))
        found = self._directions([m for x in buckets for m in x.mine], full)
        for x in buckets:
            self._send_back(x, found)
        rows: dict[int, Tensor] = {}
        for x in buckets:
            rows.update(self._receive_back(x))
        record = telemetry.active()
        for m in live:
            if m.param.grad is None:
                continue
            p = local_shard(m.param)
            d = rows.get(m.unit, p.new_zeros(0)).view(p.shape).to(state_dtype(m.param))
            local = self._local(m)
            d = d if moving[m.unit] else None
            telemetry.apply_recorded(record, opt, p, d, local, m.group, m.name, m.param)
            self._keep(m, local)

    def _send(self, x: _Exchange, updates: dict[int, Tensor]) -> None:
        """Launch the bucket's forward all-to-all: this rank's shard of each prepared update
        to its matrix's owner, grouped by owner rank (zeros where this rank has no gradient)."""
        n, rank, dev = self.world_size, self.rank, self.device
        dtype = self.comm_dtype or _bucket_dtype(x.ms)
        parts = []
        for d in range(n):
            for m in x.ms:
                if m.owner == d and m.numels[rank]:
                    u = updates.get(m.unit)
                    if u is None:  # no gradient here (but somewhere): zeros
                        u = torch.zeros(m.numels[rank], dtype=dtype, device=dev)
                    parts.append(u)
        x.send = torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype, device=dev)
        x.recv = torch.empty(sum(x.out_splits), dtype=dtype, device=dev)
        x.work = C.all_to_all(
            x.recv, x.send, x.out_splits, x.in_splits, self.process_group, self._stats,
            async_op=True,
        )  # fmt: skip

    def _receive(self, x: _Exchange) -> dict[int, Tensor]:
        """Wait for the forward all-to-all; the full update of each matrix this rank owns
        (the shards of every rank concatenated in rank order), by unit."""
        if x.work is not None:
            x.work.wait()
        chunks: dict[int, list[Tensor]] = {m.unit: [] for m in x.mine}
        offset = 0
        for s in range(self.world_size):
            for m in x.mine:
                chunks[m.unit].append(x.recv[offset : offset + m.numels[s]])
                offset += m.numels[s]
        return {
            m.unit: torch.cat(chunks[m.unit]).to(state_dtype(m.param)).view(m.param.shape)
            for m in x.mine
        }

    def _send_back(self, x: _Exchange, found: dict[int, Tensor]) -> None:
        """Launch the bucket's back all-to-all: each rank its rows of every direction this
        rank owns (zeros for a matrix the step leaves in place), laid out as it sent them."""
        parts = []
        for s in range(self.world_size):
            for m in x.mine:
                start = sum(m.numels[:s])
                d = found.get(m.unit)
                parts.append(
                    x.recv.new_zeros(m.numels[s]) if d is None else d[start : start + m.numels[s]]
                )
        ret = torch.cat(parts).to(x.recv.dtype) if parts else x.recv.new_zeros(0)
        x.back = torch.empty_like(x.send)
        x.work = C.all_to_all(
            x.back, ret, x.in_splits, x.out_splits, self.process_group, self._stats,
            async_op=True,
        )  # fmt: skip

    def _receive_back(self, x: _Exchange) -> dict[int, Tensor]:
        """Wait for the back all-to-all; this rank's rows of each direction, by unit."""
        if x.work is not None:
            x.work.wait()
        rows, offset, rank = {}, 0, self.rank
        for d in range(self.world_size):
            for m in x.ms:
                if m.owner == d and m.numels[rank]:
                    rows[m.unit] = x.back[offset : offset + m.numels[rank]]
                    offset += m.numels[rank]
        return rows

    def _directions(self, mine: list[_Matrix], full: dict[int, Tensor]) -> dict[int, Tensor]:
        """The matrix optimizer's directions of the owned full updates, batched by param group;
        flat, by unit (a None direction, a step that leaves the matrix in place, is left out)."""
        assert self.matrix_opt is not None
        by_group: dict[int, list[_Matrix]] = defaultdict(list)
        for m in mine:
            by_group[id(m.group)].append(m)
        out: dict[int, Tensor] = {}
        for ms in by_group.values():
            items = [(full[m.unit], self.state[m.param]) for m in ms]
            found = self.matrix_opt.directions(items, ms[0].group, [m.name for m in ms])
            for m, d in zip(ms, found):
                if d is not None:
                    out[m.unit] = d.reshape(-1)
        return out

    # -- accounting --------------------------------------------------------------------
    def expected_comm_bytes(self, present: list[bool] | None = None) -> dict[str, dict[str, float]]:
        """What `comm_stats()` should report for one step in which the matrices flagged in
        `present` (default: all) have gradients, from the shard layout alone.

        Per bucket, the forward all-to-all sends this rank's shard of every matrix owned
        elsewhere and receives the other ranks' shards of what it owns; the backward one
        sends and receives the reverse. So each rank sends and receives, per step, its
        shards of others' matrices plus the others' shards of its own matrices: on average
        2·(N−1)/N × its sharded matrix-gradient bytes.
        """
        n, rank = self.world_size, self.rank
        out: dict[str, dict[str, float]] = {}
        present = present if present is not None else [True] * len(self._matrices)
        for unit_ids in self.assignment.buckets if n > 1 else []:
            ms = [self._matrices[i] for i in unit_ids if present[i]]
            if not ms:
                continue
            es = (self.comm_dtype or _bucket_dtype(ms)).itemsize
            theirs = sum(m.numels[rank] for m in ms if m.owner != rank)
            mine = sum(sum(m.numels) - m.numels[rank] for m in ms if m.owner == rank)
            d = out.setdefault("all_to_all", {"sent": 0.0, "received": 0.0, "calls": 0})
            d["sent"] += (theirs + mine) * es
            d["received"] += (theirs + mine) * es
            d["calls"] += 2
        self._expected_agreement(out, len(self._matrices))
        return out

    # -- state -------------------------------------------------------------------------
    def state_view(self) -> StateView:
        """The state by name for checkpoints: elementwise state as DTensors sharded like the
        parameters (every rank), whole-matrix state on the matrix's owner."""
        return _FSDPView(self)


class _FSDPView(StateView):
    """`StateView` of an FSDPOptimizer: every parameter's elementwise and scalar state on every
    rank (DTensors, gathered by unsharding), whole-matrix state on its owner only."""

    spread = True

    def __init__(self, opt: FSDPOptimizer) -> None:
        self.whole = opt.template.state_view()  # the same optimizer over the unsharded names
        super().__init__(opt, self.whole.kinds)
        self.gather_group = opt.process_group
        self.owner_of = opt.owner_of
        self.rank = opt.rank

    def metadata(self) -> dict[str, Any]:
        return self.whole.metadata()

    def sends(self, name: str, key: str, value: Any) -> bool:
        # an unsharded DTensor entry is the same on every rank of the group: rank 0 sends it
        return self.rank == 0 or not is_dtensor(value)

    def keeps(self, name: str, key: str) -> bool:
        kind = self.kinds(name).get(key, "elementwise")
        return kind != "matrix" or self.owner_of.get(name) == self.rank


def _bucket_dtype(ms: list[_Matrix]) -> torch.dtype:
    """The dtype a bucket's updates travel in without `comm_dtype`: its matrices' state dtype
    (float32 for bf16/fp16 parameters; float64 parameters keep float64 end to end)."""
    dtype = state_dtype(ms[0].param)
    for m in ms[1:]:
        dtype = torch.promote_types(dtype, state_dtype(m.param))
    return dtype


def _check_layout(layout: Any, mesh: Any) -> None:
    """Refuse a layout FSDPOptimizer does not run under (expert or tensor parallelism), or a
    model sharded over other ranks than the layout's dp group."""
    dims = layout.dims
    if dims.ep > 1 or dims.tp > 1:
        raise ValueError(
            f"FSDPOptimizer runs over data (and pipeline) parallelism only, not under a layout "
            f"with ep={dims.ep}, tp={dims.tp}: use LayerwiseDistributedOptimizer(model, "
            "layout=layout) for expert or tensor parallelism (--ep/--tp without --fsdp)"
        )
    if mesh is None:
        return
    sharded = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    dp = layout.dims.group_ranks("dp", layout.rank)
    if sharded != dp:
        raise ValueError(
            f"the model is sharded over ranks {sharded}, but the layout's dp group is {dp}: "
            "shard it over the stage's data-parallel ranks, shard_model(model, "
            "mesh=DeviceMesh.from_group(layout.dp_group, device_type))"
        )


def _shard_group(named: list[tuple[str, Tensor]]) -> tuple[Any, Any]:
    """The process group of the mesh dimension every parameter is Shard(0) on (None without
    an initialised process group), checking the FSDP2 layout and naming what breaks it."""
    from torch.distributed.tensor import Replicate, Shard

    mesh, dim = None, None
    for name, p in named:
        if not is_dtensor(p):
            if C.world()[1] == 1:
                continue
            raise ValueError(
                f"{name} is not a DTensor: apply fully_shard to the model (its root module "
                "too) before building FSDPOptimizer"
            )
        shard = [i for i, pl in enumerate(p.placements) if isinstance(pl, Shard)]
        ok = len(shard) == 1 and p.placements[shard[0]] == Shard(0)
        ok = ok and all(isinstance(pl, (Shard, Replicate)) for pl in p.placements)
        if not ok:
            raise ValueError(
                f"{name} has placements {p.placements}: FSDPOptimizer needs Shard(0) on one "
                "mesh dimension and Replicate on the others (FSDP2 / HSDP)"
            )
        if mesh is None:
            mesh, dim = p.device_mesh, shard[0]
        elif p.device_mesh != mesh or shard[0] != dim:
            raise ValueError(f"{name} is sharded on another mesh than the other parameters")
    if mesh is None:
        return None, None
    return (mesh.get_group(dim) if mesh.ndim > 1 else mesh.get_group()), mesh
