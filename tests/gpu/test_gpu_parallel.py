"""Expert and pipeline parallelism at 2 ranks sharing one GPU, against the single-process
model on the same device (computed inside rank 0), in ONE spawned run:

- `--ep 2`: tokens dispatched to the rank holding their expert by all-to-all (the counts
  exchanged first, on the device); the mean loss and every gradient (experts' summed over
  the ep group, divided by dp) equal the single-process model's on the global batch;
- `--pp 2`: a 1F1B pipeline of 2 micro-batches over the same ranks; its loss (on both
  stages) and each stage's gradients equal the single-process model's.

float32 models (the dispatch and the pipeline sum in another order than one process:
~1e-7 relative per operation; 1e-5 bounds a forward and backward of 2 layers).
"""

from __future__ import annotations

import pytest
import torch

from orthoptim.train.model import GPT, GPTConfig, MoEConfig

from ._models import WORLD, assert_close_rel, setup_rank, spawn, to_cpu

F32_RTOL = 1e-5
CFG = GPTConfig(
    n_layer=2, n_head=4, n_kv_head=2, d_model=32, seq_len=16, fused=True,
    moe=MoEConfig(n_expert=4, top_k=2, hidden=32),
)  # fmt: skip
BATCH = 4  # sequences per rank


def _model(device: str) -> GPT:
    torch.manual_seed(0)
    return GPT(CFG).to(device)


def _batch(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    idx = torch.randint(0, CFG.vocab_size, (BATCH * WORLD, CFG.seq_len + 1), generator=g)
    idx = idx.to(device)
    return idx[:, :-1], idx[:, 1:]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _ranks(rank: int, world: int, device: str) -> dict:
    from orthoptim import collectives as C
    from orthoptim.parallel.layout import ParallelDims
    from orthoptim.train.model import expert_parallelize
    from orthoptim.train.pipeline import PipelineRunner, split_stage

    setup_rank(device)
    x, y = _batch(device)
    mine = slice(rank * BATCH, (rank + 1) * BATCH)
    out: dict = {}
    if rank == 0:  # the single-process reference, on the same device
        ref = _model(device)
        loss = ref(x, y)
        loss.backward()
        out["ref_loss"], out["ref_grads"] = loss.item(), _grads(ref)
        ref.zero_grad()
        half = ref(x[:BATCH], y[:BATCH])  # the batch the pipeline below trains on
        half.backward()
        out["ref_half_loss"], out["ref_half_grads"] = half.item(), _grads(ref)
    # expert parallelism: ep 2 over dp 2
    mesh = ParallelDims.for_world(world, ep=2).build(torch.device(device).type)
    model = expert_parallelize(_model(device), mesh.ep_group, mesh.coord.ep, 2, mesh.dp_group)
    loss = model(x[mine], y[mine])
    loss.backward()
    total = torch.tensor([loss.item()], device=device)
    C.all_reduce(total, group=mesh.dp_group)
    out["ep_loss"] = total.item() / world
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if "experts_" not in name:  # dense: averaged over dp; experts: summed by the dispatch
            C.all_reduce(g, group=mesh.dp_group)
        grads[name] = g / world
    out["ep_grads"], out["ep_slices"] = grads, model.expert_parallel_slices()
    # pipeline parallelism: pp 2, rank r holds stage r; each stage sees the first rank's batch
    dims = ParallelDims.for_world(world, pp=2)
    pipe = dims.build(torch.device(device).type)
    stage = split_stage(_model(device), 2, pipe.coord.pp)
    runner = PipelineRunner(stage, pipe, n_microbatches=2, schedule="1f1b", device=device)
    out["pp_loss"] = runner.step(x[:BATCH], y[:BATCH])
    out["pp_grads"] = _grads(stage)
    return to_cpu(out)


@pytest.fixture(scope="module")
def runs(env):
    return spawn(env, _ranks)


def test_expert_parallel_dispatch_matches_one_device(runs):
    ref = runs[0]
    for r in runs:
        assert abs(r["ep_loss"] - ref["ref_loss"]) <= F32_RTOL * abs(ref["ref_loss"])
        want = {}
        for name, g in ref["ref_grads"].items():
            lo, hi, _ = r["ep_slices"].get(name, (0, g.shape[0] if g.ndim else 1, 0))
            want[name] = g[lo:hi] if name in r["ep_slices"] else g
        assert_close_rel(r["ep_grads"], want, F32_RTOL, "ep 2 gradients")


def test_pipeline_matches_one_device(runs):
    ref = runs[0]
    for r in runs:
        assert abs(r["pp_loss"] - ref["ref_half_loss"]) <= F32_RTOL * abs(ref["ref_half_loss"])
        want = {n: ref["ref_half_grads"][n] for n in r["pp_grads"]}
        assert_close_rel(r["pp_grads"], want, F32_RTOL, "pp 2 gradients")
    names = [n for r in runs for n in r["pp_grads"]]
    assert sorted(names) == sorted(ref["ref_half_grads"])  # the stages partition the model
