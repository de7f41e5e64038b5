"""Pieces every orthoptim optimizer shares: parameter names, the non-finite gradient policy,
and the view of a parameter as a stack of matrices.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import Any, Literal, get_args

import torch
from torch import Tensor

from orthoptim import host
from orthoptim._torch_compat import foreach_norm
from orthoptim._validate import check_choice
from orthoptim.optim import telemetry
from orthoptim.optim.guards import ParamSet, mark_stepped, one_step
from orthoptim.optim.state import StateView, check_state_dict
from orthoptim.shards import is_dtensor

logger = logging.getLogger("orthoptim")

#: what a step does with a NaN/Inf gradient: raise `NonFiniteGradientError`, or skip the step
NonfinitePolicy = Literal["raise", "skip"]
NONFINITE_POLICIES: tuple[NonfinitePolicy, ...] = get_args(NonfinitePolicy)


class NonFiniteGradientError(ValueError):
    """A gradient holds NaN or Inf under the `nonfinite="raise"` policy; `names` lists the
    parameters whose gradients do."""

    def __init__(self, message: str, names: list[str] | None = None) -> None:
        super().__init__(message)
        self.names = names or []


def check_nonfinite_policy(policy: NonfinitePolicy) -> NonfinitePolicy:
    """Validate a `nonfinite` argument."""
    return check_choice("nonfinite", policy, NONFINITE_POLICIES)


def position_name(group: int, index: int) -> str:
    """The name of an unnamed parameter: its place in `param_groups`."""
    return f"param_groups[{group}]['params'][{index}]"


def param_name(group: dict[str, Any], gi: int, pi: int) -> str:
    """A readable name of parameter `pi` of group `gi`: the name given at construction, else
    its place and shape."""
    given = group.get("param_names")
    if given is not None:
        return given[pi]
    return f"{position_name(gi, pi)} (shape {tuple(group['params'][pi].shape)})"


def param_names(optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(param) → a readable name (`param_name`) of every parameter of `optimizer`."""
    return {
        id(p): param_name(group, gi, pi)
        for gi, group in enumerate(optimizer.param_groups)
        for pi, p in enumerate(group["params"])
    }


def sparse_gradient_error(owner: str, name: str, grad: Tensor) -> ValueError:
    """The error for a sparse gradient of parameter `name` reaching optimizer `owner`."""
    return ValueError(
        f"{owner}: the gradient of {name} is sparse ({grad.layout}), and orthoptim's optimizers "
        "take dense gradients only; give that parameter dense gradients (for an nn.Embedding, "
        "sparse=False, the default)"
    )


def check_dense_grads(optimizer: torch.optim.Optimizer, params: Iterable[Tensor]) -> None:
    """Refuse a sparse gradient among `params` of `optimizer`, naming its parameter (torch's own
    error, from the first elementwise op on it, names neither)."""
    for p in params:
        if p.grad is not None and p.grad.layout != torch.strided:
            name = param_names(optimizer).get(id(p), f"shape {tuple(p.shape)}")
            raise sparse_gradient_error(type(optimizer).__name__, name, p.grad)


def nonfinite_params(params: Iterable[Tensor]) -> list[Tensor]:
    """The parameters whose gradient holds NaN or Inf (one host read for all of them, through
    `orthoptim.host`; a norm that overflows from finite entries costs one more)."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return []
    grads = [p.grad for p in with_grad]
    plain = all(type(g) is Tensor and not g.is_sparse for g in grads)
    if plain and len({g.device for g in grads}) == 1:
        # A NaN or Inf entry makes the 2-norm NaN or Inf; one foreach call is far cheaper than
        # an isfinite pass per tensor (and than the max-abs norm: 13 ms vs 100 ms for 28M
        # float32 entries at 1 thread). A norm that overflows from finite entries is
        # re-checked exactly.
        norms = foreach_norm(grads, ord=2)
        finite = torch.stack([n.to(torch.float32) for n in norms]).isfinite()
        bad = host.read(~finite, "non-finite gradient check")
        for i in bad.nonzero().flatten().tolist():
            exact = torch.isfinite(grads[i]).all()
            bad[i] = not bool(host.read(exact, "non-finite gradient check (norm overflow)"))
    else:
        checks = [torch.isfinite(g).all() for g in grads]
        # A sharded (DTensor) gradient's check is reduced over its mesh, so every rank agrees.
        checks = [c.full_tensor() if is_dtensor(c) else c for c in checks]
        bad = host.read(~torch.stack(checks), "non-finite gradient check")
    return [p for p, b in zip(with_grad, bad.tolist()) if b]


def enforce_nonfinite_policy(
    policy: NonfinitePolicy, names: list[str], world_size: int = 1, compiled: bool = False
) -> bool:
    """Raise or warn for the parameters `names` whose gradients are non-finite.

    Returns True when the step must be skipped, False when `names` is empty. `world_size` > 1
    says the verdict was agreed by every rank (the distributed optimizers all-reduce it first);
    `compiled`: compiled steps found them and left state and parameters as they were.
    """
    if not names:
        return False
    listed = ", ".join(names)
    if policy == "raise":
        agreed = f" (agreed by all {world_size} ranks)" if world_size > 1 else ""
        untouched = (
            " in a compiled step; that step and every compiled step since left optimizer "
            "state and parameters untouched."
            if compiled
            else "; optimizer state and parameters are untouched."
        )
        raise NonFiniteGradientError(
            f"non-finite gradient (NaN or Inf) in {listed}{agreed}{untouched} Pass "
            "nonfinite='skip' to skip such steps instead.",
            names,
        )
    everywhere = " on every rank" if world_size > 1 else ""
    skipped = "skipped compiled optimizer step(s)" if compiled else "skipping optimizer step"
    message = f"{skipped}{everywhere}: non-finite gradient in {listed}"
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    return True


def apply_nonfinite_policy(
    optimizer: torch.optim.Optimizer,
    policy: NonfinitePolicy,
    bad: list[Tensor],
    compiled: bool = False,
) -> bool:
    """`enforce_nonfinite_policy` for the parameters `bad` of `optimizer`, named; `compiled`:
    they were latched by compiled steps (`GuardedOptimizer.check_nonfinite`)."""
    names = param_names(optimizer)
    return enforce_nonfinite_policy(
        policy, [names.get(id(p), f"shape {tuple(p.shape)}") for p in bad], compiled=compiled
    )


def check_params(owner: str, groups: list[dict[str, Any]]) -> None:
    """Refuse degenerate parameters at construction, naming them: an empty one (a dimension
    of size 0: nothing to optimize, and Newton-Schulz would divide by its zero norm) and the
    same tensor listed twice (it would be stepped twice per step)."""
    seen: dict[int, str] = {}
    for gi, group in enumerate(groups):
        names = group.get("param_names")
        for pi, p in enumerate(group["params"]):
            name = names[pi] if names is not None else position_name(gi, pi)
            if p.numel() == 0:
                raise ValueError(
                    f"{owner} got {name} with shape {tuple(p.shape)}, which has no elements: "
                    "leave empty parameters out of the optimizer (or freeze them, "
                    "requires_grad=False, so build_optimizer skips them)"
                )
            if id(p) in seen:
                raise ValueError(
                    f"{owner} got the same tensor twice: {name} is {seen[id(p)]} again, and "
                    "would be stepped twice per step; list each parameter once (tied weights "
                    "once, e.g. from model.named_parameters(), which lists them once)"
                )
            seen[id(p)] = name


def compute_dtype(p: Tensor) -> torch.dtype:
    """The dtype a parameter's optimizer step computes in, and its state's unless the
    optimizer stores state lower (`state_dtype=torch.bfloat16`, `orthoptim.optim.lean`):
    float32 for bf16/fp16 parameters (fp32 master state), else the parameter's."""
    return torch.float32 if p.dtype in (torch.float16, torch.bfloat16) else p.dtype


#: the name `compute_dtype` had before the optimizers took a `state_dtype` option
state_dtype = compute_dtype


def restore_state_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """Undo torch's cast of floating state to the parameter's dtype after `load_state_dict`.

    `torch.optim.Optimizer.load_state_dict` casts every floating-point state tensor to its
    parameter's dtype, which would turn the float32 master state of a bf16/fp16 parameter
    into bf16. Each such tensor is restored from `state_dict` in the dtype it was saved in.
    """
    saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
    params = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for saved_id, p in zip(saved_ids, params):
        for key, value in state_dict["state"].get(saved_id, {}).items():
            cast = torch.is_tensor(value) and value.is_floating_point() and value.dtype != p.dtype
            if cast and key != "step":
                optimizer.state[p][key] = value.to(device=p.device)


def _torch_hooks(attribute: str) -> bool:
    """Whether `attribute` is one of torch's per-instance hook dicts (`_optimizer_*_hooks`)."""
    return attribute.startswith("_optimizer_") and attribute.endswith("_hooks")


class CopyableOptimizer(torch.optim.Optimizer):
    """An optimizer whose copies (`copy.deepcopy`, `pickle`, `torch.save`) step like it.

    torch's `Optimizer.__getstate__` keeps only `defaults`, `state` and `param_groups`, which
    would drop every attribute of ours (an orthogonalizer, the `nonfinite` policy, a hybrid's
    inner optimizers). Here every attribute is kept, but torch's per-instance hooks and an
    LR scheduler's patch of `step`: they are not copied, as torch does not copy them either
    (they close over the original). An optimizer that cannot be copied meaningfully (one
    over a process group) says why in `copy_refusal`, and copying it raises TypeError."""

    def copy_refusal(self) -> str | None:
        """Why a copy of this optimizer could not step like it (None: it can)."""
        return None

    def __getstate__(self) -> dict[str, Any]:
        why = self.copy_refusal()
        if why is not None:
            raise TypeError(
                f"{type(self).__name__} cannot be copied or pickled: {why}. Save its "
                "state_dict() (or orthoptim.checkpoint.save_sharded) and load it into an "
                "optimizer built for the copy instead"
            )
        # instance attributes that shadow a method are patches by others, bound to this
        # object: an LR scheduler's wrapper of `step` would step the original
        cls = type(self)
        return {
            k: v
            for k, v in self.__dict__.items()
            if not _torch_hooks(k) and not callable(getattr(cls, k, None))
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict passes only "state" and "param_groups"
        had_flag = "differentiable" in state.get("defaults", getattr(self, "defaults", {}))
        super().__setstate__(state)  # fresh hook dicts, `step` patched
        if not had_flag:  # torch adds it; the original's defaults did not have it
            self.defaults.pop("differentiable", None)


def merged_defaults(optimizers: Sequence[torch.optim.Optimizer]) -> dict[str, Any]:
    """The defaults of several optimizers seen as one: each key from the first optimizer that
    has it (the hybrid lists its matrix optimizer first, so `lr` is its learning rate).

    `betas` only when every group has it: momentum-cycling schedulers (`OneCycleLR`,
    `CyclicLR`) read `group["betas"]` of every group when the defaults have `betas`, and
    otherwise set `group["momentum"]` of every group (which AdamW's groups ignore)."""
    merged: dict[str, Any] = {}
    for opt in optimizers:
        for key, value in opt.defaults.items():
            merged.setdefault(key, value)
    if not all("betas" in g for opt in optimizers for g in opt.param_groups):
        merged.pop("betas", None)
    return merged


class CompositeOptimizer(CopyableOptimizer):
    """An optimizer whose `param_groups` and `state` are those of optimizers it holds (the
    hybrid's inner Muon and AdamW, a distributed optimizer's per-rank optimizer): the very
    dicts, so LR schedulers and `zero_grad` act on them. torch's constructor runs over `params`
    only for its hooks and bookkeeping; `adopt` then installs the groups, state and defaults."""

    def __init__(self, params: Iterable[Tensor]) -> None:
        torch.optim.Optimizer.__init__(self, [{"params": list(params)}], {})

    def adopt(self, groups: list[dict[str, Any]], state: Any, defaults: dict[str, Any]) -> None:
        """Expose `groups` as `param_groups` and `state` as `state` (shared, not copied), and
        `defaults` as the defaults schedulers and user code read (`merged_defaults`)."""
        self.param_groups = groups
        self.state = state
        self.defaults = defaults


class GuardedOptimizer(CopyableOptimizer):
    """The step skeleton every orthoptim optimizer shares: closure, then the non-finite
    policy over all gradients (state untouched when it raises or skips), then `_update()`.

    Subclasses set `self.nonfinite` (see `check_nonfinite_policy`) and implement `_update`.
    `load_state_dict` keeps the saved dtype of fp32 master state for bf16/fp16 parameters.

    Under `torch.compile(opt.step)` nothing is read on the host (`_compiled_step`): one
    device-side flag says whether every gradient is finite, and every parameter and state
    write of the step is kept only where it is; otherwise parameters and state stay as they
    were, bit for bit. The parameters whose gradients were not finite are latched on the
    device (`nonfinite_latch`), and `check_nonfinite()` (which every eager `step()` calls
    first) reads the latch once: with "raise" it raises `NonFiniteGradientError` naming them,
    and until then every compiled step leaves parameters and state untouched (the compiled
    optimizer stops where the eager one would have raised); with "skip" it warns as an eager
    skip does, and compiled steps go on skipping only the non-finite steps.
    """

    nonfinite: NonfinitePolicy = "raise"
    #: the model's trainable parameters this optimizer was built over, checked at each eager
    #: step (`build_optimizer(model)` sets it; None: not guarded)
    param_set: ParamSet | None = None
    #: this optimizer counts what it steps itself (`mark_stepped` in `step_params`)
    marks_stepped: bool = False
    #: bool per parameter (in `param_groups` order): its gradient was non-finite in a
    #: compiled step since the last `check_nonfinite()`; None until a compiled step
    nonfinite_latch: Tensor | None = None

    def _update(self) -> None:
        raise NotImplementedError

    def _params(self) -> list[Tensor]:
        """Every parameter, in the order of `nonfinite_latch`."""
        return [p for g in self.param_groups for p in g["params"]]

    def _init_group(self) -> None:
        """Make what a compiled step writes before it runs: the non-finite latch here, a
        subclass's state for the parameters that have a gradient (`init_compiled_state`).
        Dynamo runs a method of this name eagerly while tracing, as for torch's optimizers, so
        the graph finds the state made and is not compiled again when it appears."""
        self._latch()
        self.init_compiled_state()

    def _latch(self) -> Tensor:
        """`nonfinite_latch`, made (or remade for a changed parameter set) when needed."""
        params = self._params()
        latch = self.nonfinite_latch
        if latch is None or latch.numel() != len(params):
            device = params[0].device if params else None
            latch = self.nonfinite_latch = torch.zeros(len(params), dtype=torch.bool, device=device)
        return latch

    def _before_compiled_step(self) -> None:
        """What a compiled step makes eagerly first (`_init_group`, run by dynamo in Python)."""
        self._init_group()

    def init_compiled_state(self) -> None:
        """The state a subclass's step would make on first sight of a parameter with a
        gradient, made ahead of a compiled step (none by default)."""

    def check_nonfinite(self) -> None:
        """Apply the non-finite policy to what compiled steps latched (one host read; nothing
        without a compiled step): "raise" raises `NonFiniteGradientError` naming the
        parameters, "skip" warns; the latch is cleared either way."""
        latch = self.nonfinite_latch
        if latch is None:
            return
        flags = host.read(latch, "compiled non-finite latch")
        if not flags.any():
            return
        bad = [p for p, flag in zip(self._params(), flags.tolist()) if flag]
        latch.zero_()
        apply_nonfinite_policy(self, self.nonfinite, bad, compiled=True)

    def _compiled_step(self) -> None:
        """The step as `torch.compile` traces it: no host reads, no data-dependent shapes.

        The update runs whatever the gradients hold; then every parameter and state tensor
        takes its new value only where one flag says every gradient is finite (and, with
        "raise", no earlier compiled step latched one), else its value from before the step
        (functionalised, the "before" is the graph's input: no copy is kept). Every state
        tensor exists before this is traced (`_init_group`): a graph traced while a step made
        state would take "no state" for granted and be reused once there is some. State made
        inside the step anyway (a torch optimizer whose `_init_group` does not make it) falls
        back to zeros."""
        self._before_compiled_step()
        params = self._params()
        latch = self._latch()
        live = [p for p in params if p.grad is not None]
        if not live:
            return
        bad = torch.stack(
            [
                ~torch.isfinite(p.grad).all() if p.grad is not None else latch.new_zeros(())
                for p in params
            ]
        )
        ok = ~bad.any()
        if self.nonfinite == "raise":
            ok = ok & ~latch.any()
        latch.logical_or_(bad)
        # `in` first: indexing the defaultdict would replay an empty entry over the state an
        # inner torch optimizer makes while this is traced
        before = [
            (p, {k: v.clone() for k, v in self.state[p].items() if torch.is_tensor(v)})
            if p in self.state
            else (p, {})
            for p in live
        ]
        saved = [p.clone() for p in live]
        self._update()
        for p, old in zip(live, saved):
            p.copy_(torch.where(ok, p, old))
        for p, old_state in before:  # in place: the graph is specialised to these tensors
            for key, value in self.state.get(p, {}).items():
                if torch.is_tensor(value):
                    fallback = old_state.get(key)
                    if fallback is None:
                        fallback = torch.zeros_like(value)
                    value.copy_(torch.where(ok, value, fallback))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, after checking the dict against this optimizer the way the layer-wise
        loader does (`orthoptim.checkpoint.check_state_dict`: names, shapes, which optimizer,
        hyper-parameters; one `CheckpointMismatchError` listing every difference, nothing
        loaded), and keeping float32 state of bf16/fp16 parameters in float32."""
        check_state_dict(self, state_dict)
        super().load_state_dict(state_dict)
        restore_state_dtypes(self, state_dict)

    def state_view(self) -> StateView:
        """This optimizer's state by parameter name, for checkpoints (`orthoptim.checkpoint`)."""
        kinds = getattr(self, "state_kinds", {})
        return StateView(self, lambda name: kinds)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step over every parameter that has a gradient, unless a gradient is non-finite."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_dense_grads(self, self._params())
        if torch.compiler.is_compiling():
            self._compiled_step()
            return loss
        if self.param_set is not None:
            self.param_set.check(self._params())
        self.check_nonfinite()
        if apply_nonfinite_policy(self, self.nonfinite, nonfinite_params(self._params())):
            return loss
        with one_step():
            self._update()
        return loss


class TraceTimeInit(torch.optim.Optimizer):
    """Runs `owner._init_group()` in Python while `torch.compile` traces a step that calls
    this object's `_init_group()`.

    Dynamo runs the `_init_group` of every torch optimizer eagerly instead of tracing it (the
    way torch's optimizers make their state before the traced update), then guards that
    optimizer's `param_groups` and `state` under its own name. An optimizer whose groups are
    its inner optimizers' (the hybrid) cannot be that optimizer: its inner torch optimizers'
    traced steps would then find their groups under its indices. This holder has no groups
    and no state, so only the owner's eager work happens."""

    def __init__(self, owner: GuardedOptimizer) -> None:  # torch's would want parameters
        self.owner = owner
        self.defaults: dict[str, Any] = {}
        self.param_groups: list[dict[str, Any]] = []
        self.state: dict[Any, Any] = {}

    def _init_group(self) -> None:
        self.owner._init_group()

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def init_torch_state(optimizer: torch.optim.Optimizer) -> None:
    """Make the state a torch optimizer's next step would make for its parameters that have
    a gradient, now: its `_init_group(group, [], ...)` for every group (torch's optimizers
    make their state there; one without `_init_group` is left alone). A CPU `step` count of a
    parameter on an accelerator goes to the parameter's device, where dynamo would otherwise
    move it inside the trace, as a new tensor."""
    init = getattr(optimizer, "_init_group", None)
    if init is None:
        return
    lists = len(inspect.signature(init).parameters) - 1  # after `group`: the lists it fills
    for group in optimizer.param_groups:
        init(group, *([] for _ in range(lists)))
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            count = state.get("step")
            if torch.is_tensor(count) and count.is_cpu and not p.is_cpu:
                state["step"] = count.to(p.device)


def step_checked(optimizer: torch.optim.Optimizer) -> None:
    """Step `optimizer` whose gradients the caller has already checked for NaN/Inf, as part
    of the caller's step: an orthoptim optimizer skips its own check, any other optimizer
    steps without torch's step hooks (global and its own), which fired for the caller's
    step (`Optimizer.profile_hook_step` wraps `step` and keeps it as `__wrapped__`)."""
    if not getattr(optimizer, "marks_stepped", False):
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        mark_stepped(params, type(optimizer).__name__, lambda: param_names(optimizer))
    record = telemetry.active()
    if record is not None and not getattr(optimizer, "records_updates", False):
        with telemetry.updates_recorded(record, optimizer, param_names(optimizer)):
            _step_unchecked(optimizer)
        return
    _step_unchecked(optimizer)


def _step_unchecked(optimizer: torch.optim.Optimizer) -> None:
    """`step_checked`'s step itself (no guard, no telemetry)."""
    if isinstance(optimizer, GuardedOptimizer):
        optimizer._update()
        return
    step = type(optimizer).step
    if torch.compiler.is_compiling():
        # torch's step wrapper breaks the graph on purpose to enter no_grad; a compiled
        # orthoptim step runs under no_grad already, so the wrapped step is traced in place
        inspect.unwrap(step)(optimizer)
        return
    if getattr(step, "hooked", False):
        step = step.__wrapped__  # type: ignore[attr-defined]
    with torch.autograd.profiler.record_function(f"Optimizer.step#{type(optimizer).__name__}.step"):
        step(optimizer)
