"""The layer-wise tests' model: a tied-embedding GPT with a module no forward uses, its
batches and loss, and the optimizer configurations it runs under."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, BATCH, STEPS = 64, 8, 32, 8, 10


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No qkv bias: the key bias has an exactly-zero gradient (softmax is shift-invariant),
        # and AdamW turns the rounding noise of a zero gradient into full-size steps.
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, 2, C // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Tied embedding / head, 1-D norms and biases, and a module no forward ever uses."""

    def __init__(self, d=WIDTH, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.unused = nn.Linear(d, d)  # never called: no gradient on any rank
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def make_model(seed=0):
    torch.manual_seed(seed)
    return TinyGPT()


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def all_matrices(name, p):
    return p.ndim >= 2


CONFIGS = {
    "muon": dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, route=all_matrices),
    "hybrid": dict(optimizer="muon", lr=0.02, adamw_lr=3e-3, weight_decay=0.01),
    "adamw": dict(optimizer="adamw", lr=3e-3),
    "soap": dict(optimizer="soap", lr=3e-3, adamw_lr=3e-3),
}


def bf16_reference(world_size, steps, make_optimizer):
    """Single process, the same rounding as bf16 parameters over fp32 masters: a bf16 model
    computes each rank's gradient of its part of the batch, their fp32 sum over ranks divided
    by the world size (as the reduction: exact for two bf16 addends) steps fp32 masters with
    `make_optimizer(masters)`, and the masters rounded to bf16 are the next parameters."""
    import copy

    torch.set_num_threads(1)
    model = make_model()
    masters = copy.deepcopy(model)
    model.to(torch.bfloat16)
    opt = make_optimizer(masters)
    per = BATCH // world_size
    for step in range(steps):
        x, y = batch(step)
        grads = None
        for r in range(world_size):
            loss_fn(model, x[r * per : (r + 1) * per], y[r * per : (r + 1) * per]).backward()
            g = [None if p.grad is None else p.grad.float() for p in model.parameters()]
            grads = g if grads is None else [b if a is None else a + b for a, b in zip(grads, g)]
            model.zero_grad()
        for m, g in zip(masters.parameters(), grads):
            m.grad = None if g is None else g / world_size
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters.parameters()):
                p.copy_(m)
    return dict(model.named_parameters()), dict(masters.named_parameters())


def reference_piece(masters, label):
    """The reference master of a unit label: `name`, or a run of a sharded AdamW parameter
    `name{a:b}` (elements a:b of `name`)."""
    import re

    m = re.fullmatch(r"(.+)\{(\d+):(\d+)\}", label)
    if m:
        return masters[m[1]].detach().reshape(-1)[int(m[2]) : int(m[3])]
    return masters[label].detach()
