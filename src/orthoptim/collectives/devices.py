"""The devices a process group's backend serves, and the refusal of a tensor on another.

CUDA for NCCL (and "cuda:gloo"), CPU or CUDA for plain gloo, both for "cpu:gloo,cuda:nccl".
`device_for(group)` names the device for tensors made for a collective (flags, sizes,
serialised objects, metrics); `check_device` refuses a tensor on another device with a
`CollectiveDeviceError` naming both, before the backend sees it, and `device_error` turns the
backend's own refusal (`NO_BACKEND_FOR_DEVICE`) into the same error."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from orthoptim.collectives.groups import world

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class CollectiveDeviceError(ValueError):
    """A tensor handed to a collective lives on a device the group's backend does not serve."""


# What torch's process group says when a tensor's device has no backend in the group.
NO_BACKEND_FOR_DEVICE = "No backend type associated with device type"


def backend_config(group: ProcessGroup | None = None) -> str:
    """The group's backend as "device:backend" pairs, e.g. "cpu:gloo,cuda:gloo" for gloo,
    "cuda:nccl" for NCCL; "" when torch.distributed is not initialised."""
    if not dist.is_available() or not dist.is_initialized():
        return ""
    return str(dist.get_backend_config(group))


_DEVICES_OF = {"gloo": ("cpu", "cuda"), "nccl": ("cuda",), "mpi": ("cpu", "cuda")}


def backends(group: ProcessGroup | None = None) -> dict[str, str]:
    """{device type: name of the backend serving it} in `group`, in the backend's order;
    {} when torch.distributed is not initialised."""
    config = backend_config(group)
    if ":" not in config:  # a bare backend name from an older torch
        return dict.fromkeys(_DEVICES_OF.get(config, ()), config)
    pairs = (part.partition(":") for part in config.split(","))
    return {kind.strip(): name.strip() for kind, _, name in pairs}


def backend_devices(group: ProcessGroup | None = None) -> tuple[str, ...]:
    """Device types ("cpu", "cuda", ...) whose tensors `group`'s collectives accept, in
    the backend's order; () when torch.distributed is not initialised (anything goes)."""
    return tuple(backends(group))


def _default_device(kind: str) -> torch.device:
    """The device of type `kind` this process uses (CUDA: the current device)."""
    if kind == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def device_for(
    group: ProcessGroup | None = None, like: torch.device | str | Tensor | None = None
) -> torch.device:
    """The device for a tensor made to be handed to `group`'s collectives: `like`'s device (a
    device or a tensor) when the backend serves its type, else the backend's first device type
    (CPU for gloo, the current CUDA device for NCCL). CPU without a process group."""
    if isinstance(like, Tensor):
        like = like.device
    like = torch.device(like) if like is not None else None
    served = backend_devices(group)
    if like is not None and (not served or like.type in served):
        return like
    if not served or "cpu" in served:
        return torch.device("cpu")
    return _default_device(served[0])


def check_device(t: Tensor, what: str, group: ProcessGroup | None = None) -> None:
    """Raise `CollectiveDeviceError` unless `group`'s backend serves `t`'s device."""
    served = backend_devices(group)
    if served and t.device.type not in served:
        raise CollectiveDeviceError(
            f"{what}: the tensor is on {t.device}, but the process group's backend "
            f"({backend_config(group)}) takes only {' or '.join(served)} tensors; create it on "
            f"collectives.device_for(group) ({device_for(group)}) or move it there first"
        )


def to_backend(t: Tensor, group: ProcessGroup | None = None) -> Tensor:
    """`t` itself when `group`'s backend serves its device, else a copy on `device_for(group)`."""
    return t.to(device_for(group, t))


def device_error(
    what: str, exc: BaseException, group: ProcessGroup | None
) -> CollectiveDeviceError:
    """The backend's own refusal of a tensor's device (`exc`, which says
    `NO_BACKEND_FOR_DEVICE`), met in `what`."""
    rank, n = world(group)
    return CollectiveDeviceError(
        f"rank {rank} of {n}: {what}: a tensor is on a device the process group's "
        f"backend ({backend_config(group)}) does not serve: {exc}. Tensors handed to "
        f"its collectives must live on {' or '.join(backend_devices(group))}"
    )
