"""Gradient sync of the layer-wise optimizer: the gradient, forward and state-dict hooks, the
reduce launches in bucket order, `no_sync`, a `DistributedDataParallel` wrap noticed at
forward, and every flag of the step's communication, in one object (`GradSync`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from orthoptim import collectives as C
from orthoptim._torch_compat import queue_backward_callback, version
from orthoptim.optim.base import sparse_gradient_error
from orthoptim.parallel.assignment import Unit
from orthoptim.parallel.layerwise.buffers import Bucket, FlatBuffers
from orthoptim.parallel.layerwise.slots import Slot, unit_label

#: why a step (or `clip_grad_norm_`) is refused when the gradients changed in place since backward
TOUCHED = (
    "the gradients were changed in place between backward() and step(), e.g. by "
    "torch.nn.utils.clip_grad_norm_(model.parameters(), ...): with "
    "LayerwiseDistributedOptimizer each rank holds only its share of the reduced "
    "gradients, so that clips by a wrong norm while they are being reduced; clip "
    "with opt.clip_grad_norm_(max_norm) instead (it returns the model's norm), or "
    "wrap the model in DistributedDataParallel"
)


class GradSync:
    """Where a step's gradients and parameters are in their travel, and the hooks that move
    them. Flags: `gathering` (parameter gathers launched and not yet waited for), `followed`
    (the parameters' storage checked since the last step), `backward_queued` (a callback
    queued at the end of this backward), `grad_versions` (of the gradient buffers when
    backward ended), `reduced` (this step's gradients reduced, by `clip_grad_norm_`),
    `syncing` (False inside `no_sync()`), `ddp` (the DistributedDataParallel wrap the last
    forward ran in), `next_launch` (the first bucket whose reduction is not launched)."""

    def __init__(
        self,
        buckets: list[Bucket],
        bucket_of: dict[int, Bucket],
        flat: FlatBuffers,
        units: list[Unit],
        slots_by_unit: list[list[Slot]],
        *,
        model: nn.Module,
        world_size: int,
        overlap_grad_reduce: bool,
        refuse_ddp: bool,
    ) -> None:
        self.buckets, self.bucket_of, self.flat, self.units = buckets, bucket_of, flat, units
        self.model, self.world_size = model, world_size
        self.overlap_grad_reduce = overlap_grad_reduce
        self.refuse_ddp = refuse_ddp  # expert or tensor-parallel weights: DDP would mix them
        self.gathering = False
        self.followed = False
        self.backward_queued = False
        self.touched_before_reduce = False  # found by `reduce_grads`, refused by the step
        self.grad_versions: list[int] | None = None
        self.reduced = False
        self.syncing = True
        self.ddp: Any = None
        self.next_launch = 0
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
        return state

    # -- hooks -------------------------------------------------------------------------
    def register(
        self,
        grad_hook: Callable[[Tensor], None],
        forward_hook: Callable[..., None],
        wait_hook: Callable[..., None],
    ) -> None:
        """Put the hooks on the model: `grad_hook` after each communicating parameter's
        gradient accumulates; `forward_hook` before the forward of the model and of every
        module holding such parameters (the first to fire in a step lands every pending
        gather: a forward may read any parameter, a parent's F.linear(x, self.child.weight),
        weights tied by hand; the submodules' hooks serve a forward that enters a submodule
        directly, as Lightning's `training_step`, and find nothing to do otherwise);
        `wait_hook` before each such module's state_dict (a trainer saving the model right
        after step() gets the updated values)."""
        if self.overlap_grad_reduce or self.world_size > 1:
            for slots in self.slots_of.values():
                self.hooks.append(slots[0].param.register_post_accumulate_grad_hook(grad_hook))
        if not (self.flat.homes or self.world_size > 1):
            return
        modules = [self.model] + [
            m
            for m in self.model.modules()
            if m is not self.model
            and any(id(p) in self.slots_of for p in m.parameters(recurse=False))
        ]
        for module in modules:
            self.hooks.append(module.register_forward_pre_hook(forward_hook))
            self.hooks.append(module.register_state_dict_pre_hook(wait_hook))

    def remove_hooks(self) -> None:
        """Detach every hook (after waiting for the parameters)."""
        self.wait_for_params()
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

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

    def on_grad(self, p: Tensor, stats: C.CommStats) -> None:
        """The gradient hook of parameter `p`: bring its gradient into the buffers and launch
        the reductions of every bucket now complete."""
        self.check_dense(p)
        if not self.backward_queued:  # once per backward: note the gradients at its end
            self.backward_queued = True
            queue_backward_callback(self.backward_end)
        slots = self.slots_of[id(p)]
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
        self.take_grad(p, slots, final=True)
        for slot in slots:
            self.bucket_of[slot.unit].ready.add(slot.unit)
        self.launch_ready(stats)

    @torch.no_grad()
    def take_grad(self, p: Tensor, slots: list[Slot], final: bool) -> None:
        """Bring parameter `p`'s gradient into its bucket's buffer, and note that it had one.

        A parameter that is a view of the buffers gets a `.grad` that is a view too (autograd
        then accumulates in place); one whose gradient dtype differs adds autograd's gradient
        into the buffer and drops it; one copied to and from the buffers (a DTensor, a
        parameter in several pieces) keeps its `.grad` and is copied in once, at the last
        backward (`final`). A group of one rank leaves the gradient where it is."""
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
        """`owner`'s step refusal when the gradients were changed in place (`touched`): it
        rides in the agreement, so one rank clipping stops every rank."""
        return [f"{owner}: {TOUCHED}"] if self.touched() else []

    def reduce_grads(self, stats: C.CommStats) -> None:
        """The gradients of this step, averaged, where the owners read them: reduced here,
        or, under DistributedDataParallel (which averaged them on every rank), taken into
        the buffers as they are. Gradients changed in place since backward (`touched`) are
        reduced all the same, so every rank's collectives match (`opt.clip_grad_norm_` on
        every rank after torch's clipping on one), and remembered: the step refuses them on
        every rank through its agreement (`refusal`)."""
        self.touched_before_reduce = self.touched()
        self.grad_versions = None
        self.backward_queued = False  # (a backward that raised never ran its callback)
        if self.ddp is None:
            self.reduce_all(stats)
            return
        for slots in self.slots_of.values():
            self.take_grad(slots[0].param, slots, final=True)

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

    def launch_ready(self, stats: C.CommStats) -> None:
        """Launch, strictly in bucket order (the same order on every rank), every bucket
        whose gradients are all in."""
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if len(b.ready) < len(b.units):
                return
            b.launch_reduce(stats, async_op=True)
            self.next_launch += 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) for the backward passes inside."""
        previous, self.syncing = self.syncing, False
        try:
            yield
        finally:
            self.syncing = previous

    def reduce_all(self, stats: C.CommStats) -> None:
        """Launch every bucket not yet launched (gradients missing here count as zeros), in
        order, and wait for all reductions."""
        for b in self.buckets[self.next_launch :]:
            for unit, slots in b.units.items():
                if unit in b.ready:
                    continue
                p = slots[0].param
                self.take_grad(p, self.slots_of[id(p)], final=True)
                if b.n > 1 and unit not in b.present:
                    for s in slots:  # no gradient here: zeros
                        b.grad_slice(s).zero_()
            b.launch_reduce(stats, async_op=True)
        self.next_launch = len(self.buckets)
        for b in self.buckets:
            b.finish_reduce()

    def reset(self) -> None:
        """The next step starts clean: no bucket ready or launched, nothing reduced."""
        for b in self.buckets:
            b.reset()
        self.next_launch = 0
        self.reduced = False
        self.touched_before_reduce = False

    def launch_gathers(self, stats: C.CommStats, async_op: bool) -> None:
        """Launch the parameter gathers (asynchronous: each is waited for by the first forward
        pre-hook of the next step)."""
        for b in reversed(self.buckets):  # forward order: the first layers arrive first
            b.launch_gather(stats, async_op=async_op)
        self.gathering = async_op
        self.followed = False
