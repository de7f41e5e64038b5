"""The one place orthoptim reaches into torch's private API (torch 2.6 to 2.13).

Every name here is something torch has no public spelling for; each says what it is for, so
that a torch upgrade that moves one breaks here, in one file, and nowhere else. The rest of
the library imports from this module instead of touching `torch._*` or `x._name` of torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# The dry run's value-tracking dispatch mode and its walk over nested arguments.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._pytree import tree_flatten, tree_map  # noqa: F401

# -- tensors ---------------------------------------------------------------------------------
# The flat-shard view of a checkpoint (`checkpoint.FlatShard`): a tensor subclass with no
# storage of its own, which refuses torch functions.
make_wrapper_subclass = Tensor._make_wrapper_subclass
disabled_torch_function_impl = torch._C._disabled_torch_function_impl


def foreach_norm(tensors: list[Tensor], ord: float = 2) -> list[Tensor]:
    """The norms of `tensors` in one call (the non-finite gradient check)."""
    return list(torch._foreach_norm(tensors, ord=ord))


def version(t: Tensor) -> int:
    """`t`'s version counter, which every in-place write bumps (the layer-wise optimizer's
    check that the gradients were not changed between backward and step)."""
    return t._version


def storage_key(storage: torch.UntypedStorage) -> int:
    """An id of a storage that every tensor viewing it shares (the dry run's accounting)."""
    return storage._cdata


def local_tensor(t: Tensor) -> Tensor:
    """A DTensor's local tensor without dispatching (`to_local()` is an autograd op, which the
    dry run's dispatch mode would record)."""
    return t._local_tensor  # type: ignore[attr-defined]


def op_schema(func: Any) -> Any:
    """An ATen operator's schema: its arguments, which of them it writes."""
    return func._schema


# ATen operators the dry run serves itself on the meta device: a value read, a copy to CPU.
LOCAL_SCALAR_DENSE = torch.ops.aten._local_scalar_dense.default
TO_COPY = torch.ops.aten._to_copy.default

# -- the optimizer step under torch.compile --------------------------------------------------


def dynamo_config() -> Any:
    """torch._dynamo's configuration (`bench compile` raises the recompile limit)."""
    import torch._dynamo

    return torch._dynamo.config


def torch_muon_newton_schulz() -> Callable[..., Tensor]:
    """torch.optim.Muon's Newton-Schulz (bfloat16, as torch ships it)."""
    from torch.optim import _muon

    return _muon._zeropower_via_newtonschulz


@contextlib.contextmanager
def torch_muon_newton_schulz_replaced(fn: Callable[..., Tensor]) -> Iterator[None]:
    """torch.optim.Muon orthogonalizing with `fn` inside the block (`bench` makes it float32:
    torch hard-codes bfloat16, ~50x slower than float32 on CPUs without native bf16)."""
    from torch.optim import _muon

    original = _muon._zeropower_via_newtonschulz
    _muon._zeropower_via_newtonschulz = fn
    try:
        yield
    finally:
        _muon._zeropower_via_newtonschulz = original


# -- autograd and DDP ------------------------------------------------------------------------


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run `callback` once the current backward pass ends (the layer-wise optimizer's
    end-of-backward reduce launch)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def active_ddp_module() -> Any:
    """The DistributedDataParallel module whose forward is running, or None."""
    return torch.nn.parallel.DistributedDataParallel._active_ddp_module


# -- process groups --------------------------------------------------------------------------


def default_store() -> Any:
    """The default process group's key-value store (raises when there is none)."""
    return dist.distributed_c10d._get_default_store()


def unbind_world_defaults() -> None:
    """Make torch.distributed.nn's `group=group.WORLD` defaults None (the default group at
    call time), what they are when that module is imported before a group exists.

    Its functions bind `group.WORLD` when the module is imported: imported after
    `init_process_group` (torch._dynamo imports it, and the first `torch.optim` step imports
    torch._dynamo) they hold the default group for good, so `destroy_process_group()` no longer
    ends it and gloo's worker threads run on into the interpreter's exit, where one that still
    releases a finished collective aborts the process ("terminate called without an active
    exception"). Imported here, with orthoptim, it binds None unless a group existed
    already; this undoes that case."""
    from torch.distributed.nn import functional

    for f in vars(functional).values():
        defaults = getattr(f, "__defaults__", None)
        if defaults and any(isinstance(d, dist.ProcessGroup) for d in defaults):
            f.__defaults__ = tuple(
                None if isinstance(d, dist.ProcessGroup) else d for d in defaults
            )


def resolve_process_group(name: str) -> dist.ProcessGroup:
    """The process group a functional collective names by string."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def fake_process_group(rank: int, size: int, options: Any) -> Any:
    """torch's fake process group backend (collectives return at once), for the dry run."""
    from torch._C._distributed_c10d import FakeProcessGroup

    return FakeProcessGroup._create_internal(rank, size, options)


def fake_store() -> Any:
    """The store the fake process group starts from."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def fsdp_param_group() -> Any:
    """FSDP2's parameter group class, whose refusal of meta parameters the dry run lifts."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return FSDPParamGroup


def fsdp_collective_bases() -> tuple[type, type]:
    """FSDP2's custom all-gather and reduce-scatter interfaces (`set_custom_all_gather`,
    `set_custom_reduce_scatter`), through which orthoptim counts FSDP2's traffic."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    return AllGather, ReduceScatter
