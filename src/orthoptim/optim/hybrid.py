"""Hybrid routing: hidden matrices to a matrix optimizer (Muon, SOAP), the rest to AdamW.

`build_optimizer` decides which parameter goes where; `HybridOptimizer` holds both inner
optimizers behind one `torch.optim.Optimizer` so that schedulers, `state_dict()` and
`zero_grad()` treat them as one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from orthoptim._validate import check_betas, check_choice, check_nonnegative
from orthoptim.optim.adamw import LeanAdamW
from orthoptim.optim.base import (
    CompositeOptimizer,
    GuardedOptimizer,
    NonfinitePolicy,
    TraceTimeInit,
    check_nonfinite_policy,
    check_params,
    init_torch_state,
    merged_defaults,
    param_names,
    position_name,
    step_checked,
)
from orthoptim.optim.guards import ParamSet
from orthoptim.optim.lean import check_rounding_seed, check_state_dtype
from orthoptim.optim.lion import Lion
from orthoptim.optim.muon import Muon
from orthoptim.optim.registry import (
    ELEMENTWISE_OPTIMIZERS,
    MATRIX_OPTIMIZERS,
    OPTIMIZER_NAMES,
    ElementwiseOptimizerName,
    OptimizerName,
)
from orthoptim.optim.routing import ModelRoute, RoutePredicate, stored_in_out
from orthoptim.optim.state import StateView
from orthoptim.shards import is_dtensor


def default_route(model: nn.Module) -> ModelRoute:
    """The default routing rule for `model`: `rule(name, param)` is True for the matrix
    optimizer, False for AdamW (see `orthoptim.optim.routing` for the rules, and
    `explain_routing(model)` for each parameter's reason)."""
    return ModelRoute(model)


class HybridOptimizer(GuardedOptimizer, CompositeOptimizer):
    """One optimizer over a matrix optimizer and AdamW, each owning a disjoint set of params.

    `param_groups` is the matrix optimizer's groups followed by AdamW's (the same dicts, so
    an LR scheduler's change reaches the inner optimizers); each group carries an `"optimizer"`
    key naming its owner. The non-finite policy is applied once for the whole step, so "skip"
    skips both inner optimizers together.
    """

    marks_stepped = True  # its inner optimizers count what they step
    records_updates = True  # and record their updates (`step_checked`)

    def __init__(
        self,
        inner: dict[str, torch.optim.Optimizer],
        nonfinite: NonfinitePolicy = "raise",
    ) -> None:
        if not isinstance(inner, dict) or not inner:
            raise ValueError(
                f"inner must be a non-empty dict of name -> torch.optim.Optimizer, got {inner!r}"
            )
        for key, opt in inner.items():
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"inner[{key!r}] must be a torch.optim.Optimizer, got {type(opt).__name__}"
                )
        self.nonfinite = check_nonfinite_policy(nonfinite)
        check_params("HybridOptimizer", [g for opt in inner.values() for g in opt.param_groups])
        groups: list[dict[str, Any]] = []
        for key, opt in inner.items():
            for g in opt.param_groups:
                g["optimizer"] = key
                groups.append(g)
        CompositeOptimizer.__init__(self, [p for g in groups for p in g["params"]])
        self.inner = inner
        self.adopt(groups, self.state, merged_defaults(list(inner.values())))
        self._share_state()
        self._trace_time_init = TraceTimeInit(self)

    def _share_state(self) -> None:
        """Let every inner optimizer read and write this optimizer's `state` (disjoint params)."""
        for opt in self.inner.values():
            self.state.update(opt.state)
            opt.state = self.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the inner optimizer named by its `"optimizer"` key.

        When the other groups name their parameters (those of `build_optimizer` do), the new
        group's `"param_names"` default to their places, `param_groups[g]['params'][i]`
        (names are what checkpoints match parameters by)."""
        if not hasattr(self, "inner"):
            super().add_param_group(param_group)
            return
        key = param_group.get("optimizer")
        if key not in self.inner:
            raise ValueError(
                f"a new param group needs an 'optimizer' key naming one of {sorted(self.inner)}, "
                f"got {key!r} (and, optionally, 'param_names': one name per parameter)"
            )
        opt = self.inner[key]
        group = {k: v for k, v in param_group.items() if k != "optimizer"}
        params = group["params"]
        group["params"] = params = [params] if isinstance(params, torch.Tensor) else list(params)
        held = param_names(self)
        for p in params:
            if id(p) in held:
                raise ValueError(
                    f"parameter {held[id(p)]} is already stepped by this optimizer: a parameter in "
                    "two groups would be stepped twice a step; leave it out of the new group"
                )
        named = any(g.get("param_names") is not None for g in opt.param_groups)  # all or none
        if named and "param_names" not in group:
            gi = len(self.param_groups)
            group["param_names"] = [position_name(gi, i) for i in range(len(params))]
        names = group.get("param_names")
        if names is not None and not named:
            raise ValueError(
                f"the {key!r} param groups do not name their parameters: leave 'param_names' "
                "out of the new group"
            )
        if names is not None and len(names) != len(params):
            raise ValueError(
                f"the new group's 'param_names' must list one name per parameter "
                f"({len(params)}), got {len(names)}: {list(names)!r}"
            )
        opt.add_param_group(group)
        group = opt.param_groups[-1]
        group["optimizer"] = key
        self.param_groups.append(group)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, after the checks of `GuardedOptimizer.load_state_dict` (a dict of
        another routing, model or optimizer raises `CheckpointMismatchError` listing every
        difference), then re-bind the inner optimizers to the loaded groups and state."""
        super().load_state_dict(state_dict)
        for key, opt in self.inner.items():
            opt.param_groups = [g for g in self.param_groups if g["optimizer"] == key]
            opt.state = self.state

    def state_view(self) -> StateView:
        """State by parameter name; each entry's kind from the inner optimizer stepping it."""
        kinds = {
            n: getattr(self.inner[g["optimizer"]], "state_kinds", {})
            for g in self.param_groups
            for n in g.get("param_names") or []
        }
        return StateView(self, lambda name: kinds.get(name, {}))

    def _params(self) -> list[torch.Tensor]:
        """Every parameter, inner optimizer by inner optimizer: a compiled step reaches each
        group through its owner first, as torch's traced `_init_group` needs."""
        return [p for opt in self.inner.values() for g in opt.param_groups for p in g["params"]]

    def _before_compiled_step(self) -> None:
        """This optimizer's `_init_group` (its latch, every inner optimizer's state), run in
        Python through `TraceTimeInit`: not as this optimizer's own `_init_group`, which
        dynamo would follow by guarding the inner groups under this optimizer's indices,
        where torch's traced steps look them up in their own."""
        self._trace_time_init._init_group()

    def init_compiled_state(self) -> None:
        """Every inner optimizer's state for its parameters with a gradient: an orthoptim
        one's `init_compiled_state`, a torch one's (AdamW's step count and moments) as its
        next step would make it (`init_torch_state`)."""
        for opt in self.inner.values():
            if isinstance(opt, GuardedOptimizer):
                opt.init_compiled_state()
            else:
                init_torch_state(opt)

    def _update(self) -> None:
        """Step every inner optimizer (the non-finite policy already covered all of them)."""
        for opt in self.inner.values():
            step_checked(opt)


def build_optimizer(
    model: nn.Module,
    optimizer: OptimizerName = "muon",
    lr: float | None = None,
    adamw_lr: float = 3e-4,
    adamw_betas: tuple[float, float] = (0.9, 0.95),
    adamw_eps: float = 1e-8,
    adamw_weight_decay: float = 0.0,
    route: RoutePredicate | None = None,
    nonfinite: NonfinitePolicy = "raise",
    params: Iterable[tuple[str, nn.Parameter]] | None = None,
    elementwise: ElementwiseOptimizerName = "adamw",
    state_dtype: torch.dtype | None = None,
    rounding_seed: int = 0,
    **kw: Any,
) -> HybridOptimizer:
    """Build the optimizer for `model`: hidden matrices → `optimizer`, the rest → AdamW.

    `optimizer` is a matrix optimizer of `orthoptim.optim.registry.MATRIX_OPTIMIZERS` ("muon",
    "soap", "normuon", "adamuon", "polargrad", "scion") or "adamw" (plain AdamW over
    everything, the baseline; it uses `lr` when given, else `adamw_lr`).
    `route(name, param) -> bool` overrides the default rule (True → matrix optimizer; the
    default, `default_route(model)`, is described in `orthoptim.optim.routing`, and
    `explain_routing(model)` prints its reasons). `params`
    restricts the build to a subset of the model's named parameters (the layer-wise
    distributed optimizer passes the ones a rank owns). Extra keyword arguments go to the
    matrix optimizer. Frozen parameters are left out. `elementwise` is the optimizer of the
    non-matrix part: "adamw", or "lion" (`orthoptim.optim.lion.Lion`, with `adamw_lr` and
    `adamw_weight_decay` as its LR and decay; its betas are its own).

    Fused matrices: Muon's `split` ({name: row sizes}) defaults to `model.split_spec()` when
    the model has one (the built-in GPT does: fused QKV and gate/up); pass `split={}` to
    orthogonalize fused matrices whole. Every name in it must be a matrix routed to Muon.
    Weights stored [in, out] (Hugging Face's `Conv1D`, GPT-2) are found in the model and
    passed as Muon's `transposed` (their LR scales are those of the [out, in] map; a `split`
    of one counts output features); `transposed=()` steps them as stored.

    `state_dtype=torch.bfloat16` stores Muon's momentum (its variants' too) and AdamW's
    moments in bfloat16, computed in float32 and stored by stochastic rounding seeded by
    `rounding_seed` (`orthoptim.optim.lean`; AdamW is then `LeanAdamW`); None or
    torch.float32 (the default) keeps float32 state and torch's AdamW. SOAP and Lion keep
    float32 state and refuse it.
    """
    check_choice("optimizer", optimizer, sorted(OPTIMIZER_NAMES))
    check_choice("elementwise", elementwise, tuple(ELEMENTWISE_OPTIMIZERS))
    check_nonfinite_policy(nonfinite)
    lean = check_state_dtype(state_dtype)
    check_rounding_seed(rounding_seed)
    muon_like = issubclass(MATRIX_OPTIMIZERS.get(optimizer, object), Muon)
    _check_combination(optimizer, elementwise, lean, muon_like)
    if lr is not None:
        check_nonnegative("lr", lr)
    check_nonnegative("adamw_lr", adamw_lr)
    check_betas("adamw_betas", adamw_betas)
    check_nonnegative("adamw_eps", adamw_eps)
    check_nonnegative("adamw_weight_decay", adamw_weight_decay)
    if route is not None and not callable(route):
        raise TypeError(f"route must be a callable (name, param) -> bool or None, got {route!r}")
    rule = route if route is not None else default_route(model)
    named = list(params) if params is not None else list(model.named_parameters())
    named = [(n, p) for n, p in named if p.requires_grad]

    if muon_like:  # Muon and its variants
        kw["split"] = _split_for(model, rule, kw.get("split"))
        kw["transposed"] = _transposed_for(model, rule, kw.get("transposed"))
        if lean is not None:
            kw.update(state_dtype=lean, rounding_seed=rounding_seed)

    adamw_kw = dict(betas=adamw_betas, eps=adamw_eps, weight_decay=adamw_weight_decay)
    adamw: Any = torch.optim.AdamW
    if lean is not None:
        adamw = LeanAdamW
        adamw_kw.update(state_dtype=lean, rounding_seed=rounding_seed)
    inner: dict[str, torch.optim.Optimizer] = {}
    if optimizer == "adamw":
        if kw:
            raise ValueError(f"optimizer='adamw' takes no extra arguments, got {sorted(kw)}")
        if named:
            inner["adamw"] = adamw(
                named, lr=lr if lr is not None else adamw_lr, **adamw_kw, **_foreach(adamw, named)
            )
    else:
        matrix = [(n, p) for n, p in named if rule(n, p)]
        rest = [(n, p) for n, p in named if not rule(n, p)]
        if matrix:
            if lr is not None:
                kw["lr"] = lr
            inner[optimizer] = MATRIX_OPTIMIZERS[optimizer](matrix, **kw)
        if rest and elementwise == "lion":
            inner["lion"] = Lion(rest, lr=adamw_lr, weight_decay=adamw_weight_decay)
        elif rest:
            inner["adamw"] = adamw(rest, lr=adamw_lr, **adamw_kw, **_foreach(adamw, rest))
    if not inner:
        raise ValueError("build_optimizer found no trainable parameters")
    opt = HybridOptimizer(inner, nonfinite=nonfinite)
    opt.param_set = ParamSet("build_optimizer", dict(named), whole=params is None, model=model)
    return opt


def _check_combination(
    optimizer: str, elementwise: str, lean: torch.dtype | None, muon_like: bool
) -> None:
    """Refuse an elementwise optimizer beside optimizer='adamw', and bf16 state for an
    optimizer that keeps float32 state (SOAP, Lion)."""
    if optimizer == "adamw" and elementwise != "adamw":
        raise ValueError(
            f"optimizer='adamw' is AdamW for every parameter; elementwise={elementwise!r} "
            "chooses the optimizer of the non-matrix part next to a matrix optimizer"
        )
    if lean is not None and (elementwise == "lion" or not (muon_like or optimizer == "adamw")):
        what = f"elementwise={elementwise!r}" if elementwise == "lion" else repr(optimizer)
        raise ValueError(
            "state_dtype=torch.bfloat16 stores Muon's (and its variants') momentum and AdamW's "
            f"moments; {what} keeps float32 state: leave state_dtype unset for it"
        )


def _foreach(adamw: Any, named: list[tuple[str, nn.Parameter]]) -> dict[str, bool]:
    """torch's AdamW over parameters that mix DTensors and plain tensors (a tensor-parallel
    model's split embedding beside its replicated norms) steps them one by one: its foreach
    ops, torch's default on CUDA, refuse such a list ("got mixed torch.Tensor and DTensor")."""
    mixed = adamw is torch.optim.AdamW and len({is_dtensor(p) for _, p in named}) > 1
    return {"foreach": False} if mixed else {}


def _split_for(
    model: nn.Module, rule: RoutePredicate, split: dict[str, Any] | None
) -> dict[str, Any]:
    """Muon's `split` for `model`: the given one, else the model's `split_spec()`, checked
    against the whole model (names must be matrices routed to Muon)."""
    if split is None:
        spec = getattr(model, "split_spec", None)
        split = dict(spec()) if callable(spec) else {}
    named = dict(model.named_parameters())
    for name in split:
        p = named.get(name)
        if p is None or not rule(name, p):
            why = "is not a parameter of the model" if p is None else "is not routed to Muon"
            raise ValueError(f"split names {name!r}, which {why}")
    return dict(split)


def _transposed_for(
    model: nn.Module, rule: RoutePredicate, transposed: Iterable[str] | None
) -> tuple[str, ...]:
    """Muon's `transposed` for `model`: the given names, else the weights the model stores
    [in, out] (`stored_in_out`) that go to Muon; given names must be 2-D matrices routed to
    Muon."""
    named = dict(model.named_parameters())
    if transposed is None:
        return tuple(sorted(n for n in stored_in_out(model) if rule(n, named[n])))
    if isinstance(transposed, str):
        raise TypeError(f"transposed must be a collection of names, got {transposed!r}")
    for name in transposed:
        p = named.get(name)
        if p is None or not rule(name, p):
            why = "is not a parameter of the model" if p is None else "is not routed to Muon"
            raise ValueError(f"transposed names {name!r}, which {why}")
    return tuple(sorted(transposed))


def routing_table(optimizer: HybridOptimizer) -> dict[str, str]:
    """Parameter name → the name of the inner optimizer that owns it ("muon", ..., "adamw")."""
    table: dict[str, str] = {}
    for g in optimizer.param_groups:
        names = g.get("param_names") or [f"<unnamed {i}>" for i in range(len(g["params"]))]
        for n in names:
            table[n] = g["optimizer"]
    return table
