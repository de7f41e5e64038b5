"""Planted `orthoptim compare` runs (no training): a run's result as `launch` returns it,
the compare options and the AdamW/Muon pair the report tests build their summaries from."""

from __future__ import annotations

from orthoptim.train.args import TrainArgs
from orthoptim.train.compare import CompareArgs
from orthoptim.train.loop import throughput

TOKENS_PER_STEP = 2 * 4 * 128  # 2 ranks × batch 4 × the tiny config's 128 bytes


def planted(
    optimizer: str,
    lr: float,
    fb: float,
    opt: float,
    losses: dict[int, float],
    steps: int = 10,
    restarts: tuple[int, ...] = (1, 6),
    peaks: tuple[float, ...] = (500e6, 510e6),
    sent: float = 3.0e6,
    device: str = "cpu",
) -> dict:
    """A run's result as `launch` returns it: every step takes `fb` s of forward/backward and
    `opt` s of optimizer part; the ranks (re)start at `restarts` (its first 2 steps cold);
    `losses` are the validation losses at evaluated steps. Throughput by the loop's own
    `throughput`."""
    rows: list[dict] = [dict(step=0, val_loss=4.0, train_time_s=0.0)]
    total = 0.0
    for step in range(1, steps + 1):
        total += fb + opt
        row = dict(step=step, step_time_s=fb + opt, opt_time_s=opt, train_time_s=total)
        if any(0 <= step - s < 2 for s in restarts):
            row["cold"] = True
        if step in losses:
            row["val_loss"] = losses[step]
        rows.append(row)
    args = TrainArgs(optimizer=optimizer, lr=lr, steps=steps, batch=4).to_dict()
    return dict(
        args=args,
        metrics=rows,
        final_val_loss=losses[steps],
        tokens_per_step=TOKENS_PER_STEP,
        device=device,
        precision="fp32",
        compiled=False,
        threads_per_rank=1,
        peak_memory_bytes_per_rank=list(peaks),
        comm_sent_bytes_per_step_per_rank=[sent] * len(peaks),
        comm_received_bytes_per_step_per_rank=[sent] * len(peaks),
        optimizer_class="LayerwiseDistributedOptimizer",
        **throughput(rows, TOKENS_PER_STEP),
    )


def opts(**kw) -> CompareArgs:
    base = dict(nproc=2, steps=10, batch=4, config="tiny", eval_every=5, segments=2)
    return CompareArgs(**{**base, **kw})


def pair(muon_fb: float = 0.1, muon_opt: float = 0.01, **kw) -> dict[str, dict]:
    """AdamW (0.1 s forward/backward, 0.01 s optimizer) and Muon as planted."""
    return dict(
        adamw=planted("adamw", 3e-3, 0.1, 0.01, {5: 3.6, 10: 3.5}, **kw),
        muon=planted("muon", 0.05, muon_fb, muon_opt, {5: 3.4, 10: 3.3}, **kw),
    )
