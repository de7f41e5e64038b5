"""The routing a run really has: for every trainable parameter, its optimizer, base LR, LR
scale (convention and factor), orientation and owner rank, read from a built optimizer.

`routing_report(opt, model)` takes what `build_optimizer` returns (or any single-process
optimizer over the model's parameters, a bare `Muon` included), a
`LayerwiseDistributedOptimizer` or an `FSDPOptimizer`, and returns one `ParamRoute` per
trainable parameter, in the model's order. `summarize_routing` condenses them into one line
per class of parameters (same optimizer, LR, scale and orientation) and, where matrices are
owned by ranks, one line of parameters per rank. `publish_routing` is what `orthoptim train`
calls at the start of a run: `routing.json` in the run folder and the summary on stdout.

Owner ranks are global ranks: "all" (a single-process or replicated optimizer: every rank
steps it), a rank (the layer-wise driver's owner of a whole matrix), "0: experts 0-3; 1:
experts 4-7" (an expert stack split across ranks), "sharded" (elements sharded over every
rank: the layer-wise driver's AdamW, FSDP's), or for an FSDP matrix "sharded (directions on
r)": elementwise state on every rank's shard, the whole-matrix step on rank r.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from orthoptim import collectives as C
from orthoptim.fileio import atomic_write_json
from orthoptim.optim.adamw import LeanAdamW
from orthoptim.optim.hybrid import HybridOptimizer
from orthoptim.optim.muon import Muon, is_transposed
from orthoptim.optim.registry import ELEMENTWISE_OPTIMIZERS, MATRIX_OPTIMIZERS
from orthoptim.optim.routing import stored_in_out
from orthoptim.optim.scion import Scion
from orthoptim.parallel.base import DistributedOptimizer
from orthoptim.parallel.fsdp import FSDPOptimizer
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer, unit_label
from orthoptim.parallel.layout import ParallelMesh

ROUTING_FILE = "routing.json"

ORIENTED = "[out, in]"
TRANSPOSED = "[in, out] stepped transposed"
AS_STORED = "[in, out] stepped as stored"  # a Conv1D weight an optimizer does not flip
ELEMENTWISE = "-"  # AdamW, Lion: no orientation

_NAMES: dict[type, str] = {
    **{cls: name for name, cls in MATRIX_OPTIMIZERS.items()},
    **{cls: name for name, cls in ELEMENTWISE_OPTIMIZERS.items()},
    LeanAdamW: "adamw",
}


@dataclass(frozen=True)
class ParamRoute:
    """One trainable parameter's routing: `optimizer` ("muon", "adamw", ...; "none" when no
    group of the optimizer holds it), `lr` (the group's base LR: `initial_lr` once a schedule
    set it, else `lr`), `lr_scale` (the convention's name, "none" for an elementwise
    optimizer) and `lr_scale_factors` (its factor for the [out, in] shape, one per row block of
    a `split` matrix whose blocks are scaled on their own), `orientation` and `owner`."""

    name: str
    shape: tuple[int, ...]
    optimizer: str
    lr: float | None
    lr_scale: str
    lr_scale_factors: tuple[float, ...]
    orientation: str
    owner: str

    def as_dict(self) -> dict[str, Any]:
        """The record as plain JSON values."""
        d = asdict(self)
        d["shape"] = list(self.shape)
        d["lr_scale_factors"] = list(self.lr_scale_factors)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ParamRoute:
        """The record `as_dict` gave."""
        factors = tuple(d["lr_scale_factors"])
        return cls(**{**d, "shape": tuple(d["shape"]), "lr_scale_factors": factors})


def optimizer_name(opt: torch.optim.Optimizer) -> str:
    """The registry name of a single optimizer ("muon", "adamw", "lion", ...), else its
    class name in lower case."""
    for cls in type(opt).__mro__:
        if cls in _NAMES:
            return _NAMES[cls]
    return type(opt).__name__.lower()


def _groups(opt: torch.optim.Optimizer) -> list[tuple[dict[str, Any], dict[str, Any], Any]]:
    """(group naming the whole model's parameters, group holding the current hyper-parameters,
    the optimizer stepping it) per param group. A driver's `template` (the whole-model
    optimizer) names every parameter; its exposed groups, one per template group in the same
    order, hold the LR a scheduler changes."""
    if isinstance(opt, DistributedOptimizer):
        template = opt.template
        return [
            (tg, g, template.inner[tg["optimizer"]])
            for tg, g in zip(template.param_groups, opt.param_groups, strict=True)
        ]
    if isinstance(opt, HybridOptimizer):
        return [(g, g, opt.inner[g["optimizer"]]) for g in opt.param_groups]
    return [(g, g, opt) for g in opt.param_groups]


def _scale(inner: Any, group: dict[str, Any], name: str, shape: tuple[int, ...]):
    """(convention, factors) of parameter `name` stepped by `inner` under `group`."""
    if not isinstance(inner, Muon) or len(shape) < 2:
        return "none", (1.0,)
    if isinstance(inner, Scion) and inner.norm_of(group, name, len(shape)) != "spectral":
        return "none", (1.0,)
    return group.get("lr_scale", "none"), inner.lr_scale_factors(shape, group, name)


def _ranges(items: list[tuple[int, int, int]]) -> str:
    """The owner text "0: experts 0-3; 1: experts 4-7" of (start, stop, rank) expert slices."""
    merged: list[list[int]] = []
    for start, stop, rank in sorted(items):
        if merged and merged[-1][2] == rank and merged[-1][1] == start:
            merged[-1][1] = stop
        else:
            merged.append([start, stop, rank])
    by_rank: dict[int, list[str]] = {}
    for start, stop, rank in merged:
        span = f"{start}" if stop - start == 1 else f"{start}-{stop - 1}"
        by_rank.setdefault(rank, []).append(span)
    return "; ".join(f"{r}: experts {', '.join(s)}" for r, s in sorted(by_rank.items()))


def owner_ranks(opt: torch.optim.Optimizer) -> dict[str, str]:
    """Parameter name → its owner, as the module docstring spells it; {} for an optimizer
    that is not a distributed driver (every parameter: "all")."""
    if isinstance(opt, LayerwiseDistributedOptimizer):
        parts: dict[str, list[tuple[int, int, int]]] = {}
        out: dict[str, str] = {}
        for ug in opt.unit_groups:
            for i in ug.units:
                unit = opt.units[i]
                r = opt.owner_of[unit_label(unit.name, unit.part)]
                if r < 0:
                    out[unit.name] = "sharded"
                    continue
                rank = C.global_rank(ug.group, r)
                start, stop = unit.part if unit.part is not None else (0, 0)
                parts.setdefault(unit.name, []).append((start, stop, rank))
        for name, items in parts.items():
            ranks = {r for _, _, r in items}
            out[name] = str(ranks.pop()) if len(ranks) == 1 else _ranges(items)
        return out
    if isinstance(opt, FSDPOptimizer):
        out = {n: "sharded" for n in opt.named}
        for name, r in opt.owner_of.items():
            out[name] = f"sharded (directions on {C.global_rank(opt.process_group, r)})"
        return out
    return {}


def routing_report(opt: torch.optim.Optimizer, model: nn.Module) -> list[ParamRoute]:
    """One `ParamRoute` per trainable parameter of `model` (a tied one once, under its first
    name), in the model's order, as `opt` steps it (see the module docstring)."""
    in_out = stored_in_out(model)
    owners = owner_ranks(opt)
    where: dict[str, tuple[dict[str, Any], dict[str, Any], Any]] = {}
    ids = {id(p): n for n, p in model.named_parameters()}
    for named, current, inner in _groups(opt):
        names = named.get("param_names") or [ids.get(id(p), "") for p in named["params"]]
        for n in names:
            where.setdefault(n, (named, current, inner))
    records = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        shape = tuple(p.shape)
        if name not in where:
            records.append(ParamRoute(name, shape, "none", None, "none", (1.0,), "-", "-"))
            continue
        named, current, inner = where[name]
        kind = current.get("optimizer") or optimizer_name(inner)
        lr = current.get("initial_lr", current.get("lr"))
        if kind in ELEMENTWISE_OPTIMIZERS or p.ndim < 2:
            orientation = ELEMENTWISE
        elif isinstance(inner, Muon) and is_transposed(named, name):
            orientation = TRANSPOSED
        else:
            orientation = AS_STORED if name in in_out else ORIENTED
        scale, factors = _scale(inner, named, name, shape)
        owner = owners.get(name, "all")
        records.append(ParamRoute(name, shape, kind, lr, scale, factors, orientation, owner))
    return records


def _number(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def summarize_routing(records: Iterable[ParamRoute]) -> str:
    """One line per class of parameters (optimizer, LR, LR scale, orientation), with their
    count, elements, owner (when they share one) and an example name; then, where ranks own
    parameters whole, the parameters per owner rank."""
    records = list(records)
    classes: dict[tuple[Any, ...], list[ParamRoute]] = {}
    for r in records:
        key = (r.optimizer, r.lr, r.lr_scale, r.lr_scale_factors, r.orientation)
        classes.setdefault(key, []).append(r)
    rows = [("optimizer", "lr", "lr scale", "orientation", "owner", "count", "elements", "e.g.")]
    for (kind, lr, scale, factors, orientation), rs in classes.items():
        distinct = [_number(f) for f in dict.fromkeys(factors)]
        by = distinct[0] if len(distinct) == 1 else f"({', '.join(distinct)})"
        scale_text = scale if scale == "none" else f"{scale} ×{by}"
        owners = {r.owner for r in rs}
        owner = owners.pop() if len(owners) == 1 else "by rank"
        elements = sum(_numel(r.shape) for r in rs)
        rows.append(
            (kind, _number(lr), scale_text, orientation, owner, str(len(rs)), f"{elements:,}",
             rs[0].name)
        )  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows
    ]
    per_rank: Counter[int] = Counter()
    for r in records:
        per_rank.update(int(part.split(":")[0]) for part in _owning(r.owner))
    if per_rank:
        lines.append(
            "parameters per owner rank: "
            + ", ".join(f"rank {k}: {v}" for k, v in sorted(per_rank.items()))
        )
    head = f"routing of {len(records)} trainable parameters ({len(classes)} classes)"
    return "\n".join([head, *lines])


def _owning(owner: str) -> list[str]:
    """The rank entries of an owner that names ranks ("3", "0: experts 0-1; 1: ..."), else []."""
    if owner.isdigit():
        return [owner]
    if ": experts" in owner:
        return owner.split("; ")
    return []


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def publish_routing(
    opt: torch.optim.Optimizer,
    model: nn.Module,
    out: Path,
    layout: ParallelMesh | None = None,
    file: TextIO | None = None,
    show: bool = True,
) -> list[ParamRoute] | None:
    """Write `routing_report(opt, model)` to `out`/routing.json (atomically, replacing the
    one a resumed run had) and, with `show`, print `summarize_routing` to `file` (default
    stdout), on global rank 0. Under pipeline parallelism (`layout` with pp > 1) every rank
    calls it: the stages' records are gathered over the pp group, so rank 0 writes the whole
    model's.
    Returns the records on rank 0, None elsewhere."""
    records = routing_report(opt, model)
    if layout is not None and layout.dims.pp > 1:
        stages = C.gather_object([r.as_dict() for r in records], group=layout.pp_group)
        if stages is None:
            return None
        # a parameter two stages hold (tied embeddings) once, under the first stage's record
        unique: dict[str, dict[str, Any]] = {}
        for d in (d for stage in stages for d in stage):
            unique.setdefault(d["name"], d)
        records = [ParamRoute.from_dict(d) for d in unique.values()]
    if C.world()[0] != 0:
        return None
    atomic_write_json(
        {"parameters": [r.as_dict() for r in records]}, Path(out) / ROUTING_FILE, indent=1
    )
    if show:
        print(summarize_routing(records), file=file or sys.stdout, flush=True)
    return records


def read_routing(out: Path) -> list[ParamRoute]:
    """The records `publish_routing` wrote to `out`/routing.json."""
    data = json.loads((Path(out) / ROUTING_FILE).read_text())
    return [ParamRoute.from_dict(d) for d in data["parameters"]]
