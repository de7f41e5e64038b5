"""What savers see of a layer-wise model: every state-dict entry in a storage of its own.

Under `LayerwiseDistributedOptimizer` the parameters are views of their group's flat buffer
(`buffers.FlatBuffers`), so `model.state_dict()` would hold many views of one storage, and
savers that tell tensors apart by their storage drop or refuse them: accelerate's
`save_model` and `save_state` (safetensors, their default) keep one name per storage
(`clean_state_dict_for_safetensors`, by `id_tensor_storage`) and write one tensor of the
model; safetensors' `save_model` and `load_model` (accelerate's `load_state`) refuse a tensor
that covers only part of its storage; `torch.save` writes the whole flat buffer, padding
included. transformers' `save_pretrained` copies such views apart; DCP copies each as it
writes it.

`alias_views`, a state-dict post-hook the optimizer puts on its model, gives every entry that
covers only part of its storage a storage of its own over the same memory (DLPack,
`torch.from_dlpack`): nothing is copied, and writing into an entry writes the parameter, as
`torch.distributed.checkpoint.load` and `orthoptim.checkpoint.load_sharded` do when they load
into `model.state_dict()` in place. Entries that are the same view (weights tied by sharing
one Parameter) share one such storage, so every saver drops or keeps ties as it would without
the optimizer. On a device DLPack does not serve here (neither CPU nor CUDA) the entry is a
copy instead, which costs one copy of those parameters while the dict lives.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from orthoptim.shards import is_dtensor, wrap_local

ALIASED_DEVICES = ("cpu", "cuda")


def register(model: nn.Module) -> RemovableHandle:
    """Put `alias_views` on `model` (its handle removes it; the handle survives pickling along
    with the model, whose hook dict it points into)."""
    return model.register_state_dict_post_hook(alias_views)


def alias_views(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]
) -> None:
    """`nn.Module.register_state_dict_post_hook`'s hook: each contiguous entry under `prefix`
    that covers only part of its storage (a view of a flat buffer) becomes `own_storage` of
    it, in place; a DTensor's local shard likewise. Parameters themselves
    (`state_dict(keep_vars=True)`) and other tensor subclasses (fake tensors) are left as
    they are."""
    made: dict[tuple[Any, ...], Tensor] = {}
    for key, value in list(state_dict.items()):
        if not key.startswith(prefix):
            continue
        if type(value) is Tensor:
            local = value
        elif is_dtensor(value) and not isinstance(value, nn.Parameter):
            local = value.to_local()
        else:  # a Parameter (keep_vars=True), another subclass, not a tensor
            continue
        if type(local) is not Tensor or not local.is_contiguous() or covers(local):
            continue
        where = (local.device, local.data_ptr(), local.dtype, local.shape, local.stride())
        if where not in made:
            made[where] = own_storage(local)
        # a tied name: another tensor over the same storage, as state_dict() gives it
        alias = made[where].detach()
        state_dict[key] = alias if local is value else wrap_local(alias, value)


def covers(t: Tensor) -> bool:
    """Whether `t` spans its whole storage (then savers see it as a tensor of its own)."""
    if t.device.type == "meta":
        return True
    storage = t.untyped_storage()
    return t.data_ptr() == storage.data_ptr() and t.numel() * t.element_size() == storage.nbytes()


def own_storage(t: Tensor) -> Tensor:
    """`t` over a storage of its own that spans exactly it: the same memory on CPU and CUDA
    (DLPack), a copy elsewhere and for an empty tensor."""
    if t.device.type in ALIASED_DEVICES and t.numel() > 0:
        return torch.from_dlpack(t.detach())
    return t.detach().clone()
