"""orthoptim optimizers inside torchtitan: an `OptimizersContainer` its trainer, LR schedulers
and DCP `CheckpointManager` take as they take torchtitan's own.

    from orthoptim.integrations.torchtitan import OrthoptimOptimizersContainer

    config.optimizer = OrthoptimOptimizersContainer.Config(name="muon", lr=0.02)
    # or, outside torchtitan's config system:
    optimizers = build_optimizers(model_parts, optimizer="muon", distributed="fsdp", lr=0.02)

One orthoptim optimizer per model part (pipeline stages give several parts), chosen by
`distributed`:

    "fsdp"        `orthoptim.FSDPOptimizer`: the part is sharded by FSDP2's `fully_shard`
                  (torchtitan's parallelize functions always apply it; or
                  `orthoptim.parallel.fsdp.shard_model`)
    "layerwise"   `orthoptim.LayerwiseDistributedOptimizer`: plain replicated parameters;
                  the optimizer reduces the gradients itself (or uses DDP's, under DDP)
    "replicated"  `orthoptim.build_optimizer` (matrices → Muon etc., the rest → AdamW) on
                  every rank, over gradients something else has averaged (DDP), or one process

torchtitan's `Trainer` shards every model with `fully_shard` and clips with torch's
`clip_grad_norm_` on the model's parameters, so under it use "fsdp" (the default); the other
two are for training loops of your own that use torchtitan's components (a layer-wise
optimizer without DDP refuses a step after torch's clipping: clip with its
`clip_grad_norm_`).

`state_dict()` is orthoptim's sharded DCP format (`orthoptim.checkpoint.sharded_state_dict`)
for every kind: what this rank owns under `optim/state/<name>/<key>` and `optim/master/<name>`
(parameter names are unique over the parts), and per part `optim/meta/<first name>` (its
layout, checked on load) and `optim/fresh/<first name>`. No key names a rank or a world size,
so a checkpoint torchtitan's `CheckpointManager` writes loads at another data-parallel size.

DCP loads into the tensors `state_dict()` returns, so an optimizer that has no state yet (a
fresh run about to load) gets its state made by one step of zero gradients at lr 0, as
torchtitan's own container does (`init_optim_state`). Here that state is a placeholder: it
is dropped before the next `step()` unless a load replaced it, and a checkpoint of it is
marked fresh (`optim/fresh/...`) and loads as no state. So calling `state_dict()` never
changes what training does.

torchtitan is imported by this module only (`pip install 'orthoptim[torchtitan]'`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn
from torchtitan.components.optimizer import OptimizersContainer

from orthoptim import checkpoint
from orthoptim._validate import check_choice
from orthoptim.optim.hybrid import build_optimizer
from orthoptim.optim.registry import OPTIMIZER_NAMES, OptimizerName
from orthoptim.parallel import FSDPOptimizer, LayerwiseDistributedOptimizer
from orthoptim.parallel.base import DistributedOptimizer

__all__ = ["DISTRIBUTED", "Distributed", "OrthoptimOptimizersContainer", "build_optimizers"]

Distributed = Literal["fsdp", "layerwise", "replicated"]
DISTRIBUTED: tuple[Distributed, ...] = get_args(Distributed)

_META = checkpoint.META_KEY  # orthoptim's key of one optimizer's layout in a sharded dict


class OrthoptimOptimizersContainer(OptimizersContainer):
    """torchtitan's `OptimizersContainer` over orthoptim optimizers, one per model part.

    `optimizers` holds them (torchtitan's LR schedulers build one `LambdaLR` per entry and
    move every group of each); `step()`, `zero_grad()` act on all; `state_dict()` /
    `load_state_dict()` are the flat, DCP-ready, world-size-free dict described in the
    module docstring. Build it from its `Config` (what torchtitan's trainer does with
    `config.optimizer.build(model_parts=...)`) or with `build_optimizers`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        """orthoptim's optimizer for torchtitan's `config.optimizer`. torchtitan's own fields
        (`param_groups`, `optimizer_factory_kwargs_by_name`, `implementation`) do not apply:
        orthoptim routes the parameters itself (`explain_routing(model)` shows how)."""

        name: OptimizerName = "muon"
        """A matrix optimizer of `orthoptim.optim.registry.MATRIX_OPTIMIZERS` (hybrid with
        AdamW for embeddings, head and vectors), or "adamw" for every parameter."""

        distributed: Distributed = "fsdp"
        """"fsdp" (parts sharded by FSDP2, as torchtitan's trainer shards them),
        "layerwise" (plain parameters, the optimizer reduces gradients) or "replicated"."""

        lr: float | None = None
        """The learning rate of the matrix optimizer (of AdamW with name="adamw"); None: the
        optimizer's default."""

        optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
        """Further keyword arguments of `build_optimizer` / `LayerwiseDistributedOptimizer` /
        `FSDPOptimizer` (e.g. adamw_lr, weight_decay, adamw_weight_decay, route)."""

        def __post_init__(self) -> None:
            check_choice("optimizer name", self.name, OPTIMIZER_NAMES)
            check_choice("distributed", self.distributed, DISTRIBUTED)
            if self.param_groups:
                raise ValueError(
                    "param_groups: orthoptim routes parameters itself (matrices to "
                    f"{self.name!r}, the rest to AdamW); leave param_groups empty and pass "
                    "route=... in optimizer_kwargs to change the routing"
                )
            if self.optimizer_factory_kwargs_by_name:
                raise ValueError(
                    "optimizer_factory_kwargs_by_name does not apply to orthoptim; pass the "
                    "optimizer's arguments in optimizer_kwargs"
                )
            for key, use in (("optimizer", "name"), ("lr", "lr"), ("model", "model_parts")):
                if key in self.optimizer_kwargs:
                    raise ValueError(f"optimizer_kwargs[{key!r}]: give it as {use!r} instead")

    optimizers: list[torch.optim.Optimizer]

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        # torchtitan's __init__ builds torch optimizers from config.param_groups: not called.
        if isinstance(model_parts, nn.Module) or not model_parts:
            raise ValueError(
                "model_parts must be a non-empty list of nn.Module (one per pipeline stage; "
                f"[model] without pipeline parallelism), got {model_parts!r}"
            )
        self.model_parts = list(model_parts)
        self.distributed = config.distributed
        kw = dict(config.optimizer_kwargs, optimizer=config.name, lr=config.lr)
        self.optimizers = [_build(part, config.distributed, kw) for part in self.model_parts]
        # per part: its trainable parameters' names, and the first, which keys its meta
        self._names = [_trainable(part) for part in self.model_parts]
        self._tags = [names[0] for names in self._names]
        self._part_of = {n: i for i, names in enumerate(self._names) for n in names}
        if len(self._part_of) != sum(len(names) for names in self._names):
            raise ValueError(
                "model_parts: two parts have a parameter of the same name; state dicts are "
                "keyed by name, so the parts' names must differ (as pipeline stages' do)"
            )
        # per part: whether its state was made by `state_dict()` as a template (see module)
        self._placeholder = [False] * len(self.optimizers)
        params = {id(p): p for part in self.model_parts for p in part.parameters()}
        self._post_init([p for p in params.values() if p.requires_grad])

    # -- step -----------------------------------------------------------------------------
    def step(self, closure: Any = None) -> None:
        """Step every part's optimizer (collective for "fsdp" and "layerwise")."""
        if closure is not None:
            raise ValueError("closure: OrthoptimOptimizersContainer.step takes none")
        for i, opt in enumerate(self.optimizers):
            if self._placeholder[i]:
                self._reset(i)
            opt.step()

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's share of every part's optimizer, flat, for torch.distributed.checkpoint
        (the live tensors, no copy). Collective over each part's group: call it on every
        rank, as DCP does."""
        out: dict[str, Any] = {}
        for i, opt in enumerate(self.optimizers):
            if not self._placeholder[i] and not self._has_state(i):
                self._make_placeholder(i)
            sd = dict(checkpoint.sharded_state_dict(opt))
            out[f"{_META}/{self._tags[i]}"] = sd.pop(_META)
            out[f"optim/fresh/{self._tags[i]}"] = self._placeholder[i]
            out.update(sd)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load what `state_dict()` returned, here or at another data-parallel size (after DCP
        read it into this container's own `state_dict()`). Each part's layout is checked
        first (`CheckpointMismatchError` lists every difference). Collective."""
        parts: list[dict[str, Any]] = [{} for _ in self.optimizers]
        for key, v in state_dict.items():
            parsed = checkpoint.parse_sharded_key(key)
            if parsed is not None and parsed[1] in self._part_of:
                parts[self._part_of[parsed[1]]][key] = v
        for i, opt in enumerate(self.optimizers):
            tag = self._tags[i]
            meta_key = f"{_META}/{tag}"
            if meta_key not in state_dict:
                raise checkpoint.CheckpointMismatchError(
                    [f"model part {i}: no {meta_key!r} in the state dict (saved for other parts?)"]
                )
            sd = {_META: state_dict[meta_key]}
            if not state_dict.get(f"optim/fresh/{tag}", False):
                sd.update(parts[i])
            # a fresh checkpoint loads as no state: the layout is still checked
            _load_sharded(opt, sd)
            self._placeholder[i] = False

    # -- the placeholder state a load template needs --------------------------------------
    def _has_state(self, i: int) -> bool:
        """Whether part i's optimizer holds state on some rank of its group (a layer-wise
        rank that owns nothing has none of its own). Collective for the distributed kinds."""
        opt = self.optimizers[i]
        mine = torch.tensor(float(bool(opt.state)))
        if isinstance(opt, (FSDPOptimizer, LayerwiseDistributedOptimizer)):
            return bool(opt.reduce_max(mine).item())
        return bool(mine.item())

    @torch.no_grad()
    def _make_placeholder(self, i: int) -> None:
        """Make part i's state by one step of zero gradients at lr 0 (parameters unchanged:
        W ← (1 − 0·wd)·W − 0·d), so that DCP has tensors to load into."""
        opt, part = self.optimizers[i], self.model_parts[i]
        params = [p for p in part.parameters() if p.requires_grad]
        if any(p.grad is not None for p in params):
            raise RuntimeError(
                f"state_dict(): model part {i}'s optimizer has no state yet but its "
                "parameters hold gradients; call state_dict() before backward() or after "
                "step() (its state is made by a zero-gradient step, which would drop them)"
            )
        lrs = [g["lr"] for g in opt.param_groups]
        for g in opt.param_groups:
            g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], Tensor) else 0.0
        for p in params:
            p.grad = torch.zeros_like(p)
        try:
            opt.step()
        finally:
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr
            opt.zero_grad(set_to_none=True)
        if isinstance(opt, DistributedOptimizer):
            opt.wait_for_params()
        self._placeholder[i] = True

    def _reset(self, i: int) -> None:
        """Drop part i's placeholder state: back to no state, as before `state_dict()`."""
        opt = self.optimizers[i]
        _load_sharded(opt, {_META: checkpoint.sharded_state_dict(opt)[_META]})
        self._placeholder[i] = False


def build_optimizers(
    model_parts: nn.Module | Sequence[nn.Module],
    optimizer: OptimizerName = "muon",
    distributed: Distributed = "fsdp",
    lr: float | None = None,
    **kwargs: Any,
) -> OrthoptimOptimizersContainer:
    """An `OrthoptimOptimizersContainer` over `model_parts` (a module, or one per pipeline
    stage): `optimizer` (a matrix optimizer hybrid with AdamW, or "adamw") at `lr`, one per
    part, as `distributed` says ("fsdp", "layerwise", "replicated"; see the module);
    `kwargs` go to the optimizer (e.g. adamw_lr=3e-4, weight_decay=0.01)."""
    parts = [model_parts] if isinstance(model_parts, nn.Module) else list(model_parts)
    config = OrthoptimOptimizersContainer.Config(
        name=optimizer, distributed=distributed, lr=lr, optimizer_kwargs=dict(kwargs)
    )
    return config.build(model_parts=parts)


def _build(part: nn.Module, distributed: Distributed, kw: dict[str, Any]) -> torch.optim.Optimizer:
    """Part `part`'s optimizer, after checking that `distributed` fits how it is laid out."""
    from torch.distributed.fsdp import FSDPModule

    sharded = any(isinstance(m, FSDPModule) for m in part.modules())
    if distributed == "fsdp":
        if not sharded:
            raise ValueError(
                "distributed='fsdp' needs model parts sharded by FSDP2's fully_shard "
                "(torchtitan's parallelize does it; or orthoptim.parallel.fsdp.shard_model); "
                "this part is not: pass distributed='layerwise' or 'replicated'"
            )
        return FSDPOptimizer(part, **kw)
    if sharded:
        raise ValueError(
            f"distributed={distributed!r}: this model part is sharded by FSDP2's fully_shard; "
            "pass distributed='fsdp'"
        )
    if distributed == "layerwise":
        return LayerwiseDistributedOptimizer(part, **kw)
    return build_optimizer(part, **kw)


def _trainable(part: nn.Module) -> list[str]:
    names = [n for n, p in part.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError(f"model part {type(part).__name__} has no trainable parameter")
    return names


def _load_sharded(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """`opt.load_sharded_state_dict(sd)` where it has one (the distributed optimizers: their
    masters follow), else orthoptim's generic loader."""
    load = getattr(opt, "load_sharded_state_dict", None)
    if callable(load):
        load(sd)
    else:
        checkpoint.load_sharded_state_dict(opt, sd)
