"""The small float64 model of the checkpoint tests (embedding tied to the head, a frozen
matrix), its batches and training loop, and an exact comparison of state."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, BATCH = 16, 4, 8, 8
KW = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.01, bucket_mb=0.0005)
HYBRID_KW = {k: v for k, v in KW.items() if k != "bucket_mb"}


class Net(nn.Module):
    """Embedding tied to the head (AdamW), a LayerNorm and biases (AdamW), two hidden
    matrices (Muon), and a frozen matrix that no optimizer holds."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.frozen = nn.Linear(WIDTH, WIDTH, bias=False)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.fc2(F.gelu(self.fc1(self.ln(x)))) + 0.1 * self.frozen(x)
        return self.head(x)


def make_model(seed=0):
    torch.manual_seed(seed)
    return Net().double()


def batch(step, rank=0, world_size=1):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    per = BATCH // world_size
    idx = idx[rank * per : (rank + 1) * per]
    return idx[:, :-1], idx[:, 1:]


def lm_loss(model, step, rank, world_size):
    x, y = batch(step, rank, world_size)
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def train(model, opt, steps, rank=0, world_size=1, loss=lm_loss):
    for step in steps:
        loss(model, step, rank, world_size).backward()
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def every_matrix(name: str, p: nn.Parameter) -> bool:
    return p.ndim >= 2


def same(a, b):
    """Equal values of equal types all the way down (tensors: dtype and every element)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b
