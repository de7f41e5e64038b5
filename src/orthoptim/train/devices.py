"""Where the ranks of `orthoptim train` / `compare` run, and in what precision.

Small pure decisions, unit-tested on CPU with a made-up GPU count:

    plan_ranks(nproc, gpus, shared_gpu)    how many ranks, which backend, which device each
    resolve_precision(precision, device)   "auto" → "bf16" on CUDA, "fp32" elsewhere
    resolve_param_dtype(param_dtype, device)   the same rule for --param-dtype

Rank placement:
    CPU (no GPU visible)   gloo, every rank on the CPU; --nproc defaults to 2
    CUDA                   NCCL, rank r on cuda:LOCAL_RANK; --nproc defaults to the number of
                           visible GPUs and may not exceed it
    CUDA, --shared-gpu     "cuda:gloo", every rank on cuda:0 (NCCL refuses two ranks on one GPU:
                           "Duplicate GPU detected"); a test mode for multi-rank code paths on a
                           one-GPU machine: like NCCL, its collectives take CUDA tensors only.
                           --nproc defaults to 2.

Precision: "bf16" runs forward and loss under `torch.autocast(device_type, torch.bfloat16)`;
parameters (fp32 masters), gradients and optimizer state stay fp32, so gradients are reduced
in fp32. "fp32" runs without autocast.

Parameter dtype (--param-dtype): "bf16" holds the parameters forward and backward see in bf16,
with fp32 masters that the optimizer steps (FSDP2's mixed precision under --fsdp: fp32 shards,
bf16 all-gathers, fp32 gradient reduction; elsewhere the layer-wise optimizer's bf16 parameters
and fp32 masters of what each rank owns); optimizer state is fp32 either way. "fp32": the
parameters are the masters. "fp64": everything in float64 (no autocast), the reference dtype
of the equivalence tests between parallel layouts (CPU).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch

from orthoptim.choices import PARAM_DTYPES, PRECISIONS, ParamDtype  # noqa: F401 (read from here)

# The data-parallel default on a machine without GPUs: two gloo ranks exercise the
# distributed optimizer (one rank runs the plain single-process optimizer).
CPU_DEFAULT_NPROC = 2
SHARED_GPU_DEFAULT_NPROC = 2


def visible_gpus() -> int:
    """CUDA devices this process may use (CUDA_VISIBLE_DEVICES honoured); 0 without CUDA."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class RankPlan:
    """How `nproc` ranks run on this machine: the process-group backend and each rank's
    device type (`device(local_rank)` gives the device itself)."""

    nproc: int
    backend: str  # "gloo", "nccl" or "cuda:gloo" (used when nproc > 1)
    device_type: str  # "cpu" or "cuda"
    shared_gpu: bool = False

    def device(self, local_rank: int) -> torch.device:
        """The device of the rank with this local rank."""
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", 0 if self.shared_gpu else local_rank)


def plan_ranks(nproc: int | None, gpus: int, shared_gpu: bool = False) -> RankPlan:
    """The placement of `nproc` ranks (None: the default) on a machine with `gpus` visible GPUs.

    Refuses, naming --nproc, the GPU count and the fix: fewer than one rank, more ranks than
    GPUs (unless `shared_gpu`), and `shared_gpu` without a GPU."""
    if nproc is not None and nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    if gpus < 1:
        if shared_gpu:
            raise ValueError(
                "--shared-gpu runs every rank on cuda:0, but no CUDA GPU is visible; drop "
                "--shared-gpu (on CPU the ranks use gloo)"
            )
        return RankPlan(nproc or CPU_DEFAULT_NPROC, "gloo", "cpu")
    if shared_gpu:
        return RankPlan(nproc or SHARED_GPU_DEFAULT_NPROC, "cuda:gloo", "cuda", shared_gpu=True)
    nproc = nproc or gpus
    if nproc > gpus:
        gpu_s = "GPU is" if gpus == 1 else "GPUs are"
        raise ValueError(
            f"--nproc {nproc} asks for {nproc} ranks, one per GPU, but only {gpus} {gpu_s} "
            f"visible (CUDA_VISIBLE_DEVICES / torch.cuda.device_count()); pass --nproc {gpus} "
            f"or fewer, or --shared-gpu to run every rank on cuda:0 over the cuda:gloo backend "
            "(a test mode: slower than NCCL)"
        )
    return RankPlan(nproc, "nccl", "cuda")


def _by_device(flag: str, value: str, device_type: str) -> Literal["bf16", "fp32"]:
    """`value` of an "auto" / "bf16" / "fp32" flag, "auto" read as bf16 on CUDA and fp32
    elsewhere (bf16 matmuls are tens of times slower than fp32 on CPUs without bf16
    instructions)."""
    if value not in PRECISIONS:
        raise ValueError(f"{flag} must be one of {PRECISIONS}, got {value!r}")
    if value == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return "bf16" if value == "bf16" else "fp32"


def resolve_precision(precision: str, device_type: str) -> str:
    """The run's precision, "bf16" or "fp32": `precision` itself, or for "auto" bf16 on CUDA
    and fp32 elsewhere."""
    return _by_device("--precision", precision, device_type)


def resolve_param_dtype(param_dtype: str, device_type: str) -> Literal["bf16", "fp32", "fp64"]:
    """The run's parameter dtype, "bf16", "fp32" or "fp64": `param_dtype` itself, or for
    "auto" bf16 on CUDA and fp32 elsewhere. "fp64" (parameters, gradients, optimizer state
    and loss in float64) is the reference dtype of equivalence checks between layouts, on
    the CPU: reduction orders then differ by ~1e-16 rather than fp32's ~1e-7."""
    if param_dtype == "fp64":
        return "fp64"
    return _by_device("--param-dtype", param_dtype, device_type)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The context forward and loss run in: bf16 autocast for "bf16", nothing for "fp32"."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
