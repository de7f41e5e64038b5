"""The real optimizer code at any world size, on one CPU: `orthoptim plan --dry-run`.

Each simulated rank builds the planner's layout of a model (`plan.model.expand`: the same
parameter names and shapes, experts as 3-D [E, out, in] stacks, only this rank's stage and
its EP rank's experts) as a real `nn.Module` on the **meta** device (tensors with a shape,
a dtype and a device but no memory), joins a fake process group of the layout's size in
which it has that rank, makes the layout's groups as `orthoptim train` makes them
(`ParallelDims.build`: the same rank order, every group on every rank; 0.8 s at 4096 ranks),
and runs the real code: forward, backward, `clip_grad_norm_` and two `step()`s of
`LayerwiseDistributedOptimizer` (Muon, SOAP, or AdamW for every parameter; tensor-parallel
Muon through `TensorParallelOrthogonalizer` in each mode) or `FSDPOptimizer` over FSDP2's
`fully_shard`.

What makes that work:

* The fake process group (torch's `FakeProcessGroup`) is registered for the meta device
  only, so like NCCL it refuses a CPU tensor ("No backend type associated with device type
  cpu"); mixing a meta tensor with a CPU one in an op raises as a device mismatch would on a
  GPU. `collectives.device_for` maps the backend ("meta:...") to the meta device, so the
  library makes its flags and buffers there.
* A dispatch mode (`record.Recorder`) sees every op: it answers host reads (`.item()`,
  `.tolist()`, `bool(t)`, `.cpu()` of a meta tensor) and counts them with the library
  function that made them; it knows the values of small tensors built from host data
  (`torch.tensor([...])`, the agreement flags) and constant tensors (zeros, `isfinite` of
  data, which is all True: a dry run's gradients are finite), and takes every simulated
  rank to hold what this one holds (a sum all-reduce multiplies a known value by the
  group's size), so every read gets the answer a healthy run gets (the library's flags
  count what is wrong: zero, unless a unit has no gradient anywhere); unknown values read
  as zeros; it records every collective (kind, group, dtypes and sizes, the root, and
  the kind `orthoptim.collectives` issued it as) in issue order; and it keeps the live storages
  (each counted once, views included) for the step's peak.
* The steady memory is read off the objects that hold it: parameters, the layer-wise
  bucket buffers, master copies, optimizer state, then gradients; each storage once.

CUDA-only paths: the meta device is not CUDA, so `COVERAGE` lists what this covers (the
assignment priced as on CUDA with Triton SYRK, handed to the optimizer as its `cost`;
Newton-Schulz in bf16 as "auto" picks on CUDA) and what it does not (Triton kernels
themselves, CUDA streams and events, the caching allocator's fragmentation, NCCL's own
buffers).

Modules: `record` (the dispatch mode and what it records), `world` (the fake process group
and torch's patches for the meta device), `model` (the planner's layout as a module), `rank`
(one simulated rank), `report` (`dry_run` and its text).
"""

from __future__ import annotations

from orthoptim.plan.dryrun.model import DescribedModel, build_model, stage_matrices
from orthoptim.plan.dryrun.rank import (
    CATEGORIES,
    DTYPES,
    Parallel,
    RankResult,
    cuda_cost,
    group_mismatches,
    host_syncs_per_step,
    run_isolated,
    run_rank,
)
from orthoptim.plan.dryrun.record import Collective, HostData, Recorder
from orthoptim.plan.dryrun.report import COVERAGE, dry_run, format_dry_run, plan_figures
from orthoptim.plan.dryrun.world import BACKEND, DEVICE, fake_world, register_backend

# the names these had before the dry run became a package (tests import them)
_HostData, _Recorder, _register_backend = HostData, Recorder, register_backend

__all__ = [
    "BACKEND",
    "CATEGORIES",
    "COVERAGE",
    "DEVICE",
    "DTYPES",
    "Collective",
    "DescribedModel",
    "HostData",
    "Parallel",
    "RankResult",
    "Recorder",
    "build_model",
    "cuda_cost",
    "dry_run",
    "fake_world",
    "format_dry_run",
    "group_mismatches",
    "host_syncs_per_step",
    "plan_figures",
    "register_backend",
    "run_isolated",
    "run_rank",
    "stage_matrices",
]
