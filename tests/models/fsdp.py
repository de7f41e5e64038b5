"""The FSDP tests' model: a tied-embedding GPT with uneven (and, at 4 ranks, empty) shards,
its batches, loss and training loop, and the model sharded with FSDP2 over the world."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, WIDTH, BATCH, STEPS, EXTRA = 50, 8, 24, 8, 10, 2
KW = dict(lr=0.02, weight_decay=0.01, adamw_lr=3e-3, adamw_weight_decay=0.01)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.fc, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        # 3 and 5 rows: uneven shards at 2 ranks, an empty shard at 4.
        self.gate, self.up = nn.Linear(d, 3, bias=False), nn.Linear(3, d, bias=False)
        self.narrow = nn.Linear(d, 5, bias=False)
        self.wide = nn.Linear(5, d, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, 2, C // 2).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        x = x + self.up(torch.tanh(self.gate(x))) + self.wide(torch.tanh(self.narrow(x)))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Tied embedding / head (vocabulary 50: uneven at 4 ranks), norms, biases."""

    def __init__(self, d=WIDTH, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(SEQ, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


def make_model(dtype=torch.float32):
    torch.manual_seed(0)
    return TinyGPT().to(dtype)


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def loss_fn(model, x, y):
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def sharded_model(world_size, dtype=torch.float32):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world_size,))
    model = make_model(dtype)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(model, opt, rank, world_size, steps):
    per = BATCH // world_size
    for step in steps:
        x, y = batch(step)
        loss_fn(
            model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        ).backward()
        opt.step()
        opt.zero_grad()
