"""`orthoptim bench calibrate --out hw.json`: this machine as a hardware profile for `plan`.

At each group size of `--nproc` it starts that many ranks (gloo on CPU; NCCL on CUDA when
every rank has a GPU of its own) and times each collective the planner prices, through
`orthoptim.collectives`: all_reduce, all_gather, reduce_scatter and all_to_all, on a tiny
message (one element per rank: the latency) and a large one (the bandwidth: the bytes a rank
sends, as `comm_bytes` counts them, over the time beyond the latency). On one group
(`compute_group`: on a GPU the largest, on a CPU the largest whose ranks fit its cores)
every rank also times, at once, matmuls per dtype and shape class (square, the Gram product
X·Xᵀ of a wide X that Newton-Schulz iterates on, small), a large elementwise add (bytes
read and written per second), the forward and backward of a transformer (`MODEL`: the
saved-activation bytes it gets through beside its flops, `activation_gb_per_s`) and the
layer-wise optimizer's step on many small matrices (its fixed cost per tensor,
`optimizer_us_per_tensor`), so a compute figure is one rank's share of the machine while
that many ranks work. Every figure is the median of `--repeats` on the slowest rank.

The profile has the keys of the shipped ones (`orthoptim.plan.hardware`), so
`orthoptim plan --hardware hw.json` takes it; its `sources` mark each figure "measured <date>"
with torch, backend, device and ranks, or say why it is not (no inter-node link on one
machine; the model's MFU, which needs a training run).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import torch
import torch.distributed as dist

from orthoptim import collectives as C
from orthoptim.bench import parse_sizes, synchronize
from orthoptim.bench.dist import spawn_gloo
from orthoptim.comm_bytes import CommStats
from orthoptim.plan.hardware import (
    CollectiveKind,
    Hardware,
    MatmulDtype,
    MatmulShape,
    TensorKind,
    load_hardware,
)

Backend = Literal["auto", "gloo", "nccl"]
# the matmul classes timed on random matrices; "linear" is timed on the transformer's shapes
SyntheticShape = Literal["square", "gram", "small"]
TORCH_DTYPES: dict[MatmulDtype, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
}
# The side n of the square class per device and dtype; gram is an (n/2)×2n X times Xᵀ (the same
# flops), small an (n/8)³ product. bf16 on CPUs without native bf16 runs ~50x slower than fp32
# (MACHINE_NOTES: 0.9 vs 60-150 GFLOP/s at 1024²), so its shapes stay small there.
MATMUL_SIDE: dict[str, dict[MatmulDtype, int]] = {
    "cpu": {"fp32": 1024, "bf16": 256},
    "cuda": {"fp32": 8192, "bf16": 8192},
}
# Bytes of each tensor of the elementwise add (past the caches on a CPU) and of the large
# collective message: on a CPU the size a small model's step sends (gloo's cost per byte
# there is several times its cost at 16 MiB), on a GPU large enough to reach the link's
# bandwidth.
ELEMENTWISE_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}
MESSAGE_BYTES = {"cpu": 1 << 20, "cuda": 256 << 20}
# the side of the square fp32 matmul each timed collective follows (`compute_chunk`), per device,
# and how many (matmul, collective) pairs one timed call runs back to back
CHUNK_SIDE = {"cpu": 384, "cuda": 4096}
CHUNK_CALLS = 8
QUICK = 4  # --quick divides the matmul sides by this and the byte sizes by its cube
# The transformer whose forward and backward measures `activation_gb_per_s`, per device:
# (orthoptim train's config, sequences), its dtype the device's (fp32 on CPU, bf16 on CUDA).
# Not the `tiny` config `orthoptim bench plan` checks the model on: the figure is to carry.
MODEL: dict[str, tuple[str, int]] = {"cpu": ("small", 1), "cuda": ("base", 8)}
MODEL_DTYPE: dict[str, MatmulDtype] = {"cpu": "fp32", "cuda": "bf16"}
# Tensors of the optimizer-step measurement (`step_items`): many small ones, so the step's
# fixed cost per tensor is what it times; and a few large ones per device (count, side),
# for its cost per element.
STEP_TENSORS, STEP_SIDE = 32, 16
# The split linear layers of the tensor-parallel measurement (`tp_items`): this many, each
# TP_SIDE × ranks wide, on TP_SIDE tokens (the all-reduce's bytes negligible)
TP_LINEARS, TP_SIDE = 16, 16
STEP_LARGE: dict[str, tuple[int, int]] = {"cpu": (4, 512), "cuda": (4, 4096)}
# the model's MFU is not a property a microbenchmark sees: the shipped profiles' figure
ASSUMED_MODEL_MFU = 0.4


@dataclass(frozen=True)
class Sizes:
    """What one calibration times: the square side per dtype, the elementwise tensor bytes
    and the large collective message bytes."""

    side: dict[MatmulDtype, int]
    elementwise_bytes: int
    message_bytes: int

    @classmethod
    def of(cls, device_type: str, quick: bool) -> Sizes:
        """The defaults of `device_type` ("cpu" or "cuda"), scaled down with `quick`."""
        scale = QUICK if quick else 1
        return cls(
            side={d: max(16, s // scale) for d, s in MATMUL_SIDE[device_type].items()},
            elementwise_bytes=ELEMENTWISE_BYTES[device_type] // scale**3,
            message_bytes=MESSAGE_BYTES[device_type] // scale**3,
        )


def matmul_dims(shape: SyntheticShape, side: int) -> tuple[int, int, int]:
    """(m, k, n) of an m×k · k×n product of the class `shape` at square side `side`."""
    if shape == "square":
        return side, side, side
    if shape == "gram":
        return side // 2, 2 * side, side // 2
    return (max(1, side // 8),) * 3


@dataclass(frozen=True)
class Timed:
    """One thing calibrate times: `fn()`, with `setup()` (untimed) before each call."""

    fn: Callable[[], object]
    setup: Callable[[], object] | None = None


def timed_rounds(items: dict[str, Timed], repeats: int, device: torch.device) -> dict[str, float]:
    """Median seconds of each item over `repeats` rounds, one untimed call of each first:
    every round times every item once, in turn (a load that comes and goes falls on them
    alike), every rank of the group starting each call together (a barrier)."""
    samples: dict[str, list[float]] = {name: [] for name in items}
    for r in range(repeats + 1):
        for name, item in items.items():
            seconds = timed_once(item, device)
            if r:
                samples[name].append(seconds)
    return {name: statistics.median(s) for name, s in samples.items()}


def timed_once(item: Timed, device: torch.device) -> float:
    """Seconds of one call of `item` (its setup untimed before it), every rank of the group
    starting it together (a barrier)."""
    if item.setup is not None:
        item.setup()
    C.barrier()
    synchronize(device)
    start = time.perf_counter()
    item.fn()
    synchronize(device)
    return time.perf_counter() - start


def compute_items(sizes: Sizes, device: torch.device) -> dict[str, Timed]:
    """The calls "matmul.<dtype>.<shape>" and "elementwise" (the add) time."""
    out: dict[str, Timed] = {}
    for dtype, side in sizes.side.items():
        for shape in get_args(SyntheticShape):
            m, k, n = matmul_dims(shape, side)
            a = torch.randn(m, k, device=device, dtype=TORCH_DTYPES[dtype])
            b = a.mT if shape == "gram" else torch.randn(k, n, device=device, dtype=a.dtype)
            res = torch.empty(m, n, device=device, dtype=a.dtype)
            out[f"matmul.{dtype}.{shape}"] = Timed(
                lambda a=a, b=b, res=res: torch.matmul(a, b, out=res)
            )
    x, y, z = (torch.ones(sizes.elementwise_bytes // 4, device=device) for _ in range(3))
    out["elementwise"] = Timed(lambda: torch.add(x, y, out=z))
    return out


def calibration_model(device_type: str, quick: bool) -> tuple[str, int]:
    """(orthoptim train's config, sequences) of the transformer calibrate runs (`MODEL`;
    with `quick`, one sequence of `tiny`)."""
    return ("tiny", 1) if quick else MODEL[device_type]


def model_items(device: torch.device, quick: bool) -> tuple[dict[str, Timed], float]:
    """One forward and backward of the device's calibration transformer ("model"), and its
    linear layers' matmuls alone ("model.linear": each layer's forward product and its two
    gradient products on random tensors of their shapes), with the latter's flops."""
    from orthoptim.train.model import CONFIGS, GPT

    name, batch = calibration_model(device.type, quick)
    cfg, dtype = CONFIGS[name], TORCH_DTYPES[MODEL_DTYPE[device.type]]
    torch.manual_seed(0)
    model = GPT(cfg).to(device, dtype)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len + 1), device=device)

    def step() -> None:
        model(idx[:, :-1], idx[:, 1:]).backward()

    tokens = batch * cfg.seq_len
    products = []  # (x, w, gy): the forward x·wᵀ, the gradients gy·w and gyᵀ·x
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear):
            out_f, in_f = layer.weight.shape
            x = torch.randn(tokens, in_f, device=device, dtype=dtype)
            gy = torch.randn(tokens, out_f, device=device, dtype=dtype)
            products.append((x, layer.weight.detach(), gy))

    def linear() -> None:
        for x, w, gy in products:
            torch.matmul(x, w.mT)
            torch.matmul(gy, w)
            torch.matmul(gy.mT, x)

    items = {
        "model": Timed(step, setup=lambda: model.zero_grad(set_to_none=True)),
        "model.linear": Timed(linear),
    }
    return items, float(sum(6 * tokens * w.numel() for _, w, _ in products))


def step_large(device_type: str, quick: bool) -> tuple[int, int]:
    """(count, side) of the large matrices of the step measurement (`STEP_LARGE`)."""
    count, side = STEP_LARGE[device_type]
    return count, max(STEP_SIDE, side // QUICK) if quick else side


def step_items(rank: int, world: int, device: torch.device, quick: bool) -> dict[str, Timed]:
    """The layer-wise optimizer's step, each rank on a group of its own: on `STEP_TENSORS`
    square matrices of side `STEP_SIDE` (their work is negligible: the fixed cost is what
    is left), "step.matrix" under Muon and "step.elementwise" under AdamW; and
    "step.elementwise.large" under AdamW on the device's `STEP_LARGE` matrices (a fourth
    of the side with `quick`)."""
    from torch import nn

    from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer

    own = [dist.new_group([r]) for r in range(world)][rank]  # every rank makes every group
    count, side = step_large(device.type, quick)
    out = {}
    for name, optimizer, n, d in (
        ("matrix", "muon", STEP_TENSORS, STEP_SIDE),
        ("elementwise", "adamw", STEP_TENSORS, STEP_SIDE),
        ("elementwise.large", "adamw", count, side),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(d, d, bias=False) for _ in range(n))).to(device)
        opt = LayerwiseDistributedOptimizer(
            model,
            optimizer=optimizer,
            lr=1e-3,
            process_group=own,  # type: ignore[arg-type]
        )
        x = torch.randn(4, d, device=device)

        def grads(model: nn.Module = model, x: torch.Tensor = x) -> None:
            model(x).square().mean().backward()

        def step(opt: LayerwiseDistributedOptimizer = opt) -> None:
            opt.step()
            opt.zero_grad()
            opt.wait_for_params()

        out[f"step.{name}"] = Timed(step, setup=grads)
    return out


def tp_items(rank: int, world: int, device: torch.device) -> dict[str, Timed]:
    """`TP_LINEARS` small linear layers split over the whole group (DTensor's ColwiseParallel
    and RowwiseParallel in turn, as orthoptim train splits a model): their forward and
    backward ("tp.linears": each layer's dispatch and its one all-reduce, the row-parallel
    one's forward, the column-parallel one's input gradient), and the layer-wise Muon step
    on them in the blockwise mode, which sends nothing ("step.matrix_tp": the fixed cost of
    a split matrix; the modes' collectives are priced apart)."""
    from torch import nn
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
    from orthoptim.parallel.layout import ParallelDims
    from orthoptim.parallel.tensor_parallel import TensorParallelOrthogonalizer

    mesh = ParallelDims.for_world(world, tp=world).build(device.type, rank)
    side = TP_SIDE * world
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(TP_LINEARS)))
    plan = {
        str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(TP_LINEARS)
    }
    parallelize_module(model.to(device), mesh.tp_mesh, plan)
    opt = LayerwiseDistributedOptimizer(
        model,
        optimizer="muon",
        lr=1e-3,
        layout=mesh,
        orthogonalizer=TensorParallelOrthogonalizer(mode="blockwise"),
    )
    x = torch.randn(TP_SIDE, side, device=device)

    def forward_backward() -> None:
        model(x).sum().backward()

    def step() -> None:
        opt.step()
        opt.zero_grad()
        opt.wait_for_params()

    return {
        "tp.linears": Timed(forward_backward, setup=lambda: model.zero_grad(set_to_none=True)),
        "step.matrix_tp": Timed(step, setup=forward_backward),
    }


def measure_compute(
    sizes: Sizes, rank: int, world: int, device: torch.device, repeats: int, quick: bool
) -> dict[str, float]:
    """Seconds per call of every compute item (`compute_items`, `model_items`, `step_items`
    and `tp_items`: "step.<kind>" per tensor, "tp.linears" per layer), timed in rounds, and
    the flops of "model.linear"."""
    model, linear_flops = model_items(device, quick)
    steps = step_items(rank, world, device, quick)
    items = {
        **compute_items(sizes, device),
        **model,
        **steps,
        **tp_items(rank, world, device),
    }
    out = timed_rounds(items, repeats, device)
    for kind in ("matrix", "elementwise"):
        out[f"step.{kind}"] /= STEP_TENSORS
    out["tp.linears"] /= TP_LINEARS
    out["step.matrix_tp"] /= TP_LINEARS
    return {**out, "model.linear_flops": linear_flops}


def collective_call(kind: CollectiveKind, numel: int, n: int, device: torch.device) -> Any:
    """A function running one `kind` of a `numel`-element float32 tensor (the all-reduced or
    all-to-all'd tensor, the gathered output, the reduce-scattered input) over the group,
    taking the `CommStats` to count it in (or None)."""
    full, sent = torch.zeros(numel, device=device), torch.zeros(numel, device=device)
    part = torch.zeros(numel // n, device=device)
    splits = [numel // n] * n
    calls = {
        "all_reduce": lambda s: C.all_reduce(full, stats=s),
        "all_gather": lambda s: C.all_gather(full, part, stats=s),
        "reduce_scatter": lambda s: C.reduce_scatter(part, full, stats=s),
        "all_to_all": lambda s: C.all_to_all(full, sent, splits, splits, stats=s),
    }
    return calls[kind]


def compute_chunk(device: torch.device) -> Callable[[], object]:
    """The compute a step does between two collectives: one square fp32 matmul of side
    `CHUNK_SIDE` (a ms or so)."""
    side = CHUNK_SIDE[device.type]
    a, b = (torch.randn(side, side, device=device) for _ in range(2))
    res = torch.empty(side, side, device=device)
    return lambda: torch.matmul(a, b, out=res)


def pairs(chunk: Callable[[], object], call: Callable[[], object] | None) -> Timed:
    """`CHUNK_CALLS` × (`chunk()`, then `call()`), back to back as a step runs them."""

    def run() -> None:
        for _ in range(CHUNK_CALLS):
            chunk()
            if call is not None:
                call()

    return Timed(run)


def measure_collectives(
    n: int, sizes: Sizes, device: torch.device, repeats: int
) -> dict[str, dict[str, float]]:
    """Per kind, for the tiny ("tiny_*") and the large ("large_*") message: the bytes this
    rank sends per call (counted) and the median seconds a call adds to the compute before
    it (`compute_chunk`, as a training step issues it: the ranks come from their own compute, not
    from a barrier), timed in rounds beside the compute alone; and "overlap" ("fraction"):
    how much of the large all-reduce runs hidden when started before the compute and waited
    for after it (1: wholly, 0: not at all; `Hardware.comm_overlap`)."""
    chunk = compute_chunk(device)
    large = max(n, sizes.message_bytes // 4 // n * n)
    items = {"compute": pairs(chunk, None)}
    counted: dict[str, float] = {}
    for kind in get_args(CollectiveKind):
        for label, numel in (("tiny", n), ("large", large)):
            call = collective_call(kind, numel, n, device)
            stats = CommStats()
            call(stats)
            counted[f"{kind}.{label}"] = stats.sent[kind]
            items[f"{kind}.{label}"] = pairs(chunk, lambda call=call: call(None))
    full = torch.zeros(large, device=device)
    pending: list[Any] = []

    def start() -> None:
        pending.append(dist.all_reduce(full, async_op=True))

    def hidden() -> None:  # each all-reduce started before its matmul, waited for after
        start()
        for _ in range(CHUNK_CALLS):
            chunk()
            pending.pop().wait()
            start()
        pending.pop().wait()

    items["overlap"] = Timed(hidden)
    t = {k: v / CHUNK_CALLS for k, v in timed_rounds(items, repeats, device).items()}
    out: dict[str, dict[str, float]] = {}
    for kind in get_args(CollectiveKind):
        out[kind] = {}
        for label in ("tiny", "large"):
            out[kind][f"{label}_sent"] = counted[f"{kind}.{label}"]
            out[kind][f"{label}_s"] = t[f"{kind}.{label}"] - t["compute"]
        out[kind]["large_pair_s"] = t[f"{kind}.large"]  # the call with its compute
    alone = out["all_reduce"]["large_s"]
    both = t["overlap"]
    hid = (t["compute"] + alone - both) / min(t["compute"], alone) if alone > 0 else 1.0
    out["overlap"] = {"fraction": min(1.0, max(0.0, hid)), "compute_s": t["compute"],
                      "collective_s": alone, "both_s": both}  # fmt: skip
    return out


def _rank_device(args: argparse.Namespace, rank: int) -> torch.device:
    if args.device == "cuda":
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _rank_main(rank: int, world: int, port: int, outdir: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    device = _rank_device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        args.backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        sizes = Sizes.of(device.type, args.quick)
        result: dict[str, Any] = {
            "collectives": measure_collectives(world, sizes, device, args.repeats)
        }
        if world == compute_group(args):
            result["compute"] = measure_compute(
                sizes, rank, world, device, args.repeats, args.quick
            )
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def compute_group(args: argparse.Namespace) -> int:
    """The group size the compute figures are measured at: on a GPU the largest (one rank a
    GPU), on a CPU the largest whose ranks × threads fit its cores (each rank's share of the
    machine when the ranks fill it; more would time ranks taking turns), else the smallest."""
    if args.device == "cuda":
        return max(args.nproc)
    fit = [n for n in args.nproc if n * args.threads <= (os.cpu_count() or 1)]
    return max(fit) if fit else min(args.nproc)


def device_name(device_type: str) -> str:
    """The accelerator's or the CPU's model name, as the system reports it."""
    if device_type == "cuda":
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb(device_type: str, ranks: int) -> tuple[float, str]:
    """(GB one rank holds, how it was read): the GPU's memory, or the RAM ÷ ranks."""
    if device_type == "cuda":
        return torch.cuda.get_device_properties(0).total_memory / 1e9, "the GPU's total memory"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    return total / ranks, f"the machine's {total:.1f} GB of RAM / {ranks} ranks"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:g} MiB"


def link_figures(row: dict[str, float]) -> dict[str, float]:
    """{"gb_per_s", "latency_us"} of one kind from its tiny and large message (the seconds
    each adds to its compute, `measure_collectives`), both positive whatever the noise."""
    extra_s = row["large_s"] - row["tiny_s"]
    extra_sent = row["large_sent"] - row["tiny_sent"]
    # on a noisy machine the large message can come out no slower than the tiny one (or than
    # its compute alone): then a lower bound, its bytes over the call with its compute
    per_s = extra_sent / extra_s if extra_s > 0 else row["large_sent"] / row["large_pair_s"]
    # a tiny message's cost can come out at or below zero beside the compute's noise
    return {"gb_per_s": per_s / 1e9, "latency_us": max(row["tiny_s"], 1e-7) * 1e6}


def slowest(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' results as one: every time (the collectives' `*_s`, every compute key) the
    slowest rank's, the counted bytes rank 0's (equal shares: every rank sends as much)."""
    out: dict[str, Any] = {"collectives": {}, "compute": {}}
    for kind, row in per_rank[0]["collectives"].items():
        out["collectives"][kind] = {
            k: max(r["collectives"][kind][k] for r in per_rank) if k.endswith("_s") else v
            for k, v in row.items()
        }
    fractions = [r["collectives"]["overlap"]["fraction"] for r in per_rank]
    out["collectives"]["overlap"]["fraction"] = min(fractions)  # the least hidden rank's
    for key in per_rank[0].get("compute", {}):
        out["compute"][key] = max(r["compute"][key] for r in per_rank)
    return out


def build_profile(
    measured: dict[int, dict[str, Any]], args: argparse.Namespace, when: datetime.date
) -> Hardware:
    """The profile of `measured` ({group size: `slowest` result}), every figure's source
    naming the date `when`, torch, the backend, the device and the ranks."""
    ranks, widest_group = compute_group(args), max(measured)
    sizes = Sizes.of(args.device, args.quick)
    compute = measured[ranks]["compute"]
    how = (
        f"measured {when.isoformat()} by orthoptim bench calibrate: torch {torch.__version__}, "
        f"{args.backend}, {args.device} ({device_name(args.device)}), {ranks} ranks x "
        f"{args.threads} thread(s), median of {args.repeats}, slowest rank"
    )
    links_how = how.replace(f", {ranks} ranks x", f", {widest_group} ranks x")
    rates = matmul_rates(compute, sizes, args)
    model_dtype = MODEL_DTYPE[args.device]
    fast = max(rates, key=lambda d: max(rates[d].values()))
    links = {
        kind: {str(n): link_figures(measured[n]["collectives"][kind]) for n in sorted(measured)}
        for kind in get_args(CollectiveKind)
    }
    fitting = links["all_reduce"][str(ranks)]
    overlap = measured[ranks]["collectives"]["overlap"]
    activation, activation_how = activation_rate(compute["model"], rates, args)
    optimizer, optimizer_how = optimizer_rate(compute, args)
    memory_gb, memory_how = _memory_gb(args.device, ranks)
    shapes = ", ".join(
        f"{d} {s} {'x'.join(map(str, matmul_dims(s, side)))}"
        for d, side in sizes.side.items()
        for s in get_args(SyntheticShape)
    )
    sources = {
        "bf16_tflops": f"{how}: the fastest bf16 shape class of matmul_tflops",
        "fp32_tflops": f"{how}: the fastest fp32 shape class of matmul_tflops",
        "matmul_tflops": f"{how}: m x k x n products {shapes}, 2mkn flops per call; "
        f"{model_dtype} linear: the calibration transformer's linear layers (see "
        "activation_gb_per_s), forward and both gradient products",
        "matmul_efficiency": f"{how}: the {fast} gram rate over the {fast} peak",
        "model_mfu": "assumed: the shipped profiles' figure; bench calibrate runs no model",
        "memory_gb": f"{how}: {memory_how}",
        "memory_gb_per_s": f"{how}: torch.add of {_mib(sizes.elementwise_bytes)} fp32 "
        "tensors, 3 tensors' bytes per call",
        "activation_gb_per_s": f"{how}: {activation_how}",
        "optimizer_gb_per_s": f"{how}: {optimizer_how}",
        **step_sources(how, links_how, ranks, sizes, overlap, args),
        "intra_node_gb_per_s": f"{how}: all_reduce at {ranks} ranks (collectives)",
        "intra_node_latency_us": f"{how}: all_reduce at {ranks} ranks (collectives)",
        "inter_node_gb_per_s": "not measured: one machine has no inter-node link; the "
        "intra-node figure",
        "inter_node_latency_us": "not measured: one machine has no inter-node link; the "
        "intra-node figure",
    }
    return Hardware(
        name=args.name or f"calibrated-{args.device}",
        description=f"{device_name(args.device)}, {ranks} {args.backend} ranks x "
        f"{args.threads} thread(s); measured by orthoptim bench calibrate",
        bf16_tflops=max(rates["bf16"].values()),
        fp32_tflops=max(rates["fp32"].values()),
        matmul_efficiency=rates[fast]["gram"] / max(rates[fast].values()),
        model_mfu=ASSUMED_MODEL_MFU,
        memory_gb=memory_gb,
        memory_gb_per_s=3 * sizes.elementwise_bytes / compute["elementwise"] / 1e9,
        nvlink_domain=widest_group,
        intra_node_gb_per_s=fitting["gb_per_s"],
        inter_node_gb_per_s=fitting["gb_per_s"],
        intra_node_latency_us=fitting["latency_us"],
        inter_node_latency_us=fitting["latency_us"],
        matmul_tflops=rates,
        collectives=links,
        activation_gb_per_s=activation,
        comm_overlap=overlap["fraction"],
        tp_us_per_linear=compute["tp.linears"] * 1e6,
        optimizer_gb_per_s=optimizer,
        optimizer_us_per_tensor={k: compute[f"step.{k}"] * 1e6 for k in get_args(TensorKind)},
        sources=sources,
    )


def matmul_rates(
    compute: dict[str, float], sizes: Sizes, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """TFLOP/s per dtype and shape class of the timed matmuls (`compute_items`), and the
    calibration transformer's linear layers' rate ("linear", in its dtype)."""
    rates: dict[str, dict[str, float]] = {}
    for dtype, side in sizes.side.items():
        rates[dtype] = {}
        for shape in get_args(SyntheticShape):
            m, k, n = matmul_dims(shape, side)
            rates[dtype][shape] = 2 * m * k * n / compute[f"matmul.{dtype}.{shape}"] / 1e12
    linear = compute["model.linear_flops"] / compute["model.linear"] / 1e12
    rates[MODEL_DTYPE[args.device]]["linear"] = linear
    return rates


def step_sources(
    how: str,
    links_how: str,
    ranks: int,
    sizes: Sizes,
    overlap: dict[str, float],
    args: argparse.Namespace,
) -> dict[str, str]:
    """Where the figures only the step-time model reads come from (the step's fixed costs,
    the split layers, the collectives as a step issues them, their overlap), `how` and
    `links_how` naming the runs that measured them."""
    chunk = f"{CHUNK_SIDE[args.device]}^2 fp32 matmul"
    return {
        "optimizer_us_per_tensor": f"{how}: LayerwiseDistributedOptimizer.step on a group of "
        f"one rank, {STEP_TENSORS} {STEP_SIDE}x{STEP_SIDE} matrices, over {STEP_TENSORS}: "
        "matrix under Muon, elementwise under AdamW; matrix_tp under Muon (blockwise) on the "
        f"{TP_LINEARS} layers of tp_us_per_linear, over {TP_LINEARS}",
        "tp_us_per_linear": f"{how}: forward and backward of {TP_LINEARS} linear layers "
        f"{TP_SIDE}x{TP_SIDE * ranks} split over the {ranks} ranks (DTensor ColwiseParallel "
        f"and RowwiseParallel in turn) on {TP_SIDE} tokens, over {TP_LINEARS}",
        "nvlink_domain": f"{links_how}: the largest group measured on this machine",
        "collectives": f"{links_how} (each group size its own), each call after a {chunk}, "
        "less the matmul alone: latency of a 1-element-per-rank message, bandwidth the bytes "
        f"a rank sends (comm_bytes) beyond it at {_mib(sizes.message_bytes)}",
        "comm_overlap": f"{how}: an async all_reduce of {_mib(sizes.message_bytes)} around "
        f"a {chunk}, {overlap['both_s'] * 1e3:.4g} ms, against the matmul alone "
        f"({overlap['compute_s'] * 1e3:.4g} ms) and the all_reduce after it "
        f"({overlap['collective_s'] * 1e3:.4g} ms): the time saved over the shorter of the two",
    }


def optimizer_rate(compute: dict[str, float], args: argparse.Namespace) -> tuple[float | None, str]:
    """(GB/s, how) of the AdamW step on the large matrices (`step_large`): the bytes its
    elementwise part is counted to move (`step_traffic`: fp32, two moments, no masters) over
    its time beyond the fixed cost per tensor the small ones measured; None where there is
    no time beyond."""
    from orthoptim.plan.steptime import step_traffic

    count, side = step_large(args.device, args.quick)
    n = count * side * side
    moved = step_traffic(n, state=2 * 4 * n, masters=0, grad_bytes=4, param_bytes=4)
    seconds = compute["step.elementwise.large"]
    beyond = seconds - count * compute["step.elementwise"]
    what = (
        f"LayerwiseDistributedOptimizer.step (AdamW, fp32) on a group of one rank, {count} "
        f"{side}x{side} matrices, {seconds * 1e3:.4g} ms: the {moved / 1e6:.4g} MB its "
        f"elementwise part is counted to move over the time beyond {count} x the fixed cost "
        "per tensor (optimizer_us_per_tensor)"
    )
    if beyond <= 0:
        return None, f"not measured: {what} (no time beyond)"
    return moved / beyond / 1e9, what


def activation_rate(
    seconds: float, rates: dict[str, dict[str, float]], args: argparse.Namespace
) -> tuple[float | None, str]:
    """(GB/s, how) of the calibration transformer's saved activations (`plan.work`) over the
    `seconds` of its forward and backward beyond its flops at its measured linear rate
    (`rates`, TFLOP/s); None where its flops alone took as long."""
    from orthoptim.plan.model import train_model
    from orthoptim.plan.work import activation_bytes_per_token, flops_per_token

    name, batch = calibration_model(args.device, args.quick)
    desc, dtype = train_model(name), MODEL_DTYPE[args.device]
    tokens = batch * desc.seq_len
    flops_s = flops_per_token(desc, desc.seq_len) * tokens / (rates[dtype]["linear"] * 1e12)
    moved = activation_bytes_per_token(desc, 2 if dtype == "bf16" else 4) * tokens
    what = (
        f"forward and backward of orthoptim train's {name} in {dtype}, {batch} sequence(s) of "
        f"{desc.seq_len} tokens, {seconds * 1e3:.4g} ms: its saved-activation bytes "
        f"({moved / 1e6:.4g} MB) over the time beyond its {flops_s * 1e3:.4g} ms of flops at "
        f"the {dtype} linear rate"
    )
    if seconds <= flops_s:
        return None, f"not measured: {what} (no time beyond)"
    return moved / (seconds - flops_s) / 1e9, what


def render(hw: Hardware, out: Path) -> str:
    """The text summary of a written profile."""
    lines = [f"orthoptim bench calibrate: wrote {out} ({hw.name}: {hw.description})"]
    shapes = get_args(MatmulShape)
    lines.append(f"  {'matmul TFLOP/s':<16}" + "".join(f"{s:>10}" for s in shapes))
    for dtype, row in hw.matmul_tflops.items():
        lines.append(
            f"  {dtype:<16}"
            + "".join(f"{row[s]:10.4g}" if s in row else f"{'—':>10}" for s in shapes)
        )
    lines.append(f"  elementwise: {hw.memory_gb_per_s:.4g} GB/s, memory {hw.memory_gb:.4g} GB")
    act, opt = (
        "not measured" if v is None else f"{v:.4g} GB/s"
        for v in (hw.activation_gb_per_s, hw.optimizer_gb_per_s)
    )
    per_tensor = ", ".join(f"{k} {v:.4g} us" for k, v in hw.optimizer_us_per_tensor.items())
    lines.append(f"  forward+backward activations: {act}; optimizer step: {opt}, per tensor: ")
    lines[-1] += per_tensor
    lines.append(
        f"  tensor-parallel linear layer: {hw.tp_us_per_linear or 0:.4g} us; collectives "
        f"hidden beside compute: {hw.comm_overlap if hw.comm_overlap is not None else 1:.2f}"
    )
    lines.append(f"  {'collective':<16}{'ranks':>6}{'latency us':>12}{'GB/s sent':>11}")
    for kind, by_size in hw.collectives.items():
        for size, e in by_size.items():
            lines.append(f"  {kind:<16}{size:>6}{e['latency_us']:12.4g}{e['gb_per_s']:11.4g}")
    lines.append(f"plan with it: orthoptim plan --model gpt-small --dp 2 --hardware {out}")
    return "\n".join(lines)


def _cmd(args: argparse.Namespace) -> int:
    if not args.nproc or min(args.nproc) < 2:
        raise SystemExit(
            f"--nproc {','.join(map(str, args.nproc))}: every group size must be >= 2 (a "
            "one-rank collective sends nothing); pass sizes like 2,4"
        )
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device; use --device cpu")
    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    if args.backend == "auto":
        args.backend = "nccl" if gpus >= max(args.nproc) else "gloo"
    if args.backend == "nccl" and gpus < max(args.nproc):
        raise SystemExit(
            f"--backend nccl needs a GPU per rank: {max(args.nproc)} ranks, {gpus} GPUs; "
            "pass fewer --nproc or --backend gloo"
        )
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // max(args.nproc))
    measured = {n: slowest(spawn_gloo(_rank_main, n, args)) for n in sorted(set(args.nproc))}
    hw = build_profile(measured, args, datetime.datetime.now(datetime.UTC).date())
    out = Path(args.out)
    out.write_text(hw.to_json())
    load_hardware(out)  # what plan will read: refuse here, not there
    print(render(hw, out))
    return 0


def add_parser(bench_subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench calibrate`."""
    p = bench_subparsers.add_parser(
        "calibrate",
        help="measure this machine (matmuls, memory bandwidth, collectives) into a hardware "
        "profile for orthoptim plan --hardware",
    )
    p.add_argument("--out", required=True, metavar="PATH", help="the profile to write (.json)")
    p.add_argument(
        "--nproc",
        type=parse_sizes,
        default=[2],
        help="group sizes to time the collectives at, comma-separated, each >= 2; compute "
        "figures are one rank's share at the largest (on a CPU: the largest whose ranks fit "
        "its cores; default 2)",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="the device each rank measures and holds its tensors on (default cpu)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=get_args(Backend),
        help="process-group backend (default auto: nccl on cuda with a GPU per rank, else gloo)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=9,
        help="timed repeats; the median is kept (default 9)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank (default: the CPU cores / the largest group size)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"matmul sides / {QUICK}, byte sizes / {QUICK**3}: a smoke test, not a profile",
    )
    p.add_argument("--name", default=None, help="the profile's name (default calibrated-DEVICE)")
    p.set_defaults(func=_cmd)
