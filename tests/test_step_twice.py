"""A second `step()` without a backward in between (issue 56 item 5): the layer-wise driver's
last step used the reduced gradients as its scratch space, so stepping again would move the
weights by garbage. It is refused on every rank with one line, and the weights stay those of
the one step, which equal the single-process optimizer's on the same gradients (float64).
Gradients set by hand between the steps are new gradients, as for torch's optimizers."""

import torch
import torch.nn.functional as F
from tests.distributed import run_ranks
from tests.models.layerwise import BATCH, CONFIGS, batch, make_model

from orthoptim import LayerwiseDistributedOptimizer, build_optimizer
from orthoptim.parallel.base import StepRefusedError


def loss_of(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _twice(rank, world_size):
    model = make_model().double()
    opt = LayerwiseDistributedOptimizer(model, **CONFIGS["hybrid"])
    x, y = batch(0)
    rows = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    loss_of(model, x[rows], y[rows]).backward()
    opt.step()
    opt.wait_for_params()
    once = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        opt.step()
        lines = None
    except StepRefusedError as e:
        lines = e.lines
    opt.wait_for_params()
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), once[n])]
    # a backward makes the next step legal again, and so do gradients set by hand
    loss_of(model, x[rows], y[rows]).backward()
    opt.step()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return lines, moved, once


def test_a_second_step_without_backward_is_refused_on_every_rank_and_moves_nothing():
    results = run_ranks(_twice, 2)
    for lines, moved, _ in results:
        assert lines is not None and len(lines) == 1, lines
        assert "step() was called again without a backward()" in lines[0]
        assert moved == []
    model = make_model().double()
    ref = build_optimizer(model, **CONFIGS["hybrid"])
    x, y = batch(0)
    loss_of(model, x, y).backward()
    ref.step()
    once = results[0][2]
    for n, p in model.named_parameters():
        assert torch.allclose(once[n], p.detach(), rtol=0, atol=1e-12), n
