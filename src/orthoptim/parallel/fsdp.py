"""Muon or SOAP over a model sharded by FSDP2 (`torch.distributed.fsdp.fully_shard`, HSDP).

Under FSDP2 every parameter is a DTensor sharded along dim 0 and, after backward, every rank
holds its dim-0 shard of the averaged gradient; nobody holds a full matrix. One step::

    agree      one small all-reduce: which matrices have a gradient, which gradients are
               non-finite (so every rank skips or raises together)
    momentum   on the local shards (Muon's momentum is elementwise, so the buffer stays a
               DTensor sharded like its parameter: memory is spread and checkpoints reshard)
    forward    per bucket, ONE all-to-all: each rank sends the Nesterov update shard of every
               matrix to that matrix's owner (cost-balanced `assign`, as the layer-wise
               optimizer); the owner concatenates the shards in rank order = the full matrix
    orthogonalize  owners run Newton-Schulz on what they own, batched by shape
    back       per bucket, ONE all-to-all: the owner sends each rank the rows of the
               orthogonalized update matching that rank's shard
    apply      decoupled weight decay and the lr-scaled update on the local shards

SOAP (`optimizer="soap"`) has per-matrix state (Kronecker factors, eigenbases, moments in the
rotated basis), so it cannot stay sharded: the forward all-to-all carries the raw gradient
shards, the owner keeps the matrix's whole SOAP state and runs SOAP's own step on the full
gradient, and the back all-to-all returns each rank its rows of the scaled update (same bytes
as Muon). Every rank keeps the step count, so all agree when SOAP's first step leaves a
matrix in place. `sharded_state_dict()` is Muon/AdamW only; SOAP saves with `state_dict()`.

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

from orthoptim import checkpoint
from orthoptim._validate import check_choice, check_float_dtype, check_positive
from orthoptim.optim.base import (
    check_nonfinite_policy,
    enforce_nonfinite_policy,
    local_shard,
    state_dtype,
)
from orthoptim.optim.hybrid import RoutePredicate, build_optimizer, default_route
from orthoptim.optim.muon import lr_scale_factor, orthogonalize_blocks, split_of
from orthoptim.parallel import clip
from orthoptim.parallel import collectives as C
from orthoptim.parallel.assignment import BALANCES, Assignment, assign, units_from_model

_NOT_HYPER = ("params", "param_names", "optimizer")


def shard_rows(rows: int, world_size: int) -> list[int]:
    """Rows of dim 0 on each rank under DTensor's Shard(0) (torch.chunk semantics): chunks of
    ceil(rows / N), so trailing ranks may hold fewer rows or none."""
    chunk = -(-rows // world_size) if rows else 0
    return [max(0, min(chunk, rows - r * chunk)) for r in range(world_size)]


def shard_model(model: nn.Module, mesh: Any = None) -> nn.Module:
    """Apply FSDP2's `fully_shard` to every module in `model.blocks` (if it has them), then to
    the root, on `mesh` (default: a 1-D mesh over the default process group). Returns `model`.

    Per-block wrapping lets FSDP gather one block's parameters at a time; the root holds the
    rest (embeddings, head, final norm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        device = next(model.parameters()).device.type
        mesh = init_device_mesh(device, (C.world()[1],))
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def count_fsdp_collectives(model: nn.Module, stats: C.CommStats) -> None:
    """Route FSDP2's own parameter all-gathers and gradient reduce-scatters, for every module of
    `model` that `fully_shard` wrapped, through collectives.py, counted in `stats` (as
    "fsdp_all_gather" and "fsdp_reduce_scatter"), so FSDP2's traffic can be told apart from
    the optimizer's. Uses FSDP2's `set_custom_all_gather` / `set_custom_reduce_scatter` hooks.
    (HSDP's all-reduce across replicas is not covered by these hooks.)"""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class _Gather(AllGather):
        def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(
            self, output_tensor: Tensor, input_tensor: Tensor, group: Any, async_op: bool = False
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
            group: Any,
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
        self.numels = [r * row for r in shard_rows(param.shape[0], world_size)]


class FSDPOptimizer(torch.optim.Optimizer):
    """Muon (hybrid with AdamW) over parameters sharded by FSDP2's `fully_shard`.

    Build it after `fully_shard` (every trainable parameter a DTensor sharded on dim 0 of one
    mesh dimension, replicated on the others, as FSDP and HSDP lay them out)::

        fully_shard(block) for each block; fully_shard(model)
        opt = FSDPOptimizer(model, optimizer="muon", lr=0.02)
        loss.backward(); opt.step(); opt.zero_grad()

    `param_groups` and `state` are those of `build_optimizer(model, optimizer, ...)` over the
    DTensor parameters (so LR schedulers and `state_dict()` act as usual; every state tensor
    is a DTensor sharded like its parameter). Arguments: `balance` ("cost", "round_robin",
    "capped") and `bucket_mb` as the layer-wise optimizer (one all-to-all pair per bucket),
    `comm_dtype` (e.g. torch.bfloat16: updates travel in it; by default they travel in the
    state dtype, float32 or float64; state and parameters stay in their dtype), `route`,
    `nonfinite` ("raise" or "skip", agreed by all ranks),
    `state_dict_to` ("all" or "rank0": where `state_dict()` delivers the full, unsharded
    dict of a Muon/AdamW run); other keyword arguments go to `build_optimizer`. Matrix
    optimizer: "muon", "soap" (whole per-matrix state on the owner), or "adamw" (the
    baseline).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: str = "muon",
        lr: float | None = None,
        balance: str = "cost",
        bucket_mb: float = 25,
        comm_dtype: torch.dtype | None = None,
        route: RoutePredicate | None = None,
        nonfinite: str = "raise",
        state_dict_to: str = "all",
        **inner_kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if optimizer not in ("muon", "soap", "adamw"):
            raise ValueError(
                f"optimizer must be one of ('muon', 'soap', 'adamw') for FSDPOptimizer, "
                f"got {optimizer!r}"
            )
        check_choice("balance", balance, BALANCES)
        check_positive("bucket_mb", bucket_mb)
        check_float_dtype("comm_dtype", comm_dtype)
        self.state_dict_to = check_choice("state_dict_to", state_dict_to, checkpoint.STATE_DICT_TO)
        self.nonfinite = check_nonfinite_policy(nonfinite)
        self.model = model
        self.comm_dtype = comm_dtype
        rule = route if route is not None else default_route(model)
        self.template = build_optimizer(
            model, optimizer=optimizer, lr=lr, route=rule, nonfinite=nonfinite, **inner_kwargs
        )
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.process_group, self.mesh = _shard_group([(n, p) for n, p in named])
        self.rank, self.world_size = C.world(self.process_group)
        for n, p in named:
            C.check_device(p, f"FSDPOptimizer: parameter {n!r}", self.process_group)
        self.device = named[0][1].device if named else torch.device("cpu")

        self.kind = optimizer
        # The matrix optimizer (Muon or SOAP; None for plain AdamW): its maths run on owners.
        self.matrix_opt: Any = self.template.inner.get(optimizer) if optimizer != "adamw" else None
        self.adamw: torch.optim.Optimizer | None = self.template.inner.get("adamw")
        group_of = self._matrix_groups()
        units = [u for u in units_from_model(model, optimizer=optimizer, route=rule)]
        self.units = [u for u in units if u.name in group_of]
        self.assignment: Assignment = assign(
            self.units, self.world_size, balance=balance, bucket_bytes=int(bucket_mb * 2**20)
        )
        params = dict(named)
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
        self._named = named

        super().__init__([{"params": [p for _, p in named]}], {})
        self.param_groups = self.template.param_groups
        self.state = self.template.state
        self._stats = C.CommStats()
        self._last_stats = C.CommStats()
        self._built = True

    def _matrix_groups(self) -> dict[str, dict[str, Any]]:
        """Matrix name → its (current) param group of the matrix optimizer."""
        if self.matrix_opt is None:
            return {}
        return {n: g for g in self.matrix_opt.param_groups for n in g["param_names"]}

    # -- the step ----------------------------------------------------------------------
    def _agree(self) -> tuple[list[bool], list[str]]:
        """Which matrices have a gradient on some rank, and the names of the parameters with
        a non-finite gradient shard somewhere (`collectives.agree`: one all-reduce)."""
        present = [m.param.grad is not None for m in self._matrices]
        bad = [
            p.grad is not None and not bool(torch.isfinite(local_shard(p.grad)).all())
            for _, p in self._named
        ]
        present, bad = C.agree(
            present, bad, group=self.process_group, stats=self._stats, device=self.device
        )
        return present, [n for (n, _), v in zip(self._named, bad) if v]

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Agree on gradients, Muon on the sharded matrices via their owners, AdamW locally."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        present, bad = self._agree()
        if enforce_nonfinite_policy(self.nonfinite, bad, self.world_size):
            self._finish_stats()
            return loss
        if self._matrices:
            self._step_matrices(present)
        if self.adamw is not None:
            self.adamw.step()
        self._finish_stats()
        return loss

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip the gradients of the whole model by their global norm, as
        `torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` on the unsharded model;
        call it between backward and `step()`.

        Sums the `norm_type`-th powers of this rank's local gradient shards, ONE small
        all-reduce over the shard group (sum; max for inf; under HSDP the replicas hold equal
        values, so the replicate dimension is left out) gives the total, and every local shard
        is scaled by min(1, max_norm / (total + 1e-6)). Returns the total norm (the same on
        every rank). A non-finite total raises RuntimeError with `error_if_nonfinite`;
        otherwise the gradients are left unscaled and `step()` applies the `nonfinite` policy.
        Collective: call it on every rank."""
        grads = [local_shard(q.grad) for _, q in self._named if q.grad is not None]
        return clip.clip_(
            grads,
            grads,
            max_norm,
            norm_type,
            error_if_nonfinite,
            device=C.device_for(self.process_group, self.device),
            groups=(self.process_group,),
            dtype=self._named[0][1].dtype if self._named else None,
            stats=self._stats,
        )

    def _finish_stats(self) -> None:
        self._last_stats = self._stats
        self._stats = C.CommStats()

    def _momentum(self, m: _Matrix) -> Tensor:
        """Update the local momentum shard; return the local update shard (fp32, flat)."""
        g = m.group
        grad = m.param.grad
        if m.param.dtype in (torch.float16, torch.bfloat16):
            grad = grad.to(torch.float32)
        state = self.state[m.param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grad)
        buf, gl = local_shard(state["momentum_buffer"]), local_shard(grad)
        buf.lerp_(gl, 1.0 - g["momentum"])
        update = gl.lerp(buf, g["momentum"]) if g["nesterov"] else buf
        return update.reshape(-1)

    def _step_matrices(self, present: list[bool]) -> None:
        n, rank, dev = self.world_size, self.rank, self.device
        wire = self.comm_dtype
        live = [m for m in self._matrices if present[m.unit]]
        # What travels to the owner: Muon's Nesterov update (its momentum is elementwise, so
        # it stays sharded); SOAP's raw gradient (its state is per matrix, held by the owner).
        outgoing = self._momentum if self.kind == "muon" else _flat_grad
        updates = {m.unit: outgoing(m) for m in live if m.param.grad is not None}
        moved = self._soap_moves(live) if self.kind == "soap" else {}
        buckets = []
        for unit_ids in self.assignment.buckets:
            ms = [self._matrices[i] for i in unit_ids if present[i]]
            if ms:
                buckets.append(ms)

        # Forward: per bucket, shards grouped by destination (owner) rank.
        sent_layouts = []
        for ms in buckets:
            in_splits = [sum(m.numels[rank] for m in ms if m.owner == d) for d in range(n)]
            out_splits = [sum(m.numels[s] for m in ms if m.owner == rank) for s in range(n)]
            dtype = wire or _bucket_dtype(ms)
            parts = []
            for d in range(n):
                for m in ms:
                    if m.owner == d and m.numels[rank]:
                        u = updates.get(m.unit)
                        # A matrix with no gradient here (but somewhere) contributes zeros.
                        if u is None:
                            u = torch.zeros(m.numels[rank], dtype=dtype, device=dev)
                        parts.append(u)
            send = torch.cat(parts).to(dtype) if parts else torch.zeros(0, dtype=dtype, device=dev)
            recv = torch.empty(sum(out_splits), dtype=dtype, device=dev)
            work = C.all_to_all(
                recv, send, out_splits, in_splits, self.process_group, self._stats, async_op=True
            )
            sent_layouts.append((ms, in_splits, out_splits, send, recv, work))

        # Owners: rebuild full matrices, Newton-Schulz batched by (group, shape).
        full: dict[int, Tensor] = {}
        for ms, _, _, _, recv, work in sent_layouts:
            if work is not None:
                work.wait()
            mine = [m for m in ms if m.owner == rank]
            chunks: dict[int, list[Tensor]] = {m.unit: [] for m in mine}
            offset = 0
            for s in range(n):
                for m in mine:
                    chunks[m.unit].append(recv[offset : offset + m.numels[s]])
                    offset += m.numels[s]
            for m in mine:
                full[m.unit] = (
                    torch.cat(chunks[m.unit]).to(state_dtype(m.param)).view(m.param.shape)
                )
        mine = [m for ms in buckets for m in ms if m.owner == rank]
        compute = self._orthogonalize if self.kind == "muon" else self._soap_deltas
        ortho = compute(mine, full)

        # Back: the owner sends each rank its rows, laid out as the forward receive buffer.
        back = []
        for ms, in_splits, out_splits, send, recv, _ in sent_layouts:
            mine = [m for m in ms if m.owner == rank]
            parts = []
            for s in range(n):
                for m in mine:
                    start = sum(m.numels[:s])
                    parts.append(ortho[m.unit][start : start + m.numels[s]])
            ret = torch.cat(parts).to(recv.dtype) if parts else recv.new_zeros(0)
            got = torch.empty_like(send)
            work = C.all_to_all(
                got, ret, in_splits, out_splits, self.process_group, self._stats, async_op=True
            )
            back.append((ms, got, work))

        for ms, got, work in back:
            if work is not None:
                work.wait()
            offset = 0
            for d in range(n):
                for m in ms:
                    if m.owner != d or not m.numels[rank]:
                        continue
                    o = got[offset : offset + m.numels[rank]]
                    offset += m.numels[rank]
                    if m.param.grad is None:
                        continue
                    g, p = m.group, local_shard(m.param)
                    if self.kind == "soap":
                        if moved[m.unit]:  # SOAP's first step only builds its bases
                            if g["weight_decay"] != 0.0:
                                p.mul_(1.0 - g["lr"] * g["weight_decay"])
                            p.add_(o.view(p.shape).to(p.dtype))
                        continue
                    rows, cols = _matrix_shape(m.param.shape)
                    scale = g["lr"] * lr_scale_factor(g["lr_scale"], rows, cols)
                    if g["weight_decay"] != 0.0:
                        p.mul_(1.0 - g["lr"] * g["weight_decay"])
                    p.add_(o.view(p.shape).to(p.dtype), alpha=-scale)

    def _soap_moves(self, live: list[_Matrix]) -> dict[int, bool]:
        """Per live matrix: does this SOAP step move it? Not on the first step of a matrix with
        a Kronecker factor (SOAP only initialises its bases then). Every rank decides alike
        from the replicated step count, which non-owners advance here as the owner's SOAP does.
        """
        out = {}
        for m in live:
            st = self.state[m.param]
            rows, cols = _matrix_shape(m.param.shape)
            factored = min(rows, cols) <= m.group["max_precond_dim"]
            out[m.unit] = "step" in st or not factored
            if m.owner != self.rank:
                st["step"] = st.get("step", 0) + int(out[m.unit])
        return out

    def _soap_deltas(self, mine: list[_Matrix], full: dict[int, Tensor]) -> dict[int, Tensor]:
        """SOAP on the owned full gradients: each matrix's state is the owner's `state[param]`
        (full size), stepped through a zero full-size stand-in without weight decay, so the
        stand-in ends up holding the update; returns flat updates by unit (weight decay is
        applied on the shards)."""
        out: dict[int, Tensor] = {}
        for m in mine:
            stand_in = torch.zeros(m.param.shape, dtype=state_dtype(m.param), device=self.device)
            stand_in.grad = full[m.unit].to(stand_in.dtype)
            group = dict(m.group, weight_decay=0.0)
            self.matrix_opt._step_param(stand_in, group, state=self.state[m.param])
            out[m.unit] = stand_in.reshape(-1)
        return out

    def _orthogonalize(self, mine: list[_Matrix], full: dict[int, Tensor]) -> dict[int, Tensor]:
        """Newton-Schulz on the owned full updates, batched by (param group, block shape);
        returns flat orthogonalized updates by unit. A split (fused) matrix is orthogonalized
        block by block, each block times its LR scale over the whole matrix's (the step
        applies the whole matrix's scale)."""
        assert self.matrix_opt is not None
        by_group: dict[int, list[_Matrix]] = defaultdict(list)
        for m in mine:
            by_group[id(m.group)].append(m)
        out: dict[int, Tensor] = {}
        for ms in by_group.values():
            g = ms[0].group
            items = [
                (full[m.unit].reshape(-1, *_matrix_shape(m.param.shape)), split_of(g, m.name))
                for m in ms
            ]
            fused: dict[int, Tensor] = {}
            blocks = orthogonalize_blocks(
                items,
                lambda mats, g=g: self.matrix_opt._orthogonalize(mats, g),
                g["lr_scale"],
                self.matrix_opt.stacks,
            )
            for i, row, o, scale in blocks:
                if row is None:
                    out[ms[i].unit] = o.reshape(-1)
                    continue
                whole = items[i][0]
                if i not in fused:
                    fused[i] = torch.empty_like(whole)
                ratio = scale / lr_scale_factor(g["lr_scale"], *whole.shape[-2:])
                fused[i][:, row : row + o.shape[-2]] = o * ratio
            for i, t in fused.items():
                out[ms[i].unit] = t.reshape(-1)
        return out

    # -- accounting --------------------------------------------------------------------
    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Bytes sent / received per collective kind (and calls) in the last step."""
        return self._last_stats.as_dict()

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
        if n == 1:
            return out
        present = present if present is not None else [True] * len(self._matrices)
        for unit_ids in self.assignment.buckets:
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
        ar = C.ring_all_reduce_bytes(4 * (len(self._matrices) + len(self._named)), n)
        out["all_reduce"] = {"sent": ar, "received": ar, "calls": 1}
        return out

    # -- state -------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported once built: ownership is computed from the whole model."""
        if not getattr(self, "_built", False):
            super().add_param_group(param_group)
            return
        raise ValueError(
            "FSDPOptimizer cannot add param groups: ownership is computed from the whole model "
            "at construction; build a new optimizer instead"
        )

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state, unsharded, in the format of `build_optimizer(model,
        ...)`'s `state_dict()` on the unsharded model (a single-process optimizer loads it as
        is; so does this optimizer at any world size): to every rank, or with
        `state_dict_to="rank0"` to global rank 0 only (the others get {}). Collective. For
        resharding DCP checkpoints use `sharded_state_dict()`. Under SOAP (whole state on
        each matrix's owner) it is torch's rank-local dict, loadable at the same world size."""
        if "soap" in self.template.inner:
            return self.template.state_dict()
        return checkpoint.full_state_dict(self, to_rank0=self.state_dict_to == "rank0")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a `state_dict()`: a full dict (Muon/AdamW; from any world size, or a
        single-process optimizer's: every rank keeps its shard of each state tensor; every
        mismatch listed in one `CheckpointMismatchError` before anything changes), or under
        SOAP the rank-local dict saved at the same world size."""
        if "soap" not in self.template.inner:
            checkpoint.load_full_state_dict(self, state_dict)
            return
        self.template.load_state_dict(state_dict)
        self.param_groups = self.template.param_groups
        self.state = self.template.state
        groups = self._matrix_groups()
        for m in self._matrices:
            m.group = groups[m.name]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every trainable parameter."""
        self.template.zero_grad(set_to_none=set_to_none)

    def _init_state(self) -> None:
        """Create zero state for every parameter that has none yet (the layout DCP loads into)."""
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                if st:
                    continue
                if g["optimizer"] == "muon":
                    dtype = torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else None
                    st["momentum_buffer"] = torch.zeros_like(p, dtype=dtype)
                else:
                    st["step"] = torch.tensor(0.0)
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                    if g.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(p)

    def sharded_state_dict(self) -> dict[str, Any]:
        """State keyed by parameter name, every tensor a DTensor sharded like its parameter
        (AdamW's `step` a plain scalar), plus every group's hyper-parameters: pass it to
        `torch.distributed.checkpoint.save`/`load` (which reshards across world sizes), then
        give the loaded dict to `load_sharded_state_dict`. Creates zero state where none
        exists yet, so a fresh optimizer offers the layout to load into."""
        if self.kind == "soap":
            raise NotImplementedError(
                "sharded_state_dict: SOAP's state lives whole on each matrix's owner, not as "
                "shards; use state_dict() / load_state_dict() (per rank, same world size)"
            )
        self._init_state()
        names = {}
        for g in self.param_groups:
            for name, p in zip(g["param_names"], g["params"]):
                names[name] = p
        state = {name: dict(self.state[p]) for name, p in names.items()}
        groups = [{k: v for k, v in g.items() if k not in _NOT_HYPER} for g in self.param_groups]
        return {"state": state, "param_groups": {str(i): g for i, g in enumerate(groups)}}

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a dict of `sharded_state_dict()`'s layout (after DCP filled it in place)."""
        names = {}
        for g in self.param_groups:
            for name, p in zip(g["param_names"], g["params"]):
                names[name] = p
        unknown = sorted(set(state_dict["state"]) - set(names))
        if unknown:
            raise ValueError(f"state_dict holds state for parameters this model lacks: {unknown}")
        saved = state_dict["param_groups"]
        if len(saved) != len(self.param_groups):
            raise ValueError(
                f"state_dict has {len(saved)} param groups, this optimizer {len(self.param_groups)}"
            )
        for i, g in enumerate(self.param_groups):
            g.update({k: v for k, v in saved[str(i)].items() if k not in _NOT_HYPER})
        self._init_state()
        for name, st in state_dict["state"].items():
            mine = self.state[names[name]]
            for k, v in st.items():
                if k in mine and isinstance(mine[k], Tensor):
                    if mine[k] is not v:
                        local_shard(mine[k]).copy_(local_shard(v))
                else:
                    mine[k] = v


def _bucket_dtype(ms: list[_Matrix]) -> torch.dtype:
    """The dtype a bucket's updates travel in without `comm_dtype`: its matrices' state dtype
    (float32 for bf16/fp16 parameters; float64 parameters keep float64 end to end)."""
    dtype = state_dtype(ms[0].param)
    for m in ms[1:]:
        dtype = torch.promote_types(dtype, state_dtype(m.param))
    return dtype


def _flat_grad(m: _Matrix) -> Tensor:
    """The local gradient shard of a matrix, flat, in float32 for bf16/fp16 parameters."""
    return local_shard(m.param.grad).reshape(-1).to(state_dtype(m.param))


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, cols) of the matrices a parameter of `shape` stands for (as `matrix_view`)."""
    if len(shape) in (2, 3):
        return shape[-2], shape[-1]
    return shape[0], int(torch.Size(shape[1:]).numel())


def _shard_group(named: list[tuple[str, Tensor]]) -> tuple[Any, Any]:
    """The process group of the mesh dimension every parameter is Shard(0) on (None without
    an initialised process group), checking the FSDP2 layout and naming what breaks it."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, dim = None, None
    for name, p in named:
        if not isinstance(p, DTensor):
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
