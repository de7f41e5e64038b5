"""Flat buffers: a bucket's layout and collectives (`Bucket`), and the group buffers the
parameters and gradients are views of (`FlatBuffers`, storage re-pointing)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from orthoptim import collectives as C
from orthoptim.comm_bytes import CommStats, broadcast_bytes, ring_all_gather_bytes
from orthoptim.parallel import ordered
from orthoptim.parallel.assignment import Unit
from orthoptim.parallel.base import add_bytes
from orthoptim.parallel.layerwise.ordering import adjacent, natural_order, rank_major_order
from orthoptim.parallel.layerwise.slots import Slot, by_param, start_of
from orthoptim.shards import is_dtensor, local_shard, wrap_local


class Bucket:
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
    holds no buffer: its gradients are used where they are (`own`, set by `take_own`) and its
    parameters are stepped in place.

    How the gradients are reduced is the gradient sync's `Reduction`'s
    (`orthoptim.parallel.layerwise.reduction`); the bucket keeps the layout, the slices and
    its parameter gather.
    """

    def __init__(
        self,
        slots: list[Slot],
        group: ProcessGroup | None,
        dtype: torch.dtype,
        grad_dtype: torch.dtype,
        gather_dtype: torch.dtype | None,
        rank_major: bool = True,
    ) -> None:
        self.slots = slots
        self.units: dict[int, list[Slot]] = {}  # unit → its slots (several runs if sharded)
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
            self._arrange(rank_major)
        # In a group of one rank: each owned slot's gradient, shaped like its local values.
        self.own: dict[Slot, Tensor | None] = {}
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
        self.pending = False  # a parameter gather in flight
        self.works: list[tuple[Any, str]] = []  # the gather's

    def _arrange(self, rank_major: bool) -> None:
        params = by_param(self.slots)
        laid = rank_major_order(params, self.n) if rank_major else None
        order = laid[0] if laid is not None else natural_order(params)
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
    def grad_slice(self, s: Slot) -> Tensor:
        assert self.grads is not None
        return self.grads[s.offset : s.offset + s.numel]

    def param_slice(self, s: Slot) -> Tensor:
        assert self.params is not None
        return self.params[s.offset : s.offset + s.numel]

    @staticmethod
    def local_grad(s: Slot, whole: Tensor | None = None) -> Tensor | None:
        """This rank's (unreduced) gradient of slot `s` shaped like its local values: a view
        of the `.grad` autograd made, or of `whole` (a gradient of the whole parameter) when
        given (a copy only where that gradient's strides forbid a view), or None when there
        is none."""
        g = s.local_grad() if whole is None else s.piece(whole)
        if g is None:
            return None
        if getattr(g, "placements", None) != getattr(s.param, "placements", None):
            raise ValueError(
                f"the gradient of {s.name} has placements {g.placements} but the parameter "
                f"{s.param.placements}; LayerwiseDistributedOptimizer needs gradients sharded "
                "like their tensor-parallel parameters"
            )
        src = local_shard(g)
        if s.flat is not None:
            src = src.reshape(-1)[s.flat[0] : s.flat[1]]
        shape = s.local().shape
        return src if src.shape == shape else src.reshape(shape)

    def put_grad(self, s: Slot, add: bool = False, whole: Tensor | None = None) -> None:
        """Copy (or with `add`, add) the parameter's local gradient (`whole`'s piece when
        given) into the slot's place in the gradient buffer; zeros when it has none and
        nothing was added before."""
        dst = self.grad_slice(s)
        g = self.local_grad(s, whole)
        if g is None:
            if not add:
                dst.zero_()
            return
        dst = dst.view(g.shape)
        dst.add_(g) if add else dst.copy_(g)

    def gather_phase(self) -> str:
        return f"parameter {'all-gather' if self.width else 'broadcast'} of {self.label}"

    def _wait(self) -> None:
        for work, name in self.works:
            if work is not None:
                C.wait(work, name)
        self.works = []

    def take_own(self, source: Callable[[Slot], Tensor | None]) -> None:
        """In a group of one rank: each owned slot's gradient is `source(s)` (autograd's, or
        the micro-batch tree's sum), divided in place when `divisor` is not 1."""
        self.own = {s: source(s) for s in self.mine}
        if self.divisor != 1:
            for g in self.own.values():
                if g is not None:
                    g.div_(self.divisor)

    def shard_view(self, s: Slot) -> Tensor:
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

    def reduced_grad(self, s: Slot) -> Tensor:
        """`shard_view` as the unit's gradient: a DTensor sharded like a DTensor parameter."""
        return wrap_local(self.shard_view(s), s.data)

    def reset(self) -> None:
        self.ready.clear()
        self.present.clear()
        self.added.clear()
        self.launched = False
        self.own = {}

    def expected_gather_bytes(self, out: dict[str, dict[str, float]]) -> None:
        """Add what one step's parameter gather of this bucket moves to `out` (an
        `expected_comm_bytes()` dict), from its layout alone (the reduction counts its own)."""
        if self.n == 1:  # a group of one rank: nothing moves
            return
        gsize = torch.empty(0, dtype=self.gather_dtype).element_size()
        n, rank = self.n, self.rank
        if self.width:
            add_bytes(out, "all_gather", *ring_all_gather_bytes([self.width * gsize] * n)[rank])
            return
        for start, stop, owner in self.regions:
            add_bytes(out, "broadcast", *broadcast_bytes((stop - start) * gsize, n, owner)[rank])

    # -- parameters --------------------------------------------------------------------
    def launch_gather(self, stats: CommStats, async_op: bool) -> None:
        """Send the owners' parameters to every rank (the owned values of parameters that are
        not views of the buffer, `copied`, copied in first)."""
        with C.phase(self.gather_phase(), self.group):
            self._launch_gather(self.group, stats, async_op)

    def _launch_gather(self, group: ProcessGroup | None, stats: CommStats, async_op: bool) -> None:
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


def agreement_items(
    buckets: list[Bucket], n_units: int, device: torch.device
) -> tuple[list[bool], list[Tensor], Callable[[], Tensor]]:
    """What the step's agreement checks of `n_units` units: which had a gradient on this rank,
    a check per owned reduced gradient (one per owned slot, so that checking them costs at
    most the largest slot's temporaries), and per unit whether its owned gradient holds a NaN
    or Inf."""
    present = [False] * n_units
    for b in buckets:
        for unit in b.present:
            present[unit] = True
    owned = [b for b in buckets if b.mine]
    checks = [~torch.isfinite(t).all() for b in owned for t in b.shards()]

    def per_unit() -> Tensor:
        flags = torch.zeros(n_units, dtype=torch.int32, device=device)
        for b in owned:
            for s in b.mine:
                flags[s.unit] |= ~torch.isfinite(b.shard_view(s)).all()
        return flags

    return present, checks, per_unit


def segments(buckets: list[Bucket]) -> list[list[Bucket]]:
    """`buckets` (in their buffer order, `adjacent`) cut into the shortest runs no parameter
    crosses: a parameter cut across buckets (an expert stack owned per expert) keeps its
    buckets in one segment, so it stays one piece of one buffer."""
    last: dict[int, int] = {}  # id(param) → the last bucket holding a slot of it
    for i, b in enumerate(buckets):
        for s in b.slots:
            last[id(s.param)] = i
    out: list[list[Bucket]] = []
    reach = -1
    for i, b in enumerate(buckets):
        if i > reach:
            out.append([])
        out[-1].append(b)
        reach = max([reach, *(last[id(s.param)] for s in b.slots)])
    return out


class FlatBuffers:
    """Each group's flat parameter and gradient buffers, laid out bucket after bucket, and
    which parameters view them: `viewed` (id(param) → its view of the gradient buffer),
    `homes` (viewed parameter, its flat parameter buffer), `copied` (ids of the parameters
    copied to and from the buffers instead), `grad_flats` (every group's gradient buffer)."""

    def __init__(
        self, buckets: list[Bucket], slots: list[Slot], param_dtype: torch.dtype | None
    ) -> None:
        self.buckets, self.slots, self.param_dtype = buckets, slots, param_dtype
        self.viewed: dict[int, Tensor] = {}
        self.homes: list[tuple[Tensor, Tensor]] = []
        self.copied: set[int] = set()
        self.grad_flats: list[Tensor] = []
        self.point()

    @torch.no_grad()
    def point(self, again: bool = False) -> None:
        """Allocate the buffers and make every parameter that lies in one piece there a view
        of them, in the parameter dtype; the others keep their storage and are copied in and
        out. A group of one rank has no buffers: its parameters only change dtype. `again`:
        the parameters' storage was replaced since (`moved`); the slots' tensors are
        re-pointed in place (the inner optimizer knows them).

        The buffers are laid out one segment at a time (`segments`: the fewest buckets no
        parameter crosses), each parameter re-pointed as soon as its segment holds it, so
        its old storage is freed before the next segment is allocated: building adds the
        gradient buffers and one segment above the model, not a second model."""
        self.viewed, self.homes, self.copied, self.grad_flats = {}, [], set(), []
        for b in self.buckets:
            b.copied = self.copied
        flats: dict[tuple[int, torch.dtype, torch.dtype], list[Bucket]] = {}
        for b in self.buckets:
            if b.n > 1:
                flats.setdefault((id(b.group), b.dtype, b.grad_dtype), []).append(b)
        laid: dict[int, list[tuple[Slot, int, Tensor]]] = {}
        placed: list[tuple[list[Bucket], torch.dtype, Tensor]] = []
        for (_, dtype, grad_dtype), buckets in flats.items():
            for segment in segments(adjacent(buckets)):
                params, where = self._lay_out(segment, dtype)
                placed.append((segment, grad_dtype, params))
                for spots in where.values():
                    self._view(spots)
                laid.update(where)
                self._rebind([s for s in self.slots if id(s.param) in where], again)
        rest: dict[int, list[Slot]] = {}  # a group of one rank's: no buffer
        for s in self.slots:
            if id(s.param) not in laid:
                rest.setdefault(id(s.param), []).append(s)
        for slots in rest.values():  # one parameter at a time, its old storage freed
            p = slots[0].param
            if self.param_dtype not in (None, p.dtype):
                p.data = p.data.to(self.param_dtype)
            self._rebind(slots, again)
        # the gradient buffers once every parameter has moved (its old storage freed)
        for segment, grad_dtype, params in placed:
            self._attach_grads(segment, grad_dtype, params, laid)

    def _lay_out(
        self, segment: list[Bucket], dtype: torch.dtype
    ) -> tuple[Tensor, dict[int, list[tuple[Slot, int, Tensor]]]]:
        """Allocate one segment's parameter buffer and copy the parameters' values in: the
        buffer, and id(param) → its (slot, offset, buffer) spots."""
        device = segment[0].slots[0].param.device
        params = torch.zeros(sum(b.numel for b in segment), dtype=dtype, device=device)
        where: dict[int, list[tuple[Slot, int, Tensor]]] = {}
        base = 0
        for b in segment:
            b.params = params[base : base + b.numel]
            for s in b.slots:
                where.setdefault(id(s.param), []).append((s, base + s.offset, params))
                values = s.param if s.data is s.param else s.view()
                b.param_slice(s).copy_(local_shard(values).reshape(-1))
            base += b.numel
        return params, where

    def _attach_grads(
        self,
        segment: list[Bucket],
        grad_dtype: torch.dtype,
        params: Tensor,
        laid: dict[int, list[tuple[Slot, int, Tensor]]],
    ) -> None:
        """Allocate one segment's gradient buffer, attach its buckets to both buffers, and
        make it the `.grad` view of every parameter there that views the parameter buffer
        in the same dtype."""
        grads = torch.zeros(params.numel(), dtype=grad_dtype, device=params.device)
        self.grad_flats.append(grads)
        base = 0
        for b in segment:
            b.attach(grads[base : base + b.numel], params[base : base + b.numel])
            base += b.numel
        homes = {id(p) for p, flat in self.homes if flat is params}
        for pid in homes:
            s, first, _ = laid[pid][0]
            local = local_shard(s.param)
            if grad_dtype == local.dtype:
                view = grads[first : first + local.numel()].view(local.shape)
                self.viewed[pid] = wrap_local(view, s.param) if is_dtensor(s.param) else view

    def _view(self, spots: list[tuple[Slot, int, Tensor]]) -> None:
        """Make the parameter of `spots` a view of its segment where it lies there in one
        piece (contiguous, covering it); else it is copied in and out (`copied`)."""
        spots.sort(key=lambda x: start_of(x[0]))
        p = spots[0][0].param
        first = spots[0][1]
        contiguous = all(
            x[1] + x[0].numel == y[1] and x[2] is y[2] for x, y in itertools.pairwise(spots)
        )
        local = local_shard(p)
        numel = local.numel()
        covers = sum(x[0].numel for x in spots) == numel and start_of(spots[0][0]) == 0
        if not (contiguous and covers and local.is_contiguous()):
            self.copied.add(id(p))
            if self.param_dtype not in (None, p.dtype):
                raise NotImplementedError(
                    f"{spots[0][0].name}: param_dtype needs the parameter in one piece of "
                    "its bucket; build the optimizer without param_dtype"
                )
            return
        params = spots[0][2]
        values = params[first : first + numel].view(local.shape)
        if is_dtensor(p):
            if values.dtype != local.dtype:
                raise NotImplementedError(
                    f"{spots[0][0].name}: param_dtype with tensor-parallel (DTensor) "
                    "parameters is not supported; build the optimizer without param_dtype"
                )
            # the same Parameter object, its local shard now the view
            viewed = nn.Parameter(wrap_local(values, p), requires_grad=p.requires_grad)
            torch.utils.swap_tensors(p, viewed)
        else:
            p.data = values
        self.homes.append((p, params))

    @staticmethod
    def _rebind(slots: list[Slot], again: bool) -> None:
        """The slices and runs among `slots` view their parameters' new storage."""
        for s in slots:
            if s.data is not s.param:
                if again:
                    s.rebind()
                else:
                    s.data = s.view().requires_grad_(True)

    def moved(self) -> bool:
        """Whether the parameters' storage was replaced since the buffers were laid out
        (`model.to(...)` of another device index, `to_empty`, `load_state_dict(assign=True)`):
        then `point(again=True)` takes their current values, so the optimizer never steps a
        dead copy. A move to another device is refused (the masters and state stay where
        they were)."""
        moved = [
            p
            for p, flat in self.homes
            if local_shard(p).untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
        ]
        if not moved:
            return False
        device = self.homes[0][1].device
        for p in moved:
            if local_shard(p).device != device:
                raise RuntimeError(
                    f"the model's parameters moved from {device} to {p.device} after "
                    "LayerwiseDistributedOptimizer was built; move the model first, then "
                    "build the optimizer"
                )
        return True


def norm_spans(
    units: list[Unit], slots_by_unit: list[list[Slot]], block: int
) -> list[tuple[int, int]]:
    """`clip.ordered_norm`'s places: each unit's span (first place, count), one place for a
    unit owned whole, one per `block` elements for a sharded AdamW unit, whose runs start
    and end on those blocks. Fixed once the slots are."""
    spans, first = [], 0
    for i, u in enumerate(units):
        sharded = any(s.flat is not None for s in slots_by_unit[i])
        count = max(1, -(-u.numel // block)) if sharded else 1
        spans.append((first, count))
        first += count
    return spans


def norm_items(
    buckets: list[Bucket],
    spans: list[tuple[int, int]],
    block: int,
    norm_type: float,
    dtype: torch.dtype,
) -> list[tuple[int, Tensor]]:
    """This rank's terms of `clip.ordered_norm`: per owned slot its first place (`spans`)
    and its power sums (a whole unit's `ordered.tree_power_sum`, a run's
    `ordered.block_power_sums`)."""
    items = []
    for b in buckets:
        for s in b.mine:
            g, at = b.shard_view(s), spans[s.unit][0]
            if s.flat is None:
                items.append((at, ordered.tree_power_sum(g, norm_type, dtype, block).reshape(1)))
            else:
                sums = ordered.block_power_sums(g, norm_type, dtype, block)
                items.append((at + s.flat[0] // block, sums))
    return items
