"""The checkpoint state view of the layer-wise optimizer."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from orthoptim import checkpoint
from orthoptim import collectives as C
from orthoptim.optim.registry import state_kinds_of
from orthoptim.optim.state import FORMAT_VERSION, StateView, hypers


class LayerwiseView(StateView):
    """`StateView` of a layer-wise optimizer: what this rank owns (whole units, expert slices
    `w[a:b]`, runs `w{a:b}` of sharded AdamW parameters) under the whole model's layout.
    `opt`: the `LayerwiseDistributedOptimizer` (typed loosely: it imports this module)."""

    spread = True

    def __init__(self, opt: Any, slices: checkpoint.ExpertSlices | None = None) -> None:
        kinds = {g["optimizer"]: state_kinds_of(g["optimizer"]) for g in opt.param_groups}
        of = {u.name: kinds.get(u.kind, {}) for u in opt.units}
        super().__init__(opt, lambda name: of.get(name, {}))
        self.lw = opt
        self.slices = slices or {}  # the expert-parallel stacks (an `ExpertSlicesView` wraps it)
        self.gather_group = opt.process_group
        # DCP over the data-parallel group; under tensor parallelism over the whole world
        # (each tp rank writes and reads its own shards)
        tp = any(C.world(g)[1] > 1 for g in opt.tp_groups)
        self.dcp_group = None if tp else opt.process_group

    def sync(self) -> None:
        self.lw.wait_for_params()

    def metadata(self) -> dict[str, Any]:
        opt = self.lw
        self._check_experts()
        named = dict(opt.model.named_parameters())
        # units are in backward order; expert slices of one parameter share its name
        order = list(dict.fromkeys(u.name for u in reversed(opt.units)))
        kinds = {u.name: u.kind for u in opt.units}
        groups = [
            {"hypers": hypers(g), "names": [n for n in order if kinds[n] == g["optimizer"]]}
            for g in opt.param_groups
        ]
        shapes = {n: list(named[n].shape) for n in order}
        return {"format": FORMAT_VERSION, "groups": groups, "shapes": shapes}

    def _check_experts(self) -> None:
        """Refuse a layout whose expert state one name-keyed dict cannot hold: the units
        owned over the expert group must be exactly the model's expert-parallel stacks (each
        expert group then holds its own global experts, which `ExpertSlicesView` names)."""
        opt = self.lw
        experts = [i for g in opt.unit_groups if g.expert for i in g.units]
        grouped = {opt.units[i].name for i in experts}
        if grouped == set(self.slices):
            return
        if not self.slices:
            # Each expert group steps its own copy of the experts under the same names.
            raise NotImplementedError(
                "full and sharded checkpoints (state_dict(), save_sharded) of a layer-wise "
                "optimizer built with an expert_group need the model to say which global "
                "experts each rank holds (model.expert_parallel_slices(), as "
                "orthoptim.train.model.expert_parallelize leaves it); without it, expert "
                "groups hold different experts under the same parameter names: save "
                "opt.inner.state_dict() on every rank and load it with "
                "opt.inner.load_state_dict() at the same layout (opt.inner is None on a rank "
                "that owns nothing)"
            )
        raise NotImplementedError(
            "full and sharded checkpoints of a layer-wise optimizer over an expert-parallel "
            f"model need its expert-parallel stacks {sorted(self.slices)} to be exactly the "
            f"units owned over the expert group, {sorted(grouped)}: build it with "
            "layout=<the ParallelMesh the model was expert_parallelize'd over> and route the "
            "expert stacks to the matrix optimizer"
        )

    def owned_params(self) -> dict[str, Tensor]:
        inner = self.lw.inner
        return {} if inner is None else StateView(inner).owned_params()

    def masters(self) -> dict[str, Tensor]:
        return self.lw.masters()

    def params(self) -> dict[str, Tensor]:
        return dict(self.lw.model.named_parameters())
