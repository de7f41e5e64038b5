"""The planner's layout of a model as a real `nn.Module` on the meta device: the same
parameter names and shapes (`plan.model.expand`), experts as 3-D [E, out, in] stacks, only
one pipeline stage and one EP rank's experts, TP-split matrices as DTensors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from orthoptim.plan.dryrun.world import DEVICE
from orthoptim.plan.layouts import Layout
from orthoptim.plan.model import Matrix, ModelDescription, expand
from orthoptim.plan.planner import local_shape, stage_of_layers
from orthoptim.shards import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


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
    for p in module.parameters(recurse=False):
        local = p.to_local() if is_dtensor(p) else p  # type: ignore[attr-defined]
        if local.ndim == 1:
            total = total + local.sum()
        elif lookup:
            total = total + F.embedding(idx % local.shape[0], local).sum()
        elif local.ndim == 2:
            x = torch.ones(1, local.shape[-1], device=DEVICE, dtype=local.dtype)
            total = total + (x @ local.mT).sum()
        else:
            # a stack's gradient made in its own layout, as a grouped GEMM's weight gradient
            # (bmm's of `x @ local.mT` comes transposed, and autograd copies it)
            x = torch.ones(*local.shape[:-2], local.shape[-1], 1, device=DEVICE, dtype=local.dtype)
            total = total + (local @ x).sum()
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
    from orthoptim.plan.planner import split_matrices, stage_of

    matrices = expand(desc)
    dense, experts = split_matrices(matrices, desc, layout.ep)
    keep = {id(m) for m in dense + experts}
    stages = stage_of_layers(desc.num_hidden_layers, layout.pp)
    return [m for m in matrices if id(m) in keep and stage_of(m, stages, layout.pp) == stage]


def build_model(
    desc: ModelDescription,
    layout: Layout,
    stage: int = 0,
    dtype: torch.dtype = torch.float32,
    tp_mesh: DeviceMesh | None = None,
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
