import copy
import warnings

import pytest
import torch
from torch import nn

from orthoptim import HybridOptimizer, Muon, NonFiniteGradientError, build_optimizer, routing_table

from distributed import run_ranks


class TinyGPT(nn.Module):
    def __init__(self, vocab=50, d=16, tied=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(8, d)
        self.attn = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        q, k, v = self.attn(x).chunk(3, dim=-1)
        x = x + self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
        x = x + self.mlp(self.ln(x))
        return self.lm_head(x) * self.gain


def _loss(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 50, (4, 8), generator=g)
    logits = model(idx)
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), idx[:, 1:].reshape(-1))


@pytest.mark.parametrize("tied", [True, False])
def test_routing_of_small_gpt(tied):
    model = TinyGPT(tied=tied)
    table = routing_table(build_optimizer(model, lr=0.02))
    muon = {"attn.weight", "proj.weight", "mlp.0.weight", "mlp.2.weight"}
    assert {n for n, o in table.items() if o == "muon"} == muon
    adamw = {n for n, o in table.items() if o == "adamw"}
    assert {"wte.weight", "wpe.weight", "attn.bias", "ln.weight", "ln.bias", "gain"} <= adamw
    assert ("lm_head.weight" in adamw) == (not tied)  # tied head is the embedding itself
    assert len(table) == len(list(model.parameters()))


def test_head_detected_by_vocab_size_without_name():
    model = nn.Sequential(nn.Embedding(30, 8), nn.Linear(8, 8), nn.Linear(8, 30))
    table = routing_table(build_optimizer(model))
    assert table["1.weight"] == "muon" and table["2.weight"] == "adamw"


def test_predicate_overrides_routing_and_frozen_skipped():
    model = TinyGPT(tied=False)
    model.proj.weight.requires_grad_(False)
    opt = build_optimizer(model, route=lambda n, p: n == "mlp.0.weight")
    table = routing_table(opt)
    assert [n for n, o in table.items() if o == "muon"] == ["mlp.0.weight"]
    assert "proj.weight" not in table


def test_adamw_baseline_covers_everything():
    model = TinyGPT()
    opt = build_optimizer(model, optimizer="adamw", lr=1e-3)
    assert set(routing_table(opt).values()) == {"adamw"}
    assert opt.param_groups[0]["lr"] == 1e-3


def test_unknown_optimizer_rejected():
    with pytest.raises(ValueError, match="optimizer must be one of"):
        build_optimizer(TinyGPT(), optimizer="lion")


def test_hybrid_step_equals_separate_optimizers():
    model = TinyGPT(tied=False)
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, lr=0.02, adamw_lr=1e-3, weight_decay=0.01)
    route = {n for n, o in routing_table(opt).items() if o == "muon"}
    muon = Muon([p for n, p in ref.named_parameters() if n in route], lr=0.02, weight_decay=0.01)
    adamw = torch.optim.AdamW(
        [p for n, p in ref.named_parameters() if n not in route],
        lr=1e-3,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )
    for step in range(3):
        for m, opts in ((model, [opt]), (ref, [muon, adamw])):
            for o in opts:
                o.zero_grad()
            _loss(m, step).backward()
            for o in opts:
                o.step()
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=n)


def test_loss_falls():
    model = TinyGPT()
    opt = build_optimizer(model, lr=0.02, adamw_lr=3e-3)
    first = None
    for _ in range(30):
        opt.zero_grad()
        loss = _loss(model)
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.7 * first


def test_state_dict_round_trip_and_scheduler():
    torch.manual_seed(0)
    a = TinyGPT()
    opt_a = build_optimizer(a, lr=0.02, adamw_lr=1e-3)
    sched_a = torch.optim.lr_scheduler.LambdaLR(opt_a, lambda s: 1.0 / (1 + s))
    for s in range(3):
        opt_a.zero_grad()
        _loss(a, s).backward()
        opt_a.step()
        sched_a.step()
    b = copy.deepcopy(a)
    opt_b = build_optimizer(b, lr=0.02, adamw_lr=1e-3)
    sched_b = torch.optim.lr_scheduler.LambdaLR(opt_b, lambda s: 1.0 / (1 + s))
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    sched_b.load_state_dict(sched_a.state_dict())
    # the scheduler's LR reached the inner optimizers
    assert opt_b.inner["muon"].param_groups[0]["lr"] == pytest.approx(0.02 / 4)
    for s in range(3, 6):
        for m, o, sc in ((a, opt_a, sched_a), (b, opt_b, sched_b)):
            o.zero_grad()
            _loss(m, s).backward()
            o.step()
            sc.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_load_state_dict_of_other_routing_rejected():
    opt = build_optimizer(TinyGPT(), lr=0.02)
    other = build_optimizer(TinyGPT(), optimizer="adamw")
    with pytest.raises(ValueError, match="routing"):
        opt.load_state_dict(other.state_dict())


@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_nonfinite_policy_covers_adamw_params(policy):
    model = TinyGPT()
    opt = build_optimizer(model, lr=0.02, nonfinite=policy)
    opt.zero_grad()
    _loss(model).backward()
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    params = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    _loss(model, 1).backward()
    model.ln.bias.grad[0] = float("inf")  # an AdamW parameter
    if policy == "raise":
        with pytest.raises(NonFiniteGradientError, match="ln.bias"):
            opt.step()
    else:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            opt.step()
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
    after = opt.state_dict()
    for k, v in before["state"].items():
        for name, t in v.items():
            assert torch.equal(torch.as_tensor(t), torch.as_tensor(after["state"][k][name]))


def test_add_param_group_routes_by_key():
    opt = build_optimizer(TinyGPT(), lr=0.02)
    assert isinstance(opt, HybridOptimizer)
    opt.add_param_group(
        {"params": [nn.Parameter(torch.randn(3, 4))], "param_names": ["extra"], "optimizer": "muon"}
    )
    assert opt.param_groups[-1] is opt.inner["muon"].param_groups[-1]
    with pytest.raises(ValueError, match="'optimizer' key"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "param_names": ["v"]})


def test_bf16_resume_keeps_fp32_state():
    """torch's loader casts state to the parameter dtype; fp32 master state must survive it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16)
    opt = build_optimizer(model, lr=0.02, adamw_lr=1e-3)
    x = torch.randn(4, 8).to(torch.bfloat16)
    for _ in range(2):
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()
    clone = copy.deepcopy(model)
    resumed = build_optimizer(clone, lr=0.02, adamw_lr=1e-3)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, q in zip(model.parameters(), clone.parameters()):
        for key, value in opt.state[p].items():
            assert resumed.state[q][key].dtype == value.dtype, key
    muon_buf = resumed.state[clone[0].weight]["momentum_buffer"]
    assert muon_buf.dtype == torch.float32
    torch.testing.assert_close(
        muon_buf, opt.state[model[0].weight]["momentum_buffer"], rtol=0, atol=0
    )
    for m, o in ((model, opt), (clone, resumed)):
        o.zero_grad()
        m(x).float().pow(2).mean().backward()
        o.step()
    for p, q in zip(model.parameters(), clone.parameters()):
        assert torch.equal(p, q)


def _mixed_adamw(rank, world_size):
    """A tensor-parallel model's non-matrix part: a DTensor embedding beside a plain norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    model = nn.Module()
    model.wte = nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
    model.norm = nn.Parameter(torch.ones(4))
    opt = build_optimizer(model)
    group = opt.inner["adamw"].param_groups[0]
    model.wte.grad = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    model.norm.grad = torch.randn(4)
    opt.step()
    refused = None
    try:  # what torch's CUDA default (foreach) does with that list
        torch.optim.AdamW([model.wte, model.norm], foreach=True).step()
    except RuntimeError as e:
        refused = str(e)
    plain = build_optimizer(nn.Linear(4, 4))
    return group["foreach"], refused, plain.inner["adamw"].param_groups[0]["foreach"]


def test_adamw_over_dtensors_and_plain_tensors_steps_them_one_by_one():
    """torch's foreach AdamW (its default on CUDA) refuses a list mixing DTensors and plain
    tensors, which a tensor-parallel model's AdamW part is: build_optimizer gives such a
    group foreach=False, and leaves torch's default (None) elsewhere."""
    ((mixed, refused, plain),) = run_ranks(_mixed_adamw, 1)
    assert mixed is False and plain is None
    assert refused is not None and "mixed torch.Tensor and DTensor" in refused
