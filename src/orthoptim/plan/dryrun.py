"""The real optimizer code at any world size, on one CPU: `orthoptim plan --dry-run`.

Each simulated rank builds the planner's layout of a model (`plan.model.expand`: the same
parameter names and shapes, experts as 3-D [E, out, in] stacks, only this rank's stage and
its EP rank's experts) as a real `nn.Module` on the **meta** device (tensors with a shape,
a dtype and a device but no memory), joins a fake process group of the layout's size in
which it has that rank, makes the layout's groups as `orthoptim train` makes them
(`ParallelDims.build`: the same rank order, every group on every rank; 0.8 s at 4096 ranks),
and runs the real code: forward, backward, `clip_grad_norm_` and
two `step()`s of `LayerwiseDistributedOptimizer` (Muon, SOAP; tensor-parallel Muon through
`TensorParallelOrthogonalizer` in each mode) or `FSDPOptimizer` over FSDP2's `fully_shard`.

What makes that work:

* The fake process group (torch's `FakeProcessGroup`) is registered for the meta device
  only, so like NCCL it refuses a CPU tensor ("No backend type associated with device type
  cpu"); mixing a meta tensor with a CPU one in an op raises as a device mismatch would on a
  GPU. `collectives.device_for` maps the backend ("meta:...") to the meta device, so the
  library makes its flags and buffers there.
* A dispatch mode (`_Recorder`) sees every op: it answers host reads (`.item()`,
  `.tolist()`, `bool(t)`, `.cpu()` of a meta tensor) and counts them with the library
  function that made them; it knows the values of small tensors built from host data
  (`torch.tensor([...])`, the agreement flags) and constant tensors (zeros, `isfinite` of
  data, which is all True: a dry run's gradients are finite), and takes every simulated
  rank to hold what this one holds (a sum all-reduce multiplies a known value by the
  group's size), so every read gets the answer a healthy run gets (the library's flags
  count what is wrong: zero, unless a unit has no gradient anywhere); unknown values read
  as zeros; it records every collective (kind, group, dtypes and sizes, the root, and
  the kind `collectives.py` issued it as) in issue order; and it keeps the live storages
  (each counted once, views included) for the step's peak.
* The steady memory is read off the objects that hold it: parameters, the layer-wise
  bucket buffers, master copies, optimizer state, then gradients; each storage once.

CUDA-only paths: the meta device is not CUDA, so `COVERAGE` lists what this covers (the
assignment priced as on CUDA with Triton SYRK; Newton-Schulz in bf16 as "auto" picks on
CUDA) and what it does not (Triton kernels themselves, CUDA streams and events, the caching
allocator's fragmentation, NCCL's own buffers).
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from orthoptim import collectives as C
from orthoptim.plan.hardware import memory_verdict
from orthoptim.plan.model import Matrix, ModelDescription, expand
from orthoptim.plan.planner import (
    Layout,
    check_layout,
    check_stage,
    local_shape,
    stage_of_layers,
)

BACKEND = "orthoptim_meta"
DEVICE = torch.device("meta")
CATEGORIES = ("params", "grads", "masters", "state", "buffers")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the planner's dtype names
Parallel = Literal["layerwise", "fsdp"]  # the driver: Layout.fsdp

COVERAGE = {
    "covered": [
        "every tensor on a non-CPU device: a CPU tensor handed to a collective is refused as "
        "NCCL refuses it; a CPU tensor mixed into a device op raises",
        "bf16 Newton-Schulz (ns_dtype bfloat16, what 'auto' picks on CUDA)",
        "the ownership assignment priced as on CUDA with Triton SYRK (the GPU's owners)",
        "host reads (.item(), .tolist(), bool(), .cpu()) counted where the library makes them",
        "FSDP2 fully_shard and DTensor tensor parallelism on a device mesh",
    ],
    "not covered": [
        "the Triton kernels themselves (on meta Newton-Schulz takes the matmul path)",
        "CUDA streams and events (FSDP2's copy streams run as on CPU), the caching "
        "allocator's fragmentation, NCCL's own buffers and timeouts",
        "activations at a real batch size (the forward touches each parameter once)",
    ],
}


# -- what a run records ---------------------------------------------------------------------


@dataclass
class Collective:
    """One collective as the backend saw it: op, group ranks, tensor (dtype, shape)s, split
    sizes; the root's group rank (reduce, broadcast) and the kind `collectives.py` issued it
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

    @property
    def steady(self) -> int:
        return sum(self.memory[k] for k in CATEGORIES)


# -- value tracking and recording ------------------------------------------------------------

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


def _plain(t: Tensor) -> Tensor:
    return t._local_tensor if C.is_dtensor(t) else t  # type: ignore[attr-defined]


def _key(t: Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    t = _plain(t)
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def _is_output(func: Any, t: Tensor, args: Any) -> bool:
    """Whether `t` is the tensor a gather-like collective fills from the other ranks (its
    first argument), not one it reduces in place."""
    name = func.__name__
    first = tree_flatten(args[0])[0] if args else []
    return any(k in name for k in ("gather", "scatter", "alltoall", "recv")) and any(
        t is f for f in first
    )


def _site() -> str:
    """The innermost orthoptim function (outside this module and the `host.read` helper
    every library read goes through) on the stack."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name.startswith("orthoptim") and name not in (__name__, "orthoptim.host"):
            return f"{name}.{f.f_code.co_name}:{f.f_lineno}"
        f = f.f_back
    return "outside orthoptim"


class _Recorder(TorchDispatchMode):
    """Answers and counts host reads, knows small and constant values, records collectives
    and live storages (see the module docstring)."""

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
        t = _plain(t)
        if t.device.type != "meta":
            return
        st = t.untyped_storage()
        key = st._cdata
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
        if func is _aten._local_scalar_dense.default and args[0].device.type == "meta":
            return self._read(args[0]).item()
        if func is _aten._to_copy.default and args[0].device.type == "meta":
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
                from torch.distributed.distributed_c10d import _resolve_process_group

                group = tuple(dist.get_process_group_ranks(_resolve_process_group(a)))
                break
        tensors = tuple(
            (str(a.dtype).removeprefix("torch."), tuple(a.shape))
            for a in flat
            if isinstance(a, Tensor)
        )
        splits = tuple(
            tuple(a) for a in args if isinstance(a, list) and a and isinstance(a[0], int)
        )
        names = [a.name for a in func._schema.arguments]
        root = args[names.index("root_rank")] if "root_rank" in names else None
        # the `collective` argument of the library's one issuing function, when it issued it
        f, issued_as = sys._getframe(1), None
        while f is not None and issued_as is None:
            if f.f_code.co_name == "_issue" and f.f_globals.get("__name__") == C.__name__:
                issued_as = f.f_locals["collective"]
            f = f.f_back
        self.collectives.append(
            Collective(func.__name__.split(".")[0], group, tensors, splits, root, issued_as)
        )

    def _propagate(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        mutated = [
            t
            for i, a in enumerate(func._schema.arguments)
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


class _HostData(TorchFunctionMode):
    """Keeps the values of tensors built from host data on the meta device (`torch.tensor`),
    which the dispatcher never sees."""

    def __init__(self, recorder: _Recorder) -> None:
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


# -- the fake world --------------------------------------------------------------------------


def _register_backend() -> None:
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
    device only; torch and the library patched for the meta device (restored on exit):
    a device module for "meta", FSDP2's refusal of meta parameters lifted, and the layer-wise
    optimizer's Newton-Schulz costs priced as on CUDA with Triton (the GPU's assignment)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from orthoptim.parallel import assignment

    if dist.is_initialized():
        raise RuntimeError(
            "orthoptim plan --dry-run: a process group is already initialised in this process"
        )
    _register_backend()
    for_device = assignment.MatrixCost.for_device

    def priced_as_cuda(cls: Any, device: Any, dtype: Any = "auto", steps: int = 5) -> Any:
        if torch.device(device).type == "meta":
            return cls("cuda", torch.float32 if dtype is None else dtype, steps, True, "auto")
        return for_device(device, dtype, steps)

    validate = FSDPParamGroup._validate_no_meta_params
    torch.meta = _device_module()  # type: ignore[attr-defined]
    FSDPParamGroup._validate_no_meta_params = lambda self: None  # type: ignore[method-assign]
    assignment.MatrixCost.for_device = classmethod(priced_as_cuda)  # type: ignore[assignment]
    try:
        dist.init_process_group(BACKEND, rank=rank, world_size=world, store=FakeStore())
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        del torch.meta  # type: ignore[attr-defined]
        FSDPParamGroup._validate_no_meta_params = validate  # type: ignore[method-assign]
        assignment.MatrixCost.for_device = for_device  # type: ignore[method-assign]


# -- the model -------------------------------------------------------------------------------


class _Part(nn.Module):
    """A module of the described model: its own parameters, then its children, each used
    once in `forward` (a matmul with a ones row per matrix, a lookup per embedding table, a
    sum per vector), so backward yields every gradient in backward order. Matrices live in
    `nn.Linear` / `nn.Embedding` modules, as in a real model, so the default routing sees
    tables and heads."""

    def forward(self, idx: Tensor) -> Tensor:
        total = _terms(self, idx, lookup=False)
        for child in self._modules.values():
            if isinstance(child, (nn.Linear, nn.Embedding)):
                total = total + _terms(child, idx, isinstance(child, nn.Embedding))
            elif child is not None:
                total = total + child(idx)
        return total


def _terms(module: nn.Module, idx: Tensor, lookup: bool) -> Tensor:
    total = torch.zeros((), device=DEVICE)
    for p in module._parameters.values():
        if p is None:
            continue
        local = p.to_local() if C.is_dtensor(p) else p  # type: ignore[attr-defined]
        if local.ndim == 1:
            total = total + local.sum()
        elif lookup:
            total = total + F.embedding(idx % local.shape[0], local).sum()
        else:
            x = torch.ones(*local.shape[:-2], 1, local.shape[-1], device=DEVICE, dtype=local.dtype)
            total = total + (x @ local.mT).sum()
    return total


class DescribedModel(_Part):
    """The planner's layout of a model as an `nn.Module` (see `build_model`); `blocks` are the
    decoder layers (what FSDP2 shards one by one)."""

    @property
    def blocks(self) -> list[nn.Module]:
        return list(self.layers.children()) if hasattr(self, "layers") else []

    def get_input_embeddings(self) -> nn.Module | None:
        return getattr(self, "embed_tokens", None)

    def get_output_embeddings(self) -> nn.Module | None:
        return getattr(self, "lm_head", None)


def stage_matrices(desc: ModelDescription, layout: Layout, stage: int) -> list[Matrix]:
    """The units of pipeline stage `stage` in parameter order (embeddings on the first stage,
    the final norm and head on the last), experts of EP rank 0 only."""
    from orthoptim.plan.planner import _stage, split_matrices

    matrices = expand(desc)
    dense, experts = split_matrices(matrices, desc, layout.ep)
    keep = {id(m) for m in dense + experts}
    stages = stage_of_layers(desc.num_hidden_layers, layout.pp)
    return [m for m in matrices if id(m) in keep and _stage(m, stages, layout.pp) == stage]


def build_model(
    desc: ModelDescription,
    layout: Layout,
    stage: int = 0,
    dtype: torch.dtype = torch.float32,
    tp_mesh: Any = None,
) -> DescribedModel:
    """Stage `stage` of `desc` as a meta-device module with the planner's parameter names and
    this rank's shapes: TP-split matrices as DTensors sharded over `tp_mesh` (their local
    shard, `plan.planner.local_shape`), routed experts as [E/ep, out, in] stacks."""
    root = DescribedModel()
    shapes: dict[str, tuple[int, ...]] = {}
    tp_dims: dict[str, int | None] = {}
    lookups: set[str] = set()
    for m in stage_matrices(desc, layout, stage):
        if m.part is not None:
            e, out, inp = shapes.get(m.param, (0, *m.shape))
            shapes[m.param] = (e + 1, out, inp)
        else:
            shapes[m.param] = m.shape
        tp_dims[m.param] = m.tp_dim if layout.tp > 1 else None
        if m.lookup or m.param.startswith("embed"):
            lookups.add(m.param)
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod: nn.Module = root
        for i, part in enumerate(path):
            if part not in mod._modules:
                matrix = i == len(path) - 1 and leaf == "weight" and len(shape) == 2
                holder: nn.Module = _Part()
                if matrix and name in lookups:
                    holder = nn.Embedding(shape[0], shape[1], device=DEVICE)
                elif matrix:
                    holder = nn.Linear(shape[1], shape[0], bias=False, device=DEVICE)
                mod.add_module(part, holder)
            mod = mod._modules[part]  # type: ignore[assignment]
        dim = tp_dims[name]
        local = (
            local_shape(Matrix(name, shape, "", tp_dim=dim), layout.tp)
            if dim is not None
            else shape
        )
        data = torch.empty(local, dtype=dtype, device=DEVICE)
        if dim is not None:
            from torch.distributed.tensor import DTensor, Shard

            data = DTensor.from_local(data, tp_mesh, [Shard(dim)], run_check=False)
        if hasattr(mod, leaf):
            delattr(mod, leaf)
        mod.register_parameter(leaf, nn.Parameter(data))
    return root


# -- one simulated rank ----------------------------------------------------------------------


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
                x = _plain(x)
                if x.device.type != "meta":
                    continue
                st = x.untyped_storage()
                if st._cdata not in seen:
                    seen.add(st._cdata)
                    out[cat] += st.nbytes()

    params = list(model.parameters())
    add("params", params)
    rest: list[Tensor] = []
    if parallel == "layerwise":
        for b in opt._buckets:
            add("buffers", b.buffers())
            rest += [t for t in (b.params, b.grads) if t is not None]
        add("masters", list(opt.masters().values()))
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
    import time

    from orthoptim.parallel.fsdp import FSDPOptimizer, count_fsdp_collectives, shard_model
    from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
    from orthoptim.parallel.tensor_parallel import TensorParallelOrthogonalizer

    check_layout(desc, layout)
    dims = layout.dims
    dp, tp, pp = dims.dp, dims.tp, dims.pp
    check_stage(stage, pp)
    if not 0 <= rank < dp * tp:
        raise ValueError(f"--rank {rank} must be in [0, {dp * tp}) (dp {dp} x tp {tp})")
    optimizer, tp_mode = layout.optimizer, layout.tp_mode  # check_layout refused the rest
    parallel: Parallel = "fsdp" if layout.fsdp else "layerwise"
    grank = dims.rank_of(stage, rank // tp, rank % tp)
    t0 = time.perf_counter()
    rec = _Recorder()
    notes: list[str] = []
    with fake_world(grank, dims.world), rec, _HostData(rec):
        # every group of the layout, made as `orthoptim train` makes them
        mesh = dims.build("meta")
        model = build_model(desc, layout, stage, tp_mesh=mesh.tp_mesh if tp > 1 else None)
        kwargs: dict[str, Any] = {"bucket_mb": layout.bucket_mb}
        if optimizer == "muon":
            kwargs["ns_dtype"] = torch.bfloat16  # what "auto" picks on CUDA
            kwargs["ns_batch_mb"] = layout.ns_batch_mb  # the stacks' chunks the plan models
        # the model is built in fp32; a lower parameter dtype is the optimizer's (or FSDP2's
        # mixed precision)
        mixed = {}
        apart: dict[str, C.CommStats] = {}  # counters besides the optimizer's own
        if layout.param_dtype != "fp32":
            mixed = {"param_dtype": DTYPES[layout.param_dtype]}
        if parallel == "fsdp":
            if mixed:
                mixed["reduce_dtype"] = DTYPES[layout.grad_dtype]
            shard_model(model, mesh.fsdp_mesh, **mixed)
            fsdp_stats = C.CommStats()
            count_fsdp_collectives(model, fsdp_stats)
            apart["fsdp"] = fsdp_stats
            opt: Any = FSDPOptimizer(model, optimizer=optimizer, layout=mesh, **kwargs)
        else:
            if tp > 1:
                kwargs["orthogonalizer"] = TensorParallelOrthogonalizer(
                    mode=tp_mode, ns_dtype=torch.bfloat16
                )
                apart["tp"] = kwargs["orthogonalizer"].stats
            if mixed:
                mixed["grad_dtype"] = DTYPES[layout.grad_dtype]
            if layout.gather_dtype is not None:
                kwargs["gather_dtype"] = DTYPES[layout.gather_dtype]
            opt = LayerwiseDistributedOptimizer(
                model, optimizer=optimizer, layout=mesh, split_experts=True, **kwargs, **mixed,
            )  # fmt: skip
        rec.reads.clear()
        idx = torch.zeros(1, 4, dtype=torch.long, device=DEVICE)
        reads, collectives, memory, comm, expected, comm_apart = [], [], {}, {}, {}, {}
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
                    memory = _category_bytes(opt, model, parallel)
                opt.step()
                reads.append(dict(rec.reads))
                collectives.append(rec.collectives)
                if step == steps - 1:
                    comm, expected = opt.comm_stats(), opt.expected_comm_bytes()
                    comm_apart = {k: stats.as_dict() for k, stats in apart.items()}
                opt.zero_grad()
        peak = rec.peak
    kinds = ("reduce_scatter", "all_gather", "reduce", "broadcast", "all_to_all")
    sent = sum(comm.get(k, {}).get("sent", 0.0) for k in kinds)
    received = sum(comm.get(k, {}).get("received", 0.0) for k in kinds)
    orth = getattr(opt, "inner", None)
    return RankResult(
        rank=grank,
        world=dims.world,
        memory=memory,
        peak=peak,
        host_syncs=reads,
        collectives=collectives,
        comm=comm,
        expected=expected,
        comm_apart=comm_apart,
        comm_matches=_comm_check(comm, expected),
        bytes_per_step=max(sent, received),
        seconds=time.perf_counter() - t0,
        plan_index=stage * dp + mesh.coord.dp,
        optimizer=optimizer,
        notes=notes + ([] if orth is not None or parallel == "fsdp" else ["owns nothing"]),
    )


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


# -- the report ------------------------------------------------------------------------------


def plan_figures(plan: dict[str, Any], index: int) -> dict[str, float | None]:
    """`make_plan`'s figures for plan slot `index` (stage × dp rank) in the dry run's
    categories: its per-category memory (`memory_per_rank`) where the plan has it, else only
    the optimizer state; bytes per step of the bucket collectives (in the layout's gather
    dtype)."""
    out: dict[str, float | None] = dict.fromkeys((*CATEGORIES, "transient", "peak"))
    per = plan.get("memory_per_rank")
    if per:
        row = per["per_rank"][index]
        for k in out:
            out[k] = row.get(k)
        out["transient"] = row["peak"] - row["steady"]  # as the dry run's: step or backward
    else:
        out["state"] = plan["memory"]["layerwise_state_bytes_per_rank"][index]
    c = plan["comm"][f"{plan['layout']['gather_dtype']}_gather"]
    out["bytes"] = (
        None  # the plan's bytes are the layer-wise buckets'
        if plan["layout"].get("fsdp")
        else max(c["layerwise_sent_per_rank"][index], c["layerwise_received_per_rank"][index])
    )
    return out


def dry_run(
    desc: ModelDescription,
    layout: Layout,
    hardware: Any,
    ranks: list[int] | None = None,
    stage: int = 0,
    progress: Callable[[Any], Any] | None = None,
) -> dict[str, Any]:
    """`run_rank` for each of `ranks` (default 0 and the last of the stage), the plan's
    figures beside each, the cross-rank collective check, and whether the peak fits
    `hardware.memory_gb`; as a JSON-ready dict (`format_dry_run` prints it)."""
    from orthoptim.plan.planner import make_plan

    optimizer, tp_mode = layout.optimizer, layout.tp_mode
    parallel: Parallel = "fsdp" if layout.fsdp else "layerwise"
    n = layout.dp * layout.tp
    ranks = sorted(set(ranks if ranks else [0, n - 1]))
    plan = make_plan(desc, hardware, layout)
    results = []
    run = run_isolated if layout.tp > 1 else run_rank
    for r in progress(ranks) if progress is not None else ranks:
        results.append(run(desc, layout, r, stage))
    mismatches = [
        m for a in results for b in results if a.rank < b.rank for m in group_mismatches(a, b)
    ]
    capacity = hardware.memory_gb * 1e9
    rows = []
    for r in results:
        fits = r.peak <= capacity
        rows.append(
            {
                "rank": r.rank,
                "memory": r.memory,
                "steady": r.steady,
                "peak": r.peak,
                "transient": r.peak - r.steady,
                "bytes_per_step": r.bytes_per_step,
                "comm_stats": r.comm,
                "expected_comm_bytes": r.expected,
                "comm_matches_expected": r.comm_matches,
                "collectives_per_step": len(r.collectives[-1]),
                "host_syncs_per_step": host_syncs_per_step(r),
                "host_sync_sites": r.host_syncs[-1],
                "seconds": r.seconds,
                "plan": plan_figures(plan, r.plan_index),
                "fits": fits,
                "notes": r.notes,
            }
        )
    worst = max(rows, key=lambda x: x["peak"])
    over = sum(not x["fits"] for x in rows)
    return {
        "model": desc.name,
        "hardware": hardware.name,
        "memory_bytes": capacity,
        "layout": {**layout.__dict__, "stage": stage, "world": results[0].world},
        "optimizer": optimizer,
        "parallel": parallel,
        "tp_mode": tp_mode if layout.tp > 1 else None,
        "ranks": rows,
        "group_mismatches": mismatches,
        "fits": all(x["fits"] for x in rows),
        "verdict": memory_verdict(worst["peak"], capacity, hardware.name, over, len(rows)),
        "to_fit": [] if worst["fits"] else _to_fit(worst, layout, parallel, desc),
        "coverage": COVERAGE,
    }


def _to_fit(
    row: dict[str, Any], layout: Layout, parallel: Parallel, desc: ModelDescription
) -> list[str]:
    """Flags that shrink what dominates the peak, with the share each removes."""
    mem = row["memory"]
    out = []
    if parallel == "layerwise" and layout.tp == 1 and layout.ep == 1:
        out.append(
            f"--fsdp (parameters and gradients sharded over --dp {layout.dp}, no bucket "
            f"buffers: about {(mem['params'] + mem['grads'] + mem['buffers']) / 2**30:.1f} GiB "
            "of this rank's shrink by that factor)"
        )
    if layout.param_dtype == "fp32":
        out.append(
            f"--param-dtype bf16 (every rank's {mem['params'] / 2**30:.1f} GiB of parameters "
            "halve; fp32 master copies of the owned elements only)"
        )
    out.append(
        f"--pp {layout.pp * 2} (each stage holds half the layers: parameters, gradients, "
        "buffers and state about halve)"
    )
    if (
        desc.is_moe
        and desc.n_routed_experts % (layout.ep * 2) == 0
        and layout.dp % (layout.ep * 2) == 0
    ):
        out.append(f"--ep {layout.ep * 2} (half the experts per rank)")
    out.append(f"--tp {layout.tp * 2} (attention and dense MLP matrices split in two)")
    return out


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.3f}"


def format_dry_run(d: dict[str, Any]) -> str:
    """The human-readable report of `dry_run`'s dict: per rank, the dry run's figures with
    `plan`'s beside them."""
    lay = d["layout"]
    head = (
        f"orthoptim plan --dry-run: {d['model']} on {d['hardware']}, {d['parallel']} "
        f"{d['optimizer']}"
        + (f" (TP mode {d['tp_mode']})" if d["tp_mode"] else "")
        + f": DP {lay['dp']} x TP {lay['tp']} (EP {lay['ep']})"
        + (f", stage {lay['stage']} of PP {lay['pp']}" if lay["pp"] > 1 else "")
        + f", {lay['world']} simulated ranks on the meta device"
    )
    lines = [
        head,
        "",
        f"{'per rank (GiB)':<22}" + "".join(f"{'rank ' + str(r['rank']):>22}" for r in d["ranks"]),
    ]
    lines.append(f"{'':<22}" + "".join(f"{'dry run':>11}{'plan':>11}" for _ in d["ranks"]))

    def row(
        label: str, dry: Callable[[dict], Any], planned: Callable[[dict], Any], fmt: Callable = _gib
    ) -> None:
        lines.append(
            f"{label:<22}" + "".join(f"{fmt(dry(r)):>11}{fmt(planned(r)):>11}" for r in d["ranks"])
        )

    for k in CATEGORIES:
        row(k, lambda r, k=k: r["memory"][k], lambda r, k=k: r["plan"][k])
    row("transient", lambda r: r["transient"], lambda r: r["plan"]["transient"])
    row("peak", lambda r: r["peak"], lambda r: r["plan"]["peak"])
    cap = d["memory_bytes"]
    row(
        "fits", lambda r: r["peak"], lambda r: r["plan"]["peak"],
        lambda x: "-" if x is None else ("yes" if x <= cap else "no"),
    )  # fmt: skip
    row("bytes/step (buckets)", lambda r: r["bytes_per_step"], lambda r: r["plan"]["bytes"])
    row(
        "collectives/step", lambda r: r["collectives_per_step"], lambda r: None,
        lambda x: "-" if x is None else str(x),
    )  # fmt: skip
    row(
        "host syncs/step", lambda r: r["host_syncs_per_step"], lambda r: None,
        lambda x: "-" if x is None else str(x),
    )  # fmt: skip
    lines.append(f"{'seconds':<22}" + "".join(f"{r['seconds']:>11.1f}{'':>11}" for r in d["ranks"]))
    lines.append("")
    for r in d["ranks"]:
        sites = ", ".join(
            f"{s.rsplit('.', 1)[-1]} {n}" for s, n in sorted(r["host_sync_sites"].items())
        )
        ok = "equal" if r["comm_matches_expected"] else "DIFFERENT"
        lines.append(
            f"rank {r['rank']}: comm_stats() {ok} to expected_comm_bytes(); host syncs: {sites}"
        )
    lines.append(
        "collectives: every shared group issues the same sequence on the ranks run"
        if not d["group_mismatches"]
        else "collectives MISMATCH (NCCL would hang): " + "; ".join(d["group_mismatches"])
    )
    if d["fits"]:
        lines.append(f"{d['verdict']} (measured)")
    else:
        lines.append(f"{d['verdict']} (measured); flags that shrink it:")
        lines += [f"  {x}" for x in d["to_fit"]]
    lines.append("covers: " + "; ".join(d["coverage"]["covered"]))
    lines.append("does not cover: " + "; ".join(d["coverage"]["not covered"]))
    return "\n".join(lines)
