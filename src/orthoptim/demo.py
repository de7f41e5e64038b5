"""`orthoptim demo`: fit a small MLP with Muon (hidden matrices) + AdamW (the rest) and
print the loss falling next to plain AdamW on the same data."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


def _model(width: int, seed: int) -> nn.Module:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, width), nn.GELU(), nn.Linear(width, width), nn.GELU(), nn.Linear(width, 1)
    )


def run_demo(
    steps: int = 200, width: int = 128, seed: int = 0, log_every: int = 25
) -> dict[str, list[float]]:
    """Train the same MLP with Muon and with AdamW on a fixed regression task; return losses.
    (torch is imported here: `orthoptim demo --help` needs none.)"""
    import torch
    from torch import nn

    from orthoptim.optim.hybrid import build_optimizer

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 16, generator=gen)
    w = torch.randn(16, 1, generator=gen)
    y = torch.sin(x @ w) + 0.1 * torch.randn(512, 1, generator=gen)
    losses: dict[str, list[float]] = {}
    for name, kw in (("muon", dict(lr=0.02, adamw_lr=3e-3)), ("adamw", dict(lr=3e-3))):
        model = _model(width, seed)
        opt = build_optimizer(model, optimizer=name, **kw)
        history = losses.setdefault(name, [])
        for step in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            history.append(loss.item())
            if log_every and (step % log_every == 0 or step == steps - 1):
                print(f"{name:>5} step {step:4d}  loss {loss.item():.4f}")
    return losses


def _cmd(args: argparse.Namespace) -> int:
    losses = run_demo(steps=args.steps, width=args.width, seed=args.seed)
    for name, h in losses.items():
        print(f"{name}: loss {h[0]:.4f} -> {h[-1]:.4f}")
    print(
        f"(the training loss of one MLP fitting a fixed regression, the same weights, data and "
        f"{args.steps} steps for both: Muon on the hidden matrix with AdamW beside it, against "
        "AdamW alone; a toy that shows both run, not which is better: `orthoptim compare` "
        "measures that on a real model)"
    )
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim demo`."""
    p = subparsers.add_parser(
        "demo", help="optimize a small model with Muon and AdamW, print the loss"
    )
    p.add_argument(
        "--steps", type=int, default=200, help="steps per optimizer (default %(default)s)"
    )
    p.add_argument(
        "--width", type=int, default=128, help="hidden width of the MLP (default %(default)s)"
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of the data and the weights (default 0)"
    )
    p.set_defaults(func=_cmd)
