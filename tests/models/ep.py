"""The expert-parallel tests' float64 MoE GPT (tiny-moe shrunk), its sizes and tolerance,
and the helpers the expert-parallel checkpoint tests share with them."""

import dataclasses

import torch
from torch import nn

from orthoptim.train.model import CONFIGS, GPT

# tiny-moe shrunk for speed; the balancing loss weighted enough that its gradient matters.
CFG = dataclasses.replace(
    CONFIGS["tiny-moe"],
    n_head=2,
    n_kv_head=1,
    d_model=16,
    seq_len=8,
    vocab_size=64,
    moe=dataclasses.replace(CONFIGS["tiny-moe"].moe, n_expert=8, hidden=16, aux_loss_coef=0.1),
)
BATCH = 2  # sequences per rank
REL = 1e-10  # float64: routing equal, sums in another order (~1e-16 each)


def moe_model(cfg=CFG):
    """The float64 MoE GPT of `cfg`, seeded the same on every rank."""
    torch.manual_seed(0)
    return GPT(cfg).double()


def rel(a, b):
    """The relative error of `a` against `b`."""
    return ((a - b).norm() / b.norm()).item()


OPT_KW = dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.01, ns_dtype=torch.float64)


def state_by_name(sd):
    """A full optimizer dict's state by parameter name."""
    names = {i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    return {names[i]: st for i, st in sd["state"].items()}


class Experts(nn.Module):
    """Dense weights beside one 3-D expert stack [4, 10, 6] (its gate/up rows 5 + 5)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 6, bias=False)
        self.experts = nn.Parameter(torch.randn(4, 10, 6) * 0.3)

    def forward(self, x):
        h = self.inp(x)
        return sum(torch.tanh(h @ self.experts[e].T).pow(2).mean() for e in range(4))


def rank_experts(world_size):
    """One `Experts` per rank: the same dense weights (seed 0), each rank's own experts
    (seeded by its rank), as expert parallelism holds them."""
    out = []
    for r in range(world_size):
        torch.manual_seed(0)
        m = Experts()
        with torch.no_grad():
            m.experts.copy_(
                torch.randn(m.experts.shape, generator=torch.Generator().manual_seed(r))
            )
        out.append(m)
    return out
