"""A 1-element tensor LR (any shape, as torch.optim takes it) steps exactly as the float.

The LR is 2⁻⁶, a float32 number, so a float32 tensor holds the very value of the float and
the two runs must agree bit for bit (weight decay on, so (1 − lr·wd) is exercised too).
"""

import pytest
import torch
from torch import nn

from orthoptim import (
    SOAP,
    AdaMuon,
    FSDPOptimizer,
    LayerwiseDistributedOptimizer,
    Lion,
    Muon,
    NorMuon,
    PolarGrad,
    Scion,
    build_optimizer,
)

LR = 2.0**-6
SHAPES = {"0-d": (), "[1]": (1,), "[1, 1]": (1, 1)}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def matrices(m):
    return [p for p in m.parameters() if p.ndim == 2]


def backward(m, step):
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 4, generator=gen)
    m.zero_grad()
    nn.functional.mse_loss(m(x), y).backward()


# name → build(model, lr): every optimizer whose constructor takes the LR
BUILDS = {
    "muon": lambda m, lr: Muon(matrices(m), lr=lr, weight_decay=0.1),
    "normuon": lambda m, lr: NorMuon(matrices(m), lr=lr, weight_decay=0.1),
    "adamuon": lambda m, lr: AdaMuon(matrices(m), lr=lr),
    "polargrad": lambda m, lr: PolarGrad(matrices(m), lr=lr, weight_decay=0.1),
    "scion": lambda m, lr: Scion(m.parameters(), lr=lr),
    "soap": lambda m, lr: SOAP(m.parameters(), lr=lr, precondition_frequency=2),
    "lion": lambda m, lr: Lion(m.parameters(), lr=lr, weight_decay=0.1),
    "hybrid_muon": lambda m, lr: build_optimizer(m, lr=lr, adamw_lr=lr, weight_decay=0.1),
    "hybrid_soap_lion": lambda m, lr: build_optimizer(
        m, optimizer="soap", lr=lr, adamw_lr=lr, elementwise="lion"
    ),
    "layerwise": lambda m, lr: LayerwiseDistributedOptimizer(m, lr=lr, weight_decay=0.1),
    "fsdp": lambda m, lr: FSDPOptimizer(m, lr=lr, weight_decay=0.1),
}


def run(build, lr, steps=3, schedule=None):
    m = model()
    opt = build(m, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    for step in range(steps):
        backward(m, step)
        opt.step()
        if sched is not None:
            sched.step()
    return m, opt


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", BUILDS)
def test_tensor_lr_steps_exactly_as_the_float(name, shape):
    ref, _ = run(BUILDS[name], LR)
    got, _ = run(BUILDS[name], torch.full(SHAPES[shape], LR))
    for (n, p), q in zip(got.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}, lr of shape {shape}: {n} differs"
    assert any(not torch.equal(p, q) for p, q in zip(got.parameters(), model().parameters()))


@pytest.mark.parametrize("name", ["muon", "soap", "lion", "hybrid_muon"])
def test_scheduler_changes_a_tensor_lr_as_it_changes_the_float(name):
    def halve(step):
        return 0.5**step

    ref, _ = run(BUILDS[name], LR, schedule=halve)
    got, opt = run(BUILDS[name], torch.tensor([LR]), schedule=halve)
    for (n, p), q in zip(got.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{name}: {n} differs"
    lr = opt.param_groups[0]["lr"]
    assert torch.is_tensor(lr) and float(lr) == LR * 0.5**3


@pytest.mark.parametrize("name", ["muon", "soap", "lion", "hybrid_muon"])
def test_multi_element_tensor_lr_is_refused_naming_lr(name):
    with pytest.raises(ValueError, match=r"lr must be a real number or a 1-element.*\(2,\)"):
        BUILDS[name](model(), torch.tensor([LR, LR]))
