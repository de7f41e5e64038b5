"""The oracle of `orthoptim train` runs: the same training written as a plain single-process
float64 loop, with none of the run's drivers, checkpoints or resharding.

`reference_run` builds the model with the run's seed and `build_optimizer`'s optimizers in
one process, and takes each step on the step's global batch: every data-parallel rank's
(seed, step, rank) batch of `get_batch`, cut into the pipeline's micro-batches (gradients
accumulated), with the run's LR schedule, gradient clipping and QK-clip. A run resumed at
another data-parallel size is an uninterrupted reference run whose size changes at the step
resumed (`sizes`): nothing of the checkpoint's loading is shared with the run it checks, so a
state lost in resharding (a momentum, an Adam moment) shows as a difference.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from orthoptim.optim.hybrid import build_optimizer
from orthoptim.optim.qk_clip import QKClip
from orthoptim.train.args import TrainArgs
from orthoptim.train.data import get_batch
from orthoptim.train.loop import lr_multiplier
from orthoptim.train.model import GPT, GPTConfig


def reference_run(
    cfg: GPTConfig,
    train: torch.Tensor,
    args: TrainArgs,
    sizes: list[int],
    microbatches: int = 1,
    tau: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Steps 1 to len(sizes) of the run `args` (its seed, optimizers, LRs, weight decay,
    --batch, --warmup / --steps schedule, --grad-clip) in one process in float64 on the
    corpus `train`, step s on the global batch of `sizes[s - 1]` data-parallel ranks, each in
    `microbatches` micro-batches (micro-batch m of every rank together, as the ranks'
    reductions of each micro-batch see them), QK-clip at `tau` after each step. Returns each
    step's loss (the mean over the ranks' batches) and the parameters after the last step."""
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(torch.float64)
    if args.optimizer == "adamw":  # AdamW for every parameter
        opt = build_optimizer(
            model, optimizer="adamw", lr=args.matrix_lr, adamw_weight_decay=args.decay
        )
    else:
        given = {} if args.weight_decay is None else dict(weight_decay=args.weight_decay)
        opt = build_optimizer(
            model, optimizer=args.optimizer, lr=args.matrix_lr, adamw_lr=args.embed_lr,
            adamw_weight_decay=args.decay, elementwise=args.elementwise, **given,
        )  # fmt: skip
    qk = QKClip(model, tau=tau) if tau else None
    initial = [g["lr"] for g in opt.param_groups]
    losses = []
    for step, dp in enumerate(sizes, start=1):
        for g, lr in zip(opt.param_groups, initial):
            g["lr"] = lr * lr_multiplier(step, args)
        batches = [get_batch(train, args.batch, cfg.seq_len, args.seed, step, d) for d in range(dp)]
        total = 0.0
        for m in range(microbatches):
            xm = torch.cat([x.chunk(microbatches)[m] for x, _ in batches])
            ym = torch.cat([y.chunk(microbatches)[m] for _, y in batches])
            loss = model(xm, ym)  # with a router's balancing loss, as the run's
            (loss / microbatches).backward()
            total += loss.item() / microbatches
        if args.clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if qk is not None:
            qk.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (b = 0: the norm of a − b over 1e-300)."""
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def saved_model(out: Path) -> dict[str, torch.Tensor]:
    """The model of the last checkpoint of the run under `out`, read by torch alone (none
    of the library's loaders): model.pt of the full format, the "model/" entries of a DCP
    one (`dcp_to_torch_save`)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    record = json.loads((out / "checkpoints/latest.json").read_text())
    folder = out / "checkpoints" / record["folder"]
    if record["format"] == "full":
        return torch.load(folder / "model.pt", weights_only=True)
    assert record["format"] == "dcp", record["format"]
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(folder / "dcp", Path(tmp) / "whole.pt")
        stored = torch.load(Path(tmp) / "whole.pt", weights_only=True)
    return {k.removeprefix("model/"): v for k, v in stored.items() if k.startswith("model/")}
