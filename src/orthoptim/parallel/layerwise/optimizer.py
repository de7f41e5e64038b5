"""The layer-wise optimizer: ownership, masters, the inner optimizer and the step (the data
flow is in `orthoptim.parallel.layerwise`'s docstring)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from orthoptim import checkpoint
from orthoptim import collectives as C
from orthoptim._validate import check_float_dtype
from orthoptim.kernels import unraced
from orthoptim.ns_cost import NS_STEPS
from orthoptim.optim.base import NonfinitePolicy, param_name, step_checked
from orthoptim.optim.contract import MatrixOptimizer
from orthoptim.optim.hybrid import RoutePredicate, build_optimizer
from orthoptim.optim.registry import OptimizerName
from orthoptim.optim.routing import ModelRoute
from orthoptim.optim.state import StateView
from orthoptim.parallel import clip, ordered
from orthoptim.parallel.assignment import (
    Balance,
    MatrixCost,
    assign,
    units_from_model,
)
from orthoptim.parallel.base import DistributedOptimizer
from orthoptim.parallel.layerwise import saving
from orthoptim.parallel.layerwise.buffers import (
    Bucket,
    agreement_items,
    norm_items,
    norm_spans,
)
from orthoptim.parallel.layerwise.ownership import (
    UnitGroup,
    carried_load,
    check_reproducible,
    check_tensor_parallel_layout,
    counted_here,
    inner_parts,
    make_slots,
    tensor_parallel_groups,
)
from orthoptim.parallel.layerwise.slots import Slot, make_masters
from orthoptim.parallel.layerwise.sync import GradSync
from orthoptim.parallel.layerwise.view import LayerwiseView
from orthoptim.parallel.layout import ParallelMesh, expert_gradient_divisor
from orthoptim.shards import local_shard


class LayerwiseDistributedOptimizer(DistributedOptimizer):
    """Layer-wise distributed optimizer: each matrix (or expert slice) is owned whole by one
    rank; AdamW parameters are sharded element-wise over all ranks (`shard_adamw`).

    Every rank builds `build_optimizer(model, optimizer, params=<what it owns>, ...)`; the
    assignment (`opt.assignment`) and the routing are computed from the whole model, so every
    rank agrees. `param_groups` has one group per inner group of the whole-model optimizer on
    every rank (empty `params` where this rank owns none), so LR schedulers act identically on
    every rank. Works without an initialised process group (world size 1).

    Arguments: `balance` ("cost", "round_robin", "capped"), `bucket_mb` (bucket size),
    `overlap_grad_reduce` (reduce during backward from gradient hooks, else in `step()`),
    `overlap_param_gather` (gather asynchronously, waited for in module forward pre-hooks, else in
    `step()`), `gather_dtype` (e.g. torch.bfloat16: parameters travel in it and every replica holds
    the rounded value, the owner keeps a master copy in the parameter dtype), `route` (as
    `build_optimizer`), `nonfinite` ("raise" or "skip", agreed by all ranks), `split_experts` (True,
    or k experts per unit: the experts of a 3-D [E, out, in] matrix parameter become separate units,
    so different ranks may own different experts of one tensor; gradients are reduced and parameters
    gathered per slice), `expert_group` (expert data parallelism: the process group over which
    expert weights, every 3-D matrix parameter, are replicated; they are owned, reduced (averaged
    over it; over a model cut by `expert_parallelize`, whose dispatch summed them over ep already,
    summed over it and divided by the size of `process_group`) and gathered within it, while dense
    weights use `process_group`; `owner_of` gives a rank within the unit's own group),
    `state_dict_to` ("all": `state_dict()` gathers the full dict to every rank; "rank0": to rank 0
    only, the others get {}), `shard_adamw` (True: the AdamW parameters, embeddings, head and
    vectors, have no owner but are sharded element-wise over `process_group`, ZeRO-1 style, inside
    the same buckets and collectives: each rank steps AdamW on its run of every bucket's AdamW
    elements, sized to level the optimizer state per rank (`assignment.deal_adamw`); `owner_of`
    gives -1 for them. False: owned whole like the matrices. Tensor-parallel (DTensor) models keep
    them whole), `param_dtype` (e.g. torch.bfloat16: the model's parameters and the gathers in it,
    fp32 masters and state on the owners), `grad_dtype` (the reduction's; fp32 under `param_dtype`
    by default), `layout` (a `ParallelMesh`, instead of `process_group` and `expert_group`: its dp
    group, its expert group when ep > 1, with expert gradients summed over it and divided by dp, its
    tp group when tp > 1 and its pp group when pp > 1; see the module docstring), `cost` (the
    `MatrixCost` the assignment balances; None: the path Newton-Schulz takes on the parameters'
    device, `MatrixCost.for_device`), `reproducible` (True: the same bits at every power-of-two
    data-parallel size for the accumulation loop `docs/reproducible.md` writes out: each rank's
    micro-batches summed in a binary tree, an ordered cross-rank reduction, a clip norm from
    fixed blocks (the sharded AdamW runs start and end on them, `norm_block`), each
    matrix orthogonalized on its own on a path its shape decides (`kernels.unraced`);
    data parallelism only: no tensor, expert or pipeline groups);
    other keyword arguments go to `build_optimizer`.

    Parameters and gradients are views of flat buffers (nothing model-sized is held twice).
    `step()` uses the reduced gradients as its scratch space (Muon's Nesterov updates are
    computed in them): read or clip gradients before `step()`, not after.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerName = "muon",
        lr: float | None = None,
        process_group: ProcessGroup | None = None,
        balance: Balance = "cost",
        bucket_mb: float = 25,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        gather_dtype: torch.dtype | None = None,
        route: RoutePredicate | None = None,
        nonfinite: NonfinitePolicy = "raise",
        split_experts: bool | int = False,
        expert_group: ProcessGroup | None = None,
        state_dict_to: checkpoint.StateDictTo = "all",
        shard_adamw: bool = True,
        param_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        layout: ParallelMesh | None = None,
        cost: MatrixCost | None = None,
        reproducible: bool = False,
        **inner_kwargs: Any,
    ) -> None:
        for name, dtype in (("gather_dtype", gather_dtype), ("param_dtype", param_dtype)):
            check_float_dtype(name, dtype)
        check_float_dtype("grad_dtype", grad_dtype)
        self.param_dtype, self.grad_dtype, self.gather_dtype = param_dtype, grad_dtype, gather_dtype
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.reproducible = bool(reproducible)
        self.norm_block = ordered.NORM_BLOCK  # the clip norm's blocks under `reproducible`
        self._preamble(
            model, optimizer, lr, route, nonfinite, balance, bucket_mb, state_dict_to,
            dict(inner_kwargs),
        )  # fmt: skip
        self._bind_groups(process_group, expert_group, layout)
        found = tensor_parallel_groups(self.named, self.process_group)
        if self.tp_groups:  # the layout's
            assert layout is not None
            check_tensor_parallel_layout(found, layout.dims.group_ranks("tp", layout.rank))
        else:
            self.tp_groups = found
        if self.reproducible:
            check_reproducible(
                self.world_size, bool(self.tp_groups), self.expert_group is not None, self.stages
            )
        # AdamW units sharded element-wise (not under tensor parallelism: DTensor parameters)
        self.shard_adamw = bool(shard_adamw) and not found
        self.units = units_from_model(
            model,
            optimizer=optimizer,
            route=self.rule,
            split_experts=split_experts,
            elementwise=inner_kwargs.get("elementwise", "adamw"),
        )
        groups = self._group_units(layout)
        self.unit_groups = self._assign(groups, balance, bucket_mb, cost, inner_kwargs)
        # The dense units' assignment (all units' when there is no expert group).
        self.assignment = self.unit_groups[0].assignment
        self._slots, self._slots_by_unit, self.owner_of = make_slots(
            self.units, self.named, self.unit_groups
        )
        self._master = make_masters(self._slots, param_dtype, gather_dtype)
        # the clip norm's places under `reproducible` (`clip.ordered_norm`), fixed with the slots
        self._norm_spans = norm_spans(self.units, self._slots_by_unit, self.norm_block)
        self.grad_sync = GradSync(
            model, self.units, self.unit_groups, self._slots, self._slots_by_unit, self._stats,
            world_size=self.world_size, param_dtype=param_dtype, grad_dtype=grad_dtype,
            gather_dtype=gather_dtype, overlap_grad_reduce=overlap_grad_reduce,
            refuse_ddp=self.expert_group is not None or bool(self.tp_groups),
            reproducible=self.reproducible,
        )  # fmt: skip
        self.inner = self._build_inner(optimizer, lr, nonfinite, inner_kwargs)
        self._consumed = False  # whether the last step used the reduced gradients
        self._expose()
        self.grad_sync.register()
        self._saving = saving.register(model)  # state dicts without views (`saving`)

    # -- construction ------------------------------------------------------------------
    def _group_units(
        self, layout: ParallelMesh | None
    ) -> list[tuple[ProcessGroup | None, list[int], int]]:
        """The units by the group they are data-parallel over: experts (the stacks the model
        declares, `ModelRoute.is_expert`, whatever steps them: under --optimizer adamw they
        are AdamW's) over `expert_group` when one is given, everything else over
        `process_group`: (group, unit indices, gradient divisor) each, dense first."""
        cut = checkpoint.expert_slices(self.model)
        if cut and self.expert_group is None and self.world_size > 1:
            raise ValueError(
                f"LayerwiseDistributedOptimizer: the model is expert-parallel (each rank holds "
                f"its own experts of {sorted(cut)[0]} and {len(cut) - 1} more stacks under the "
                "full model's names), which averaging over process_group would mix; build it "
                "with layout=<the ParallelMesh the model was expert_parallelize'd over> (or "
                "expert_group=<the ranks holding the same experts>)"
            )
        declared = ModelRoute(self.model)
        expert = [
            self.expert_group is not None and declared.is_expert(u.name, self.named[u.name])
            for u in self.units
        ]
        dense = (self.process_group, [i for i, e in enumerate(expert) if not e], self.world_size)
        if self.expert_group is None:
            return [dense]
        # The experts' gradients arrive summed over the expert-parallel group (the token
        # all-to-all's backward) under a layout with ep > 1 and over a model cut by
        # `expert_parallelize`, whichever way the groups were given.
        divisor = expert_gradient_divisor(
            layout, bool(cut), self.world_size, C.world(self.expert_group)[1]
        )
        return [dense, (self.expert_group, [i for i, e in enumerate(expert) if e], divisor)]

    def _assign(
        self,
        groups: list[tuple[ProcessGroup | None, list[int], int]],
        balance: Balance,
        bucket_mb: float,
        cost: MatrixCost | None,
        inner_kwargs: dict[str, Any],
    ) -> list[UnitGroup]:
        """Each group's units assigned over its ranks, on `cost` (None: the costs of the path
        Newton-Schulz takes here, device, dtype, SYRK / Gram form); the expert group's units
        fill around the dense load its ranks already carry."""
        named = self.named
        masters = (self.param_dtype not in (None, torch.float32)) or (
            self.gather_dtype is not None
            and any(p.dtype != self.gather_dtype for p in named.values())
        )
        device = next(iter(named.values())).device if named else torch.device("cpu")
        cost = cost or MatrixCost.for_device(
            device, inner_kwargs.get("ns_dtype", "auto"), inner_kwargs.get("ns_steps", NS_STEPS)
        )
        out: list[UnitGroup] = []
        for k, (group, ids, divisor) in enumerate(groups):
            base = carried_load(out[0].assignment, self.process_group, group) if out else None
            a = assign(
                [self.units[i] for i in ids], C.world(group)[1], balance, int(bucket_mb * 2**20),
                cost=cost, base=base, shard_adamw=self.shard_adamw, masters=masters,
                align_adamw=self.norm_block if self.reproducible else None,
            )  # fmt: skip
            out.append(UnitGroup(group, ids, a, divisor, expert=k > 0))
        return out

    def _build_inner(
        self,
        optimizer: OptimizerName,
        lr: float | None,
        nonfinite: NonfinitePolicy,
        inner_kwargs: dict[str, Any],
    ) -> Any:
        """The inner optimizer over what this rank owns (None when it owns nothing): runs of
        sharded AdamW units go to AdamW whatever `route` says of their names; the route sees
        the slot's values (not the master standing in for them)."""
        owned = [(s.name, self._target(s)) for s in reversed(self._slots) if s.mine]
        if not owned:
            return None
        runs_here = {id(self._target(s)) for s in self._slots if s.mine and s.flat is not None}
        values = {id(self._target(s)): s.data for s in self._slots if s.mine}
        rule = self.rule

        def inner_route(name: str, p: nn.Parameter) -> bool:
            return id(p) not in runs_here and rule(name, values.get(id(p), p))

        inner = build_optimizer(
            self.model, optimizer=optimizer, lr=lr, route=inner_route, nonfinite=nonfinite,
            params=owned, **dict(inner_kwargs),
        )  # fmt: skip
        for part in inner_parts(inner):
            if isinstance(part, MatrixOptimizer):
                # the reduced gradients are the buckets': the step's scratch
                part.consumes_grads = not self.tp_groups
                # how many same-shape matrices a rank owns follows dp: never batch them
                part.batch_matrices = not self.reproducible
        return inner

    def _expose(self) -> None:
        """One param group per group of the whole-model optimizer, the inner optimizer's where
        this rank has one of that kind, else an empty one; its state as the optimizer's."""
        groups: list[dict[str, Any]] = []
        inner_groups = list(self.inner.param_groups) if self.inner is not None else []
        for tg in self.template.param_groups:
            match = next((g for g in inner_groups if g["optimizer"] == tg["optimizer"]), None)
            if match is not None:
                inner_groups.remove(match)
                groups.append(match)
            else:
                g = {k: v for k, v in tg.items() if k not in ("params", "param_names")}
                groups.append({**g, "params": [], "param_names": []})
        state = self.inner.state if self.inner is not None else None
        self._adopt(groups, state, dict(self.template.defaults))

    def _target(self, s: Slot) -> Tensor:
        """The tensor the inner optimizer steps for owned slot `s`: its master, else its values."""
        return self._master.get(s.name, s.data)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for s in self._slots:  # pickle copies views apart: make slices views again
            if s.data is not s.param:
                s.rebind()
        self.grad_sync.index(self._slots_by_unit)  # keyed by id(param): the copy's parameters
        self.grad_sync.register()

    def remove_hooks(self) -> None:
        """Detach every hook this optimizer put on the model (after waiting for parameters)."""
        self.grad_sync.remove_hooks()
        self._saving.remove()

    def _accumulate(self) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no communication) for the backward passes inside;
        the backward after the block reduces the accumulated gradients."""
        return self.grad_sync.no_sync()

    def _agreement_items(self) -> tuple[list[bool], list[Tensor], Callable[[], Tensor], list[str]]:
        """The units, checked on the buckets' reduced gradients (`buffers.agreement_items`)."""
        device = self._slots[0].param.device
        present, checks, per_unit = agreement_items(self.grad_sync.buckets, len(self.units), device)
        return present, checks, per_unit, [u.name for u in self.units]

    # -- gradient clipping -------------------------------------------------------------
    def _clip_tensors(self) -> tuple[Iterator[Tensor], list[Tensor], torch.dtype | None]:
        """Finish the gradient reductions first (`step()` then uses them as they are). Counted:
        the averaged gradient elements this rank owns (its whole units and its runs of the
        sharded AdamW units; under tensor parallelism local shards, a replicated tensor
        counted once, `counted_here`); scaled: every owned reduced gradient."""
        self.grad_sync.ensure_reduced()
        tp, buckets = self.tp_groups, self.grad_sync.buckets
        counted = (b.shard_view(s) for b in buckets for s in b.mine if counted_here(s, tp))
        scaled = [t for b in buckets if b.mine for t in b.shards()]
        return counted, scaled, buckets[0].dtype if buckets else None

    @torch.no_grad()
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """`DistributedOptimizer.clip_grad_norm_`; under `reproducible` with the norm from
        the units, each summed in a fixed tree by its owner, summed in a fixed tree
        (`clip.ordered_norm`), so it has the same bits at every data-parallel size."""
        if not self.reproducible:
            return super().clip_grad_norm_(max_norm, norm_type, error_if_nonfinite)
        _, scaled, dtype = self._clip_tensors()
        p = clip.check_norm_type(norm_type)
        device = C.device_for(self.process_group, self._device())
        items = norm_items(
            self.grad_sync.buckets,
            self._norm_spans,
            self.norm_block,
            p,
            clip.accumulator_dtype(device),
        )
        groups = self.agreement_groups().all
        total = clip.ordered_norm(items, self._norm_spans, p, device, groups, self._stats)
        return clip.apply_clip(total, scaled, max_norm, p, error_if_nonfinite, dtype)

    # -- the step (`DistributedOptimizer.step`) -----------------------------------------
    def refusal(self) -> list[str]:  # the base's, and the gradient sync's
        return super().refusal() + self.grad_sync.refusal(type(self).__name__)

    def _before_agree(self) -> None:
        """Land the parameter gathers, then the gradients of this step, averaged, where the
        owners read them (unless `clip_grad_norm_` reduced them already)."""
        self._consumed = False
        self.grad_sync.ensure_reduced()

    def _end_owned(self) -> None:
        self.grad_sync.finish_step(self._consumed)

    def _after_step(self) -> None:
        """Launch the parameter gathers (asynchronous under `overlap_param_gather`: each is
        waited for by the first forward pre-hook of the next step)."""
        self.grad_sync.launch_gathers(async_op=self.overlap_param_gather)

    def _step_owned(self, present: list[bool]) -> None:
        """Step what this rank owns on its reduced gradients. Gradients in another dtype than
        the tensor stepped (autograd's bf16 gradients of a group of one rank, stepped on fp32
        masters) are converted one bucket at a time, each bucket stepped on its own, so the
        step holds one bucket's converted gradients, not the model's."""
        ready: list[tuple[Tensor, Tensor]] = []
        converted: list[list[tuple[Tensor, Bucket, Slot]]] = []
        for b in self.grad_sync.buckets:
            chunk = []
            for s in b.mine:
                t = self._target(s)
                g = b.reduced_grad(s) if present[s.unit] else None
                if g is not None and g.dtype != t.dtype:
                    chunk.append((t, b, s))
                    g = None
                t.grad = g
                if g is not None:
                    ready.append((t, g))
            if chunk:
                converted.append(chunk)
        if self.inner is None:
            return
        # the matrix optimizers compute in the reduced gradients (`consumes_grads`)
        self._consumed = not self.tp_groups
        # under `reproducible` Newton-Schulz's path follows the shape alone (`unraced`): the
        # CPU's SYRK and Gram paths and the GPU's Triton SYRK are raced per process
        with unraced(self._device(), self.reproducible):
            step_checked(self.inner)  # the gradients were checked by _agree
            for t, _ in ready:  # stepped: hidden from the buckets' steps
                t.grad = None
            if converted:
                self._step_converted(converted)
        for t, g in ready:
            t.grad = g
        for name, master in self._master.items():
            s = self._slot_by_name(name)
            s.local().copy_(local_shard(master))

    def _step_converted(self, converted: list[list[tuple[Tensor, Bucket, Slot]]]) -> None:
        """Step each bucket of converted gradients on its own: a matrix optimizer steps just
        that bucket's parameters (`step_params`, found through one index of its groups, so
        a step of many buckets does not scan every parameter per bucket); any other part
        (torch's AdamW) steps what has a gradient, the bucket's."""
        where: dict[int, tuple[MatrixOptimizer, int, int]] = {}
        others = []
        for part in inner_parts(self.inner):
            if not isinstance(part, MatrixOptimizer):
                others.append(part)
                continue
            for gi, group in enumerate(part.param_groups):
                where.update((id(p), (part, gi, pi)) for pi, p in enumerate(group["params"]))
        for chunk in converted:
            groups: dict[tuple[int, int], tuple[MatrixOptimizer, int, list[int]]] = {}
            rest = False
            for t, b, s in chunk:
                t.grad = b.reduced_grad(s).to(t.dtype)
                spot = where.get(id(t))
                if spot is None:
                    rest = True
                    continue
                part, gi, pi = spot
                groups.setdefault((id(part), gi), (part, gi, []))[2].append(pi)
            for part, gi, index in groups.values():
                group = part.param_groups[gi]
                index.sort()
                params = [group["params"][i] for i in index]
                with torch.no_grad():
                    part.step_params(params, group, [param_name(group, gi, i) for i in index])
            for part in others if rest else []:
                step_checked(part)
            for t, _, _ in chunk:
                t.grad = None

    def _slot_by_name(self, name: str) -> Slot:
        if not hasattr(self, "_slots_by_name"):
            self._slots_by_name = {s.name: s for s in self._slots}
        return self._slots_by_name[name]

    def master_weight(self, name: str) -> Tensor | None:
        """The owner's master copy of parameter `name` (kept when `gather_dtype` rounds), for
        code that edits weights after a step (e.g. QK-clip); None when there is none here."""
        return self._master.get(name)

    def masters(self) -> dict[str, Tensor]:
        """Every master copy this rank keeps, by unit name (live tensors)."""
        return dict(self._master)

    def memory_tensors(self) -> dict[str, list[Tensor]]:
        """`DistributedOptimizer.memory_tensors` with what this driver adds: every bucket's
        slices of its group's flat parameter and gradient buffers (`params`, `grads`: the
        parameters and their `.grad` view them where they lie in one piece), the owner's
        masters and the gather buffers of a rounding gather dtype (`buffers`)."""
        out = super().memory_tensors()
        out["params"] += [b.params for b in self.grad_sync.buckets if b.params is not None]
        out["grads"] += [b.grads for b in self.grad_sync.buckets if b.grads is not None]
        out["masters"] = list(self._master.values())
        out["buffers"] = [t for b in self.grad_sync.buckets for t in b.buffers()]
        return out

    def wait_for_params(self) -> None:
        """Finish every parameter gather in flight (the model's first forward pre-hook does
        this; call it before reading parameters outside a forward pass)."""
        self.grad_sync.wait_for_params()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every trainable parameter of the model (owned or not)."""
        tensors = {id(t): t for s in self._slots for t in (s.param, s.data, self._target(s))}
        for p in tensors.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                # as torch.optim.Optimizer.zero_grad: a view (an expert slice, a bucket view)
                # cannot be detached in place
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def expected_comm_bytes(self) -> dict[str, dict[str, float]]:
        """What `comm_stats()` should report for one step of this layout (sent, received per
        collective kind), computed from the bucket layout alone."""
        out: dict[str, dict[str, float]] = {}
        self.grad_sync.expected_bytes(out)
        self._expected_agreement(out, len(self.units))
        return out

    # -- state -------------------------------------------------------------------------
    def state_view(self) -> StateView:
        """The state by name for checkpoints: the owners' states, gathered over
        `process_group`; every group's parameter names from the whole model. Over an
        expert-parallel model (`model.expert_parallel_slices()`, as `expert_parallelize`
        leaves it) the expert state goes by its global slices and shapes
        (`checkpoint.ExpertSlicesView`), gathered over the same dp group, which holds every
        expert once per expert-data-parallel rank: so the dicts are the single-process
        optimizer's and reshard across --ep and --dp."""
        slices = checkpoint.expert_slices(self.model)
        view = LayerwiseView(self, slices)
        return checkpoint.ExpertSlicesView(view, slices, self.process_group) if slices else view

    def _loading(self) -> contextlib.AbstractContextManager[None]:
        return self._masters_follow()

    @contextlib.contextmanager
    @torch.no_grad()
    def _masters_follow(self) -> Iterator[None]:
        """Around a load: the masters first take the parameters' current values (the model
        loaded before, or a checkpoint written without masters, e.g. at another parameter
        dtype), the checkpoint's masters then replace them, and the owners' parameters are
        written from the masters (every replica already holds their rounding when the model
        was saved with the optimizer)."""
        self.wait_for_params()
        for name, master in self._master.items():
            local_shard(master).copy_(self._slot_by_name(name).local())
        yield
        for name, master in self._master.items():
            self._slot_by_name(name).local().copy_(local_shard(master))
