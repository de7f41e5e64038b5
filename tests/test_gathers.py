"""Parameter gathers of the layer-wise optimizer land before any read in the next forward, even
a read from outside the parameter's own module (a parent's F.linear(x, self.child.weight)):
every rank then holds the same parameters, equal to the single-process run's."""

import torch
import torch.nn.functional as F
from torch import nn

from orthoptim import build_optimizer
from orthoptim.parallel import LayerwiseDistributedOptimizer

from distributed import run_ranks

STEPS, BATCH = 4, 8
KW = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3)


class Parent(nn.Module):
    """Reads `child`'s weight and bias directly; `child`'s own forward never runs, so no
    per-module hook of `child` fires. The root has no parameters of its own."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.child = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)
        self.seen = []  # child.weight as every forward read it

    def forward(self, x):
        self.seen.append(self.child.weight.detach().clone())
        h = torch.tanh(self.inp(x))
        h = torch.tanh(F.linear(h, self.child.weight, self.child.bias))
        return self.out(h)


def make_model():
    torch.manual_seed(0)
    return Parent().double()


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 8, dtype=torch.float64, generator=g)
    return x, torch.randn(BATCH, 4, dtype=torch.float64, generator=g)


def reference():
    model = make_model()
    opt = build_optimizer(model, **KW)
    for step in range(STEPS):
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(rank, world_size):
    model = make_model()
    # One unit per bucket: child's bucket is waited for by no module that runs.
    opt = LayerwiseDistributedOptimizer(model, bucket_mb=1e-5, overlap_param_gather=True, **KW)
    assert len(opt.grad_sync.buckets) > 3
    per = BATCH // world_size
    for step in range(STEPS):
        x, y = batch(step)
        sl = slice(rank * per, (rank + 1) * per)
        F.mse_loss(model(x[sl]), y[sl]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, model.seen


def test_parent_reading_child_weight_sees_gathered_values():
    (got0, seen0), (got1, seen1) = run_ranks(_train, 2)
    got = [got0, got1]
    for step, (a, b) in enumerate(zip(seen0, seen1)):
        diff = (a - b).abs().max().item()
        assert diff == 0, f"forward {step} read child.weight {diff:.1e} apart on the two ranks"
    want = reference()
    for n, w in want.items():
        diff = (got[1][n] - got[0][n]).abs().max().item()
        assert diff == 0, f"{n}: ranks differ by {diff:.1e}"
        err = ((got[0][n] - w).norm() / w.norm()).item()
        assert err <= 1e-10, f"{n}: relative error {err:.1e} against one process"
