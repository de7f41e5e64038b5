"""Pipeline parallelism for the built-in GPT with `torch.distributed.pipelining`.

`split_stage(model, pp, stage)` keeps stage `stage`'s share of a `GPT`: a contiguous run of
blocks (`stage_layers`), the embedding on stage 0, the final norm and `lm_head` on the last
stage. The modules are the model's own (no copy) and keep the full model's parameter names
(`blocks.3.attn.q.weight` stays that name), so a stage's state dict is a subset of the full
model's and a stage's optimizer routes, splits and clips as the full model's would.

`PipelineRunner` runs one stage of a 1F1B or GPipe schedule over micro-batches: `step(x, y)`
is the forward and backward of a batch, `evaluate(x, y)` its forward only; both return the
batch's mean loss on every stage of the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from orthoptim import collectives, host
from orthoptim.choices import SCHEDULES, ScheduleName
from orthoptim.parallel.layout import ParallelDims
from orthoptim.train.model import GPT, GPTConfig, lm_loss

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from orthoptim.parallel.layout import ParallelMesh

NoSync = Callable[[], AbstractContextManager[Any]]


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    """The blocks stage `stage` of `pp` holds: `n_layer // pp` each, the first
    `n_layer % pp` stages one more (the last stage also computes the head and the loss).
    Refuses (naming --pp) more stages than blocks: every stage holds at least one."""
    ParallelDims(pp=pp).check(n_layer=n_layer)
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}) for --pp {pp}, got {stage}")
    base, extra = divmod(n_layer, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class StageBlocks(nn.ModuleDict):
    """A stage's blocks under their indices in the full model (`blocks.3` stays `blocks.3`);
    iterating yields the blocks, as over the full model's ModuleList (`compile_blocks`,
    `GPT.record_attention_logits`); `items()` pairs them with their indices."""

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]
        return iter(self.values())


class GPTStage(nn.Module):
    """Stage `stage` of `pp` of a `GPT` (see `split_stage`): `forward(x)` takes token ids on
    stage 0, hidden states [B, T, d_model] elsewhere, and returns hidden states, or logits
    on the last stage. Implements the MuonClip protocol over the blocks it holds.

    Router auxiliary loss (MoE layers with `aux_loss` and `aux_loss_coef`, as
    `GPT.router_aux_loss`): a training forward adds this stage's Σ coef · aux_loss to
    `aux_loss_sum` (detached; reset it to None to start again) and, when it has a gradient,
    ties it to the output so that backward from a later stage also differentiates it, with
    weight `aux_loss_scale` (a pipeline runner sets 1 / micro-batches, the weight of each
    micro-batch's loss).
    """

    def __init__(self, model: GPT, pp: int, stage: int) -> None:
        super().__init__()
        self.cfg: GPTConfig = model.cfg
        self.pp, self.stage = pp, stage
        self.layers = stage_layers(model.cfg.n_layer, pp, stage)
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        if self.is_first:
            self.embed = model.embed
        self.blocks = StageBlocks({str(i): model.blocks[i] for i in self.layers})
        if self.is_last:
            self.norm = model.norm
            self.lm_head = model.lm_head
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.aux_loss_scale = 1.0
        self.aux_loss_sum: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        if self.cfg.seq_len < T:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        if self.is_first:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x, cos, sin)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        aux = self.router_aux_loss()
        if aux is not None:
            done = aux.detach()
            self.aux_loss_sum = done if self.aux_loss_sum is None else self.aux_loss_sum + done
            if aux.requires_grad:
                x = _WithLossGradient.apply(x, aux, self.aux_loss_scale)
        return x

    def stream_dtype(self) -> torch.dtype:
        """The dtype of the residual stream a stage sends: its parameters' (the embedding's
        output; a block adds its autocast output to it in the stream's dtype)."""
        return next(p.dtype for p in self.parameters() if p.is_floating_point())

    # The full model's, as they read only named_modules() and iterate over `blocks`
    # (checkpoints read `expert_parallel_slices` to store expert stacks as full tensors).
    split_spec = GPT.split_spec
    record_attention_logits = GPT.record_attention_logits
    moe_layers = GPT.moe_layers
    router_aux_loss = GPT.router_aux_loss
    expert_parallel_slices = GPT.expert_parallel_slices

    def numbered_blocks(self) -> list[tuple[int, nn.Module]]:
        """(index in the full model, block) of this stage's blocks."""
        return [(int(i), block) for i, block in self.blocks.items()]

    # MuonClip's protocol over this stage's blocks, under the full model's layer names.
    attention_max_logits = GPT.attention_max_logits
    qk_clip_heads = GPT.qk_clip_heads


class _WithLossGradient(torch.autograd.Function):
    """x unchanged; its backward also sends `scale` as the gradient of the scalar `loss`
    (a loss computed inside a stage joins the backward that reaches the stage's output)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.like = scale, loss.detach()
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full_like(ctx.like, ctx.scale), None


def split_stage(model: GPT, pp: int, stage: int) -> GPTStage:
    """Stage `stage` of a `pp`-stage pipeline over `model` (see `GPTStage`), sharing the
    model's modules. Every rank builds the same full model (same seed) and keeps its stage.

    Tensor parallelism: `parallelize(model, tp_mesh)` the full model BEFORE splitting (its
    plan names every block of the full model)."""
    return GPTStage(model, pp, stage)


class _SyncedStage(PipelineStage):
    """The `PipelineStage` of a `GPTStage` for micro-batches of `tokens` [mb, T] (their ids'
    dtype `ids`), given its input and output shapes (static metadata: torch's inference of
    them would run a forward on uninitialized tensors, recording garbage into MuonClip's
    logits and the router losses). The backward of every micro-batch but the last runs
    inside `no_sync()` (a data-parallel optimizer's), so gradients are reduced once a step."""

    def __init__(
        self,
        module: GPTStage,
        tokens: tuple[int, int],
        ids: torch.dtype,
        device: torch.device,
        group: Any,
        no_sync: NoSync | None,
    ) -> None:
        stream, cfg = module.stream_dtype(), module.cfg
        self.sends = torch.Size((*tokens, cfg.d_model)), stream

        def example(*shape: int, dtype: torch.dtype = stream) -> Tensor:
            t = torch.empty(*tokens, *shape, dtype=dtype, device="meta")
            return t.requires_grad_() if t.is_floating_point() else t

        super().__init__(
            module,
            module.stage,
            module.pp,
            device,
            input_args=example(dtype=ids) if module.is_first else example(cfg.d_model),
            output_args=example(cfg.vocab_size if module.is_last else cfg.d_model),
            group=group,
        )
        self.no_sync = no_sync

    def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward_maybe_with_nosync(*args, **kwargs)
        if not self.is_last and (out.shape, out.dtype) != self.sends:
            raise RuntimeError(
                f"pipeline stage {self.stage_index} sends {out.dtype} {tuple(out.shape)}, but "
                f"the next stage receives {self.sends[1]} {tuple(self.sends[0])}: the model's "
                "parameters must all have one dtype (the residual stream's)"
            )
        return out

    def backward_maybe_with_nosync(
        self, backward_type: Any, bwd_kwargs: dict, last_backward: bool = False
    ) -> Any:
        if self.no_sync is None or last_backward:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        with self.no_sync():
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


class PipelineRunner:
    """Run stage `module` of a pipeline: one rank per stage in `group`.

    `group`: the pipeline group (ranks with the same dp and tp index, in stage order), or a
    `ParallelMesh` (its `pp_group`). `schedule`: "1f1b" (one forward, one backward: at most
    pp micro-batches' activations alive; needs n_microbatches >= pp) or "gpipe" (every
    forward, then every backward). Each batch is cut into `n_microbatches` equal
    micro-batches along dim 0; the loss of each is its mean over its tokens divided by
    `n_microbatches`, so the gradients summed over them are those of the batch's mean loss.
    `no_sync`: the stage's data-parallel optimizer's (`LayerwiseDistributedOptimizer.no_sync`),
    entered for the backward of every micro-batch but the last of a step (None: no
    data-parallel reduction during backward).

    The loss `step` and `evaluate` return is the same on every stage (one all-reduce of a
    float over the pipeline group): the cross-entropy of the batch, plus the router
    auxiliary losses of every stage's MoE layers (in training mode, as `GPT.forward` adds
    them), each the mean of its micro-batches' (a balancing loss per micro-batch, as under
    gradient accumulation). The module's mode is the caller's (`module.eval()` first for a
    validation loss without them).
    """

    def __init__(
        self,
        module: GPTStage,
        group: ProcessGroup | ParallelMesh | None,
        *,
        n_microbatches: int,
        schedule: ScheduleName = "1f1b",
        device: torch.device | str = "cpu",
        no_sync: NoSync | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
        if n_microbatches < 1:
            raise ValueError(f"n_microbatches must be >= 1, got {n_microbatches}")
        if schedule == "1f1b" and n_microbatches < module.pp:
            raise ValueError(
                f"the 1f1b schedule needs at least one micro-batch per stage: n_microbatches "
                f"({n_microbatches}) must be >= --pp ({module.pp}), or use the gpipe schedule"
            )
        self.group = getattr(group, "pp_group", group)
        rank, size = collectives.world(self.group)
        if (rank, size) != (module.stage, module.pp):
            raise ValueError(
                f"the pipeline group has {size} ranks and this rank is its rank {rank}, but the "
                f"module is stage {module.stage} of --pp {module.pp}: pass the pp group"
            )
        self.module, self.n_microbatches, self.schedule = module, n_microbatches, schedule
        self.device, self.no_sync = torch.device(device), no_sync
        self._schedules: dict[tuple[int, ...], PipelineScheduleSingle] = {}

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return lm_loss(logits, targets) / self.n_microbatches

    def _schedule_for(self, x: Tensor) -> PipelineScheduleSingle:
        """The schedule for batches shaped as `x`: a stage's shapes are fixed, so each batch
        shape has its own (every stage sees the same shapes)."""
        key = (*x.shape, x.dtype)
        if key not in self._schedules:
            tokens = (x.shape[0] // self.n_microbatches, x.shape[1])
            stage = _SyncedStage(
                self.module, tokens, x.dtype, self.device, self.group, self.no_sync
            )
            kind = ScheduleGPipe if self.schedule == "gpipe" else Schedule1F1B
            self._schedules[key] = kind(
                stage, self.n_microbatches, loss_fn=self._loss, scale_grads=False
            )
        return self._schedules[key]

    def _run(self, x: Tensor, y: Tensor, train: bool) -> float:
        if x.shape[0] % self.n_microbatches:
            raise ValueError(
                f"the batch of {x.shape[0]} sequences does not split into n_microbatches "
                f"({self.n_microbatches}) equal micro-batches: make the batch a multiple of it"
            )
        schedule = self._schedule_for(x)
        m = self.module
        args = (x.to(self.device),) if m.is_first else ()
        kw = {"target": y.to(self.device), "losses": []} if m.is_last else {}
        m.aux_loss_scale, m.aux_loss_sum = 1.0 / self.n_microbatches, None
        (schedule.step if train else schedule.eval)(*args, **kw)
        # The last stage's cross-entropy (its micro-batches' losses carry the 1 / n) and this
        # stage's router losses (a mean over the micro-batches): one host read.
        parts = [loss.detach().double() for loss in kw.get("losses", ())]
        if m.aux_loss_sum is not None:
            parts.append(m.aux_loss_sum.double() / self.n_microbatches)
        total = float(host.read(torch.stack(parts).sum(), "pipeline loss")) if parts else 0.0
        with collectives.phase("pipeline loss (all-reduce over pp)", self.group):
            return collectives.sum_floats([total], group=self.group)[0]

    def step(self, x: Tensor, y: Tensor) -> float:
        """Forward and backward of the batch (x, y) [B, T]: gradients accumulate into the
        stage's `.grad` as `loss.backward()` of the batch's mean loss would; returns that
        mean loss (float) on every stage. Every stage passes the same (x, y): stage 0 reads
        x's values, the last stage y's, the others their shapes only."""
        return self._run(x, y, train=True)

    @torch.no_grad()
    def evaluate(self, x: Tensor, y: Tensor) -> float:
        """The batch's mean loss, forward only, on every stage (as `step`, no gradients)."""
        return self._run(x, y, train=False)


__all__ = [
    "SCHEDULES",
    "GPTStage",
    "PipelineRunner",
    "ScheduleName",
    "lm_loss",
    "split_stage",
    "stage_layers",
]
