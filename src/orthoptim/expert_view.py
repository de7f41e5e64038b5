"""Expert parallelism's view of an optimizer's state, for checkpoints that load at any --ep.

Under --ep, rank e's stack of parameter `w` holds global experts [lo, hi) of E. Its
optimizer state is named by the global range (`w[lo:hi]`, or `w[lo+a:lo+b]` for a local
slice `w[a:b]`), and the layout reports `w` at its global shape, so the slices of every ep
rank join into the single-process optimizer's entry and are cut again on load.
`orthoptim.checkpoint` re-exports these names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from orthoptim.optim.state import StateView, ranged

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

ExpertSlices = dict[str, tuple[int, int, int]]  # name → (start, stop, n_expert), global


def expert_slices(model: nn.Module | None) -> ExpertSlices:
    """The model's expert-parallel stacks (`expert_parallel_slices()`, read duck-typed so
    that no driver imports the model's module; {} for other models)."""
    get = getattr(model, "expert_parallel_slices", None)
    return get() if callable(get) else {}


class ExpertSlicesView(StateView):
    """`inner` (a driver's `StateView` over an expert-parallel model) with global expert
    names: the state of a local stack of `slices[name] = (lo, hi, E)` is named `name[lo:hi]`
    (a local slice `name[a:b]`: `name[lo+a:lo+b]`) and the layout gives `name` the shape
    [E, ...]. `gather_group` (and the DCP group) must span every rank that holds another
    part of the state: the data-parallel group of a stage (ep inside dp). A driver returns it
    from `state_view()` when its model is expert-parallel."""

    spread = True

    def __init__(
        self, inner: StateView, slices: ExpertSlices, gather_group: ProcessGroup | None
    ) -> None:
        super().__init__(inner.opt, inner.kinds)
        self.inner, self.slices = inner, dict(slices)
        self.gather_group = self.dcp_group = gather_group
        self._local: dict[str, str] = {}  # global name → the inner view's name

    def _global(self, name: str) -> str:
        base, part = ranged(name, "[]")
        if base not in self.slices:
            return name
        lo, hi, _ = self.slices[base]
        a, b = part if part is not None else (0, hi - lo)
        out = f"{base}[{lo + a}:{lo + b}]"
        self._local[out] = name
        return out

    def _renamed(self, entries: dict[str, Any]) -> dict[str, Any]:
        return {self._global(n): v for n, v in entries.items()}

    def sync(self) -> None:
        self.inner.sync()

    def metadata(self) -> dict[str, Any]:
        meta = self.inner.metadata()
        shapes = dict(meta["shapes"])
        for name, (_, _, n_expert) in self.slices.items():
            if name in shapes:
                shapes[name] = [n_expert, *shapes[name][1:]]
        return {**meta, "shapes": shapes}

    def owned_params(self) -> dict[str, Tensor]:
        return self._renamed(self.inner.owned_params())

    def owned_state(self) -> dict[str, dict[str, Any]]:
        return self._renamed(self.inner.owned_state())

    def masters(self) -> dict[str, Tensor]:
        return self._renamed(self.inner.masters())

    def params(self) -> dict[str, Tensor]:
        return self.inner.params()

    def sends(self, name: str, key: str, value: Any) -> bool:
        return self.inner.sends(self._local.get(name, name), key, value)

    def keeps(self, name: str, key: str) -> bool:
        return self.inner.keeps(self._local.get(name, name), key)

    def elementwise(self, name: str, key: str) -> bool:
        return self.inner.elementwise(self._local.get(name, name), key)
