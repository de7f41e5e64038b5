"""What a dry run sees of every op: a dispatch mode (`Recorder`) that answers and counts host
reads, keeps the values of small and constant tensors, records every collective as the
backend saw it (`Collective`) and the live storages for the step's peak; and a function mode
(`HostData`) for tensors built from host data, which the dispatcher never sees."""

from __future__ import annotations

import sys
import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.overrides import TorchFunctionMode

from orthoptim import collectives as C
from orthoptim._torch_compat import (
    LOCAL_SCALAR_DENSE,
    TO_COPY,
    TorchDispatchMode,
    local_tensor,
    op_schema,
    resolve_process_group,
    storage_key,
    tree_flatten,
    tree_map,
)
from orthoptim.shards import is_dtensor

# the dry run's own frames (the model's forward, the per-rank run), which `_site` skips
_PACKAGE = __name__.rpartition(".")[0]


@dataclass
class Collective:
    """One collective as the backend saw it: op, group ranks, tensor (dtype, shape)s, split
    sizes; the root's group rank (reduce, broadcast) and the kind `orthoptim.collectives` issued it
    as (None: issued outside it)."""

    kind: str
    group: tuple[int, ...]
    tensors: tuple[tuple[str, tuple[int, ...]], ...]
    splits: tuple[tuple[int, ...], ...] = ()
    root: int | None = None
    issued_as: str | None = None

    def signature(self) -> tuple[Any, ...]:
        """What every member of the group must issue alike (all-to-all sizes differ by rank)."""
        if "alltoall" in self.kind:
            return (self.kind, tuple(d for d, _ in self.tensors))
        return (self.kind, self.tensors)


_MAX_EXACT = 1 << 16  # elements: small tensors whose values are kept exactly
_aten = torch.ops.aten
_c10d = torch.ops.c10d
_SUM = int(dist.ReduceOp.RedOpType.SUM)
_CONSTANT_FACTORIES = {
    _aten.zeros.default: lambda a, k: 0,
    _aten.ones.default: lambda a, k: 1,
    _aten.full.default: lambda a, k: a[1],
    _aten.zeros_like.default: lambda a, k: 0,
    _aten.ones_like.default: lambda a, k: 1,
    _aten.full_like.default: lambda a, k: a[1],
    _aten.new_zeros.default: lambda a, k: 0,
    _aten.new_ones.default: lambda a, k: 1,
    _aten.new_full.default: lambda a, k: a[2],
    _aten.fill_.Scalar: lambda a, k: a[1],
    _aten.zero_.default: lambda a, k: 0,
}
_SAME_VALUE_REDUCTIONS = {
    _aten.all.default, _aten.all.dim, _aten.all.dims, _aten.any.default, _aten.any.dim,
    _aten.any.dims, _aten.amax.default, _aten.amin.default, _aten.max.default,
    _aten.min.default, _aten.mean.default, _aten.mean.dim,
}  # fmt: skip
# flags of a tensor of unknown data, which in a dry run is finite (composite ops: seen at the
# function level, before they decompose)
_DATA_FLAGS: dict[Any, bool] = {
    f: flag
    for name, flag in (("isfinite", True), ("isnan", False), ("isinf", False))
    for f in (getattr(torch, name), getattr(Tensor, name))
}


def plain(t: Tensor) -> Tensor:
    """The local tensor of a DTensor, else `t`."""
    return local_tensor(t) if is_dtensor(t) else t


def _key(t: Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    t = plain(t)
    return (storage_key(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _is_output(func: Any, t: Tensor, args: Any) -> bool:
    """Whether `t` is the tensor a gather-like collective fills from the other ranks (its
    first argument), not one it reduces in place."""
    name = func.__name__
    first = tree_flatten(args[0])[0] if args else []
    return any(k in name for k in ("gather", "scatter", "alltoall", "recv")) and any(
        t is f for f in first
    )


def _site() -> str:
    """The innermost orthoptim function (outside the dry run and the `host.read` helper
    every library read goes through) on the stack."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        ours = name == _PACKAGE or name.startswith(_PACKAGE + ".")
        if name.startswith("orthoptim") and not ours and name != "orthoptim.host":
            return f"{name}.{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "outside orthoptim"


class Recorder(TorchDispatchMode):
    """Answers and counts host reads, knows small and constant values, records collectives
    and live storages (see the package docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.values: dict[tuple, Tensor | bool | int | float] = {}
        self.by_storage: dict[int, set[tuple]] = defaultdict(set)
        self.live: dict[int, int] = {}
        self.live_bytes = 0
        self.peak = 0
        self.reads: dict[str, int] = defaultdict(int)
        self.collectives: list[Collective] = []

    # -- storages ----------------------------------------------------------------------
    def track(self, t: Any) -> None:
        if not isinstance(t, Tensor):
            return
        t = plain(t)
        if t.device.type != "meta":
            return
        st = t.untyped_storage()
        key = storage_key(st)
        if key in self.live:
            return
        self.live[key] = st.nbytes()
        self.live_bytes += st.nbytes()
        self.peak = max(self.peak, self.live_bytes)
        weakref.finalize(st, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self.live.pop(key, 0)
        for k in self.by_storage.pop(key, ()):
            self.values.pop(k, None)

    def reset_peak(self) -> None:
        self.peak = self.live_bytes

    # -- values ------------------------------------------------------------------------
    def know(self, t: Tensor, value: Tensor | bool | int | float | None) -> None:
        k = _key(t)
        if value is None:
            self.values.pop(k, None)
            return
        self.values[k] = value
        self.by_storage[k[0]].add(k)

    def forget_storage(self, t: Tensor) -> None:
        for k in self.by_storage.pop(_key(t)[0], ()):
            self.values.pop(k, None)

    def value(self, t: Tensor) -> Tensor | bool | int | float | None:
        return self.values.get(_key(t))

    def _exact(self, t: Tensor) -> Tensor | None:
        """`t`'s values as a CPU tensor when known and small."""
        v = self.value(t)
        if v is None or isinstance(v, Tensor):
            return v
        if t.numel() > _MAX_EXACT:
            return None
        return torch.full(tuple(t.shape), v, dtype=t.dtype)

    def _read(self, t: Tensor) -> Tensor:
        """A host read of `t`: counted, answered with its known value (else zeros)."""
        self.reads[_site()] += 1
        exact = self._exact(t)
        if exact is None:
            exact = torch.zeros(tuple(t.shape), dtype=t.dtype)
        return exact

    # -- dispatch ----------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is LOCAL_SCALAR_DENSE and args[0].device.type == "meta":
            return self._read(args[0]).item()
        if func is TO_COPY and args[0].device.type == "meta":
            dev = kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu":
                dtype = kwargs.get("dtype") or args[0].dtype
                return self._read(args[0]).to(dtype)
        if func is _aten.copy_.default and (args[0].device.type, args[1].device.type) == (
            "cpu",
            "meta",
        ):
            return args[0].copy_(self._read(args[1]))
        if func.namespace in ("c10d", "_c10d_functional"):
            self._collective(func, args)
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            self.track(t)
        try:
            self._propagate(func, args, kwargs, out)
        except Exception:  # a value we cannot follow is simply unknown
            for t in tree_flatten(out)[0]:
                if isinstance(t, Tensor) and t.device.type == "meta":
                    self.know(t, None)
        return out

    def _collective(self, func: Any, args: Any) -> None:
        flat = tree_flatten(args)[0]
        group: tuple[int, ...] = ()
        for a in flat:
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except (RuntimeError, TypeError):
                    continue
                group = tuple(dist.get_process_group_ranks(pg))
                break
            if isinstance(a, str) and func.namespace == "_c10d_functional":
                group = tuple(dist.get_process_group_ranks(resolve_process_group(a)))
                break
        tensors = tuple(
            (str(a.dtype).removeprefix("torch."), tuple(a.shape))
            for a in flat
            if isinstance(a, Tensor)
        )
        splits = tuple(
            tuple(a) for a in args if isinstance(a, list) and a and isinstance(a[0], int)
        )
        names = [a.name for a in op_schema(func).arguments]
        root = args[names.index("root_rank")] if "root_rank" in names else None
        self.collectives.append(
            Collective(func.__name__.split(".")[0], group, tensors, splits, root, C.issuing_kind())
        )

    def _propagate(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        mutated = [
            t
            for i, a in enumerate(op_schema(func).arguments)
            if a.alias_info is not None and a.alias_info.is_write and i < len(args)
            for t in tree_flatten(args[i])[0]
            if isinstance(t, Tensor)
        ]
        if func.namespace in ("c10d", "_c10d_functional"):
            # every simulated rank holds the same flags when all is well: a collective
            # leaves this rank's known value, a sum all-reduce multiplies it by the group's
            # size (a count of what is missing on every rank becomes the group's size), and
            # outputs filled from others are unknown
            sources = {_key(t)[0] for t in tree_flatten(args)[0] if isinstance(t, Tensor)}
            for t in tree_flatten(args)[0] + tree_flatten(out)[0]:
                if isinstance(t, Tensor) and (
                    _key(t)[0] not in sources or _is_output(func, t, args)
                ):
                    self.forget_storage(t)
            if func is _c10d.allreduce_.default and args[2].op() == _SUM:
                size = dist.ProcessGroup.unbox(args[1]).size()
                for t in args[0]:
                    v = self.value(t)
                    if v is not None and t.dtype != torch.bool:
                        self.know(t, v * size)
            return
        for m in mutated:
            self.forget_storage(m)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
        if not outs or any(t.device.type != "meta" for t in outs):
            return
        if func in _CONSTANT_FACTORIES:
            c = _CONSTANT_FACTORIES[func](args, kwargs)
            for t in outs:
                self.know(t, c)
            return
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, Tensor)]
        known = [self.value(a) for a in inputs]
        if not inputs or any(v is None for v in known):
            return
        if func in _SAME_VALUE_REDUCTIONS and not isinstance(known[0], Tensor):
            c = known[0]
            self.know(outs[0], bool(c) if outs[0].dtype == torch.bool else c)
            return
        if all(isinstance(v, Tensor) or a.numel() <= _MAX_EXACT for v, a in zip(known, inputs)):
            # only when it keeps an output: the weight gradient of a known row (the dry run's
            # forward is a ones row times each matrix) is a whole matrix, made on the CPU
            if any(t.numel() <= _MAX_EXACT for t in outs):
                self._recompute(func, args, kwargs, out, mutated)
        elif torch.Tag.pointwise in func.tags and all(not isinstance(v, Tensor) for v in known):
            one = {
                id(a): torch.full((1,) * a.ndim, v, dtype=a.dtype) for a, v in zip(inputs, known)
            }
            r = func(*tree_map(lambda x: one.get(id(x), x), (args, kwargs))[0], **kwargs)
            for t, v in zip(outs, tree_flatten(r)[0]):
                self.know(t, v.reshape(-1)[0].item())

    def _recompute(self, func: Any, args: Any, kwargs: Any, out: Any, mutated: list) -> None:
        """Run `func` on the CPU values of its (small, known) inputs; keep the results."""

        def cpu(x: Any) -> Any:
            if isinstance(x, Tensor) and x.device.type == "meta":
                v = self._exact(x)
                return v.clone() if v is not None else x
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x

        a2, k2 = tree_map(cpu, (args, kwargs))
        r = func(*a2, **k2)
        for t, v in zip(tree_flatten(out)[0], tree_flatten(r)[0]):
            if isinstance(t, Tensor) and isinstance(v, Tensor) and t.numel() <= _MAX_EXACT:
                self.know(t, v.detach().clone())


class HostData(TorchFunctionMode):
    """Keeps the values of tensors built from host data on the meta device (`torch.tensor`),
    which the dispatcher never sees."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, Tensor) or out.device.type != "meta":
            return out
        if func in _DATA_FLAGS and self.recorder.value(args[0]) is None:
            self.recorder.track(out)
            self.recorder.know(out, _DATA_FLAGS[func])
        if func in (torch.tensor, torch.as_tensor) and out.numel() <= _MAX_EXACT:
            host = {k: v for k, v in kwargs.items() if k not in ("device", "requires_grad")}
            self.recorder.track(out)
            self.recorder.know(out, torch.tensor(*args, **host))
        return out
