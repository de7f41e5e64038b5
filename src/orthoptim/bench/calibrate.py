"""`orthoptim bench calibrate --out hw.json`: this machine as a hardware profile for `plan`.

At each group size of `--nproc` it starts that many ranks (gloo on CPU; NCCL on CUDA when
every rank has a GPU of its own) and times each collective the planner prices, through
`orthoptim.collectives`: all_reduce, all_gather, reduce_scatter and all_to_all, on a tiny
message (one element per rank: the latency) and a large one (the bandwidth: the bytes a rank
sends, as `comm_bytes` counts them, over the time beyond the latency). On the largest group
every rank also times, at once, matmuls per dtype and shape class (square, the Gram product
X·Xᵀ of a wide X that Newton-Schulz iterates on, small) and a large elementwise add (bytes
read and written per second), so a compute figure is one rank's share of the machine while
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
    load_hardware,
)

Backend = Literal["auto", "gloo", "nccl"]
TORCH_DTYPES: dict[MatmulDtype, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The side n of the square class per device and dtype; gram is an (n/2)×2n X times Xᵀ (the same
# flops), small an (n/8)³ product. bf16 on CPUs without native bf16 runs ~50x slower than fp32
# (MACHINE_NOTES: 0.9 vs 60-150 GFLOP/s at 1024²), so its shapes stay small there.
MATMUL_SIDE: dict[str, dict[MatmulDtype, int]] = {
    "cpu": {"fp32": 1024, "bf16": 256},
    "cuda": {"fp32": 8192, "bf16": 8192},
}
# Bytes of each tensor of the elementwise add and of the large collective message: past the
# caches on CPU, large enough to reach the link's bandwidth on a GPU.
ELEMENTWISE_BYTES = {"cpu": 64 << 20, "cuda": 1 << 30}
MESSAGE_BYTES = {"cpu": 16 << 20, "cuda": 256 << 20}
QUICK = 4  # --quick divides the matmul sides by this and the byte sizes by its cube
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


def matmul_dims(shape: MatmulShape, side: int) -> tuple[int, int, int]:
    """(m, k, n) of an m×k · k×n product of the class `shape` at square side `side`."""
    if shape == "square":
        return side, side, side
    if shape == "gram":
        return side // 2, 2 * side, side // 2
    return (max(1, side // 8),) * 3


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of `fn()` over `repeats`, one untimed call first, every rank of the
    group starting each repeat together (a barrier)."""
    fn()
    samples = []
    for _ in range(repeats):
        C.barrier()
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def measure_compute(sizes: Sizes, device: torch.device, repeats: int) -> dict[str, float]:
    """Seconds per call: "matmul.<dtype>.<shape>" and "elementwise" (the add)."""
    out: dict[str, float] = {}
    for dtype, side in sizes.side.items():
        for shape in get_args(MatmulShape):
            m, k, n = matmul_dims(shape, side)
            a = torch.randn(m, k, device=device, dtype=TORCH_DTYPES[dtype])
            b = a.mT if shape == "gram" else torch.randn(k, n, device=device, dtype=a.dtype)
            res = torch.empty(m, n, device=device, dtype=a.dtype)
            out[f"matmul.{dtype}.{shape}"] = timed(
                lambda a=a, b=b, res=res: torch.matmul(a, b, out=res), repeats, device
            )
    x, y, z = (torch.ones(sizes.elementwise_bytes // 4, device=device) for _ in range(3))
    out["elementwise"] = timed(lambda: torch.add(x, y, out=z), repeats, device)
    return out


def _collective_call(kind: CollectiveKind, numel: int, n: int, device: torch.device) -> Any:
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


def measure_collectives(
    n: int, sizes: Sizes, device: torch.device, repeats: int
) -> dict[str, dict[str, float]]:
    """Per kind, for the tiny ("tiny_*") and the large ("large_*") message: the bytes this
    rank sends per call (counted) and the median seconds per call."""
    out: dict[str, dict[str, float]] = {}
    large = max(n, sizes.message_bytes // 4 // n * n)
    for kind in get_args(CollectiveKind):
        row: dict[str, float] = {}
        for label, numel in (("tiny", n), ("large", large)):
            call = _collective_call(kind, numel, n, device)
            counted = CommStats()
            call(counted)
            row[f"{label}_sent"] = counted.sent[kind]
            row[f"{label}_s"] = timed(lambda call=call: call(None), repeats, device)
        out[kind] = row
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
        if world == max(args.nproc):
            result["compute"] = measure_compute(sizes, device, args.repeats)
        torch.save(result, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


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


def _link(row: dict[str, float]) -> dict[str, float]:
    """{"gb_per_s", "latency_us"} of one kind from its tiny and large message."""
    extra_s = row["large_s"] - row["tiny_s"]
    extra_sent = row["large_sent"] - row["tiny_sent"]
    # on a noisy machine the large message can come out no slower than the tiny one
    per_s = extra_sent / extra_s if extra_s > 0 else row["large_sent"] / row["large_s"]
    return {"gb_per_s": per_s / 1e9, "latency_us": row["tiny_s"] * 1e6}


def slowest(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' results as one: every time (the collectives' `*_s`, every compute key) the
    slowest rank's, the counted bytes rank 0's (equal shares: every rank sends as much)."""
    out: dict[str, Any] = {"collectives": {}, "compute": {}}
    for kind, row in per_rank[0]["collectives"].items():
        out["collectives"][kind] = {
            k: max(r["collectives"][kind][k] for r in per_rank) if k.endswith("_s") else v
            for k, v in row.items()
        }
    for key in per_rank[0].get("compute", {}):
        out["compute"][key] = max(r["compute"][key] for r in per_rank)
    return out


def build_profile(
    measured: dict[int, dict[str, Any]], args: argparse.Namespace, when: datetime.date
) -> Hardware:
    """The profile of `measured` ({group size: `slowest` result}), every figure's source
    naming the date `when`, torch, the backend, the device and the ranks."""
    ranks = max(measured)
    sizes = Sizes.of(args.device, args.quick)
    compute = measured[ranks]["compute"]
    how = (
        f"measured {when.isoformat()} by orthoptim bench calibrate: torch {torch.__version__}, "
        f"{args.backend}, {args.device} ({device_name(args.device)}), {ranks} ranks x "
        f"{args.threads} thread(s), median of {args.repeats}, slowest rank"
    )
    rates: dict[str, dict[str, float]] = {}
    for dtype, side in sizes.side.items():
        rates[dtype] = {}
        for shape in get_args(MatmulShape):
            m, k, n = matmul_dims(shape, side)
            rates[dtype][shape] = 2 * m * k * n / compute[f"matmul.{dtype}.{shape}"] / 1e12
    fast = max(rates, key=lambda d: max(rates[d].values()))
    links = {
        kind: {str(n): _link(measured[n]["collectives"][kind]) for n in sorted(measured)}
        for kind in get_args(CollectiveKind)
    }
    widest = links["all_reduce"][str(ranks)]
    memory_gb, memory_how = _memory_gb(args.device, ranks)
    shapes = ", ".join(
        f"{d} {s} {'x'.join(map(str, matmul_dims(s, side)))}"
        for d, side in sizes.side.items()
        for s in get_args(MatmulShape)
    )
    sources = {
        "bf16_tflops": f"{how}: the fastest bf16 shape class of matmul_tflops",
        "fp32_tflops": f"{how}: the fastest fp32 shape class of matmul_tflops",
        "matmul_tflops": f"{how}: m x k x n products {shapes}, 2mkn flops per call",
        "matmul_efficiency": f"{how}: the {fast} gram rate over the {fast} peak",
        "model_mfu": "assumed: the shipped profiles' figure; bench calibrate runs no model",
        "memory_gb": f"{how}: {memory_how}",
        "memory_gb_per_s": f"{how}: torch.add of {_mib(sizes.elementwise_bytes)} fp32 "
        "tensors, 3 tensors' bytes per call",
        "nvlink_domain": f"{how}: the largest group measured on this machine",
        "collectives": f"{how}: latency of a 1-element-per-rank message, bandwidth the bytes "
        f"a rank sends (comm_bytes) beyond it at {_mib(sizes.message_bytes)}",
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
        nvlink_domain=ranks,
        intra_node_gb_per_s=widest["gb_per_s"],
        inter_node_gb_per_s=widest["gb_per_s"],
        intra_node_latency_us=widest["latency_us"],
        inter_node_latency_us=widest["latency_us"],
        matmul_tflops=rates,
        collectives=links,
        sources=sources,
    )


def render(hw: Hardware, out: Path) -> str:
    """The text summary of a written profile."""
    lines = [f"orthoptim bench calibrate: wrote {out} ({hw.name}: {hw.description})"]
    shapes = get_args(MatmulShape)
    lines.append(f"  {'matmul TFLOP/s':<16}" + "".join(f"{s:>10}" for s in shapes))
    for dtype, row in hw.matmul_tflops.items():
        lines.append(f"  {dtype:<16}" + "".join(f"{row[s]:10.4g}" for s in shapes))
    lines.append(f"  elementwise: {hw.memory_gb_per_s:.4g} GB/s, memory {hw.memory_gb:.4g} GB")
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
        "figures are one rank's share at the largest (default 2)",
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
        "--repeats", type=int, default=5, help="timed repeats; the median is kept (default 5)"
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
