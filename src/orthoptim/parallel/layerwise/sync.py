"""The layer-wise optimizer's gradient sync, its own DDP layer (`GradSync`): it owns the
buckets, the flat buffers the parameters and gradients view, the gradient, forward and
state-dict hooks, the byte counter, the reduce launches in bucket order, `no_sync`, a
`DistributedDataParallel` wrap noticed at forward, and the state of a step's gradients
(`SyncState`). How a bucket's gradients reach their owners is its pluggable `Reduction`
(`reduction`): the ring of the backend, or the ordered reduction of `reproducible=True`,
which also sums each rank's micro-batches in a tree (`accumulation`)."""

from __future__ import annotations

import contextlib
import enum
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from orthoptim import collectives as C
from orthoptim._torch_compat import active_ddp_module, queue_backward_callback, version
from orthoptim.comm_bytes import CommStats
from orthoptim.optim.base import sparse_gradient_error
from orthoptim.parallel.assignment import Unit
from orthoptim.parallel.layerwise.accumulation import TreeAccumulator
from orthoptim.parallel.layerwise.buffers import Bucket, FlatBuffers
from orthoptim.parallel.layerwise.ownership import UnitGroup
from orthoptim.parallel.layerwise.reduction import Reduction, make_reduction
from orthoptim.parallel.layerwise.slots import Slot, unit_label
from orthoptim.shards import local_shard

#: why a step (or `clip_grad_norm_`) is refused when the gradients changed in place since backward
TOUCHED = (
    "the gradients were changed in place between backward() and step(), e.g. by "
    "torch.nn.utils.clip_grad_norm_(model.parameters(), ...): with "
    "LayerwiseDistributedOptimizer each rank holds only its share of the reduced "
    "gradients, so that clips by a wrong norm while they are being reduced; clip "
    "with opt.clip_grad_norm_(max_norm) instead (it returns the model's norm), or "
    "wrap the model in DistributedDataParallel"
)

#: why a second step() without a backward in between is refused
STEPPED = (
    "step() was called again without a backward() since the last step: the last step used "
    "the reduced gradients as its scratch space (Muon's momentum and update are computed in "
    "them), so stepping again would apply garbage; call backward() before each step()"
)


class SyncState(enum.Enum):
    """Where this step's gradients are: none since the last step (`IDLE`), arriving
    (`ACCUMULATING`), some bucket's reduction launched (`REDUCING`), every reduction landed
    where the owners read them (`REDUCED`), used by a step as its scratch space
    (`CONSUMED`, until the next backward)."""

    IDLE = "idle"
    ACCUMULATING = "accumulating"
    REDUCING = "reducing"
    REDUCED = "reduced"
    CONSUMED = "consumed"


def build_buckets(
    units: list[Unit],
    unit_groups: list[UnitGroup],
    slots_by_unit: list[list[Slot]],
    param_dtype: torch.dtype | None,
    grad_dtype: torch.dtype | None,
    gather_dtype: torch.dtype | None,
) -> list[Bucket]:
    """Every group's buckets, merged in backward order and split by dtype: rank-major where
    the assignment (and so `plan`) says so and the layout agrees."""
    buckets: list[Bucket] = []
    merged = sorted(
        ([g.units[j] for j in bucket], k, b)
        for k, g in enumerate(unit_groups)
        for b, bucket in enumerate(g.assignment.buckets)
    )
    group_units = [[units[i] for i in g.units] for g in unit_groups]
    for unit_ids, k, index in merged:
        g = unit_groups[k]
        rank_major = g.assignment.rank_major(index, group_units[k])
        by_dtype: dict[torch.dtype, list[Slot]] = {}
        for i in unit_ids:
            for slot in slots_by_unit[i]:
                if slot.numel:
                    by_dtype.setdefault(slot.data.dtype, []).append(slot)
        for dtype, slots in by_dtype.items():
            dtype = param_dtype or dtype
            gdtype = grad_dtype or (torch.float32 if param_dtype else dtype)
            bucket = Bucket(slots, g.group, dtype, gdtype, gather_dtype, rank_major)
            bucket.label = f"bucket {len(buckets)}"
            bucket.divisor = g.divisor
            buckets.append(bucket)
    return buckets


class GradSync:
    """The gradient sync of a layer-wise optimizer: its buckets (`buckets`, public: what
    tests and tools read), their flat buffers (`flat`), hooks, reduction and the state of a
    step's gradients (`state`). Beside the state, the flags of the parameters' travel:
    `gathering` (parameter gathers launched and not yet waited for), `followed` (the
    parameters' storage checked since the last step), `backward_queued` (a callback queued
    at the end of this backward), `grad_versions` (of the gradient buffers when backward
    ended), `syncing` (False inside `no_sync()`), `ddp` (the DistributedDataParallel wrap
    the last forward ran in), `next_launch` (the first bucket whose reduction is not
    launched), `micro` (the backward passes of this step so far).

    `stats` is the driver's byte counter, handed over once; every collective here records
    in it."""

    def __init__(
        self,
        model: nn.Module,
        units: list[Unit],
        unit_groups: list[UnitGroup],
        slots: list[Slot],
        slots_by_unit: list[list[Slot]],
        stats: CommStats,
        *,
        world_size: int,
        param_dtype: torch.dtype | None,
        grad_dtype: torch.dtype | None,
        gather_dtype: torch.dtype | None,
        overlap_grad_reduce: bool,
        refuse_ddp: bool,
        reproducible: bool = False,
    ) -> None:
        self.model, self.units, self.world_size, self.stats = model, units, world_size, stats
        self.buckets = build_buckets(
            units, unit_groups, slots_by_unit, param_dtype, grad_dtype, gather_dtype
        )
        self.bucket_of: dict[int, Bucket] = {
            s.unit: b for b in self.buckets for s in b.slots
        }  # unit index → its bucket
        self.flat = FlatBuffers(self.buckets, slots, param_dtype)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.refuse_ddp = refuse_ddp  # expert or tensor-parallel weights: DDP would mix them
        self.reproducible = reproducible
        self.reduction: Reduction = make_reduction(reproducible)
        self.tree = TreeAccumulator() if reproducible else None
        self.sums: dict[int, Tensor] = {}  # id(param) → the tree's sum, where no buffer is
        self.state = SyncState.IDLE
        self.stale = False  # this step's gradients were CONSUMED by the last one
        # each parameter's `.grad` as a consuming step left it (a weak reference and its
        # version): one set by hand since (a new tensor, or written in place) is new
        self.left: dict[int, tuple[Any, int]] = {}
        self.gathering = False
        self.followed = False
        self.backward_queued = False
        self.touched_before_reduce = False  # found by `ensure_reduced`, refused by the step
        self.grad_versions: list[int] | None = None
        self.syncing = True
        self.ddp: Any = None
        self.next_launch = 0
        self.micro = 0
        self.hooks: list[Any] = []
        self.index(slots_by_unit)

    def index(self, slots_by_unit: list[list[Slot]]) -> None:
        """id(param) → its units that communicate (one slot each); the gradient hooks look
        parameters up in it."""
        self.slots_of: dict[int, list[Slot]] = {}
        for slots in slots_by_unit:
            if slots and slots[0].unit in self.bucket_of:
                self.slots_of.setdefault(id(slots[0].param), []).append(slots[0])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["hooks"] = []  # handles of hooks on the original model
        state["ddp"] = None  # the original's wrap, noticed again at the copy's forward
        state["left"] = {}  # weak references, of the original's gradients
        return state

    # -- hooks -------------------------------------------------------------------------
    def register(self) -> None:
        """Put the hooks on the model: `on_grad` after each communicating parameter's
        gradient accumulates; `before_forward` before the forward of the model and of every
        module holding such parameters (the first to fire in a step lands every pending
        gather: a forward may read any parameter, a parent's F.linear(x, self.child.weight),
        weights tied by hand; the submodules' hooks serve a forward that enters a submodule
        directly, as Lightning's `training_step`, and find nothing to do otherwise);
        `before_state_dict` before each such module's state_dict (a trainer saving the model
        right after step() gets the updated values)."""
        for slots in self.slots_of.values():
            self.hooks.append(slots[0].param.register_post_accumulate_grad_hook(self.on_grad))
        if not (self.flat.homes or self.world_size > 1):
            return
        modules = [self.model] + [
            m
            for m in self.model.modules()
            if m is not self.model
            and any(id(p) in self.slots_of for p in m.parameters(recurse=False))
        ]
        for module in modules:
            self.hooks.append(module.register_forward_pre_hook(self.before_forward))
            self.hooks.append(module.register_state_dict_pre_hook(self.before_state_dict))

    def remove_hooks(self) -> None:
        """Detach every hook (after waiting for the parameters)."""
        self.wait_for_params()
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """Land pending gathers, follow a model that moved, notice a DDP wrap."""
        self.wait_if_gathering()
        if not self.followed:
            self.followed = True
            self.follow()
        if torch.is_grad_enabled():
            self.notice_ddp(active_ddp_module())

    def before_state_dict(self, module: nn.Module, *args: Any) -> None:
        self.wait_if_gathering()

    def follow(self) -> None:
        """Re-point the buffers at the parameters if their storage was replaced
        (`FlatBuffers.moved`)."""
        if self.flat.moved():
            self.wait_for_params()
            self.flat.point(again=True)

    def wait_for_params(self) -> None:
        """Finish every parameter gather in flight."""
        for b in self.buckets:
            b.finish_gather()
        self.gathering = False

    def wait_if_gathering(self) -> None:
        if self.gathering:
            self.wait_for_params()

    def notice_ddp(self, ddp: Any) -> None:
        """Note whether this forward runs inside a `DistributedDataParallel` wrap of the model
        (HF Trainer, accelerate and Lightning wrap it after the optimizer is built): DDP then
        all-reduces the gradients, and the step uses them as they are instead of reducing
        them again."""
        if ddp is self.ddp:
            return
        if ddp is None or self.world_size == 1:
            self.ddp = None
            return
        if not any(m is self.model for m in ddp.module.modules()):
            self.ddp = None
            return
        if self.refuse_ddp:
            raise RuntimeError(
                "LayerwiseDistributedOptimizer: the model is wrapped in "
                "DistributedDataParallel, whose all-reduce would average the expert or "
                "tensor-parallel weights over the wrong ranks; train the unwrapped model (the "
                "optimizer reduces the gradients itself)"
            )
        if self.reproducible:
            raise RuntimeError(
                "LayerwiseDistributedOptimizer(reproducible=True): the model is wrapped in "
                "DistributedDataParallel, whose all-reduce sums in an order that follows the "
                "number of ranks; train the unwrapped model (the optimizer reduces the "
                "gradients itself, in a fixed order)"
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
        self.ddp = ddp

    # -- gradient path -----------------------------------------------------------------
    def check_dense(self, p: Tensor) -> None:
        """Refuse a sparse `.grad` of `p` by name: the buffers hold dense gradients."""
        if p.grad is not None and p.grad.layout != torch.strided:
            name = self.units[self.slots_of[id(p)][0].unit].name
            raise sparse_gradient_error("LayerwiseDistributedOptimizer", name, p.grad)

    def on_grad(self, p: Tensor) -> None:
        """The gradient hook of parameter `p`: bring its gradient into the buffers (under
        `reproducible`, into the micro-batch tree first) and launch the reductions of every
        bucket now complete."""
        self.check_dense(p)
        if not self.backward_queued:  # once per backward: note the gradients at its end
            self.backward_queued = True
            queue_backward_callback(self.backward_end)
        if self.state in (SyncState.IDLE, SyncState.CONSUMED):
            self.state = SyncState.ACCUMULATING
        slots = self.slots_of[id(p)]
        if self.tree is not None:
            self.push_leaf(p, slots)
        if self.world_size == 1:  # nothing to reduce: accumulation needs no no_sync()
            return
        if self.ddp is not None or not self.overlap_grad_reduce:
            # DDP reduces (its no_sync accumulates), or step() does: only make a `.grad` that
            # autograd made anew the parameter's view of the buffer
            if p.grad is not None:
                self.into_view(p)
            return
        if not self.syncing:
            self.take_grad(p, slots, final=False)
            return
        for slot in slots:
            bucket = self.bucket_of[slot.unit]
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
        self.take_grad(p, slots, final=True, count=self.micro + 1)
        for slot in slots:
            self.bucket_of[slot.unit].ready.add(slot.unit)
        self.launch_ready()

    @torch.no_grad()
    def push_leaf(self, p: Tensor, slots: list[Slot]) -> None:
        """`reproducible`: this backward's gradient of `p` becomes a leaf of the micro-batch
        tree, in the reduction's dtype, and `.grad` is cleared so the next backward's is its
        own. A parameter's first leaf of the step is its view of the gradient buffer where it
        has one (the tree's partial sums then add into the buffer, and at most log2(k) - 1
        of them are held beside it); a gradient already in the buffer is copied out first."""
        assert self.tree is not None
        g = p.grad
        if g is None:
            return
        p.grad = None
        leaf = local_shard(g)
        dtype = self.bucket_of[slots[0].unit].grad_dtype
        view = self.flat.viewed.get(id(p))
        if view is not None and not self.tree.pending(id(p)):
            if g is not view:
                view.copy_(leaf)
            leaf = view
        elif leaf.dtype != dtype:
            leaf = leaf.to(dtype)
        elif view is g:
            leaf = leaf.clone()
        self.tree.push(id(p), self.micro, leaf)

    @torch.no_grad()
    def take_tree_sum(self, p: Tensor, slots: list[Slot], count: int) -> None:
        """`reproducible`: `p`'s sum over this step's `count` micro-batches, written where the
        reduction reads it: the slots' places in the buffers (a viewed parameter's `.grad`
        is its view again), or in a group of one rank kept for `take_own` (`sums`)."""
        assert self.tree is not None
        total = self.tree.collapse(id(p), count)
        if total is None:
            return
        for slot in slots:
            self.bucket_of[slot.unit].present.add(slot.unit)
        if self.bucket_of[slots[0].unit].n == 1:
            self.sums[id(p)] = total
            return
        view = self.flat.viewed.get(id(p))
        if view is not None:
            if total is not view:
                view.copy_(total)
            p.grad = view
            return
        for slot in slots:
            b = self.bucket_of[slot.unit]
            for s in b.units[slot.unit]:
                b.put_grad(s, whole=total)

    @torch.no_grad()
    def take_grad(self, p: Tensor, slots: list[Slot], final: bool, count: int = 0) -> None:
        """Bring parameter `p`'s gradient into its bucket's buffer, and note that it had one.

        A parameter that is a view of the buffers gets a `.grad` that is a view too (autograd
        then accumulates in place); one whose gradient dtype differs adds autograd's gradient
        into the buffer and drops it; one copied to and from the buffers (a DTensor, a
        parameter in several pieces) keeps its `.grad` and is copied in once, at the last
        backward (`final`). A group of one rank leaves the gradient where it is. Under
        `reproducible` the `final` call takes the micro-batch tree's sum over `count`
        micro-batches instead (`take_tree_sum`)."""
        if self.tree is not None:
            if final and self.tree.pending(id(p)):
                self.take_tree_sum(p, slots, count)
            return
        if p.grad is None:
            return
        self.check_dense(p)
        for slot in slots:
            self.bucket_of[slot.unit].present.add(slot.unit)
        bucket = self.bucket_of[slots[0].unit]
        if bucket.n == 1:
            return
        if self.into_view(p):
            return
        if id(p) in self.flat.copied:
            if final:
                for slot in slots:
                    for s in self.bucket_of[slot.unit].units[slot.unit]:
                        self.bucket_of[slot.unit].put_grad(s)
            return
        for slot in slots:  # into a buffer of another dtype, adding to what came before
            b = self.bucket_of[slot.unit]
            for s in b.units[slot.unit]:
                b.put_grad(s, add=slot.unit in b.added)
            b.added.add(slot.unit)
        p.grad = None

    def backward_end(self) -> None:
        self.backward_queued = False
        self.micro += 1
        self.grad_versions = [version(g) for g in self.flat.grad_flats]

    def touched(self) -> bool:
        """Whether the gradient buffers changed in place since the last backward ended:
        `torch.nn.utils.clip_grad_norm_(model.parameters())` (HF `max_grad_norm`,
        `accelerator.clip_grad_norm_`, Lightning `gradient_clip_val` without its strategy)
        scaled this rank's unreduced gradients, racing the reductions in flight, by a norm
        that is not the model's (`TOUCHED`). Host-side (version counters). Under
        DistributedDataParallel every rank holds the averaged gradients and such clipping is
        right: never touched then."""
        if self.touched_before_reduce:
            return True
        if self.ddp is not None or self.grad_versions is None:
            return False
        return [version(g) for g in self.flat.grad_flats] != self.grad_versions

    def refusal(self, owner: str) -> list[str]:
        """`owner`'s step refusals that ride in the agreement, so one rank's stops every rank:
        the gradients changed in place (`touched`), a second step without a backward
        (`STEPPED`), a micro-batch count the ordered reduction cannot take."""
        lines = [f"{owner}: {TOUCHED}"] if self.touched() else []
        if self.state is SyncState.CONSUMED and not self.regraded():
            lines.append(f"{owner}: {STEPPED}")
        if self.tree is not None and self.micro & (self.micro - 1):
            lines.append(
                f"{owner}(reproducible=True): this rank ran {self.micro} micro-batches in the "
                "step; the same bits at every data-parallel size need a power-of-two number "
                "per rank (the same on every rank); change the accumulation"
            )
        return lines

    def regraded(self) -> bool:
        """Whether some parameter's `.grad` is not what the last (consuming) step left: set
        by hand (a new tensor, or written in place), as torch's optimizers allow."""
        for pid, slots in self.slots_of.items():
            g = slots[0].param.grad
            if g is None:
                continue
            ref, seen = self.left.get(pid, (None, -1))
            if ref is None or ref() is not g or version(g) != seen:
                return True
        return False

    def ensure_reduced(self) -> None:
        """The gradients of this step, averaged, where the owners read them: reduced here,
        or, under DistributedDataParallel (which averaged them on every rank), taken into
        the buffers as they are; nothing when `clip_grad_norm_` reduced them already.
        Gradients changed in place since backward (`touched`) are reduced all the same, so
        every rank's collectives match (`opt.clip_grad_norm_` on every rank after torch's
        clipping on one), and remembered: the step refuses them on every rank through its
        agreement (`refusal`)."""
        self.wait_for_params()  # a gather may still own a bucket's buffer
        if self.state is SyncState.REDUCED:
            return
        self.stale = self.state is SyncState.CONSUMED and not self.regraded()
        self.touched_before_reduce = self.touched()
        self.grad_versions = None
        self.backward_queued = False  # (a backward that raised never ran its callback)
        if self.ddp is None:
            self.reduce_all()
        else:
            for slots in self.slots_of.values():
                self.take_grad(slots[0].param, slots, final=True, count=self.micro)
        self.state = SyncState.REDUCED

    @torch.no_grad()
    def into_view(self, p: Tensor) -> bool:
        """Whether `p` (with a `.grad`) is a view of the buffers; if so, its `.grad` is made
        its view of the gradient buffer (copied in when autograd made a tensor anew)."""
        view = self.flat.viewed.get(id(p))
        if view is None:
            return False
        if p.grad is not view:
            view.copy_(p.grad)
            p.grad = view
        return True

    def launch_ready(self) -> None:
        """Launch, strictly in bucket order (the same order on every rank), every bucket
        whose gradients are all in."""
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if len(b.ready) < len(b.units):
                return
            self.launch(b)
            self.next_launch += 1

    def launch(self, b: Bucket) -> None:
        self.reduction.launch(b, self.stats, async_op=True)
        b.launched = True
        self.state = SyncState.REDUCING

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for the backward passes inside."""
        previous, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = previous

    def reduce_all(self) -> None:
        """Launch every bucket not yet launched (gradients missing here count as zeros), in
        order, and wait for all reductions."""
        for b in self.buckets[self.next_launch :]:
            for unit, slots in b.units.items():
                if unit in b.ready:
                    continue
                p = slots[0].param
                self.take_grad(p, self.slots_of[id(p)], final=True, count=self.micro)
                if b.n > 1 and unit not in b.present:
                    for s in slots:  # no gradient here: zeros
                        b.grad_slice(s).zero_()
            self.launch(b)
        self.next_launch = len(self.buckets)
        for b in self.buckets:
            if b.n == 1:
                b.take_own(self.own_grad)
            else:
                self.reduction.finish(b)

    def own_grad(self, s: Slot) -> Tensor | None:
        """Slot `s`'s gradient in a group of one rank: the micro-batch tree's sum under
        `reproducible` (a zero's sign made +0, as the ordered reduction does), else autograd's."""
        total = self.sums.get(id(s.param))
        if total is None:
            return None if self.tree is not None else Bucket.local_grad(s)
        return Bucket.local_grad(s, total.add_(0.0))

    def finish_step(self, consumed: bool) -> None:
        """The next step starts clean: no bucket ready or launched, nothing reduced, the
        micro-batch tree empty; gradients a step used (`consumed`), or that an earlier step
        had used, stay `CONSUMED` until the next backward."""
        for b in self.buckets:
            b.reset()
        self.next_launch = 0
        self.micro = 0
        self.sums.clear()
        if self.tree is not None:
            self.tree.reset()
        self.touched_before_reduce = False
        self.state = SyncState.CONSUMED if consumed or self.stale else SyncState.IDLE
        self.stale = False
        self.left = {}
        if self.state is SyncState.CONSUMED:
            for pid, slots in self.slots_of.items():
                g = slots[0].param.grad
                if g is not None:
                    self.left[pid] = (weakref.ref(g), version(g))

    def launch_gathers(self, async_op: bool) -> None:
        """Launch the parameter gathers (asynchronous: each is waited for by the first forward
        pre-hook of the next step)."""
        for b in reversed(self.buckets):  # forward order: the first layers arrive first
            b.launch_gather(self.stats, async_op=async_op)
        self.gathering = async_op
        self.followed = False

    def expected_bytes(self, out: dict[str, dict[str, float]]) -> None:
        """Add what one step's reductions and gathers move to `out`, from the layout alone."""
        for b in self.buckets:
            self.reduction.expected_bytes(b, out)
            b.expected_gather_bytes(out)
