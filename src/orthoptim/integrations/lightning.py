"""orthoptim's layer-wise optimizer inside Lightning (`pip install 'orthoptim[lightning]'`).

    import orthoptim
    from orthoptim.integrations.lightning import LayerwiseStrategy

    class LM(lightning.LightningModule):
        def configure_optimizers(self):
            return orthoptim.LayerwiseDistributedOptimizer(self, optimizer="muon", lr=0.02)

    trainer = lightning.Trainer(strategy=LayerwiseStrategy(), devices=2,
                                gradient_clip_val=1.0, accumulate_grad_batches=2)
    # or strategy="layerwise" once this module is imported

`build_optimizer` (replicated) needs nothing of this: use Lightning's `strategy="ddp"`.
The layer-wise optimizer does its own communication, reducing each gradient to the rank that
owns it (a reduce-scatter, half the bytes of DDP's all-reduce) and gathering the updated
parameters, so `LayerwiseStrategy` is `DDPStrategy` without the DDP wrap, with the three
things Lightning would otherwise do wrong for it:
- `gradient_clip_val` clips through `opt.clip_grad_norm_` (Lightning's own clipping sees only
  the parameters in `optimizer.param_groups`: for the layer-wise optimizer, what this rank
  owns); `gradient_clip_algorithm="value"` is refused;
- `accumulate_grad_batches` runs the micro-batches but the last inside `opt.no_sync()`;
- checkpoints gather the optimizer's full state to rank 0 (which alone writes the file) and
  every rank loads it back.
Every optimizer `configure_optimizers` returns must be a `LayerwiseDistributedOptimizer`:
without the DDP wrap nothing else would average the gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from typing import Any, Literal

from torch.optim import Optimizer

from orthoptim import collectives as C
from orthoptim.parallel import LayerwiseDistributedOptimizer

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy
except ImportError as exc:  # pragma: no cover - exercised without the extra
    raise ImportError(
        "orthoptim.integrations.lightning needs Lightning: pip install 'orthoptim[lightning]'"
    ) from exc

__all__ = ["STRATEGY_NAME", "LayerwiseStrategy"]

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
STRATEGY_NAME = "layerwise"


def _unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's `LightningOptimizer` (or `optimizer` itself)."""
    while isinstance(optimizer, pl.core.optimizer.LightningOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class LayerwiseStrategy(DDPStrategy):
    """Lightning's DDP strategy (one process a device, `torch.distributed` process group) for
    `LayerwiseDistributedOptimizer`: no DDP wrap; clipping, gradient accumulation and
    checkpoints go through the optimizer (see the module doc). Arguments are `DDPStrategy`'s
    that do not concern the DDP wrap."""

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[Any] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: StartMethod = "popen",
    ) -> None:
        kw = {} if timeout is None else {"timeout": timeout}
        super().__init__(
            accelerator=accelerator, parallel_devices=parallel_devices,
            cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin, process_group_backend=process_group_backend,
            start_method=start_method, **kw,
        )  # fmt: skip

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Makes `Trainer(strategy="layerwise")` this strategy."""
        strategy_registry.register(
            STRATEGY_NAME,
            cls,
            description="DDP processes for LayerwiseDistributedOptimizer",
            override=True,
        )

    def configure_ddp(self) -> None:
        """No DDP wrap; the start every rank would get from DDP's constructor: rank 0's
        parameters and buffers."""
        assert self.model is not None
        for t in [*self.model.parameters(), *self.model.buffers()]:
            C.broadcast(t.data, src=0)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        for opt in self.optimizers:
            if not isinstance(_unwrap_optimizer(opt), LayerwiseDistributedOptimizer):
                raise ValueError(
                    "LayerwiseStrategy: configure_optimizers returned "
                    f"{type(_unwrap_optimizer(opt)).__name__}; this strategy does not average "
                    "gradients itself. Return orthoptim.LayerwiseDistributedOptimizer(...), or "
                    'use strategy="ddp" for any other optimizer'
                )

    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # Lightning clips `precision_plugin.main_params(optimizer)`: for the layer-wise
        # optimizer only what this rank owns, and before the gradients are reduced.
        self.precision_plugin.clip_grad_by_norm = _clip_grad_by_norm  # type: ignore[method-assign]
        self.precision_plugin.clip_grad_by_value = _clip_grad_by_value  # type: ignore[method-assign]

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation (every micro-batch but the last): the gradients stay on
        every rank, added up, until the last micro-batch's backward reduces them."""
        with ExitStack() as stack:
            for opt in self.optimizers:
                stack.enter_context(_unwrap_optimizer(opt).no_sync())
            yield

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full state on rank 0 (which alone writes the checkpoint), {} on the others;
        a collective: Lightning calls it on every rank."""
        return _unwrap_optimizer(optimizer).full_state_dict(to_rank0=True)


def _clip_grad_by_norm(optimizer: Optimizer, clip_val: float) -> None:
    _unwrap_optimizer(optimizer).clip_grad_norm_(float(clip_val))


def _clip_grad_by_value(optimizer: Optimizer, clip_val: float) -> None:
    raise ValueError(
        "LayerwiseStrategy: gradient_clip_algorithm='value' clips each rank's gradients before "
        "they are reduced; use gradient_clip_algorithm='norm' (opt.clip_grad_norm_)"
    )


LayerwiseStrategy.register_strategies(pl.strategies.StrategyRegistry)
