"""One simulated rank: its model and optimizer built on the meta device under the fake
world, a few training steps under the recorder, and what it held, read and sent
(`RankResult`); the cross-rank check of the collectives (`group_mismatches`)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from orthoptim._torch_compat import storage_key, tree_flatten
from orthoptim.comm_bytes import CommStats
from orthoptim.ns_cost import NS_STEPS
from orthoptim.optim.contract import MatrixOptimizer
from orthoptim.parallel.assignment import MatrixCost
from orthoptim.parallel.layerwise.ownership import inner_parts
from orthoptim.plan.dryrun.model import build_model
from orthoptim.plan.dryrun.record import Collective, HostData, Recorder, plain
from orthoptim.plan.dryrun.world import DEVICE, fake_world
from orthoptim.plan.layouts import Layout, check_layout, check_stage
from orthoptim.plan.model import ModelDescription

if TYPE_CHECKING:
    from orthoptim.parallel.layout import ParallelMesh

CATEGORIES = ("params", "grads", "masters", "state", "buffers")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the planner's dtype names
Parallel = Literal["layerwise", "fsdp"]  # the driver: Layout.fsdp


@dataclass
class RankResult:
    """What one simulated rank did and held."""

    rank: int
    world: int
    memory: dict[str, int]
    peak: int
    host_syncs: list[dict[str, int]]  # per step: site → reads
    collectives: list[list[Collective]]  # per step, in issue order
    comm: dict[str, Any]
    expected: dict[str, Any]
    # the last step's bytes counted apart from `comm`: FSDP2's own ("fsdp"), the TP
    # orthogonalizer's ("tp")
    comm_apart: dict[str, Any]
    comm_matches: bool
    bytes_per_step: float
    seconds: float
    plan_index: int
    optimizer: str = "muon"
    notes: list[str] = field(default_factory=list)
    # the peak while the optimizer was built (the model as built, its parameters moving
    # into the buffers), beside the steps' `peak`
    construction: int = 0
    # tensors the rank's inner optimizer steps: "matrix" (a matrix optimizer's), "elementwise"
    stepped: dict[str, int] = field(default_factory=dict)

    @property
    def steady(self) -> int:
        """Bytes held between steps: every category."""
        return sum(self.memory[k] for k in CATEGORIES)


def _category_bytes(opt: Any, model: nn.Module, parallel: Parallel) -> dict[str, int]:
    """Bytes by category of every live meta storage the model and optimizer hold; a storage
    is counted once, in the first category that holds it (params, buffers, masters, state,
    grads). The buckets' flat gradients count as gradients where no `.grad` views them (a
    `.grad` of another dtype is dropped once added into them)."""
    seen: set[int] = set()
    out = dict.fromkeys(CATEGORIES, 0)

    def add(cat: str, t: Any) -> None:
        for x in tree_flatten(t)[0]:
            if isinstance(x, Tensor):
                x = plain(x)
                if x.device.type != "meta":
                    continue
                st = x.untyped_storage()
                if storage_key(st) not in seen:
                    seen.add(storage_key(st))
                    out[cat] += st.nbytes()

    params = list(model.parameters())
    add("params", params)
    rest: list[Tensor] = []
    if parallel == "layerwise":
        held = opt.memory_tensors()
        add("buffers", held["buffers"])
        rest += held["params"] + held["grads"]
        add("masters", held["masters"])
    add("state", [dict(s) for s in opt.state.values()])
    add("grads", [p.grad for p in params] + rest)
    return out


def _comm_check(comm: dict[str, Any], expected: dict[str, Any]) -> bool:
    """Whether the step's bytes and calls per kind equal the layout's (clipping's grad_norm
    all-reduce, which `expected_comm_bytes` leaves out, aside)."""
    kinds = set(comm) - {"total", "grad_norm"}
    if kinds != set(expected):
        return False
    return all(
        math.isclose(comm[k][f], expected[k][f], rel_tol=1e-12, abs_tol=1e-6)
        for k in kinds
        for f in ("sent", "received", "calls")
    )


def cuda_cost(ns_dtype: torch.dtype | str = "auto") -> MatrixCost:
    """The assignment's cost as on the GPU's owners: CUDA with Triton SYRK, Newton-Schulz in
    `ns_dtype` (what `MatrixCost.for_device` gives on a CUDA device with Triton)."""
    return MatrixCost("cuda", ns_dtype, NS_STEPS, triton=True, kernel_mode="auto")


def _optimizer(
    model: nn.Module, layout: Layout, mesh: ParallelMesh
) -> tuple[Any, dict[str, CommStats]]:
    """The layout's optimizer over `model` (layer-wise, its assignment priced as on CUDA, or
    over FSDP2) and the byte counters besides the optimizer's own, by name."""
    from orthoptim.parallel.fsdp import FSDPOptimizer, count_fsdp_collectives, shard_model
    from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
    from orthoptim.parallel.tensor_parallel import TensorParallelOrthogonalizer

    optimizer = layout.optimizer  # check_layout refused the rest
    kwargs: dict[str, Any] = {"bucket_mb": layout.bucket_mb}
    if optimizer == "muon":
        kwargs["ns_dtype"] = torch.bfloat16  # what "auto" picks on CUDA
        kwargs["ns_batch_mb"] = layout.ns_batch_mb  # the stacks' chunks the plan models
    # the model is built in fp32; a lower parameter dtype is the optimizer's (or FSDP2's
    # mixed precision)
    mixed = {}
    apart: dict[str, CommStats] = {}
    if layout.param_dtype != "fp32":
        mixed = {"param_dtype": DTYPES[layout.param_dtype]}
    if layout.fsdp:
        if mixed:
            mixed["reduce_dtype"] = DTYPES[layout.grad_dtype]
        shard_model(model, mesh.fsdp_mesh, **mixed)
        fsdp_stats = CommStats()
        count_fsdp_collectives(model, fsdp_stats)
        apart["fsdp"] = fsdp_stats
        opt = FSDPOptimizer(model, optimizer=optimizer, layout=mesh, **kwargs)
        _foreach_adamw(opt)
        return opt, apart
    if layout.dims.tp > 1:
        kwargs["orthogonalizer"] = TensorParallelOrthogonalizer(
            mode=layout.tp_mode, ns_dtype=torch.bfloat16
        )
        apart["tp"] = kwargs["orthogonalizer"].stats
    if mixed:
        mixed["grad_dtype"] = DTYPES[layout.grad_dtype]
    if layout.gather_dtype is not None:
        kwargs["gather_dtype"] = DTYPES[layout.gather_dtype]
    if layout.reproducible:  # check_layout: the layer-wise driver, data parallelism alone
        kwargs["reproducible"] = True
    if layout.state_dtype != "fp32":  # check_layout: Muon, layer-wise, no TP
        kwargs["state_dtype"] = DTYPES[layout.state_dtype]
    cost = cuda_cost(kwargs.get("ns_dtype", "auto"))
    opt = LayerwiseDistributedOptimizer(
        model, optimizer=optimizer, layout=mesh, split_experts=True, cost=cost, **kwargs, **mixed,
    )  # fmt: skip
    if layout.dims.tp == 1:
        _foreach_adamw(opt)
    return opt, apart


def _foreach_adamw(opt: Any) -> None:
    """AdamW's foreach path, which torch picks for CUDA parameters (on the meta device it steps
    one tensor at a time): the step's square roots of every second moment at once. Not under
    tensor parallelism, where one AdamW holds DTensor and plain parameters, a mix torch's
    foreach ops refuse (`build_optimizer` steps such a group tensor by tensor)."""
    for group in opt.param_groups:
        if group.get("optimizer") == "adamw":
            group["foreach"] = True


@dataclass
class _Steps:
    """What the steps recorded: per step the host reads and the collectives; of the last
    step the memory it starts from, the optimizer's counted and expected bytes and the
    counters apart."""

    reads: list[dict[str, int]] = field(default_factory=list)
    collectives: list[list[Collective]] = field(default_factory=list)
    memory: dict[str, int] = field(default_factory=dict)
    comm: dict[str, Any] = field(default_factory=dict)
    expected: dict[str, Any] = field(default_factory=dict)
    comm_apart: dict[str, Any] = field(default_factory=dict)


def _run_steps(
    rec: Recorder,
    model: nn.Module,
    opt: Any,
    apart: dict[str, CommStats],
    parallel: Parallel,
    steps: int,
    plant: Callable[[], contextlib.AbstractContextManager] | None,
) -> _Steps:
    """`steps` training steps (forward, backward, `clip_grad_norm_`, `step()`), each recorded
    from a fresh peak; inside `plant()` when given."""
    idx = torch.zeros(1, 4, dtype=torch.long, device=DEVICE)
    out = _Steps()
    planted = plant() if plant is not None else contextlib.nullcontext()
    with planted:
        for step in range(steps):
            rec.reads.clear()
            rec.collectives = []
            for stats in apart.values():
                stats.reset()
            rec.reset_peak()
            model(idx).backward()
            opt.clip_grad_norm_(1.0)
            if step == steps - 1:
                # what the step starts from: every local gradient still autograd's (the
                # step re-points the owned ones at views of the buckets), the state of
                # the steps before
                out.memory = _category_bytes(opt, model, parallel)
            opt.step()
            out.reads.append(dict(rec.reads))
            out.collectives.append(rec.collectives)
            if step == steps - 1:
                out.comm, out.expected = opt.comm_stats(), opt.expected_comm_bytes()
                out.comm_apart = {k: stats.as_dict() for k, stats in apart.items()}
            opt.zero_grad()
    return out


def run_rank(
    desc: ModelDescription,
    layout: Layout,
    rank: int,
    stage: int = 0,
    steps: int = 2,
    plant: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> RankResult:
    """Simulate `rank` (of the dp × tp ranks of pipeline stage `stage`) of `layout`: build its
    model and optimizer on the meta device under a fake process group, run `steps` training
    steps (forward, backward, `clip_grad_norm_`, `step()`), and report what it held, read and
    sent. `plant` (tests) wraps the steps in a context manager that breaks something."""
    check_layout(desc, layout)
    dims = layout.dims
    dp, tp, pp = dims.dp, dims.tp, dims.pp
    check_stage(stage, pp)
    if not 0 <= rank < dp * tp:
        raise ValueError(f"--rank {rank} must be in [0, {dp * tp}) (dp {dp} x tp {tp})")
    parallel: Parallel = "fsdp" if layout.fsdp else "layerwise"
    grank = dims.rank_of(stage, rank // tp, rank % tp)
    t0 = time.perf_counter()
    rec = Recorder()
    with fake_world(grank, dims.world), rec, HostData(rec):
        # every group of the layout, made as `orthoptim train` makes them
        mesh = dims.build("meta")
        model = build_model(desc, layout, stage, tp_mesh=mesh.tp_mesh if tp > 1 else None)
        rec.reset_peak()
        opt, apart = _optimizer(model, layout, mesh)
        construction = rec.peak
        rec.reads.clear()
        run = _run_steps(rec, model, opt, apart, parallel, steps, plant)
        peak = rec.peak
    kinds = ("reduce_scatter", "all_gather", "reduce", "broadcast", "all_to_all", "ordered_reduce")
    sent = sum(run.comm.get(k, {}).get("sent", 0.0) for k in kinds)
    received = sum(run.comm.get(k, {}).get("received", 0.0) for k in kinds)
    orth = getattr(opt, "inner", None)
    return RankResult(
        rank=grank,
        world=dims.world,
        memory=run.memory,
        peak=peak,
        host_syncs=run.reads,
        collectives=run.collectives,
        comm=run.comm,
        expected=run.expected,
        comm_apart=run.comm_apart,
        comm_matches=_comm_check(run.comm, run.expected),
        bytes_per_step=max(sent, received),
        seconds=time.perf_counter() - t0,
        plan_index=stage * dp + mesh.coord.dp,
        optimizer=layout.optimizer,
        notes=[] if orth is not None or parallel == "fsdp" else ["owns nothing"],
        construction=construction,
        stepped=stepped_tensors(orth),
    )


def stepped_tensors(inner: Any) -> dict[str, int]:
    """Tensors an inner optimizer steps (`inner_parts`): "matrix", those of its matrix
    optimizer, and "elementwise", the rest (what `plan.steptime` prices per tensor)."""
    out = {"matrix": 0, "elementwise": 0}
    for part in inner_parts(inner):
        kind = "matrix" if isinstance(part, MatrixOptimizer) else "elementwise"
        out[kind] += sum(len(g["params"]) for g in part.param_groups)
    return out


def run_isolated(*args: Any, **kwargs: Any) -> RankResult:
    """`run_rank` in a fresh (spawned) process. Tensor-parallel runs need one: a second
    DTensor mesh in one process fails to resolve its process groups by name after the first
    fake world is torn down (torch 2.13)."""
    import concurrent.futures
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        return pool.submit(run_rank, *args, **kwargs).result()


def group_mismatches(a: RankResult, b: RankResult) -> list[str]:
    """Where two ranks' collectives on a group they both belong to differ (a mismatch hangs
    NCCL): per step and group, the sequences of (kind, dtypes, shapes); and all-to-all
    splits that do not pair up (what a sends b must be what b expects from a)."""
    problems = []
    for step, (sa, sb) in enumerate(zip(a.collectives, b.collectives, strict=True)):
        groups = {c.group for c in sa} & {c.group for c in sb}
        for g in sorted(groups):
            qa = [c for c in sa if c.group == g]
            qb = [c for c in sb if c.group == g]
            if [c.signature() for c in qa] != [c.signature() for c in qb]:
                problems.append(
                    f"step {step + 1}: ranks {a.rank} and {b.rank} issue different collectives "
                    f"on the group of {len(g)} ranks {g[:4]}...: {len(qa)} vs {len(qb)} calls"
                )
                continue
            ga, gb = g.index(a.rank), g.index(b.rank)
            for ca, cb in zip(qa, qb):
                if len(ca.splits) == 2 and len(cb.splits) == 2:
                    out_a, in_a = ca.splits
                    out_b, in_b = cb.splits
                    if in_a[gb] != out_b[ga] or in_b[ga] != out_a[gb]:
                        problems.append(
                            f"step {step + 1}: all-to-all splits of ranks {a.rank} and "
                            f"{b.rank} do not pair up"
                        )
    return problems


def host_syncs_per_step(r: RankResult) -> int:
    """Host reads of the last simulated step (the first builds state and warms up)."""
    return sum(r.host_syncs[-1].values())
