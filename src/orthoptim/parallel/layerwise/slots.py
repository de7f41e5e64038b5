"""The slot model of the layer-wise optimizer: where each unit (a parameter, a slice of experts)
or each rank's run of a sharded AdamW unit lives in its bucket."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from orthoptim.optim.state import flat_label
from orthoptim.shards import is_dtensor, local_shard, wrap_local


def unit_label(name: str, part: tuple[int, int] | None) -> str:
    """The name a unit goes by in state dicts and errors: the parameter's name, or for a slice
    of experts `name[start:stop]`."""
    return name if part is None else f"{name}[{part[0]}:{part[1]}]"


class Slot:
    """Where one unit (a parameter, or a slice of the experts of a 3-D one), or one rank's
    run of a sharded AdamW unit, lives in its bucket: owner rank and offset in the owner's
    shard. `data` is the slot's values (a view of the parameter) and the tensor the owner's
    inner optimizer steps.

    `flat` = (lo, hi): elements lo:hi of the flattened parameter (a sharded AdamW unit's run
    on rank `owner`, named `name{lo:hi}`, `data` 1-D); None: the whole unit."""

    __slots__ = (
        "data", "flat", "mine", "name", "numel", "offset", "owner", "param", "part", "unit",
    )  # fmt: skip

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        unit: int,
        owner: int,
        part: tuple[int, int] | None = None,
        flat: tuple[int, int] | None = None,
    ) -> None:
        self.name, self.param, self.unit, self.owner = unit_label(name, part), param, unit, owner
        self.part = part
        self.flat = flat
        if flat is not None:
            if is_dtensor(param) or not param.is_contiguous():
                raise ValueError(
                    f"{name}: a sharded AdamW parameter must be a contiguous plain tensor; "
                    "build the optimizer with shard_adamw=False"
                )
            self.name = flat_label(name, *flat)
            # A leaf view of the run: the inner optimizer updates the parameter in place.
            self.data: Tensor = self.view().requires_grad_(True)
        elif part is None:
            self.data = param
        elif is_dtensor(param):
            raise NotImplementedError(
                f"{self.name}: expert slices of a tensor-parallel (DTensor) parameter are not "
                "owned separately; build the optimizer with split_experts=False"
            )
        else:
            # A leaf view of the slice: the inner optimizer updates the parameter in place.
            self.data = self.view().requires_grad_(True)
        self.numel = local_shard(self.data).numel()
        self.offset = 0
        self.mine = False  # owned by this rank (set by the optimizer)

    def view(self) -> Tensor:
        """The slot's values as a view of its parameter (a run or an expert slice)."""
        if self.flat is not None:
            return self.param.detach().view(-1)[self.flat[0] : self.flat[1]]
        assert self.part is not None
        return self.param.detach()[self.part[0] : self.part[1]]

    @torch.no_grad()
    def rebind(self) -> None:
        """Point `data` (the same tensor: the inner optimizer knows it) at its parameter's
        storage again, as `view()`; a pickled copy holds it apart."""
        v = self.view()
        self.data.set_(v.untyped_storage(), v.storage_offset(), v.shape, v.stride())

    def local(self) -> Tensor:
        """The unit's local values (a DTensor's shard), sharing the parameter's storage."""
        return local_shard(self.data.detach())

    def local_grad(self) -> Tensor | None:
        """This rank's (unreduced) gradient of the unit (of a run: the whole parameter's)."""
        g = self.param.grad
        return None if g is None else self.piece(g)

    def piece(self, whole: Tensor) -> Tensor:
        """The unit's part of `whole`, a tensor shaped like the parameter (of a run: all of
        it; of an expert slice: its experts)."""
        return whole if self.part is None else whole[self.part[0] : self.part[1]]


def start_of(s: Slot) -> int:
    """Where slot `s` starts inside its parameter, in elements (for ordering a parameter's
    slots: expert slices by their first expert, runs by their first element)."""
    if s.flat is not None:
        return s.flat[0]
    if s.part is not None:
        return s.part[0] * (s.param.numel() // max(1, s.param.shape[0]))
    return 0


def by_param(slots: list[Slot]) -> list[list[Slot]]:
    """The slots grouped by parameter (first-seen order), each parameter's in element order."""
    groups: dict[int, list[Slot]] = {}
    for s in slots:
        groups.setdefault(id(s.param), []).append(s)
    return [sorted(g, key=start_of) for g in groups.values()]


def make_masters(
    slots: list[Slot], param_dtype: torch.dtype | None, gather_dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """The owner's masters of the slots it owns, by name, taken before the parameters change
    dtype (fp32 under `param_dtype`; in the parameter's dtype where only `gather_dtype`
    rounds): the inner optimizer steps them and the parameters are written from them."""
    out: dict[str, Tensor] = {}
    for s in slots:
        master_dtype = torch.float32 if param_dtype is not None else s.data.dtype
        keeps = (param_dtype or s.data.dtype) != master_dtype
        if s.mine and (keeps or gather_dtype not in (None, s.data.dtype)):
            m = local_shard(s.data).detach().to(master_dtype, copy=True)
            out[s.name] = wrap_local(m, s.data).requires_grad_(True)
    return out
