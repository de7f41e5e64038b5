"""The layer-wise optimizer with optimizer="adamw" and bf16 parameters (what
`orthoptim plan --optimizer adamw --param-dtype bf16` plans): every parameter sharded
element-wise over the ranks, each rank keeping fp32 masters and state of its runs only,
against single-process torch AdamW stepping fp32 masters on the same rounded model.

The fp32 path is `tests/test_zero.py::test_sharded_adamw_equals_single_process` (2 to 4
ranks, float64, 1e-12) and `tests/test_contract.py::test_distributed_paths_equal_single_process`.

Oracle: a bf16 copy of the model computes each rank's gradient of its half of the batch;
their fp32 sum divided by 2 (as the reduction: g0 + g1 is exact in fp32 for bf16 addends,
and halving is exact) steps fp32 masters with torch AdamW, and the masters rounded to bf16
are the next parameters. Every operation is the same on both sides, so the bf16 parameters
and the fp32 masters agree bitwise; a master stepped twice or on another rank's run, a lost
moment or a missed rounding differs at 1e-3 or more.
"""

import torch

from models.layerwise import (
    BATCH,
    CONFIGS,
    batch,
    bf16_reference,
    loss_fn,
    make_model,
    reference_piece,
)
from orthoptim.parallel import LayerwiseDistributedOptimizer

from distributed import run_ranks

STEPS = 3


def _two_ranks(rank, world_size):
    torch.set_num_threads(1)
    model = make_model()
    opt = LayerwiseDistributedOptimizer(
        model, **CONFIGS["adamw"], bucket_mb=0.03, param_dtype=torch.bfloat16
    )
    per = BATCH // world_size
    for step in range(STEPS):
        x, y = batch(step)
        part = slice(rank * per, (rank + 1) * per)
        loss_fn(model, x[part], y[part]).backward()
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()
    state = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return {
        "owners": set(opt.owner_of.values()),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "masters": {n: m.detach().clone() for n, m in opt.masters().items()},
        "state_dtypes": {v.dtype for v in state},
        "state_numel": sum(v.numel() for v in state if v.ndim > 0),
    }


def _adamw(masters):
    """build_optimizer(optimizer="adamw")'s AdamW: betas (0.9, 0.95), no weight decay."""
    return torch.optim.AdamW(
        masters.parameters(), lr=CONFIGS["adamw"]["lr"], betas=(0.9, 0.95), weight_decay=0.0
    )


def test_bf16_adamw_runs_and_masters_equal_single_process_adamw():
    """2 gloo ranks: no unit owned whole (owner -1 for all); bf16 parameters and every fp32
    master equal the reference bitwise after 3 steps; every element has exactly one master,
    and a rank holds fp32 moments of its own runs only (two per master element of every
    parameter that has a gradient: the model's unused module has none)."""
    results = run_ranks(_two_ranks, 2)
    ref_params, ref_masters = bf16_reference(2, STEPS, _adamw)
    moved = ref_params["blocks.0.fc.weight"].float() - make_model().blocks[0].fc.weight
    assert moved.abs().max() > 1e-4  # the optimizer moved the weights
    owned: dict[str, torch.Tensor] = {}
    for res in results:
        assert res["owners"] == {-1}
        assert res["state_dtypes"] <= {torch.float32}, res["state_dtypes"]
        for n, p in res["params"].items():
            assert p.dtype == torch.bfloat16 and torch.equal(p, ref_params[n].detach()), n
        for label, m in res["masters"].items():
            assert label not in owned, f"{label} has two owners"
            owned[label] = m
            assert m.dtype == torch.float32
            assert torch.equal(m, reference_piece(ref_masters, label).view_as(m)), label
        stepped = [m for label, m in res["masters"].items() if not label.startswith("unused.")]
        assert res["state_numel"] == 2 * sum(m.numel() for m in stepped)  # no gradient, no state
    assert sum(m.numel() for m in owned.values()) == sum(p.numel() for p in ref_masters.values())
