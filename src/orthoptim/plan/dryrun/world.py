"""The fake world a simulated rank runs in: torch's fake process group registered for the
meta device only (so, like NCCL, it refuses a CPU tensor), and the patches of torch that
let DeviceMesh and FSDP2 run on the meta device."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

BACKEND = "orthoptim_meta"
DEVICE = torch.device("meta")


def register_backend() -> None:
    """Register the fake process group as backend `BACKEND`, serving the meta device only
    (once per process)."""
    if hasattr(dist.Backend, BACKEND.upper()):
        return
    from torch._C._distributed_c10d import FakeProcessGroup

    def create(common: Any, backend_opts: Any) -> Any:
        return FakeProcessGroup._create_internal(common.group_rank, common.group_size, backend_opts)

    dist.Backend.register_backend(BACKEND, create, extended_api=True, devices=["meta"])


def _device_module() -> types.ModuleType:
    """A device module for "meta" (what `torch.cuda` is for "cuda"), which DeviceMesh and
    FSDP2 ask for the current device and streams; streams are the CPU's no-ops."""
    mod = types.ModuleType("meta")
    for name in ("Stream", "Event", "current_stream", "stream", "synchronize", "set_device"):
        setattr(mod, name, getattr(torch.cpu, name))
    mod.current_device = lambda: 0  # type: ignore[attr-defined]
    mod.device_count = lambda: 1  # type: ignore[attr-defined]
    mod.is_available = lambda: True  # type: ignore[attr-defined]
    mod.is_initialized = lambda: True  # type: ignore[attr-defined]
    return mod


@contextlib.contextmanager
def fake_world(rank: int, world: int) -> Iterator[None]:
    """This process as `rank` of a fake process group of `world` ranks serving the meta
    device only; torch patched for the meta device (restored on exit): a device module for
    "meta" and FSDP2's refusal of meta parameters lifted. The library is not patched: the
    GPU's assignment is the dry run's `cost` argument (`rank.cuda_cost`)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError(
            "orthoptim plan --dry-run: a process group is already initialised in this process"
        )
    register_backend()
    validate = FSDPParamGroup._validate_no_meta_params
    torch.meta = _device_module()  # type: ignore[attr-defined]
    FSDPParamGroup._validate_no_meta_params = lambda self: None  # type: ignore[method-assign]
    try:
        dist.init_process_group(BACKEND, rank=rank, world_size=world, store=FakeStore())
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        del torch.meta  # type: ignore[attr-defined]
        FSDPParamGroup._validate_no_meta_params = validate  # type: ignore[method-assign]
