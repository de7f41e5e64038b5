"""orthoptim inside Hugging Face `transformers.Trainer` (`pip install 'orthoptim[hf]'`).

Two recipes, at any number of ranks (torchrun):

    from orthoptim.integrations.hf import LayerwiseCheckpointCallback, optimizer_cls_and_kwargs

    # a factory: Trainer builds the optimizer over its (already placed) model
    Trainer(model, args, train_dataset=ds,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs("layerwise", lr=0.02),
            callbacks=[LayerwiseCheckpointCallback()])

    # or an optimizer built by hand (after TrainingArguments, which starts the process group)
    opt = orthoptim.LayerwiseDistributedOptimizer(model, optimizer="muon", lr=0.02)
    Trainer(model, args, train_dataset=ds, optimizers=(opt, None),
            callbacks=[LayerwiseCheckpointCallback()])

`kind="replicated"` (`orthoptim.build_optimizer`, every rank steps every parameter) needs no
callback. The layer-wise optimizer needs one thing Trainer does not do: Trainer saves the
optimizer by calling `optimizer.state_dict()` on rank 0 alone, and the layer-wise state dict is
a collective (each rank holds the state of what it owns). `LayerwiseCheckpointCallback` gathers
it on every rank (`prepare_state_dict()`) just before each save, after Trainer decided to save.
Everything else works as Trainer does it: Trainer (through accelerate) wraps the model in
`DistributedDataParallel`, whose all-reduced gradients the layer-wise optimizer uses as they
are; `max_grad_norm` clipping, gradient accumulation (`no_sync`), `save_model()` and
`resume_from_checkpoint` (every rank loads the full optimizer dict) need nothing more.
On one process the layer-wise optimizer steps as `kind="replicated"` does (nothing to reduce).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, get_args

import torch

from orthoptim._validate import check_choice
from orthoptim.optim import build_optimizer
from orthoptim.parallel import LayerwiseDistributedOptimizer

try:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "orthoptim.integrations.hf needs Hugging Face transformers: pip install 'orthoptim[hf]'"
    ) from exc

__all__ = ["KINDS", "LayerwiseCheckpointCallback", "OptimizerKind", "optimizer_cls_and_kwargs"]

OptimizerKind = Literal["replicated", "layerwise"]
KINDS: tuple[OptimizerKind, ...] = get_args(OptimizerKind)


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside accelerate's `AcceleratedOptimizer` wrappers (what Trainer hands
    its callbacks), or `optimizer` itself when it is not wrapped."""
    from accelerate.optimizer import AcceleratedOptimizer  # a dependency of Trainer

    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def optimizer_cls_and_kwargs(
    kind: OptimizerKind = "replicated", **kwargs: Any
) -> tuple[Callable[[], Callable[..., torch.optim.Optimizer]], dict[str, Any]]:
    """What `Trainer(optimizer_cls_and_kwargs=...)` takes to build an orthoptim optimizer over
    the model: `kind="replicated"` is `orthoptim.build_optimizer(model, **kwargs)`,
    `"layerwise"` is `orthoptim.LayerwiseDistributedOptimizer(model, **kwargs)` (add
    `LayerwiseCheckpointCallback()` to the Trainer's callbacks). `kwargs` are the builder's
    (`optimizer="muon"`, `lr`, ...)."""
    check_choice("kind", kind, KINDS)
    builder: Callable[..., torch.optim.Optimizer] = (
        build_optimizer if kind == "replicated" else LayerwiseDistributedOptimizer
    )
    # Trainer calls a factory that is not an Optimizer class with no arguments, and what it
    # returns with (model, **kwargs).
    return (lambda: builder), dict(kwargs)


class LayerwiseCheckpointCallback(TrainerCallback):
    """Gathers a `LayerwiseDistributedOptimizer`'s full state dict on every rank right before
    Trainer saves a checkpoint (`control.should_save`, set by Trainer's flow callback before
    this one runs), so that Trainer's rank-0-only `optimizer.state_dict()` returns it without
    communication. Does nothing for any other optimizer. Add it to `Trainer(callbacks=[...])`.

    With `save_strategy="best"` Trainer decides to save only after evaluating, so the state
    is gathered at every evaluation step then; with `save_only_model=True`, never."""

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._prepare(args, control, kw.get("optimizer"))

    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kw: Any
    ) -> None:
        self._prepare(args, control, kw.get("optimizer"))

    @staticmethod
    def _prepare(args: TrainingArguments, control: TrainerControl, optimizer: Any) -> None:
        opt = _unwrap_optimizer(optimizer)
        if not isinstance(opt, LayerwiseDistributedOptimizer) or args.save_only_model:
            return
        best = str(getattr(args.save_strategy, "value", args.save_strategy)) == "best"
        if control.should_save or (best and control.should_evaluate):
            opt.prepare_state_dict()
