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

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from orthoptim import collectives
from orthoptim.optim.muon import Split
from orthoptim.optim.qk_clip import QKHeads
from orthoptim.train.model import GPT, GPTConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from orthoptim.parallel.layout import ParallelMesh

ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[ScheduleName, ...] = ("gpipe", "1f1b")


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    """The blocks stage `stage` of `pp` holds: `n_layer // pp` each, the first
    `n_layer % pp` stages one more (the last stage also computes the head and the loss)."""
    check_pipeline(n_layer, pp)
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in [0, {pp}) for --pp {pp}, got {stage}")
    base, extra = divmod(n_layer, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def check_pipeline(n_layer: int, pp: int) -> None:
    """Refuse a pipeline size the model cannot be split into: every stage needs a block."""
    if pp < 1:
        raise ValueError(f"--pp must be >= 1, got {pp}")
    if pp > n_layer:
        raise ValueError(
            f"--pp {pp} exceeds the model's {n_layer} blocks (every stage holds at least one "
            f"block): use --pp {n_layer} or fewer"
        )


class GPTStage(nn.Module):
    """Stage `stage` of `pp` of a `GPT` (see `split_stage`): `forward(x)` takes token ids on
    stage 0, hidden states [B, T, d_model] elsewhere, and returns hidden states, or logits
    on the last stage. Implements the MuonClip protocol over the blocks it holds."""

    def __init__(self, model: GPT, pp: int, stage: int) -> None:
        super().__init__()
        self.cfg: GPTConfig = model.cfg
        self.pp, self.stage = pp, stage
        self.layers = stage_layers(model.cfg.n_layer, pp, stage)
        self.is_first, self.is_last = stage == 0, stage == pp - 1
        if self.is_first:
            self.embed = model.embed
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in self.layers})
        if self.is_last:
            self.norm = model.norm
            self.lm_head = model.lm_head
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        if self.cfg.seq_len < T:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        if self.is_first:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x, cos, sin)
        if self.is_last:
            x = self.lm_head(self.norm(x))
        return x

    def split_spec(self) -> dict[str, Split]:
        """Row blocks of the fused matrices this stage holds (as `GPT.split_spec`)."""
        return GPT.split_spec(self)  # type: ignore[arg-type]  # reads named_modules() only

    def record_attention_logits(self, on: bool = True) -> None:
        """As `GPT.record_attention_logits`, for this stage's blocks."""
        for block in self.blocks.values():
            block.attn.record_logits = on
            block.attn.max_logits = None

    def attention_max_logits(self) -> dict[str, Tensor | None]:
        """As `GPT.attention_max_logits`, for this stage's blocks (full-model layer names)."""
        out: dict[str, Tensor | None] = {}
        for i, block in self.blocks.items():
            out[f"blocks.{i}.attn"] = block.attn.max_logits
            block.attn.max_logits = None
        return out

    def qk_clip_heads(self) -> dict[str, QKHeads]:
        """As `GPT.qk_clip_heads`, for this stage's blocks (full-model parameter names)."""
        return {
            f"blocks.{i}.attn": block.attn.qk_heads(f"blocks.{i}.attn.")
            for i, block in self.blocks.items()
        }


def split_stage(model: GPT, pp: int, stage: int) -> GPTStage:
    """Stage `stage` of a `pp`-stage pipeline over `model` (see `GPTStage`), sharing the
    model's modules. Every rank builds the same full model (same seed) and keeps its stage.

    Tensor parallelism: `parallelize(model, tp_mesh)` the full model BEFORE splitting (its
    plan names every block of the full model)."""
    check_pipeline(model.cfg.n_layer, pp)
    return GPTStage(model, pp, stage)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """The mean next-token cross-entropy over logits [B, T, V], in float32 at least (as
    `GPT.forward(idx, targets)`, which also takes bf16 logits to float32; float64 stays)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


class PipelineRunner:
    """Run stage `module` of a pipeline: one rank per stage in `group`.

    `group`: the pipeline group (ranks with the same dp and tp index, in stage order), or a
    `ParallelMesh` (its `pp_group`). `schedule`: "1f1b" (one forward, one backward: at most
    pp micro-batches' activations alive; needs n_microbatches >= pp) or "gpipe" (every
    forward, then every backward). Each batch is cut into `n_microbatches` equal
    micro-batches along dim 0; the loss of each is its mean over its tokens divided by
    `n_microbatches`, so the gradients summed over them are those of the batch's mean loss.
    """

    def __init__(
        self,
        module: GPTStage,
        group: ProcessGroup | ParallelMesh | None,
        *,
        n_microbatches: int,
        schedule: ScheduleName = "1f1b",
        device: torch.device | str = "cpu",
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
        self.device = torch.device(device)
        self._schedules: dict[tuple[int, ...], PipelineScheduleSingle] = {}

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return lm_loss(logits, targets) / self.n_microbatches

    def _schedule_for(self, shape: torch.Size) -> PipelineScheduleSingle:
        """The schedule for batches of `shape`: a stage infers the shapes it receives from
        the first batch, so each batch shape has its own (every stage sees the same)."""
        key = tuple(shape)
        if key not in self._schedules:
            stage = PipelineStage(
                self.module, self.module.stage, self.module.pp, self.device, group=self.group
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
        schedule = self._schedule_for(x.shape)
        m = self.module
        args = (x.to(self.device),) if m.is_first else ()
        kw = {"target": y.to(self.device), "losses": []} if m.is_last else {}
        (schedule.step if train else schedule.eval)(*args, **kw)
        total = sum(float(loss.detach()) for loss in kw["losses"]) if m.is_last else 0.0
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
    "check_pipeline",
    "lm_loss",
    "split_stage",
    "stage_layers",
]
