"""The layer-wise distributed optimizer: every matrix is owned whole by one data-parallel rank,
the AdamW parameters (embeddings, head, vectors) are sharded element-wise over all of them.

One training step::

    backward ──► per bucket, as soon as its gradients are ready: one async reduce-scatter
                 of a flat buffer laid out rank by rank (shard r = the matrices rank r
                 owns, then its run of the bucket's AdamW elements, padded to the bucket's
                 largest shard), so each owner receives the summed gradient of exactly what
                 it owns; a bucket owned by one rank is reduced to it instead
    step()   ──► wait, average by world size, agree on non-finite gradients and on which
                 parameters had a gradient anywhere (one small all-reduce, one host read;
                 under pipeline parallelism one more, of one count, across the stages),
                 owners run the inner optimizer (Muon, SOAP, AdamW, the hybrid) on what they own
             ──► all-gather of the updated parameters per bucket (optionally in bf16),
                 asynchronous: the forward pre-hook of each module waits for its buckets

The model is not wrapped; the optimizer registers the hooks it needs.

AdamW is element-wise, so its parameters need no single owner (`shard_adamw`, ZeRO-1 style):
in every bucket each rank's shard ends with a run of the bucket's AdamW elements (the AdamW
parameters flattened back to back, rank 0's run first), so the same reduce-scatter brings
each rank the summed gradient of its run, its inner AdamW steps the run (a 1-D view of the
parameter, named `name{lo:hi}`, state and master copy shaped like it), and the same
all-gather returns it. The runs' lengths level the optimizer state per rank
(`assignment.deal_adamw`). State dicts join and cut runs by name (`orthoptim.checkpoint`).

Tensor parallelism (a (dp, tp) mesh, the model `parallelize_module`d over mesh["tp"], the
optimizer given `process_group=mesh["dp"].get_group()`): buckets hold the local shards of
DTensor parameters, ownership is over the dp group and computed from global shapes (the
same on every tp rank), so the tp ranks of an owner step the same matrices and run a
`TensorParallelOrthogonalizer` together; the non-finite agreement also spans the tp group.

A `ParallelMesh` (`layout=`, `orthoptim.parallel.layout`) hands out every group at once: dense
weights over its dp group, expert weights over its expert-data-parallel group when ep > 1
(their gradients, which the token all-to-all's backward already summed over the ep group, are
summed over the expert group and divided by dp, so they are the single-process gradients),
the agreement and `clip_grad_norm_` also across its pp group when pp > 1; over a model cut by
`expert_parallelize` the state dicts name the experts by their global slices (`state_view`),
so they are the single-process optimizer's at any --ep. The step skeleton, the agreement
groups and the state-dict surface are `orthoptim.parallel.base`'s; this module holds how the
bytes move.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from orthoptim import checkpoint
from orthoptim import collectives as C
from orthoptim._validate import (
    check_float_dtype,
)
from orthoptim.optim.base import (
    NonfinitePolicy,
    sparse_gradient_error,
    step_checked,
)
from orthoptim.optim.contract import MatrixOptimizer
from orthoptim.optim.hybrid import HybridOptimizer, RoutePredicate, build_optimizer
from orthoptim.optim.registry import OptimizerName, state_kinds_of
from orthoptim.optim.routing import ModelRoute
from orthoptim.optim.state import FORMAT_VERSION, StateView, flat_label, hypers
from orthoptim.parallel.assignment import (
    MAX_PADDING,
    NS_STEPS,
    Assignment,
    Balance,
    MatrixCost,
    assign,
    units_from_model,
)
from orthoptim.parallel.base import DistributedOptimizer, add_bytes


def unit_label(name: str, part: tuple[int, int] | None) -> str:
    """The name a unit goes by in state dicts and errors: the parameter's name, or for a slice
    of experts `name[start:stop]`."""
    return name if part is None else f"{name}[{part[0]}:{part[1]}]"


class _Slot:
    """Where one unit (a parameter, or a slice of the experts of a 3-D one), or one rank's
    run of a sharded AdamW unit, lives in its bucket: owner rank and offset in the owner's
    shard. `data` is the slot's values (a view of the parameter) and the tensor the owner's
    inner optimizer steps.

    `flat` = (lo, hi): elements lo:hi of the flattened parameter (a sharded AdamW unit's run
    on rank `owner`, named `name{lo:hi}`, `data` 1-D); None: the whole unit."""

    __slots__ = (
        "data", "flat", "mine", "name", "numel", "offset", "owner", "param", "part", "unit",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        unit: int,
        owner: int,
        part: tuple[int, int] | None = None,
        flat: tuple[int, int] | None = None,
    ) -> None:
        self.name, self.param, self.unit, self.owner = unit_label(name, part), param, unit, owner
        self.part = part
        self.flat = flat
        if flat is not None:
            if C.is_dtensor(param) or not param.is_contiguous():
                raise ValueError(
                    f"{name}: a sharded AdamW parameter must be a contiguous plain tensor; "
                    "build the optimizer with shard_adamw=False"
                )
            self.name = flat_label(name, *flat)
            # A leaf view of the run: the inner optimizer updates the parameter in place.
            self.data: Tensor = self.view().requires_grad_(True)
        elif part is None:
            self.data = param
        elif C.is_dtensor(param):
            raise NotImplementedError(
                f"{self.name}: expert slices of a tensor-parallel (DTensor) parameter are not "
                "owned separately; build the optimizer with split_experts=False"
            )
        else:
            # A leaf view of the slice: the inner optimizer updates the parameter in place.
            self.data = self.view().requires_grad_(True)
        self.numel = C.local_shard(self.data).numel()
        self.offset = 0
        self.mine = False  # owned by this rank (set by the optimizer)

    def view(self) -> Tensor:
        """The slot's values as a view of its parameter (a run or an expert slice)."""
        if self.flat is not None:
            return self.param.detach().view(-1)[self.flat[0] : self.flat[1]]
        assert self.part is not None
        return self.param.detach()[self.part[0] : self.part[1]]

    @torch.no_grad()
    def rebind(self) -> None:
        """Point `data` (the same tensor: the inner optimizer knows it) at its parameter's
        storage again, as `view()`; a pickled copy holds it apart."""
        v = self.view()
        self.data.set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())

    def local(self) -> Tensor:
        """The unit's local values (a DTensor's shard), sharing the parameter's storage."""
        return C.local_shard(self.data.detach())

    def local_grad(self) -> Tensor | None:
        """This rank's (unreduced) gradient of the unit (of a run: the whole parameter's)."""
        g = self.param.grad
        if g is None or self.part is None:
            return g
        return g[self.part[0] : self.part[1]]


def _start(s: _Slot) -> int:
    """Where slot `s` starts inside its parameter, in elements (for ordering a parameter's
    slots: expert slices by their first expert, runs by their first element)."""
    if s.flat is not None:
        return s.flat[0]
    if s.part is not None:
        return s.part[0] * (s.param.numel() // max(1, s.param.shape[0]))
    return 0


def _by_param(slots: list[_Slot]) -> list[list[_Slot]]:
    """The slots grouped by parameter (first-seen order), each parameter's in element order."""
    groups: dict[int, list[_Slot]] = {}
    for s in slots:
        groups.setdefault(id(s.param), []).append(s)
    return [sorted(g, key=_start) for g in groups.values()]


def _rank_major(params: list[list[_Slot]], n: int) -> tuple[list[_Slot | int], int] | None:
    """The order of a bucket laid out rank by rank in equal shards (so one reduce-scatter and
    one all-gather serve it), with padding (ints, in elements) where a shard falls short, or
    None when that would pad more than `MAX_PADDING` or split a parameter.

    Shard r: the end of a sharded AdamW parameter whose run began on rank r-1, rank r's whole
    units, padding, then r's other runs (the last of which may go on into shard r+1)."""
    if n == 1:
        return None
    head: list[list[_Slot]] = [[] for _ in range(n)]
    whole: list[list[_Slot]] = [[] for _ in range(n)]
    tail: list[list[_Slot]] = [[] for _ in range(n)]
    for ss in params:
        owners = [s.owner for s in ss]
        if all(s.flat is None for s in ss):
            if len(set(owners)) > 1:
                return None  # expert slices of several owners: not rank-major
            whole[owners[0]] += ss
            continue
        if owners != sorted(owners) or len(set(owners)) != len(owners):
            return None
        for k, s in enumerate(ss):
            (head if k > 0 else tail)[s.owner].append(s)
    for r in range(n):
        if len(head[r]) > 1:
            return None
    sizes = [sum(s.numel for s in head[r] + whole[r] + tail[r]) for r in range(n)]
    width = max(sizes)
    padding = n * width - sum(sizes)
    if padding > MAX_PADDING * sum(sizes):
        return None
    order: list[_Slot | int] = []
    for r in range(n):
        order += head[r] + whole[r]
        if width > sizes[r]:
            order.append(width - sizes[r])
        order += tail[r]
    # every parameter's slots must lie back to back, in element order
    at = {}
    pos = 0
    for item in order:
        if isinstance(item, int):
            pos += item
            continue
        at[item] = pos
        pos += item.numel
    for ss in params:
        for x, y in itertools.pairwise(ss):
            if at[x] + x.numel != at[y]:
                return None
    return order, width


def _natural(params: list[list[_Slot]]) -> list[_Slot | int]:
    """The order of a bucket reduced region by region, each parameter's slots back to back,
    no padding: first the parameter whose earlier slots are in the bucket before, last the
    one whose later slots are in the next (so that a parameter across buckets stays in one
    piece of the group's buffers), the others by the owners of their first and last slots
    (so a rank's runs join its whole units)."""

    def key(ss: list[_Slot]) -> tuple[int, int, int]:
        end = _start(ss[-1]) + ss[-1].numel
        place = 0 if _start(ss[0]) > 0 else 2 if end < C.local_shard(ss[0].param).numel() else 1
        return place, ss[0].owner, ss[-1].owner

    return [s for ss in sorted(params, key=key) for s in ss]


def _adjacent(buckets: list[_Bucket]) -> list[_Bucket]:
    """The order buckets take in their group's flat buffers: by first unit, except that a
    bucket whose units lie inside another's range (a unit of at least `bucket_mb` alone,
    `make_buckets`) goes after all the others, so that buckets continuing one another are
    adjacent and a parameter across them stays in one piece."""
    spans = sorted(
        ((min(s.unit for s in b.slots), max(s.unit for s in b.slots)), i)
        for i, b in enumerate(buckets)
    )
    outer, inner, reach = [], [], -1
    for (_, hi), i in spans:
        (inner if hi < reach else outer).append(buckets[i])
        reach = max(reach, hi)
    return outer + inner


class _Bucket:
    """The parameters of one assignment bucket that share a dtype: layout, and the
    collectives in flight over the slices of its group's flat buffers it covers.

    Every parameter of the group lives in two flat buffers of the group, laid out bucket by
    bucket: its values (`params`, the parameter dtype) and its gradient (`grads`, the
    gradient dtype); the parameter and its `.grad` are views of them wherever the layout
    keeps the parameter in one piece (`LayerwiseDistributedOptimizer._point`), so nothing
    model-sized is held twice. Two layouts:

    rank-major (`width` set): N equal shards, shard r holding what rank r owns (its whole
    units and its runs of the sharded AdamW units), padded by at most `MAX_PADDING`; one
    reduce-scatter and one all-gather, in place. natural: the parameters back to back,
    `regions` the runs of one owner; one reduce to and one broadcast from each region's owner
    (a bucket of one owner is one region).

    A group of one rank (an expert group when ep = dp, or no process group) sends nothing and
    holds no buffer: its gradients are used where autograd left them (`own`, read by
    `finish_reduce`) and its parameters are stepped in place.
    """

    def __init__(
        self,
        slots: list[_Slot],
        group: Any,
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        gather_dtype: torch.dtype | None,
        rank_major: bool = True,
    ) -> None:
        self.slots = slots
        self.units: dict[int, list[_Slot]] = {}  # unit → its slots (several runs if sharded)
        for s in slots:
            self.units.setdefault(s.unit, []).append(s)
        self.group = group
        self.rank, self.n = C.world(group)
        self.dtype = dtype
        self.grad_dtype = grad_dtype
        self.gather_dtype = gather_dtype or dtype
        self.owners = sorted({s.owner for s in slots})
        self.mine = [s for s in slots if s.owner == self.rank]
        # what the summed gradients are divided by: the group's size (the mean over it), or
        # for expert weights under expert parallelism the dense group's (`divisor`)
        self.divisor = self.n
        self.width: int | None = None
        self.numel = 0
        self.regions: list[tuple[int, int, int]] = []  # (start, stop, owner rank)
        if self.n > 1:
            self._lay_out(rank_major)
        # In a group of one rank: each owned slot's gradient, shaped like its local values.
        self.own: dict[_Slot, Tensor | None] = {}
        self.grads: Tensor | None = None  # this bucket's slice of the group's buffers
        self.params: Tensor | None = None
        self.gathered: Tensor | None = None  # the gather dtype's buffer, where it rounds
        self.label = "bucket"  # named in errors, set by the optimizer ("bucket 2")
        self.ready: set[int] = set()  # units whose gradients are in (for this step)
        self.present: set[int] = set()  # units that had a gradient on this rank
        self.added: set[int] = set()  # units added into a buffer of another dtype
        # ids of the parameters not viewing the group's buffers, copied to and from them
        self.copied: set[int] = set()
        self.launched = False
        self.pending = False
        self.works: list[tuple[Any, str]] = []

    def _lay_out(self, rank_major: bool) -> None:
        params = _by_param(self.slots)
        laid = _rank_major(params, self.n) if rank_major else None
        order = laid[0] if laid is not None else _natural(params)
        self.width = laid[1] if laid is not None else None
        pos = 0
        for item in order:
            if isinstance(item, int):
                pos += item
                continue
            item.offset = pos
            pos += item.numel
            if self.width is None:
                if self.regions and self.regions[-1][2] == item.owner:
                    start, _, owner = self.regions.pop()
                    self.regions.append((start, pos, owner))
                else:
                    self.regions.append((pos - item.numel, pos, item.owner))
        self.numel = pos
        if self.width is not None:
            w = self.width
            self.regions = [(r * w, (r + 1) * w, r) for r in range(self.n)]

    @property
    def rounds(self) -> bool:
        """Whether the gather dtype rounds the parameters (a gather buffer of its own)."""
        return self.gather_dtype != self.dtype

    def attach(self, grads: Tensor, params: Tensor) -> None:
        """Take this bucket's slices of the group's flat buffers."""
        self.grads, self.params = grads, params
        if self.rounds:
            self.gathered = torch.zeros(self.numel, dtype=self.gather_dtype, device=params.device)

    def buffers(self) -> list[Tensor]:
        """The tensors this bucket holds beyond the parameters and gradients themselves."""
        return [] if self.gathered is None else [self.gathered]

    def mine_regions(self) -> list[tuple[int, int, int]]:
        return [r for r in self.regions if r[2] == self.rank]

    # -- gradients ---------------------------------------------------------------------
    def grad_slice(self, s: _Slot) -> Tensor:
        assert self.grads is not None
        return self.grads[s.offset : s.offset + s.numel]

    def param_slice(self, s: _Slot) -> Tensor:
        assert self.params is not None
        return self.params[s.offset : s.offset + s.numel]

    @staticmethod
    def local_grad(s: _Slot) -> Tensor | None:
        """This rank's (unreduced) gradient of slot `s` shaped like its local values: a view
        of the `.grad` autograd made (a copy only where that gradient's strides forbid a
        view), or None when it has none."""
        g = s.local_grad()
        if g is None:
            return None
        if getattr(g, "placements", None) != getattr(s.param, "placements", None):
            raise ValueError(
                f"the gradient of {s.name} has placements {g.placements} but the parameter "
                f"{s.param.placements}; LayerwiseDistributedOptimizer needs gradients sharded "
                "like their tensor-parallel parameters"
            )
        src = C.local_shard(g)
        if s.flat is not None:
            src = src.reshape(-1)[s.flat[0] : s.flat[1]]
        shape = s.local().shape
        return src if src.shape == shape else src.reshape(shape)

    def put_grad(self, s: _Slot, add: bool = False) -> None:
        """Copy (or with `add`, add) the parameter's local gradient into the slot's place in
        the gradient buffer; zeros when it has none and nothing was added before."""
        dst = self.grad_slice(s)
        g = self.local_grad(s)
        if g is None:
            if not add:
                dst.zero_()
            return
        dst = dst.view(g.shape)
        dst.add_(g) if add else dst.copy_(g)

    def reduce_phase(self) -> str:
        return f"gradient {'reduce-scatter' if self.width else 'reduce'} of {self.label}"

    def gather_phase(self) -> str:
        return f"parameter {'all-gather' if self.width else 'broadcast'} of {self.label}"

    def launch_reduce(self, stats: C.CommStats, async_op: bool) -> None:
        with C.phase(self.reduce_phase(), self.group):
            self._launch_reduce(self.group, stats, async_op)

    def _launch_reduce(self, group: Any, stats: C.CommStats, async_op: bool) -> None:
        if self.n > 1:
            assert self.grads is not None
            if self.width:
                w = self.width
                out = self.grads[self.rank * w : (self.rank + 1) * w]
                work = C.reduce_scatter(
                    out, self.grads, group=group, stats=stats, async_op=async_op
                )
                self.works.append((work, self.reduce_phase()))
            else:
                for start, stop, owner in self.regions:
                    dst = C.global_rank(group, owner)
                    work = C.reduce(
                        self.grads[start:stop], dst, group=group, stats=stats, async_op=async_op
                    )
                    self.works.append((work, self.reduce_phase()))
        self.launched = True

    def _wait(self) -> None:
        for work, name in self.works:
            if work is not None:
                C.wait(work, name)
        self.works = []

    def finish_reduce(self) -> None:
        """Wait for the reduction and turn the owner's regions into averaged gradients, the
        sums divided by `divisor` (in a group of one rank: take each owned slot's gradient
        where it is, divided in place when `divisor` is not 1)."""
        if self.n == 1:
            self.own = {s: self.local_grad(s) for s in self.mine}
            if self.divisor != 1:
                for g in self.own.values():
                    if g is not None:
                        g.div_(self.divisor)
            return
        self._wait()
        assert self.grads is not None
        for start, stop, _ in self.mine_regions():
            self.grads[start:stop].div_(self.divisor)

    def shard_view(self, s: _Slot) -> Tensor:
        """The reduced gradient of a parameter this rank owns, shaped like its local values
        (zeros where a group of one rank has no gradient of it, as a buffer would hold)."""
        if self.n == 1:
            g = self.own[s]
            return torch.zeros_like(s.local()) if g is None else g
        return self.grad_slice(s).view_as(s.local())

    def shards(self) -> list[Tensor]:
        """Every reduced gradient this rank owns here, one per owned slot (so that checking
        them costs at most the largest slot's temporaries): its slices of the buffer, or in a
        group of one rank the gradients themselves."""
        if self.n == 1:
            return [g for g in self.own.values() if g is not None]
        return [self.grad_slice(s) for s in self.mine]

    def reduced_grad(self, s: _Slot) -> Tensor:
        """`shard_view` as the unit's gradient: a DTensor sharded like a DTensor parameter."""
        return C.wrap_local(self.shard_view(s), s.data)

    def reset(self) -> None:
        self.ready.clear()
        self.present.clear()
        self.added.clear()
        self.launched = False
        self.own = {}

    # -- parameters --------------------------------------------------------------------
    def launch_gather(self, stats: C.CommStats, async_op: bool) -> None:
        """Send the owners' parameters to every rank (the owned values of parameters that are
        not views of the buffer, `copied`, copied in first)."""
        with C.phase(self.gather_phase(), self.group):
            self._launch_gather(self.group, stats, async_op)

    def _launch_gather(self, group: Any, stats: C.CommStats, async_op: bool) -> None:
        if self.n == 1:
            if self.rounds:  # the one replica holds the rounded value
                for s in self.mine:
                    v = s.local()
                    v.copy_(v.to(self.gather_dtype))
            return
        assert self.params is not None
        for s in self.mine:
            if id(s.param) in self.copied:
                self.param_slice(s).copy_(s.local().reshape(-1))
        buf = self.params
        if self.gathered is not None:
            buf = self.gathered
            for start, stop, _ in self.mine_regions():
                buf[start:stop].copy_(self.params[start:stop])
        if self.width:
            w = self.width
            mine = buf[self.rank * w : (self.rank + 1) * w]
            work = C.all_gather(buf, mine, group=group, stats=stats, async_op=async_op)
            self.works.append((work, self.gather_phase()))
        else:
            for start, stop, owner in self.regions:
                src = C.global_rank(group, owner)
                work = C.broadcast(
                    buf[start:stop], src, group=group, stats=stats, async_op=async_op
                )
                self.works.append((work, self.gather_phase()))
        self.pending = True
        if not async_op:
            self.finish_gather()

    @torch.no_grad()
    def finish_gather(self) -> None:
        """Wait for the gather; where the gather dtype rounds, every replica (the owner's
        too) takes the rounded values; parameters that are not views of the buffer copy
        theirs out of it."""
        if not self.pending:
            return
        self._wait()
        self.pending = False
        assert self.params is not None
        if self.gathered is not None:
            self.params.copy_(self.gathered)
        for s in self.slots:
            if id(s.param) in self.copied and (s.owner != self.rank or self.rounds):
                s.local().view(-1).copy_(self.param_slice(s))


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
    `overlap_param_gather` (gather asynchronously, waited for in module forward pre-hooks,
    else in `step()`), `gather_dtype` (e.g. torch.bfloat16: parameters travel in it and every
    replica holds the rounded value, the owner keeps a master copy in the parameter dtype),
    `route` (as `build_optimizer`), `nonfinite` ("raise" or "skip", agreed by all ranks),
    `split_experts` (True, or k experts per unit: the experts of a 3-D [E, out, in] matrix
    parameter become separate units, so different ranks may own different experts of one
    tensor; gradients are reduced and parameters gathered per slice), `expert_group` (expert
    data parallelism: the process group over which expert weights, every 3-D matrix
    parameter, are replicated; they are owned, reduced (averaged over it; over a model cut by
    `expert_parallelize`, whose dispatch summed them over ep already, summed over it and
    divided by the size of `process_group`) and gathered within it, while dense weights use
    `process_group`; `owner_of` gives a rank within the unit's own
    group), `state_dict_to` ("all": `state_dict()` gathers the full dict to every rank;
    "rank0": to rank 0 only, the others get {}), `shard_adamw` (True: the AdamW parameters,
    embeddings, head and vectors, have no owner but are sharded element-wise over
    `process_group`, ZeRO-1 style, inside the same buckets and collectives: each rank steps
    AdamW on its run of every bucket's AdamW elements, sized to level the optimizer state
    per rank (`assignment.deal_adamw`); `owner_of` gives -1 for them. False: owned whole like
    the matrices. Tensor-parallel (DTensor) models keep them whole), `param_dtype` (e.g.
    torch.bfloat16: the model's parameters and the gathers in it, fp32 masters and state on
    the owners), `grad_dtype` (the reduction's; fp32 under `param_dtype` by default),
    `layout` (a `ParallelMesh`, instead of `process_group` and `expert_group`: its dp group,
    its expert group when ep > 1, with expert gradients summed over it and divided by dp, its
    tp group when tp > 1 and its pp group when pp > 1; see the module docstring), `cost` (the
    `MatrixCost` the assignment balances; None: the path Newton-Schulz takes on the
    parameters' device, `MatrixCost.for_device`); other keyword arguments go to
    `build_optimizer`.

    Parameters and gradients are views of flat buffers (nothing model-sized is held twice).
    `step()` uses the reduced gradients as its scratch space (Muon's Nesterov updates are
    computed in them): read or clip gradients before `step()`, not after.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerName = "muon",
        lr: float | None = None,
        process_group: Any = None,
        balance: Balance = "cost",
        bucket_mb: float = 25,
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = True,
        gather_dtype: torch.dtype | None = None,
        route: RoutePredicate | None = None,
        nonfinite: NonfinitePolicy = "raise",
        split_experts: bool | int = False,
        expert_group: Any = None,
        state_dict_to: checkpoint.StateDictTo = "all",
        shard_adamw: bool = True,
        param_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        layout: Any = None,
        cost: MatrixCost | None = None,
        **inner_kwargs: Any,
    ) -> None:
        check_float_dtype("gather_dtype", gather_dtype)
        check_float_dtype("param_dtype", param_dtype)
        check_float_dtype("grad_dtype", grad_dtype)
        self.param_dtype, self.grad_dtype = param_dtype, grad_dtype
        self._preamble(
            model, optimizer, lr, route, nonfinite, balance, bucket_mb, state_dict_to,
            dict(inner_kwargs),
        )  # fmt: skip
        self._bind_groups(process_group, expert_group, layout)
        process_group, expert_group = self.process_group, self.expert_group
        cut = checkpoint.expert_slices(model)
        # The experts' gradients arrive summed over the expert-parallel group (the token
        # all-to-all's backward): a layout with ep > 1 says so, and so does a model cut by
        # `expert_parallelize`, whichever way the groups were given.
        self._dispatched = bool(cut) or (layout is not None and layout.dims.ep > 1)
        if cut and expert_group is None and C.world(process_group)[1] > 1:
            raise ValueError(
                f"LayerwiseDistributedOptimizer: the model is expert-parallel (each rank holds "
                f"its own experts of {sorted(cut)[0]} and {len(cut) - 1} more stacks under the "
                "full model's names), which averaging over process_group would mix; build it "
                "with layout=<the ParallelMesh the model was expert_parallelize'd over> (or "
                "expert_group=<the ranks holding the same experts>)"
            )
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.gather_dtype = gather_dtype
        rule, template, named = self.rule, self.template, self.named
        found = _tensor_parallel_groups(named, process_group)
        if self.tp_groups:  # the layout's
            _check_tensor_parallel_layout(found, layout.dims.group_ranks("tp", layout.rank))
        else:
            self.tp_groups = found
        # AdamW units sharded element-wise (not under tensor parallelism: DTensor parameters)
        self.shard_adamw = bool(shard_adamw) and not found
        masters = (param_dtype not in (None, torch.float32)) or (
            gather_dtype is not None and any(p.dtype != gather_dtype for p in named.values())
        )
        self.units = units_from_model(
            model,
            optimizer=optimizer,
            route=rule,
            split_experts=split_experts,
            elementwise=inner_kwargs.get("elementwise", "adamw"),
        )
        # Units by the group they are data-parallel over: experts (the stacks the model
        # declares, `ModelRoute.is_expert`, whatever steps them: under --optimizer adamw
        # they are AdamW's) over `expert_group` when one is given, everything else over
        # `process_group`.
        declared = ModelRoute(model)
        expert = [
            expert_group is not None and declared.is_expert(u.name, named[u.name])
            for u in self.units
        ]
        self._groups = [process_group] + ([expert_group] if expert_group is not None else [])
        self._group_units = [
            [i for i, e in enumerate(expert) if e == bool(g)] for g in range(len(self._groups))
        ]
        bucket_bytes = int(bucket_mb * 2**20)
        owners = [0] * len(self.units)
        self._assignments: list[Assignment] = []
        # Costs on the path Newton-Schulz takes here (device, dtype, SYRK / Gram form); the
        # expert group's units fill around the dense load its ranks already carry.
        device = next(iter(named.values())).device if named else torch.device("cpu")
        cost = cost or MatrixCost.for_device(
            device, inner_kwargs.get("ns_dtype", "auto"), inner_kwargs.get("ns_steps", NS_STEPS)
        )
        for group, ids in zip(self._groups, self._group_units):
            base = None
            if self._assignments:  # the expert group, after the dense one
                base = _carried_load(self._assignments[0], process_group, group)
            a = assign(
                [self.units[i] for i in ids], C.world(group)[1], balance, bucket_bytes,
                cost=cost, base=base, shard_adamw=self.shard_adamw, masters=masters,
            )  # fmt: skip
            for i, r in zip(ids, a.owners):
                owners[i] = r
            self._assignments.append(a)
        # The dense units' assignment (all units' when there is no expert group).
        self.assignment: Assignment = self._assignments[0]
        # One slot per unit owned whole and one per rank's run of a sharded AdamW unit, in
        # unit order; owned slots in model order for the inner optimizer.
        runs = self._adamw_runs()
        self._slots: list[_Slot] = []
        for i, u in enumerate(self.units):
            p = named[u.name]
            if owners[i] >= 0:
                self._slots.append(_Slot(u.name, p, i, owners[i], u.part))
                continue
            for r, lo, hi in runs.get(i, []):  # a run of the whole parameter is the parameter
                flat = None if (lo, hi) == (0, p.numel()) else (lo, hi)
                self._slots.append(_Slot(u.name, p, i, r, flat=flat))
        self._slots_by_unit: list[list[_Slot]] = [[] for _ in self.units]
        for s in self._slots:
            self._slots_by_unit[s.unit].append(s)
        for group, ids in zip(self._groups, self._group_units):
            rank = C.world(group)[0]
            for i in ids:
                for s in self._slots_by_unit[i]:
                    s.mine = s.owner == rank
        # owner rank of every unit within its group; -1: AdamW, sharded over the group
        self.owner_of: dict[str, int] = {
            unit_label(u.name, u.part): o for u, o in zip(self.units, owners)
        }
        # The owner's fp32 masters (of what it owns), taken before the parameters change dtype;
        # the inner optimizer steps them and the parameters are written from them.
        self._master: dict[str, Tensor] = {}
        for s in self._slots:
            master_dtype = torch.float32 if self.param_dtype is not None else s.data.dtype
            keeps = (self.param_dtype or s.data.dtype) != master_dtype
            if s.mine and (keeps or self.gather_dtype not in (None, s.data.dtype)):
                m = C.local_shard(s.data).detach().to(master_dtype, copy=True)
                self._master[s.name] = C.wrap_local(m, s.data).requires_grad_(True)
        self._build_buckets()
        owned = [(s.name, self._target(s)) for s in reversed(self._slots) if s.mine]
        # runs of sharded AdamW units go to AdamW whatever `route` says of their names; the
        # route sees the slot's values (not the master standing in for them)
        runs_here = {id(self._target(s)) for s in self._slots if s.mine and s.flat is not None}
        values = {id(self._target(s)): s.data for s in self._slots if s.mine}

        def inner_route(name: str, p: nn.Parameter) -> bool:
            return id(p) not in runs_here and rule(name, values.get(id(p), p))

        self.inner = (
            build_optimizer(
                model,
                optimizer=optimizer,
                lr=lr,
                route=inner_route,
                nonfinite=nonfinite,
                params=owned,
                **dict(inner_kwargs),
            )
            if owned
            else None
        )

        if not self.tp_groups:  # the reduced gradients are the buckets': the step's scratch
            for part in _parts(self.inner):
                if isinstance(part, MatrixOptimizer):
                    part.consumes_grads = True

        groups: list[dict[str, Any]] = []
        inner_groups = list(self.inner.param_groups) if self.inner is not None else []
        for tg in template.param_groups:
            match = next((g for g in inner_groups if g["optimizer"] == tg["optimizer"]), None)
            if match is not None:
                inner_groups.remove(match)
                groups.append(match)
            else:
                g = {k: v for k, v in tg.items() if k not in ("params", "param_names")}
                groups.append({**g, "params": [], "param_names": []})
        self._adopt(
            groups, self.inner.state if self.inner is not None else None, dict(template.defaults)
        )
        self._sync = True
        self._ddp: Any = None  # the DistributedDataParallel wrap the last forward ran in
        self._hooks: list[Any] = []
        self._register_hooks()

    def _target(self, s: _Slot) -> Tensor:
        """The tensor the inner optimizer steps for owned slot `s`: its master, else its values."""
        return self._master.get(s.name, s.data)

    # -- construction ------------------------------------------------------------------
    def _build_buckets(self) -> None:
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}  # unit index → its bucket
        # Every group's buckets, as unit indices, merged in backward order.
        merged = sorted(
            ([ids[j] for j in bucket], g, b)
            for g, (ids, a) in enumerate(zip(self._group_units, self._assignments))
            for b, bucket in enumerate(a.buckets)
        )
        units = [[self.units[i] for i in ids] for ids in self._group_units]
        for unit_ids, g, index in merged:
            # rank-major where the assignment (and so plan) says so and the layout agrees
            rank_major = self._assignments[g].rank_major(index, units[g])
            by_dtype: dict[torch.dtype, list[_Slot]] = {}
            for i in unit_ids:
                for slot in self._slots_by_unit[i]:
                    if slot.numel:
                        by_dtype.setdefault(slot.data.dtype, []).append(slot)
            for dtype, slots in by_dtype.items():
                dtype = self.param_dtype or dtype
                grad_dtype = self.grad_dtype or (torch.float32 if self.param_dtype else dtype)
                bucket = _Bucket(
                    slots, self._groups[g], dtype, grad_dtype, self.gather_dtype, rank_major
                )
                bucket.label = f"bucket {len(self._buckets)}"
                if g == 1 and self._dispatched:
                    # expert parallelism: the all-to-all's backward summed each expert's
                    # gradient over the ep group; the sum over the expert group then spans
                    # every dp rank of the stage, so it is averaged over dp
                    bucket.divisor = self.world_size
                self._buckets.append(bucket)
                self._bucket_of.update((s.unit, bucket) for s in slots)
        self._point()
        self._index_slots()
        self._next_launch = 0

    @torch.no_grad()
    def _point(self, again: bool = False) -> None:
        """Allocate each group's flat parameter and gradient buffers (bucket after bucket) and
        make every parameter that lies in one piece there a view of them (`_viewed`), in the
        parameter dtype; the others keep their storage and are copied in and out. A group of
        one rank has no buffers: its parameters only change dtype. `again`: the parameters'
        storage was replaced since (`_follow`); the slots' tensors are re-pointed in place
        (the inner optimizer knows them)."""
        self._viewed: dict[int, Tensor] = {}  # id(param) → its view of the gradient buffer
        self._homes: list[tuple[Tensor, Tensor]] = []  # (viewed param, its flat buffer)
        self._copied: set[int] = set()  # id(param) of parameters copied to and from buffers
        self._grad_flats: list[Tensor] = []  # every group's flat gradient buffer
        for b in self._buckets:
            b.copied = self._copied
        flats: dict[tuple[int, torch.dtype, torch.dtype], list[_Bucket]] = {}
        for b in self._buckets:
            if b.n > 1:
                flats.setdefault((id(b.group), b.dtype, b.grad_dtype), []).append(b)
        where: dict[int, list[tuple[_Slot, int, Tensor, Tensor]]] = {}
        for (_, dtype, grad_dtype), buckets in flats.items():
            buckets = _adjacent(buckets)
            device = buckets[0].slots[0].param.device
            total = sum(b.numel for b in buckets)
            params = torch.zeros(total, dtype=dtype, device=device)
            grads = torch.zeros(total, dtype=grad_dtype, device=device)
            self._grad_flats.append(grads)
            base = 0
            for b in buckets:
                b.attach(grads[base : base + b.numel], params[base : base + b.numel])
                for s in b.slots:
                    where.setdefault(id(s.param), []).append((s, base + s.offset, params, grads))
                    values = s.param if s.data is s.param else s.view()
                    b.param_slice(s).copy_(C.local_shard(values).reshape(-1))
                base += b.numel
        for s in self._slots:
            p = s.param
            if id(p) in where or self.param_dtype in (None, p.dtype):
                continue
            p.data = p.data.to(self.param_dtype)  # a group of one rank: no buffer
        for pid, spots in where.items():
            spots.sort(key=lambda x: _start(x[0]))
            p = spots[0][0].param
            first = spots[0][1]
            contiguous = all(
                x[1] + x[0].numel == y[1] and x[2] is y[2] for x, y in itertools.pairwise(spots)
            )
            local = C.local_shard(p)
            numel = local.numel()
            covers = sum(x[0].numel for x in spots) == numel and _start(spots[0][0]) == 0
            if not (contiguous and covers and local.is_contiguous()):
                self._copied.add(pid)
                if self.param_dtype not in (None, p.dtype):
                    raise NotImplementedError(
                        f"{spots[0][0].name}: param_dtype needs the parameter in one piece of "
                        "its bucket; build the optimizer without param_dtype"
                    )
                continue
            params, grads = spots[0][2], spots[0][3]
            values = params[first : first + numel].view(local.shape)
            if C.is_dtensor(p):
                if values.dtype != local.dtype:
                    raise NotImplementedError(
                        f"{spots[0][0].name}: param_dtype with tensor-parallel (DTensor) "
                        "parameters is not supported; build the optimizer without param_dtype"
                    )
                # the same Parameter object, its local shard now the view
                viewed = nn.Parameter(C.wrap_local(values, p), requires_grad=p.requires_grad)
                torch.utils.swap_tensors(p, viewed)
            else:
                p.data = values
            self._homes.append((p, params))
            if grads.dtype == values.dtype:
                view = grads[first : first + numel].view(local.shape)
                self._viewed[pid] = C.wrap_local(view, p) if C.is_dtensor(p) else view
        for s in self._slots:  # the slices and runs view the parameters' new storage
            if s.data is not s.param:
                if again:
                    s.rebind()
                else:
                    s.data = s.view().requires_grad_(True)

    def _follow(self) -> None:
        """Re-point the buffers at the parameters if their storage was replaced since they
        were laid out (`model.to(...)` of another device index, `to_empty`,
        `load_state_dict(assign=True)`), taking the parameters' current values, so the
        optimizer never steps a dead copy; a move to another device is refused (the masters
        and state stay where they were)."""
        moved = [
            p
            for p, flat in self._homes
            if C.local_shard(p).untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        ]
        if not moved:
            return
        device = self._homes[0][1].device
        for p in moved:
            if C.local_shard(p).device != device:
                raise RuntimeError(
                    f"the model's parameters moved from {device} to {p.device} after "
                    "LayerwiseDistributedOptimizer was built; move the model first, then "
                    "build the optimizer"
                )
        self.wait_for_params()
        self._point(again=True)

    def _index_slots(self) -> None:
        """id(param) → its units that communicate (one slot each); the gradient hooks look
        parameters up in it."""
        self._slots_of: dict[int, list[_Slot]] = {}
        for slots in self._slots_by_unit:
            if slots and slots[0].unit in self._bucket_of:
                self._slots_of.setdefault(id(slots[0].param), []).append(slots[0])

    def _adamw_runs(self) -> dict[int, list[tuple[int, int, int]]]:
        """Unit → (rank, lo, hi) of every rank's run of a sharded AdamW unit
        (`Assignment.adamw_runs`, bucket by bucket)."""
        return {
            ids[j]: runs
            for ids, a in zip(self._group_units, self._assignments)
            for b in range(len(a.buckets))
            for j, runs in a.adamw_runs(b).items()
        }

    def _register_hooks(self) -> None:
        if self.overlap_grad_reduce or self.world_size > 1:
            for slots in self._slots_of.values():
                hook = slots[0].param.register_post_accumulate_grad_hook(self._grad_hook)
                self._hooks.append(hook)
        if not (self._homes or self.world_size > 1):
            return
        # Forward pre-hooks on the model and on every module holding parameters: the first
        # to fire in a step lands every pending gather (a forward may read any parameter: a
        # parent's F.linear(x, self.child.weight), weights tied by hand, so waiting module by
        # module for the module's own parameters let such reads see the old values), follows
        # a model that moved and notices a DistributedDataParallel wrap. The submodules'
        # hooks serve a forward that enters a submodule directly (Lightning calls
        # `training_step`, not the module) and find nothing to do otherwise (flag tests).
        modules = [self.model] + [
            m
            for m in self.model.modules()
            if m is not self.model
            and any(id(p) in self._slots_of for p in m.parameters(recurse=False))
        ]
        for module in modules:
            self._hooks.append(module.register_forward_pre_hook(self._forward_hook))
            # model.state_dict() right after step() (a trainer saving the model) returns the
            # updated values
            self._hooks.append(module.register_state_dict_pre_hook(self._wait_hook))

    # -- copies ------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        del state["_hooks"]  # handles of hooks on the original model
        state["_ddp"] = None  # the original's wrap, noticed again at the copy's forward
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for s in self._slots:  # pickle copies views apart: make slices views again
            if s.data is not s.param:
                s.rebind()
        self._index_slots()  # keyed by id(param): the copy's parameters
        self._hooks = []
        self._register_hooks()

    _gathering = False  # parameter gathers launched and not yet waited for

    def _wait_hook(self, module: nn.Module, *args: Any) -> None:
        if self._gathering:
            self.wait_for_params()

    _followed = False  # the parameters' storage checked since the last step

    def _forward_hook(self, module: nn.Module, args: Any) -> None:
        if self._gathering:
            self.wait_for_params()
        if not self._followed:
            self._followed = True
            if self._homes:
                self._follow()
        if torch.is_grad_enabled():
            ddp = torch.nn.parallel.DistributedDataParallel._active_ddp_module
            if ddp is not self._ddp:
                self._notice_ddp(ddp)

    def _notice_ddp(self, ddp: Any) -> None:
        """Note whether this forward runs inside a `DistributedDataParallel` wrap of the model
        (HF Trainer, accelerate and Lightning wrap it after the optimizer is built): DDP then
        all-reduces the gradients, and the step uses them as they are instead of reducing
        them again."""
        if ddp is None or self.world_size == 1:
            self._ddp = None
            return
        if not any(m is self.model for m in ddp.module.modules()):
            self._ddp = None
            return
        if self.expert_group is not None or self.tp_groups:
            raise RuntimeError(
                "LayerwiseDistributedOptimizer: the model is wrapped in "
                "DistributedDataParallel, whose all-reduce would average the expert or "
                "tensor-parallel weights over the wrong ranks; train the unwrapped model (the "
                "optimizer reduces the gradients itself)"
            )
        lightning = ("lightning", "pytorch_lightning")
        if any(c.__module__.split(".")[0] in lightning for c in type(ddp.module).__mro__):
            # Lightning's DDP strategy clips the parameters of `param_groups`, which here are
            # only what this rank owns: every rank would clip by another, wrong norm
            raise RuntimeError(
                "LayerwiseDistributedOptimizer under Lightning's DDP strategy: Lightning would "
                "clip only the parameters this rank owns; use "
                "Trainer(strategy=orthoptim.integrations.lightning.LayerwiseStrategy()) "
                '(or strategy="layerwise")'
            )
        if C.world(ddp.process_group)[1] != self.world_size:
            raise RuntimeError(
                f"LayerwiseDistributedOptimizer runs over {self.world_size} ranks but the "
                f"model's DistributedDataParallel wrap over {C.world(ddp.process_group)[1]}; "
                "give both the same process group"
            )
        self._ddp = ddp

    def remove_hooks(self) -> None:
        """Detach every hook this optimizer put on the model (after waiting for parameters)."""
        self.wait_for_params()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- gradient path -----------------------------------------------------------------
    def _check_dense(self, p: Tensor) -> None:
        """Refuse a sparse `.grad` of `p` by name: the buffers hold dense gradients."""
        if p.grad is not None and p.grad.layout != torch.strided:
            name = self.units[self._slots_of[id(p)][0].unit].name
            raise sparse_gradient_error(type(self).__name__, name, p.grad)

    def _grad_hook(self, p: Tensor) -> None:
        self._check_dense(p)
        if not self._backward_queued:  # once per backward: note the gradients at its end
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        slots = self._slots_of[id(p)]
        if self.world_size == 1:  # nothing to reduce: accumulation needs no no_sync()
            return
        if self._ddp is not None or not self.overlap_grad_reduce:
            # DDP reduces (its no_sync accumulates), or step() does: only make a `.grad` that
            # autograd made anew the parameter's view of the buffer
            if p.grad is not None:
                self._into_view(p)
            return
        if not self._sync:
            self._take_grad(p, slots, final=False)
            return
        for slot in slots:
            bucket = self._bucket_of[slot.unit]
            bucket.finish_gather()
            label = unit_label(self.units[slot.unit].name, self.units[slot.unit].part)
            if slot.unit in bucket.ready:
                raise RuntimeError(
                    f"the gradient of {label} arrived twice before step(): accumulate "
                    "micro-batches inside `with opt.no_sync():` except for the last one"
                )
            if bucket.launched:
                raise RuntimeError(
                    f"the gradient of {label} arrived after its bucket was reduced; call "
                    "step() before the next backward"
                )
        self._take_grad(p, slots, final=True)
        for slot in slots:
            self._bucket_of[slot.unit].ready.add(slot.unit)
        self._launch_ready()

    @torch.no_grad()
    def _take_grad(self, p: Tensor, slots: list[_Slot], final: bool) -> None:
        """Bring parameter `p`'s gradient into its bucket's buffer, and note that it had one.

        A parameter that is a view of the buffers gets a `.grad` that is a view too (autograd
        then accumulates in place); one whose gradient dtype differs adds autograd's gradient
        into the buffer and drops it; one copied to and from the buffers (a DTensor, a
        parameter in several pieces) keeps its `.grad` and is copied in once, at the last
        backward (`final`). A group of one rank leaves the gradient where it is."""
        if p.grad is None:
            return
        self._check_dense(p)
        for slot in slots:
            self._bucket_of[slot.unit].present.add(slot.unit)
        bucket = self._bucket_of[slots[0].unit]
        if bucket.n == 1:
            return
        if self._into_view(p):
            return
        if id(p) in self._copied:
            if final:
                for slot in slots:
                    for s in self._bucket_of[slot.unit].units[slot.unit]:
                        self._bucket_of[slot.unit].put_grad(s)
            return
        for slot in slots:  # into a buffer of another dtype, adding to what came before
            b = self._bucket_of[slot.unit]
            for s in b.units[slot.unit]:
                b.put_grad(s, add=slot.unit in b.added)
            b.added.add(slot.unit)
        p.grad = None

    _backward_queued = False
    _grad_versions: list[int] | None = None  # of the gradient buffers when backward ended

    def _backward_end(self) -> None:
        self._backward_queued = False
        self._grad_versions = [g._version for g in self._grad_flats]

    def _check_untouched(self) -> None:
        """Raise if the gradient buffers changed in place since the last backward ended:
        `torch.nn.utils.clip_grad_norm_(model.parameters())` (HF `max_grad_norm`,
        `accelerator.clip_grad_norm_`, Lightning `gradient_clip_val` without its strategy)
        scaled this rank's unreduced gradients, racing the reductions in flight, by a norm
        that is not the model's. Under DistributedDataParallel every rank holds the averaged
        gradients and such clipping is right."""
        if self._ddp is not None or self._grad_versions is None:
            return
        if [g._version for g in self._grad_flats] != self._grad_versions:
            self._grad_versions = None
            self._reduce_all()  # every collective of this step done: the next one starts clean
            self._reset_buckets()
            raise RuntimeError(
                "the gradients were changed in place between backward() and step(), e.g. by "
                "torch.nn.utils.clip_grad_norm_(model.parameters(), ...): with "
                "LayerwiseDistributedOptimizer each rank holds only its share of the reduced "
                "gradients, so that clips by a wrong norm while they are being reduced; clip "
                "with opt.clip_grad_norm_(max_norm) instead (it returns the model's norm), or "
                "wrap the model in DistributedDataParallel"
            )

    def _reduce_grads(self) -> None:
        """The gradients of this step, averaged, where the owners read them: reduced here,
        or, under DistributedDataParallel (which averaged them on every rank), taken into
        the buffers as they are."""
        self._check_untouched()
        self._grad_versions = None
        self._backward_queued = False  # (a backward that raised never ran its callback)
        if self._ddp is None:
            self._reduce_all()
            return
        for slots in self._slots_of.values():
            self._take_grad(slots[0].param, slots, final=True)

    @torch.no_grad()
    def _into_view(self, p: Tensor) -> bool:
        """Whether `p` (with a `.grad`) is a view of the buffers; if so, its `.grad` is made
        its view of the gradient buffer (copied in when autograd made a tensor anew)."""
        view = self._viewed.get(id(p))
        if view is None:
            return False
        if p.grad is not view:
            view.copy_(p.grad)
            p.grad = view
        return True

    def _launch_ready(self) -> None:
        """Launch, strictly in bucket order (the same order on every rank), every bucket
        whose gradients are all in."""
        while self._next_launch < len(self._buckets):
            b = self._buckets[self._next_launch]
            if len(b.ready) < len(b.units):
                return
            b.launch_reduce(self._stats, async_op=True)
            self._next_launch += 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for the backward passes inside;
        the backward after the block reduces the accumulated gradients."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def _reduce_all(self) -> None:
        """Launch every bucket not yet launched (gradients missing here count as zeros), in
        order, and wait for all reductions."""
        for b in self._buckets[self._next_launch :]:
            for unit, slots in b.units.items():
                if unit in b.ready:
                    continue
                p = slots[0].param
                self._take_grad(p, self._slots_of[id(p)], final=True)
                if b.n > 1 and unit not in b.present:
                    for s in slots:  # no gradient here: zeros
                        b.grad_slice(s).zero_()
            b.launch_reduce(self._stats, async_op=True)
        self._next_launch = len(self._buckets)
        for b in self._buckets:
            b.finish_reduce()

    def _agreement_items(self) -> tuple[list[bool], list[Tensor], Callable[[], Tensor], list[str]]:
        """The units: which had a gradient here, a check per owned reduced gradient (one per
        owned slot, so that checking them costs at most the largest slot's temporaries), and
        per unit whether its owned gradient holds a NaN or Inf."""
        present = [False] * len(self.units)
        for b in self._buckets:
            for unit in b.present:
                present[unit] = True
        owned = [b for b in self._buckets if b.mine]
        device = self._slots[0].param.device
        checks = [~torch.isfinite(t).all() for b in owned for t in b.shards()]

        def per_unit() -> Tensor:
            flags = torch.zeros(len(self.units), dtype=torch.int32, device=device)
            for b in owned:
                for s in b.mine:
                    flags[s.unit] |= ~torch.isfinite(b.shard_view(s)).all()
            return flags

        return present, checks, per_unit, [u.name for u in self.units]

    # -- gradient clipping -------------------------------------------------------------
    _reduced = False  # the gradients of this step are reduced (by clip_grad_norm_)

    def _clip_tensors(self) -> tuple[Iterator[Tensor], list[Tensor], torch.dtype | None]:
        """Finish the gradient reductions first (`step()` then uses them as they are). Counted:
        the averaged gradient elements this rank owns (its whole units and its runs of the
        sharded AdamW units; under tensor parallelism local shards, a replicated tensor
        counted once, `_counted_here`); scaled: every owned reduced gradient."""
        self.wait_for_params()  # a gather may still own a bucket's buffer
        if not self._reduced:
            self._reduce_grads()
            self._reduced = True
        counted = (b.shard_view(s) for b in self._buckets for s in b.mine if self._counted_here(s))
        scaled = [t for b in self._buckets if b.mine for t in b.shards()]
        return counted, scaled, self._buckets[0].dtype if self._buckets else None

    def _counted_here(self, s: _Slot) -> bool:
        """Whether this rank counts owned slot `s` in the gradient norm: always without
        tensor parallelism; under it, a DTensor's local shard unless the tensor is replicated
        over a mesh dimension where this rank's coordinate is not 0, a plain tensor on the
        first rank of every TP group only."""
        if not self.tp_groups:
            return True
        if not C.is_dtensor(s.param):
            return all(C.world(g)[0] == 0 for g in self.tp_groups)
        placements = s.param.placements
        coord = s.param.device_mesh.get_coordinate() or [0] * len(placements)
        return all(c == 0 for c, pl in zip(coord, placements) if pl.is_replicate())

    # -- the step (`DistributedOptimizer.step`) -----------------------------------------
    def _before_agree(self) -> None:
        """Land the parameter gathers, then the gradients of this step, averaged, where the
        owners read them (unless `clip_grad_norm_` reduced them already)."""
        self.wait_for_params()
        if not self._reduced:
            self._reduce_grads()

    def _end_owned(self) -> None:
        self._reset_buckets()

    def _after_step(self) -> None:
        """Launch the parameter gathers (asynchronous under `overlap_param_gather`: each is
        waited for by the first forward pre-hook of the next step)."""
        for b in reversed(self._buckets):  # forward order: the first layers arrive first
            b.launch_gather(self._stats, async_op=self.overlap_param_gather)
        self._gathering = self.overlap_param_gather
        self._followed = False

    def _reset_buckets(self) -> None:
        for b in self._buckets:
            b.reset()
        self._next_launch = 0
        self._reduced = False

    def _step_owned(self, present: list[bool]) -> None:
        for b in self._buckets:
            for s in b.mine:
                t = self._target(s)
                g = b.reduced_grad(s) if present[s.unit] else None
                t.grad = g if g is None or g.dtype == t.dtype else g.to(t.dtype)
        if self.inner is None:
            return
        step_checked(self.inner)  # the gradients were checked by _agree
        for name, master in self._master.items():
            s = self._slot_by_name(name)
            s.local().copy_(C.local_shard(master))

    def _slot_by_name(self, name: str) -> _Slot:
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

    def wait_for_params(self) -> None:
        """Finish every parameter gather in flight (the model's first forward pre-hook does
        this; call it before reading parameters outside a forward pass)."""
        for b in self._buckets:
            b.finish_gather()
        self._gathering = False

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
        for b in self._buckets:
            if b.n == 1:  # a group of one rank: nothing moves
                continue
            gsize = torch.empty(0, dtype=b.gather_dtype).element_size()
            psize = torch.empty(0, dtype=b.grad_dtype).element_size()
            n, rank = b.n, b.rank
            if b.width:
                sent = C.ring_reduce_scatter_bytes([b.width * psize] * n)[rank]
                add_bytes(out, "reduce_scatter", *sent)
                add_bytes(out, "all_gather", *C.ring_all_gather_bytes([b.width * gsize] * n)[rank])
                continue
            for start, stop, owner in b.regions:
                add_bytes(out, "reduce", *C.reduce_bytes((stop - start) * psize, n, owner)[rank])
                sent = C.broadcast_bytes((stop - start) * gsize, n, owner)[rank]
                add_bytes(out, "broadcast", *sent)
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
        view = _LayerwiseView(self, slices)
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
            C.local_shard(master).copy_(self._slot_by_name(name).local())
        yield
        for name, master in self._master.items():
            self._slot_by_name(name).local().copy_(C.local_shard(master))


def _parts(opt: Any) -> list[Any]:
    """The optimizers a built optimizer steps with: a hybrid's inner ones, else itself."""
    if opt is None:
        return []
    return list(opt.inner.values()) if isinstance(opt, HybridOptimizer) else [opt]


def _carried_load(dense: Assignment, dense_group: Any, group: Any) -> list[float]:
    """The load each rank of `group` carries from `dense` (an assignment over `dense_group`);
    0 for a rank outside `dense_group`. Read from the groups' members, so every rank of
    `group` gets the same list."""
    loads = dense.loads
    out = []
    for j in range(C.world(group)[1]):
        try:
            k = C.group_rank(dense_group, C.global_rank(group, j))
        except (ValueError, RuntimeError):
            k = -1
        out.append(loads[k] if 0 <= k < len(loads) else 0.0)
    return out


def _check_tensor_parallel_layout(found: list[Any], want: list[int]) -> None:
    """Refuse DTensor parameters whose mesh groups (`found`) are not the layout's tp group
    (of ranks `want`)."""
    import torch.distributed as dist

    for g in found:
        if C.world(g)[1] > 1 and dist.get_process_group_ranks(g) != want:
            raise ValueError(
                f"the model's tensor-parallel parameters are DTensors over ranks "
                f"{dist.get_process_group_ranks(g)}, but the layout's tp group is {want}: "
                "parallelize the model over layout.tp_mesh"
            )


def _tensor_parallel_groups(params: dict[str, Tensor], process_group: Any) -> list[Any]:
    """The process groups of the device meshes of the DTensor (tensor-parallel) parameters,
    one per mesh dimension, in first-seen order; each must meet the data-parallel group
    `process_group` in this rank only (the TP ranks of a data-parallel rank own the same
    matrices and run the orthogonalizer together)."""
    import torch.distributed as dist

    groups: list[Any] = []
    for name, p in params.items():
        if not C.is_dtensor(p):
            continue
        mesh = p.device_mesh
        for d in range(mesh.ndim):
            g = mesh.get_group(d)
            if any(g is h for h in groups):
                continue
            if C.world(g)[1] > 1 and dist.is_initialized():
                dp = set(dist.get_process_group_ranks(process_group or dist.group.WORLD))
                shared = dp & set(dist.get_process_group_ranks(g))
                if len(shared) > 1:
                    raise ValueError(
                        f"{name} is a DTensor over ranks {sorted(dist.get_process_group_ranks(g))}"
                        f" (mesh dim {d}), which overlap the data-parallel process_group in "
                        f"{sorted(shared)}: pass the data-parallel group of a (dp, tp) mesh, "
                        "e.g. process_group=mesh['dp'].get_group(), and parallelize the model "
                        "over mesh['tp']"
                    )
            groups.append(g)
    return groups


class _LayerwiseView(StateView):
    """`StateView` of a layer-wise optimizer: what this rank owns (whole units, expert slices
    `w[a:b]`, runs `w{a:b}` of sharded AdamW parameters) under the whole model's layout."""

    spread = True

    def __init__(
        self, opt: LayerwiseDistributedOptimizer, slices: checkpoint.ExpertSlices | None = None
    ) -> None:
        kinds = {g["optimizer"]: state_kinds_of(g["optimizer"]) for g in opt.param_groups}
        of = {u.name: kinds.get(u.kind, {}) for u in opt.units}
        super().__init__(opt, lambda name: of.get(name, {}))
        self.lw = opt
        self.slices = slices or {}  # the expert-parallel stacks (an `ExpertSlicesView` wraps it)
        self.gather_group = opt.process_group
        # DCP over the data-parallel group; under tensor parallelism over the whole world
        # (each tp rank writes and reads its own shards)
        tp = any(C.world(g)[1] > 1 for g in opt.tp_groups)
        self.dcp_group = None if tp else opt.process_group

    def sync(self) -> None:
        self.lw.wait_for_params()

    def layout(self) -> dict[str, Any]:
        opt = self.lw
        self._check_experts()
        named = dict(opt.model.named_parameters())
        # units are in backward order; expert slices of one parameter share its name
        order = list(dict.fromkeys(u.name for u in reversed(opt.units)))
        kinds = {u.name: u.kind for u in opt.units}
        groups = [
            {"hypers": hypers(g), "names": [n for n in order if kinds[n] == g["optimizer"]]}
            for g in opt.param_groups
        ]
        shapes = {n: list(named[n].shape) for n in order}
        return {"format": FORMAT_VERSION, "groups": groups, "shapes": shapes}

    def _check_experts(self) -> None:
        """Refuse a layout whose expert state one name-keyed dict cannot hold: the units
        owned over the expert group must be exactly the model's expert-parallel stacks (each
        expert group then holds its own global experts, which `ExpertSlicesView` names)."""
        opt = self.lw
        experts = opt._group_units[1] if len(opt._groups) > 1 else []
        grouped = {opt.units[i].name for i in experts}
        if grouped == set(self.slices):
            return
        if not self.slices:
            # Each expert group steps its own copy of the experts under the same names.
            raise NotImplementedError(
                "full and sharded checkpoints (state_dict(), save_sharded) of a layer-wise "
                "optimizer built with an expert_group need the model to say which global "
                "experts each rank holds (model.expert_parallel_slices(), as "
                "orthoptim.train.model.expert_parallelize leaves it); without it, expert "
                "groups hold different experts under the same parameter names: save "
                "opt.inner.state_dict() on every rank and load it with "
                "opt.inner.load_state_dict() at the same layout (opt.inner is None on a rank "
                "that owns nothing)"
            )
        raise NotImplementedError(
            "full and sharded checkpoints of a layer-wise optimizer over an expert-parallel "
            f"model need its expert-parallel stacks {sorted(self.slices)} to be exactly the "
            f"units owned over the expert group, {sorted(grouped)}: build it with "
            "layout=<the ParallelMesh the model was expert_parallelize'd over> and route the "
            "expert stacks to the matrix optimizer"
        )

    def owned_params(self) -> dict[str, Tensor]:
        inner = self.lw.inner
        return {} if inner is None else StateView(inner).owned_params()

    def masters(self) -> dict[str, Tensor]:
        return self.lw.masters()

    def params(self) -> dict[str, Tensor]:
        return dict(self.lw.model.named_parameters())
