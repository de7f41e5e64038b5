"""FSDP2 mixed precision (`shard_model(param_dtype=torch.bfloat16)`) under FSDPOptimizer.

The sharded parameters stay fp32 (the masters), forward and backward run on bf16 unsharded
parameters, gradients are reduced in fp32. The reference is one process doing the same
arithmetic by hand: each fp32 master cast to bf16 for the forward, the gradient of each
rank's half-batch (bf16, cast to fp32 on its way back to the master) summed in fp32 and
halved, and single-process `build_optimizer` stepping the fp32 masters.

Why bit-for-bit: both sides round the same values the same way. The cast fp32 → bf16 is
elementwise (shard then cast = cast then gather); each half-batch gradient is the same bf16
computation on the same bf16 weights and inputs, in a process with one thread like the
ranks; a sum of two fp32 values is one rounding whatever the order, and halving (before or
after the sum) is exact. The optimizer sees the same fp32 gradient; FSDPOptimizer's step is
bitwise single-process's on equal gradients (tests/test_fsdp.py's SOAP check; Muon's here).
Any bf16 hop the policy should not have (a bf16 reduction, bf16 masters or state) rounds
some element differently.

Models are tiny: bf16 matmuls are ~50x slower than fp32 on this CPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from orthoptim import build_optimizer
from orthoptim.comm_bytes import CommStats
from orthoptim.parallel.fsdp import FSDPOptimizer, count_fsdp_collectives, shard_model
from orthoptim.shards import local_shard

from distributed import run_ranks

VOCAB, SEQ, WIDTH, BATCH, STEPS = 32, 8, 16, 8, 3
KW = dict(lr=0.02, weight_decay=0.01, adamw_lr=3e-3, adamw_weight_decay=0.01)
BF16 = torch.bfloat16


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.narrow = nn.Linear(d, 5, bias=False)  # 5 rows: uneven shards at 2 ranks

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.ln(x)))) + self.narrow(x).sum(-1, keepdim=True)


class Tiny(nn.Module):
    """Tied embedding / head, two blocks (each wrapped by `shard_model`), a final norm."""

    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(2))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def make_model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def batch(step: int, rank: int, world_size: int):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    per = BATCH // world_size
    idx = idx[rank * per : (rank + 1) * per]
    return idx[:, :-1], idx[:, 1:]


def loss_of(logits, y):
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def reference(world_size: int, steps: int, cast: torch.dtype | None) -> list[dict]:
    """fp32 masters stepped by `build_optimizer`; each rank's half-batch forward on copies of
    the masters cast to `cast` (None: fp32 throughout), its gradient summed into the masters'
    fp32 `.grad` and averaged: data-parallel training with the policy's rounding."""
    model = make_model()
    opt = build_optimizer(model, **KW)
    names = [n for n, _ in model.named_parameters()]  # the tied weight once
    snaps = []
    for step in range(steps):
        for rank in range(world_size):
            x, y = batch(step, rank, world_size)
            params = dict(model.named_parameters())
            if cast is not None:
                params = {n: params[n].to(cast) for n in names}
            loss_of(functional_call(model, params, (x,)), y).backward()
        for p in model.parameters():
            p.grad /= world_size
        opt.step()
        opt.zero_grad()
        snaps.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return snaps


def local(model: nn.Module) -> dict:
    return {n: local_shard(p).detach().clone() for n, p in model.named_parameters()}


def mixed_precision_ranks(rank: int, world_size: int) -> dict:
    out: dict = {}
    if rank == 0:  # in a one-thread rank process: the ranks' kernels, the ranks' rounding
        out["ref"] = reference(world_size, STEPS, BF16)
        out["ref_fp32"] = reference(world_size, STEPS, None)[-1]
    model = shard_model(make_model(), param_dtype=BF16)
    stats = CommStats()
    count_fsdp_collectives(model, stats)
    opt = FSDPOptimizer(model, bucket_mb=0.001, **KW)
    seen: dict = {}
    block = model.blocks[0]
    block.fc.register_forward_hook(lambda m, i, o: seen.update(weight=m.weight.dtype, out=o.dtype))
    out["params"] = []
    for step in range(STEPS):
        stats.reset()
        x, y = batch(step, rank, world_size)
        loss_of(model(x), y).backward()
        if step == 0:
            out["grads"] = {n: (type(p.grad).__name__, p.grad.dtype) for n, p in
                            model.named_parameters()}  # fmt: skip
            out["fsdp_bytes"] = stats.as_dict()
        opt.step()
        opt.zero_grad()
        out["params"].append(local(model))
    out["compute"] = seen
    out["sharded"] = {n: (type(p).__name__, p.dtype) for n, p in model.named_parameters()}
    out["state"] = {
        f"{n}/{k}": v.dtype
        for n, p in model.named_parameters()
        for k, v in opt.state[p].items()
        if torch.is_tensor(v) and v.is_floating_point()
    }
    out["numels"] = {n: local_shard(p).numel() for n, p in model.named_parameters()}
    out["matrices"] = sorted(opt.owner_of)
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(mixed_precision_ranks, 2)


def full(results, step):
    names = results[0]["params"][step].keys()
    return {n: torch.cat([r["params"][step][n] for r in results]) for n in names}


def test_bf16_compute_fp32_masters_match_the_same_rounding_bitwise(runs):
    ref = runs[0]["ref"]
    for step in range(STEPS):
        got = full(runs, step)
        assert got.keys() == ref[step].keys()
        for n in got:
            assert torch.equal(got[n], ref[step][n]), (step, n)
    # The comparison can fail: bf16 compute is not fp32 compute (gradients differ by about
    # bf16's 2^-8 relative; by the last step every parameter shows it) ...
    fp32 = runs[0]["ref_fp32"]
    assert [n for n in fp32 if torch.equal(ref[-1][n], fp32[n])] == []
    # ... and the steps moved every parameter.
    start = {n: p.detach() for n, p in make_model().named_parameters()}
    assert [n for n in start if torch.equal(ref[-1][n], start[n])] == []


def test_dtypes_are_what_the_policy_says(runs):
    for r in runs:
        # Sharded parameters (the masters) and their gradients stay fp32 DTensors.
        assert set(r["sharded"].values()) == {("DTensor", torch.float32)}
        assert set(r["grads"].values()) == {("DTensor", torch.float32)}
        # Forward runs on bf16 unsharded weights.
        assert r["compute"] == {"weight": BF16, "out": BF16}
        # Optimizer state (Muon's momentum, AdamW's moments) is fp32.
        assert r["state"] and set(r["state"].values()) == {torch.float32}, r["state"]
        assert any(k.endswith("momentum_buffer") for k in r["state"])
        assert any(k.endswith("exp_avg_sq") for k in r["state"])
        assert "blocks.0.fc.weight" in r["matrices"]
    # The wire: each FSDP collective moves a padded shard (the largest rank's) per parameter
    # and rank; the all-gathers carry bf16 (2 bytes an element: the root's parameters once,
    # each block's twice, resharded after forward and gathered again for backward), the
    # reduce-scatters fp32 (4 bytes, every parameter once).
    padded = {n: max(r["numels"][n] for r in runs) for n in runs[0]["numels"]}
    root = sum(v for n, v in padded.items() if not n.startswith("blocks."))
    blocks = sum(padded.values()) - root
    for r in runs:
        b = r["fsdp_bytes"]
        assert b["fsdp_all_gather"]["sent"] == 2 * (root + 2 * blocks), b
        assert b["fsdp_reduce_scatter"]["sent"] == 4 * (root + blocks), b


def test_shard_model_rejects_a_non_float_dtype():
    with pytest.raises(ValueError, match="param_dtype must be a torch floating-point dtype"):
        shard_model(make_model(), param_dtype=torch.int8)
    with pytest.raises(TypeError, match="reduce_dtype must be a torch floating-point dtype"):
        shard_model(make_model(), reduce_dtype="fp32")
