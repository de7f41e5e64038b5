"""Bad arguments fail at construction, with a message naming the argument, the bad value and
what is allowed: one table over every public constructor and entry point (single process),
and one 2-rank run for process groups this rank is not in.
"""

import math

import pytest
import torch
from torch import nn

from orthoptim import (
    SOAP,
    FSDPOptimizer,
    HybridOptimizer,
    LayerwiseDistributedOptimizer,
    Muon,
    build_optimizer,
    newton_schulz,
)
from orthoptim import checkpoint as ckpt
from orthoptim.optim.muon import lr_scale_factor
from orthoptim.parallel import TensorParallelOrthogonalizer

from distributed import run_ranks


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))


def W():
    return [nn.Parameter(torch.randn(4, 4))]


class _SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8, sparse=True)
        self.proj = nn.Linear(8, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(x)).square().sum()


NAN = float("nan")
# (what, call, exception, words the message must contain: the argument, the bad value and,
# for a name chosen from a list, an allowed one)
CASES = [
    ("Muon lr<0", lambda: Muon(W(), lr=-1.0), ValueError, ["lr", "-1.0", ">= 0"]),
    ("Muon lr=nan", lambda: Muon(W(), lr=NAN), ValueError, ["lr", "nan"]),
    ("Muon lr=inf", lambda: Muon(W(), lr=math.inf), ValueError, ["lr", "inf"]),
    ("Muon lr str", lambda: Muon(W(), lr="0.1"), TypeError, ["lr", "'0.1'"]),
    ("Muon wd<0", lambda: Muon(W(), weight_decay=-0.1), ValueError, ["weight_decay", "-0.1"]),
    ("Muon momentum=1", lambda: Muon(W(), momentum=1.0), ValueError, ["momentum", "1.0", "[0, 1)"]),
    ("Muon momentum<0", lambda: Muon(W(), momentum=-0.5), ValueError, ["momentum", "-0.5"]),
    ("Muon ns_steps=0", lambda: Muon(W(), ns_steps=0), ValueError, ["ns_steps", "0", ">= 1"]),
    ("Muon ns_steps=2.0", lambda: Muon(W(), ns_steps=2.0), ValueError, ["ns_steps", "2.0"]),
    ("Muon coefficients", lambda: Muon(W(), coefficients="quintik"), ValueError,
     ["coefficients", "'quintik'", "quintic"]),
    ("Muon lr_scale", lambda: Muon(W(), lr_scale="keler"), ValueError,
     ["lr_scale", "'keler'", "keller"]),
    ("Muon nonfinite", lambda: Muon(W(), nonfinite="ignore"), ValueError,
     ["nonfinite", "'ignore'", "skip"]),
    ("Muon eps=0", lambda: Muon(W(), eps=0.0), ValueError, ["eps", "0.0", "> 0"]),
    ("Muon ns_dtype", lambda: Muon(W(), ns_dtype=torch.int32), ValueError,
     ["ns_dtype", "int32", "floating"]),
    ("Muon ns_dtype str", lambda: Muon(W(), ns_dtype="Auto"), ValueError,
     ["ns_dtype", "'Auto'", "'auto'", "floating"]),
    ("Muon ns_dtype bf16", lambda: Muon(W(), ns_dtype="bf16"), ValueError,
     ["ns_dtype", "'bf16'", "'auto'", "torch.bfloat16"]),
    ("Muon ns_dtype type", lambda: Muon(W(), ns_dtype=16), TypeError, ["ns_dtype", "16", "'auto'"]),
    ("Muon group ns_dtype", lambda: Muon(W()).add_param_group(
        {"params": W(), "ns_dtype": "fp32"}), ValueError, ["ns_dtype", "'fp32'", "'auto'"]),
    ("Muon orthogonalizer", lambda: Muon(W(), orthogonalizer=3), TypeError, ["orthogonalizer"]),
    ("lr_scale_factor", lambda: lr_scale_factor("spectrl", 2, 2), ValueError,
     ["lr_scale", "'spectrl'", "spectral"]),
    ("SOAP lr<0", lambda: SOAP(W(), lr=-1.0), ValueError, ["lr", "-1.0"]),
    ("SOAP betas", lambda: SOAP(W(), betas=(0.9, 1.0)), ValueError, ["betas[1]", "1.0", "[0, 1)"]),
    ("SOAP wd<0", lambda: SOAP(W(), weight_decay=-1.0), ValueError, ["weight_decay", "-1.0"]),
    ("SOAP frequency", lambda: SOAP(W(), precondition_frequency=0), ValueError,
     ["precondition_frequency", "0", ">= 1"]),
    ("SOAP refresh", lambda: SOAP(W(), refresh_method="svd"), ValueError,
     ["refresh_method", "'svd'", "qr"]),
    ("SOAP nonfinite", lambda: SOAP(W(), nonfinite="warn"), ValueError, ["nonfinite", "'warn'"]),
    ("build optimizer", lambda: build_optimizer(model(), optimizer="mun"), ValueError,
     ["optimizer", "'mun'", "muon"]),
    ("build lr<0", lambda: build_optimizer(model(), lr=-0.1), ValueError, ["lr", "-0.1"]),
    ("build adamw_lr", lambda: build_optimizer(model(), adamw_lr=NAN), ValueError,
     ["adamw_lr", "nan"]),
    ("build adamw_wd", lambda: build_optimizer(model(), adamw_weight_decay=-1.0), ValueError,
     ["adamw_weight_decay", "-1.0"]),
    ("build adamw_betas", lambda: build_optimizer(model(), adamw_betas=(1.0, 0.9)), ValueError,
     ["adamw_betas[0]", "1.0", "[0, 1)"]),
    ("build momentum", lambda: build_optimizer(model(), momentum=1.5), ValueError,
     ["momentum", "1.5"]),
    ("build ns_steps", lambda: build_optimizer(model(), ns_steps=0), ValueError, ["ns_steps"]),
    ("build lr_scale", lambda: build_optimizer(model(), lr_scale="x"), ValueError,
     ["lr_scale", "'x'", "keller"]),
    ("build nonfinite", lambda: build_optimizer(model(), nonfinite="nan"), ValueError,
     ["nonfinite", "'nan'", "raise"]),
    ("build ns_dtype", lambda: build_optimizer(model(), ns_dtype="cuda"), ValueError,
     ["ns_dtype", "'cuda'", "'auto'"]),
    ("build route", lambda: build_optimizer(model(), route="matrices"), TypeError, ["route"]),
    ("hybrid empty", lambda: HybridOptimizer({}), ValueError, ["inner", "{}"]),
    ("hybrid not optimizer", lambda: HybridOptimizer({"muon": 3}), TypeError,
     ["inner['muon']", "int"]),
    ("hybrid nonfinite", lambda: HybridOptimizer(
        {"muon": Muon(W())}, nonfinite="Raise"), ValueError, ["nonfinite", "'Raise'", "raise"]),
    ("layerwise model", lambda: LayerwiseDistributedOptimizer("net"), TypeError, ["model", "str"]),
    ("layerwise balance", lambda: LayerwiseDistributedOptimizer(model(), balance="greedy"),
     ValueError, ["balance", "'greedy'", "round_robin"]),
    ("layerwise bucket_mb", lambda: LayerwiseDistributedOptimizer(model(), bucket_mb=0),
     ValueError, ["bucket_mb", "0", "> 0"]),
    ("layerwise gather_dtype", lambda: LayerwiseDistributedOptimizer(
        model(), gather_dtype=torch.int8), ValueError, ["gather_dtype", "int8"]),
    ("layerwise state_dict_to", lambda: LayerwiseDistributedOptimizer(
        model(), state_dict_to="rank1"), ValueError, ["state_dict_to", "'rank1'", "rank0"]),
    ("layerwise lr", lambda: LayerwiseDistributedOptimizer(model(), lr=-1.0), ValueError,
     ["lr", "-1.0"]),
    ("layerwise momentum", lambda: LayerwiseDistributedOptimizer(model(), momentum=1.0),
     ValueError, ["momentum", "[0, 1)"]),
    ("layerwise coefficients", lambda: LayerwiseDistributedOptimizer(
        model(), coefficients="polar"), ValueError, ["coefficients", "'polar'", "polar_express"]),
    ("layerwise nonfinite", lambda: LayerwiseDistributedOptimizer(model(), nonfinite="skp"),
     ValueError, ["nonfinite", "'skp'", "skip"]),
    ("layerwise ns_dtype", lambda: LayerwiseDistributedOptimizer(model(), ns_dtype="float32"),
     ValueError, ["ns_dtype", "'float32'", "'auto'"]),
    ("layerwise optimizer", lambda: LayerwiseDistributedOptimizer(model(), optimizer="sgd"),
     ValueError, ["optimizer", "'sgd'", "soap"]),
    ("fsdp optimizer", lambda: FSDPOptimizer(model(), optimizer="sgd"), ValueError,
     ["optimizer", "'sgd'", "soap"]),
    ("fsdp balance", lambda: FSDPOptimizer(model(), balance="lpt"), ValueError,
     ["balance", "'lpt'", "cost"]),
    ("fsdp bucket_mb", lambda: FSDPOptimizer(model(), bucket_mb=-1), ValueError,
     ["bucket_mb", "-1"]),
    ("fsdp comm_dtype", lambda: FSDPOptimizer(model(), comm_dtype=torch.int32), ValueError,
     ["comm_dtype", "int32"]),
    ("fsdp state_dict_to", lambda: FSDPOptimizer(model(), state_dict_to="0"), ValueError,
     ["state_dict_to", "'0'", "all"]),
    ("fsdp lr", lambda: FSDPOptimizer(model(), lr=NAN), ValueError, ["lr", "nan"]),
    ("fsdp sparse embedding", lambda: FSDPOptimizer(_SparseEmbedding()), ValueError,
     ["FSDPOptimizer: emb is an Embedding with sparse=True", "sparse=False"]),
    ("fsdp ns_dtype", lambda: FSDPOptimizer(model(), ns_dtype="half"), ValueError,
     ["ns_dtype", "'half'", "'auto'"]),
    ("fsdp weight_decay", lambda: FSDPOptimizer(model(), weight_decay=-1.0), ValueError,
     ["weight_decay", "-1.0"]),
    ("tp mode", lambda: TensorParallelOrthogonalizer(mode="distribute"), ValueError,
     ["mode", "'distribute'", "distributed"]),
    ("tp form", lambda: TensorParallelOrthogonalizer(form="both"), ValueError,
     ["form", "'both'", "auto"]),
    ("tp steps", lambda: TensorParallelOrthogonalizer(steps=0), ValueError, ["steps", "0"]),
    ("tp coefficients", lambda: TensorParallelOrthogonalizer(coefficients="cubik"), ValueError,
     ["coefficients", "'cubik'", "cubic"]),
    ("tp eps", lambda: TensorParallelOrthogonalizer(eps=-1.0), ValueError, ["eps", "-1.0"]),
    ("tp ns_dtype", lambda: TensorParallelOrthogonalizer(ns_dtype=torch.int64), ValueError,
     ["ns_dtype", "int64"]),
    ("tp ns_dtype str", lambda: TensorParallelOrthogonalizer(ns_dtype="automatic"), ValueError,
     ["ns_dtype", "'automatic'", "'auto'"]),
    ("ns steps", lambda: newton_schulz(torch.randn(3, 3), steps=0), ValueError,
     ["steps", "0", ">= 1"]),
    ("ns coefficients", lambda: newton_schulz(torch.randn(3, 3), coefficients="simpel"),
     ValueError, ["coefficients", "'simpel'", "simple"]),
    ("ns eps", lambda: newton_schulz(torch.randn(3, 3), eps=0.0), ValueError, ["eps", "0.0"]),
    ("ns dtype", lambda: newton_schulz(torch.randn(3, 3), dtype=torch.int32), ValueError,
     ["dtype", "int32"]),
    ("ns dtype str", lambda: newton_schulz(torch.randn(3, 3), dtype="bfloat16"), ValueError,
     ["dtype", "'bfloat16'", "'auto'"]),
    ("ckpt full opt", lambda: ckpt.full_state_dict(model()), TypeError, ["opt", "Sequential"]),
    ("ckpt sharded opt", lambda: ckpt.sharded_state_dict({}), TypeError, ["opt", "dict"]),
    ("ckpt save opt", lambda: ckpt.save_sharded("/nonexistent/x", None), TypeError,
     ["opt", "NoneType"]),
    ("ckpt load empty", lambda: ckpt.load_full_state_dict(build_optimizer(model()), {}),
     ValueError, ["state_dict", "{}", "rank0"]),
    ("ckpt load local", lambda: LayerwiseDistributedOptimizer(model()).load_state_dict(
        {"state": {}, "param_groups": [{"lr": 0.1}]}), ValueError, ["state_dict", "'params'"]),
]  # fmt: skip


@pytest.mark.parametrize(("call", "exc", "needles"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_bad_argument_is_named(call, exc, needles):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


SPARSE_CASES = {
    "muon": lambda m: Muon([m.emb.weight, m.proj.weight], lr=0.01),
    **{
        name: lambda m, name=name: build_optimizer(m, optimizer=name, lr=0.01)
        for name in ("muon", "adamw", "soap", "normuon", "scion")
    },
    "lion": lambda m: build_optimizer(m, lr=0.01, elementwise="lion"),
    "layerwise": lambda m: LayerwiseDistributedOptimizer(m, lr=0.01),
    "layerwise, reduced in step": lambda m: LayerwiseDistributedOptimizer(
        m, lr=0.01, overlap_grad_reduce=False
    ),
}


@pytest.mark.parametrize("make", list(SPARSE_CASES.values()), ids=list(SPARSE_CASES))
def test_sparse_gradient_is_refused_naming_the_parameter(make):
    """A sparse gradient used to fail with torch's "Could not run 'aten::ne.Scalar' with
    arguments from the 'SparseCPU' backend", naming no parameter."""
    m = _SparseEmbedding()
    opt = make(m)
    before = m.emb.weight.detach().clone()
    with pytest.raises(ValueError, match="sparse") as info:
        m(torch.tensor([1, 2, 3])).backward()  # the layer-wise gradient hook may refuse here
        opt.step()
    msg = str(info.value)
    name = "param_groups[0]['params'][0]" if isinstance(opt, Muon) else "emb.weight"
    assert name in msg and "take dense gradients only" in msg and "sparse=False" in msg, msg
    assert torch.equal(m.emb.weight, before)


def _outside_group(rank, world_size):
    """Rank 1 passes a group holding rank 0 only: refused, naming the argument."""
    import torch.distributed as dist

    group = dist.new_group([0])
    errors = {}
    if rank == 0:  # a member: accepted
        LayerwiseDistributedOptimizer(model(), process_group=group)
        TensorParallelOrthogonalizer(group=group)
        return errors
    for what, call in (
        ("layerwise", lambda: LayerwiseDistributedOptimizer(model(), process_group=group)),
        ("tp", lambda: TensorParallelOrthogonalizer(group=group)),
    ):
        try:
            call()
        except ValueError as e:
            errors[what] = str(e)
    return errors


def test_process_group_without_this_rank_is_refused():
    r = run_ranks(_outside_group, 2)
    assert r[0] == {}
    assert "process_group" in r[1]["layerwise"] and "global rank 1" in r[1]["layerwise"]
    assert "group" in r[1]["tp"] and "not a member" in r[1]["tp"]
