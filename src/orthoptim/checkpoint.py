"""Optimizer checkpoints that do not depend on the data-parallel size, saved atomically.

Every optimizer state is keyed by parameter NAME, never by rank or position, so a checkpoint
written by N ranks loads on any other number of ranks, or in a single process:

    full_state_dict(opt)        torch's optimizer format over the whole model (integer
                                indices in the order `build_optimizer(model, ...)` uses, plus
                                `param_names`): `build_optimizer(...).load_state_dict(sd)`
                                takes it as is; gathered to every rank, or to rank 0 only.
    sharded_state_dict(opt)     flat dict for torch.distributed.checkpoint (DCP): each rank
                                holds only what it owns, under `optim/state/<name>/<key>`.
    save_sharded / load_sharded DCP save (written aside, then renamed into place) and load
                                at any world size, model state included if given.
    atomic_save / atomic_load   torch.save to a temporary file, fsync, rename.

The distributed optimizers' `state_dict()` is `full_state_dict` (to every rank, or with
`state_dict_to="rank0"` to rank 0 only) and their `load_state_dict()` takes any full dict.
Expert slices of a `split_experts` run (`name[start:stop]`) are joined into their parameter's
entry in full dicts and cut again on load; DCP checkpoints keep one entry per slice and load
under any split. Runs of a sharded AdamW parameter (`name{lo:hi}`: elements lo:hi of the
flattened parameter, one per rank) are joined into the parameter's entry in full dicts; in
DCP checkpoints every rank writes its run as the boxes it covers of the full-size state
tensor (`FlatShard`), under the parameter's key, so the stored tensor is the parameter's
whole state, which loads as runs of any length or whole.

Expert parallelism: a model cut by `expert_parallelize` says which global experts each local
stack holds (`model.expert_parallel_slices()`); `save_sharded` / `load_sharded` store its
stacks as their slices of the full [E, ...] tensors, so model checkpoints move between any
--ep and a single process. The optimizer's side: `ExpertSlicesView` wraps a driver's
`StateView` so its expert state carries global slice names and shapes; the layer-wise
optimizer's `state_view()` returns it over such a model, so the full and sharded dicts of an
--ep run are the single-process optimizer's and load at any --ep and --dp.

Before anything is loaded the checkpoint is compared with the optimizer (parameter names
and shapes, the optimizer of each group, hyper-parameters that change what the state means);
every difference is listed in one `CheckpointMismatchError` and nothing is modified.

Hyper-parameters a scheduler may change (`SCHEDULED_HYPERS`) are restored from the
checkpoint, as torch does; every other hyper-parameter must be equal.
"""

from __future__ import annotations

import contextlib
import functools
import io
import itertools
import math
import os
import shutil
import warnings
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any, Literal, get_args

import torch
import torch.distributed as dist
from torch import Tensor, nn

from orthoptim import collectives as C
from orthoptim._torch_compat import disabled_torch_function_impl, make_wrapper_subclass
from orthoptim.expert_view import ExpertSlices as ExpertSlices
from orthoptim.expert_view import ExpertSlicesView, expert_slices
from orthoptim.fileio import atomic_write, fsync_dir
from orthoptim.optim.state import (
    IMPLEMENTATION_HYPERS,
    NOT_HYPERS,
    SCHEDULED_HYPERS,
    CheckpointMismatchError,
    StateView,
    base_name,
    check_optimizer,
    check_state_dict,
    compare,
    describe,
    flat_label,
    is_full_state_dict,
    meta_from_full,
    ranged,
    require_full,
    shapes_from_state,
    state_view,
    validate,
)
from orthoptim.safe_load import ONE_LINE_CHARS as ONE_LINE_CHARS
from orthoptim.safe_load import (
    CheckpointLoadError,
    MetadataUnpickler,
    atomic_load,
    load_file,
    pack,
    reading,
    safe_load,
    unpack,
)
from orthoptim.safe_load import one_line as one_line
from orthoptim.shards import cut_like, is_dtensor, wrap_local

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "META_KEY",
    "SCHEDULED_HYPERS",
    "STATE_DICT_TO",
    "CheckpointLoadError",
    "CheckpointMismatchError",
    "ExpertSlicesView",
    "StateView",
    "atomic_load",
    "atomic_save",
    "check_state_dict",
    "expert_slices",
    "full_state_dict",
    "is_full_state_dict",
    "load_file",
    "load_full_state_dict",
    "load_sharded",
    "load_sharded_state_dict",
    "parse_sharded_key",
    "save_sharded",
    "sharded_state_dict",
]

# Where a distributed optimizer's `state_dict()` delivers the full dict (its `state_dict_to`):
# every rank, or rank 0 only (the others get {}).
StateDictTo = Literal["all", "rank0"]
STATE_DICT_TO: tuple[StateDictTo, ...] = get_args(StateDictTo)
# The keys of `sharded_state_dict`: the layout, and each owned parameter's state entries and
# master copy under its name.
META_KEY = "optim/meta"
_STATE_PREFIX, _MASTER_PREFIX = "optim/state/", "optim/master/"


def parse_sharded_key(key: str) -> tuple[Literal["state", "master"], str, str] | None:
    """(kind, parameter name, state entry; "" for a master) of a `sharded_state_dict` key
    `optim/state/<name>/<entry>` or `optim/master/<name>`; None for any other key."""
    if key.startswith(_STATE_PREFIX):
        name, _, entry = key[len(_STATE_PREFIX) :].rpartition("/")
        return "state", name, entry
    if key.startswith(_MASTER_PREFIX):
        return "master", key[len(_MASTER_PREFIX) :], ""
    return None


# -- install, shared by every loader -----------------------------------------------------------


@torch.no_grad()
def _install(
    opt: torch.optim.Optimizer,
    saved_meta: dict[str, Any],
    state: dict[str, dict[str, Any]],
    masters: dict[str, Tensor],
) -> None:
    """Replace `opt`'s hyper-parameters and the state of every owned parameter with the
    checkpoint's (called only after `compare` found nothing)."""
    for g, sg in zip(opt.param_groups, saved_meta["groups"]):
        g.update(
            {
                k: v
                for k, v in sg["hypers"].items()
                if k not in NOT_HYPERS and k not in IMPLEMENTATION_HYPERS
            }
        )
    view = state_view(opt)
    owned = view.owned_params()
    state_of = _by_base(state)
    masters_of = _by_base({n: {"master": m} for n, m in masters.items()})
    for n, p in owned.items():
        opt.state.pop(p, None)
        st = _take(state_of.get(base_name(n), {}), n, tuple(p.shape))
        if st is not None:
            opt.state[p] = {
                k: _placed(v, p, view.elementwise(n, k)) for k, v in st.items() if view.keeps(n, k)
            }
    for n, m in view.masters().items():
        st = _take(masters_of.get(base_name(n), {}), n, tuple(m.shape))
        m.copy_(st["master"] if st is not None else owned[n])


# -- expert slices ------------------------------------------------------------------------------
# A layer-wise optimizer built with split_experts owns `name[start:stop]`, a slice of the
# experts (dim 0) of a 3-D parameter; its state tensors are that slice of the parameter's.
# Checkpoints may hold whole-parameter or slice entries; `_take` cuts or joins them.


def _range(name: str) -> tuple[str, tuple[int, int] | None]:
    """An expert slice's range: "w[2:4]" → ("w", (2, 4)); "w" → ("w", None)."""
    return ranged(name, "[]")


def _take(
    entries: dict[str, dict[str, Any]], name: str, shape: tuple[int, ...] | None = None
) -> dict[str, Any] | None:
    """The state of `name` (a parameter, an expert slice or a run of a sharded parameter)
    from `entries`, keyed by parameter, slice or run names: as is, cut from the whole
    parameter's entry, or joined from slice or run entries (runs joined into a whole
    parameter take its `shape`). None when `entries` holds nothing for it; a partial cover
    raises."""
    if name in entries:
        return entries[name]
    base, run = _flat_range(name)
    runs = (_flat_range(k) for k in entries)
    if run is not None or any(r is not None and b == name for b, r in runs):
        return _take_run(entries, base, run, shape)
    base, want = _range(name)
    return _joined(entries, base, want, _range, _rows, name)


def _by_base(entries: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """`entries` (keyed by parameter, slice or run names) grouped by parameter, so that each
    `_take` looks at its own parameter's entries only."""
    out: dict[str, dict[str, Any]] = {}
    for k, v in entries.items():
        out.setdefault(base_name(k), {})[k] = v
    return out


def _flat_range(name: str) -> tuple[str, tuple[int, int] | None]:
    """A run's range: "w{2:9}" → ("w", (2, 9)); "w" → ("w", None)."""
    return ranged(name, "{}")


def _take_run(
    entries: dict[str, dict[str, Any]],
    base: str,
    want: tuple[int, int] | None,
    shape: tuple[int, ...] | None,
) -> dict[str, Any] | None:
    """`_take` of elements `want` (None: all, shaped `shape`) of the flattened parameter
    `base` from its whole entry or its runs' entries."""
    what = flat_label(base, *want) if want is not None else base
    whole = math.prod(shape) if shape is not None else None
    out = _joined(entries, base, want, _flat_range, _numel, what, whole=whole, flat=True)
    if out is None or want is not None or shape is None:
        return out
    return {k: v.reshape(shape) if isinstance(v, Tensor) and v.ndim >= 1 else v
            for k, v in out.items()}  # fmt: skip


def _joined(
    entries: dict[str, dict[str, Any]],
    base: str,
    want: tuple[int, int] | None,
    parse: Callable[[str], tuple[str, tuple[int, int] | None]],
    size: Callable[[dict[str, Any]], int],
    what: str,
    whole: int | None = None,
    flat: bool = False,
) -> dict[str, Any] | None:
    """Range `want` (None: 0 to `whole`, default the end of the last piece) of parameter
    `base`, joined from the entries `parse` names as its pieces (a whole entry spans 0 to
    `size(entry)`): along dim 0, or over the flattened tensors with `flat`. None when no
    entry belongs to `base`; pieces that leave a gap in the range raise, naming `what`."""
    pieces = []  # (start, stop, entry) of every entry for this parameter
    for key, entry in entries.items():
        b, r = parse(key)
        if b == base:
            pieces.append((*(r if r is not None else (0, size(entry))), entry))
    if not pieces:
        return None
    pieces.sort(key=lambda x: x[0])
    if whole is None:
        whole = max(stop for _, stop, _ in pieces)
    lo, hi = want if want is not None else (0, whole)
    cover = [x for x in pieces if x[0] < hi and x[1] > lo]
    gaps = any(a[1] != b[0] for a, b in itertools.pairwise(cover))
    if not cover or cover[0][0] > lo or cover[-1][1] < hi or gaps:
        held = [k for k in entries if parse(k)[0] == base]
        raise CheckpointMismatchError(
            [f"state of {what}: the checkpoint's entries {held} do not cover it"]
        )
    out: dict[str, Any] = {}
    for k, v in cover[0][2].items():
        if isinstance(v, Tensor) and v.ndim >= 1:
            parts = [e[k].reshape(-1) if flat else e[k] for _, _, e in cover]
            joined = torch.cat(parts) if len(parts) > 1 else parts[0]
            out[k] = joined[lo - cover[0][0] : hi - cover[0][0]]
        else:
            out[k] = v  # per-parameter scalars (step counts) are the same in every piece
    return out


def _numel(entry: dict[str, Any]) -> int:
    """Elements of a whole parameter's state entry (its first non-scalar tensor)."""
    return next(v.numel() for v in entry.values() if isinstance(v, Tensor) and v.ndim >= 1)


def _rows(entry: dict[str, Any]) -> int:
    """Dim 0 (the expert count) of a whole parameter's state entry."""
    return next(v.shape[0] for v in entry.values() if isinstance(v, Tensor) and v.ndim >= 1)


def _placed(v: Any, p: Tensor, elementwise: bool) -> Any:
    """A saved state value as a fresh tensor on `p`'s device; a full elementwise tensor of a
    DTensor parameter becomes a DTensor laid out like it (each rank keeps its shard)."""
    if not isinstance(v, Tensor):
        return v
    if elementwise and is_dtensor(p) and not is_dtensor(v) and v.shape == p.shape:
        return cut_like(v.detach().to(p.device_mesh.device_type, copy=True), p)
    return v.detach().to(p.device, copy=True)


def _model_entries(model: nn.Module, fresh: bool = False) -> dict[str, Any]:
    """`model`'s state for DCP (`fresh`: empty tensors to read into): each expert-parallel
    stack as its slice of the full [E, ...] tensor (a `FlatShard`: experts are dim 0, so a
    slice is one run of the row-major flattening)."""
    sd = model.state_dict()
    out: dict[str, Any] = {k: torch.empty_like(v) if fresh else v for k, v in sd.items()}
    for k, (lo, _, n_expert) in expert_slices(model).items():
        local = out[k]
        whole = (n_expert, *local.shape[1:])
        out[k] = FlatShard(local.detach().contiguous(), whole, lo * math.prod(whole[1:]))
    return out


def _model_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Every model entry's shape in the checkpoint: the full [E, ...] for expert stacks."""
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for k, (_, _, n_expert) in expert_slices(model).items():
        shapes[k] = (n_expert, *shapes[k][1:])
    return shapes


# -- full state dicts (torch format) ------------------------------------------------------------


def full_state_dict(opt: torch.optim.Optimizer, to_rank0: bool = False) -> dict[str, Any]:
    """The whole optimizer's state in torch's format, as `build_optimizer(model, ...)` over
    the whole model would return it: integer indices numbered group by group in model order,
    each group's `param_names`, and an `"orthoptim"` entry (the `describe()` of the optimizer
    and the fp32 master copies of a `gather_dtype` run) that the loaders check.

    On a layer-wise optimizer the owners' states are gathered: to every rank, or with
    `to_rank0=True` to rank 0 only (the others return {}). DTensor state (FSDPOptimizer's,
    sharded like its parameters) is all-gathered into full tensors; with `to_rank0` only
    global rank 0 keeps the result. Tensors are copies on the CPU. Collective.
    """
    check_optimizer(opt)
    view = state_view(opt)
    view.sync()
    meta = view.metadata()
    # DTensor state (FSDP, tensor-parallel parameters) is all-gathered into full tensors, in
    # the same (parameter, key) order on every rank; only what this rank `sends` is kept.
    # Each tensor is copied to the CPU as soon as it is whole, so at most one full tensor is
    # on the device at a time.
    state: dict[str, dict[str, Any]] = {}
    with C.phase("full state dict (unshard and copy to the CPU)"):
        for n, st in view.owned_state().items():
            entry = {}
            for k, v in st.items():
                whole = C.unshard(v)
                if view.sends(n, k, v):
                    entry[k] = _cpu(whole)
            if entry:
                state[n] = entry
        masters = {n: _cpu(C.unshard(m)) for n, m in view.masters().items()}
    local = {"state": state, "master": masters}
    if view.spread:
        group = view.gather_group
        with C.phase("full state dict gather", group):
            if to_rank0:
                parts = C.gather_object(local, dst=0, group=group)
            else:
                parts = C.all_gather_object(local, group=group)
        if parts is None:
            return {}
    elif to_rank0 and C.world()[0] != 0:
        return {}  # every rank holds the whole (unsharded) state: rank 0 of the job keeps it
    else:
        parts = [local]
    pieces: dict[str, dict[str, Any]] = {}
    master_pieces: dict[str, dict[str, Any]] = {}
    for part in parts:
        for n, st in part["state"].items():  # a name's entries may come from several ranks
            pieces.setdefault(n, {}).update(st)
        master_pieces.update({n: {"master": m} for n, m in part["master"].items()})
    # expert slices (split_experts) and runs (sharded AdamW) are joined into their
    # parameter's entry
    shapes = {n: tuple(s) for n, s in meta["shapes"].items()}
    pieces_of, master_pieces_of = _by_base(pieces), _by_base(master_pieces)
    state = {
        n: st for g in meta["groups"] for n in g["names"]
        if (st := _take(pieces_of.get(n, {}), n, shapes.get(n)))
    }  # fmt: skip
    master = {
        n: st["master"]
        for n in dict.fromkeys(base_name(k) for k in master_pieces)
        if (st := _take(master_pieces_of.get(n, {}), n, shapes.get(n)))
    }
    index: dict[str, int] = {}
    groups = []
    for g in meta["groups"]:
        ids = []
        for n in g["names"]:
            index[n] = len(index)
            ids.append(index[n])
        groups.append({**g["hypers"], "params": ids, "param_names": list(g["names"])})
    return {
        "state": {index[n]: st for n, st in state.items()},
        "param_groups": groups,
        "orthoptim": {"meta": meta, "master": master},
    }


def _cpu(v: Any) -> Any:
    return v.detach().to("cpu", copy=True) if isinstance(v, Tensor) else v


def load_full_state_dict(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Load a `full_state_dict` (or a single-process optimizer's `state_dict()`) into a
    layer-wise or single-process optimizer: each rank takes the state of what it owns.

    Every mismatch is listed in one `CheckpointMismatchError` before anything changes. State
    tensors keep their saved dtype (torch's own loader would cast a bf16 parameter's fp32
    momentum to bf16).
    """
    check_optimizer(opt)
    require_full(sd)
    saved_meta = meta_from_full(sd)
    here = describe(opt)
    if not saved_meta["shapes"]:
        saved_meta = {**saved_meta, "shapes": shapes_from_state(sd, saved_meta, here)}
    names = {i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    state = {names[i]: st for i, st in sd["state"].items()}
    validate(opt, saved_meta)
    _install(opt, saved_meta, state, sd.get("orthoptim", {}).get("master", {}))


# -- sharded state dicts (DCP) --------------------------------------------------------------------


def sharded_state_dict(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's share of the optimizer for `torch.distributed.checkpoint.save`: the state
    of each parameter it owns under `optim/state/<name>/<key>`, fp32 master copies under
    `optim/master/<name>`, and `optim/meta` (the same on every rank). No key mentions a rank
    or a world size. Values are the live tensors (no copy)."""
    check_optimizer(opt)
    view = state_view(opt)
    view.sync()
    meta = view.metadata()
    out: dict[str, Any] = {META_KEY: pack(meta)}

    def value(name: str, v: Any) -> tuple[str, Any]:
        # a run of a sharded parameter: its boxes of the full-size tensor, under its key
        base, run = _flat_range(name)
        if run is None or not isinstance(v, Tensor) or v.ndim == 0:
            return base, v
        return base, FlatShard(v, tuple(meta["shapes"][base]), run[0])

    for n, st in view.owned_state().items():
        for k, v in st.items():
            base, v = value(n, v)
            out[f"{_STATE_PREFIX}{base}/{k}"] = v
    for n, m in view.masters().items():
        base, m = value(n, m)
        out[f"{_MASTER_PREFIX}{base}"] = m
    return out


def load_sharded_state_dict(opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Install a dict read with DCP (keys as `sharded_state_dict`, for the parameters this
    rank owns now, whatever world size wrote them); validates first, lists every mismatch."""
    saved_meta = unpack(sd[META_KEY], f"the state dict's {META_KEY!r} entry")
    validate(opt, saved_meta)
    state: dict[str, dict[str, Any]] = {}
    masters: dict[str, Tensor] = {}
    for key, v in sd.items():
        parsed = parse_sharded_key(key)
        if parsed is None:
            continue
        kind, name, k = parsed
        if kind == "state":
            state.setdefault(name, {})[k] = v
        else:
            masters[name] = v
    # runs read as `FlatShard`s go under their run's name
    for name in list(state):
        run = next((v for v in state[name].values() if isinstance(v, FlatShard)), None)
        if run is not None:
            st = state.pop(name)
            state[run.label(name)] = {
                k: v.local if isinstance(v, FlatShard) else v for k, v in st.items()
            }
    for name in list(masters):
        if isinstance(masters[name], FlatShard):
            run = masters.pop(name)
            masters[run.label(name)] = run.local
    _install(opt, saved_meta, state, masters)


def flat_boxes(
    shape: tuple[int, ...], start: int, stop: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The boxes (offsets, sizes) that elements start:stop of the row-major flattening of a
    tensor of `shape` cover, in order: a partial first row, whole rows, a partial last row,
    recursively (at most 2·ndim − 1 boxes)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(start, inner), divmod(stop, inner)
    rest = [0] * (len(shape) - 1)

    def row(r: int, lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((r, *o), (1, *z)) for o, z in flat_boxes(shape[1:], lo, hi)]

    if r0 == r1:
        return row(r0, c0, c1)
    boxes = []
    if c0:
        boxes += row(r0, c0, inner)
        r0 += 1
    if r1 > r0:
        boxes.append(((r0, *rest), (r1 - r0, *shape[1:])))
    if c1:
        boxes += row(r1, 0, c1)
    return boxes


class FlatShard(Tensor):
    """One rank's run of a tensor of `shape`: elements `offset` : `offset + local.numel()` of
    its row-major flattening, held in the 1-D `local` (a sharded AdamW parameter's state or
    master copy). To torch.distributed.checkpoint it is the full-size tensor of which this
    rank holds the boxes its run covers (`flat_boxes`): a save writes them as chunks under
    the tensor's key (the ranks' runs tile it), a load reads them from whatever chunks the
    checkpoint holds, so runs reshard to any other runs or to whole tensors. Only DCP's
    protocol is implemented; use `local` for anything else."""

    local: Tensor
    offset: int

    @staticmethod
    def __new__(cls, local: Tensor, shape: tuple[int, ...], offset: int) -> FlatShard:
        t = make_wrapper_subclass(cls, shape, dtype=local.dtype, device=local.device)
        t.local = local.view(-1)
        t.offset = int(offset)
        t._boxes = []
        start = 0
        for off, size in flat_boxes(tuple(shape), t.offset, t.offset + local.numel()):
            t._boxes.append((off, size, start))
            start += math.prod(size)
        return t

    __torch_function__ = disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(
            f"{func}: a FlatShard is one rank's run of a sharded optimizer state, for "
            "torch.distributed.checkpoint only; use its .local (the run's elements)"
        )

    def __repr__(self) -> str:  # type: ignore[override]
        return (
            f"FlatShard(elements {self.offset}:{self.offset + self.local.numel()} of "
            f"{tuple(self.shape)}, {self.dtype})"
        )

    def label(self, name: str) -> str:
        """The run's name (`flat_label`) in a state dict of parameter `name`."""
        return flat_label(name, self.offset, self.offset + self.local.numel())

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        props = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)),
                    properties=props,
                    size=self.shape,
                ),
            )
            for off, size, _ in self._boxes
        ]

    def __create_chunk_list__(self) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size))
            for off, size, _ in self._boxes
        ]

    def __get_tensor_shard__(self, index: Any) -> Tensor:
        for off, size, start in self._boxes:
            if tuple(off) == tuple(index.offset):
                return self.local[start : start + math.prod(size)].view(size)
        raise ValueError(f"{index.fqn}: this rank holds no box at offset {index.offset}")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns on every call made without a process group; that is intended here."""
    with warnings.catch_warnings():
        if not (dist.is_available() and dist.is_initialized()):
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


@functools.cache
def _safe_dcp() -> tuple[type, type]:
    """DCP's file reader and load planner, made to unpickle nothing that
    `torch.load(weights_only=True)` would refuse: DCP reads `.metadata` with `pickle.load`
    and non-tensor items with `torch.load(weights_only=False)`."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            # FileSystemReader.read_metadata with a restricted unpickler
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as f:
                metadata = MetadataUnpickler(f, os.fspath(path)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class Planner(DefaultLoadPlanner):
        def __init__(self, path: str) -> None:
            super().__init__()
            self.path = path

        def load_bytes(self, read_item: Any, value: IO[bytes]) -> None:
            fqn = read_item.dest_index.fqn
            obj = safe_load(value, f"{fqn!r} of checkpoint {self.path}")
            # the parent places it in the state dict; what it unpickles is only what passed
            super().load_bytes(read_item, io.BytesIO(pack(obj)))

    return Reader, Planner


def dcp_load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    process_group: ProcessGroup | None = None,
) -> None:
    """`torch.distributed.checkpoint.load(state_dict, checkpoint_id=path, process_group=...)`
    that unpickles only what `torch.load(weights_only=True)` allows (and DCP's own metadata
    records): a checkpoint that would run code while loading is refused instead. Any failure
    to read raises `CheckpointLoadError` (an Exception, unlike DCP's `CheckpointException`)
    naming every rank's reason. Collective over `process_group`."""
    reader, planner = _safe_dcp()
    path = os.fspath(path)
    with _quiet(), reading(path), C.issuing("torch.distributed.checkpoint.load", process_group):
        _dcp().load(
            state_dict,
            storage_reader=reader(path),
            planner=planner(path),
            process_group=process_group,
        )


def _template(md: Any, like: Tensor | None) -> Tensor:
    """An empty tensor for DCP to read a stored tensor of metadata `md` into: sharded like
    `like` (the parameter it belongs to) when that is a DTensor of the same shape, so each
    rank reads only its shard; else the whole tensor."""
    shape = tuple(md.size)
    if like is not None and is_dtensor(like) and tuple(like.shape) == shape:
        local = torch.empty(like.to_local().shape, dtype=md.properties.dtype)
        return wrap_local(local, like)
    return torch.empty(shape, dtype=md.properties.dtype)


def save_sharded(
    path: str | os.PathLike[str],
    opt: torch.optim.Optimizer,
    model: nn.Module | None = None,
    extra: dict[str, Any] | None = None,
    _before_rename: Callable[[str], None] | None = None,
) -> None:
    """Save `opt` (and `model`'s state, and `extra` picklable values) as a DCP checkpoint at
    `path`, atomically: every rank writes into `<path>.partial`, then rank 0 swaps it into
    place (`path` → `<path>.old`, `.partial` → `path`, `.old` removed). A save killed at any
    point leaves a loadable checkpoint: `path`, or `<path>.old` between the two renames, which
    `load_sharded` falls back to. Collective: call on every rank of the optimizer's group.
    """
    check_optimizer(opt)
    dcp = _dcp()
    group = state_view(opt).dcp_group
    rank, _ = C.world(group)
    path = os.fspath(path)
    partial, old = path + ".partial", path + ".old"
    sd: dict[str, Any] = dict(sharded_state_dict(opt))
    if model is not None:
        sd.update({f"model/{k}": v for k, v in _model_entries(model).items()})
    for k, v in (extra or {}).items():
        sd[f"extra/{k}"] = pack(v)
    if rank == 0 and os.path.exists(partial):
        shutil.rmtree(partial)
    with C.phase("checkpoint save", group):
        C.barrier(group)
        with _quiet(), C.issuing("torch.distributed.checkpoint.save", group):
            dcp.save(sd, checkpoint_id=partial, process_group=group)
    if rank == 0:  # local file operations: their OSError names the path
        if _before_rename is not None:
            _before_rename(partial)
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.replace(path, old)
        os.replace(partial, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        if os.path.exists(old):
            shutil.rmtree(old)
    with C.phase("checkpoint save: waiting for rank 0 to move it into place", group):
        C.barrier(group)


def resolve(path: str | os.PathLike[str]) -> str:
    """The directory to load for checkpoint `path`: `path`, or `<path>.old` when a save was
    killed between its two renames."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    if os.path.isdir(path + ".old"):
        return path + ".old"
    raise FileNotFoundError(f"no checkpoint at {path} (nor {path}.old)")


def load_sharded(
    path: str | os.PathLike[str],
    opt: torch.optim.Optimizer,
    model: nn.Module | None = None,
) -> dict[str, Any]:
    """Load a `save_sharded` checkpoint written at any world size into `opt` (and `model`).

    Each rank reads only the state of the parameters it owns now. Names, shapes, optimizers
    and hyper-parameters are checked first, for the model too; every mismatch is listed in
    one `CheckpointMismatchError` and neither the model nor the optimizer is touched.
    Returns the `extra` values saved with it. Collective: call on every rank. A checkpoint
    that cannot be read (missing or damaged files) raises `CheckpointLoadError`, an
    Exception, in place of DCP's `CheckpointException` (a BaseException); so does one that
    would run code while loading (nothing is unpickled beyond what
    `torch.load(weights_only=True)` allows, `dcp_load`), before anything is changed.
    """
    check_optimizer(opt)
    group = state_view(opt).dcp_group
    path = resolve(path)
    stored = _stored_metadata(path)
    with C.phase("checkpoint load (metadata)", group):
        head: dict[str, Any] = {META_KEY: None}
        dcp_load(head, path, group)
    saved_meta = unpack(head[META_KEY], f"{META_KEY!r} of checkpoint {path}")
    mismatches = compare(saved_meta, describe(opt))
    model_sd = model.state_dict() if model is not None else {}
    if model is not None:
        mismatches += _model_mismatches(model, model_sd, stored)
    if mismatches:
        raise CheckpointMismatchError(mismatches)
    want = _read_targets(state_view(opt), stored)
    fresh_model = (
        {f"model/{k}": v for k, v in _model_entries(model, fresh=True).items()}
        if model is not None
        else {}
    )
    want.update(fresh_model)
    with C.phase("checkpoint load", group):
        dcp_load(want, path, group)
    extra = {
        k[len("extra/") :]: unpack(v, f"{k!r} of checkpoint {path}")
        for k, v in want.items()
        if k.startswith("extra/")
    }
    # Everything was read (and nothing refused): only now change anything.
    with torch.no_grad():
        for k, v in model_sd.items():
            got = fresh_model[f"model/{k}"]
            v.copy_(got.local.view_as(v) if isinstance(got, FlatShard) else got)
    load_sharded_state_dict(opt, {**want, META_KEY: head[META_KEY]})
    return extra


def _stored_metadata(path: str) -> dict[str, Any]:
    """What DCP checkpoint `path` stores (key → its storage metadata), read as `dcp_load`
    reads; a failure to read it is a `CheckpointLoadError`."""
    reader, _ = _safe_dcp()
    try:
        return reader(path).read_metadata().state_dict_metadata
    except CheckpointLoadError:
        raise
    except Exception as exc:
        raise CheckpointLoadError(
            f"could not read the metadata of checkpoint {path}: {type(exc).__name__}: {exc}"
        ) from exc


def _model_mismatches(
    model: nn.Module, model_sd: dict[str, Any], stored: dict[str, Any]
) -> list[str]:
    """How the model entries of a checkpoint (`stored`'s `model/` keys) differ from `model`'s
    state dict `model_sd`: entries missing on either side, shapes that differ."""
    mismatches = []
    model_shapes = _model_shapes(model)
    saved_model = {k[len("model/") :]: v for k, v in stored.items() if k.startswith("model/")}
    for k in sorted(set(model_sd) - set(saved_model)):
        mismatches.append(f"model entry {k}: in this model, missing from the checkpoint")
    for k in sorted(set(saved_model) - set(model_sd)):
        mismatches.append(f"model entry {k}: in the checkpoint, not in this model")
    for k in sorted(set(saved_model) & set(model_sd)):
        size = getattr(saved_model[k], "size", None)
        if size is not None and list(size) != list(model_shapes[k]):
            mismatches.append(
                f"model entry {k}: shape {tuple(size)} in the checkpoint, {model_shapes[k]} here"
            )
    return mismatches


def _read_targets(view: StateView, stored: dict[str, Any]) -> dict[str, Any]:
    """What this rank reads of the optimizer's entries in `stored` (key → its storage
    metadata), as DCP's targets: the entries of the parameters it owns (whole, or the expert
    slices it owns: entries of the same parameter are read and cut or joined by `_take`; or
    its run of a sharded parameter: only those elements are read), and the `extra` values."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    owned_params = view.owned_params()
    named = view.params()
    need_state = {base_name(n) for n in owned_params}
    need_master = {base_name(n) for n in view.masters()}
    runs = dict(_flat_range(n) for n in owned_params if _flat_range(n)[1] is not None)
    want: dict[str, Any] = {}
    for key, md in stored.items():
        if key.startswith("extra/"):
            want[key] = None
            continue
        parsed = parse_sharded_key(key)
        if parsed is None:
            continue
        kind, name, entry = parsed
        if kind == "state" and not view.keeps(name, entry):
            continue
        needed = need_state if kind == "state" else need_master
        if base_name(name) not in needed:
            continue
        if isinstance(md, BytesStorageMetadata):
            want[key] = None
        elif name in runs and len(md.size) > 0:
            lo, hi = runs[name]
            run = torch.empty(hi - lo, dtype=md.properties.dtype)
            want[key] = FlatShard(run, tuple(md.size), lo)
        else:
            like = owned_params.get(name, named.get(name))
            if kind == "state" and not view.elementwise(name, entry):
                like = None  # whole-matrix state: read whole
            want[key] = _template(md, like)
    return want


# -- single-file atomic save ------------------------------------------------------------------


def atomic_save(
    obj: Any,
    path: str | os.PathLike[str],
    _before_rename: Callable[[str], None] | None = None,
) -> None:
    """`torch.save(obj, path)` that never leaves a partial file at `path`: written to a
    temporary file in the same directory, flushed to disk, then renamed over `path`
    (`fileio.atomic_write`)."""
    atomic_write(path, lambda f: torch.save(obj, f), before_rename=_before_rename)
