"""An optimizer's state as checkpoints see it, by parameter name, and the checks a
checkpoint must pass before anything is loaded.

`StateView` is the one door checkpoints (`orthoptim.checkpoint`) go through: the layout every
rank agrees on (groups, hyper-parameters, every parameter's name and shape), the state that
lives on this rank (`owned_state()`, by name; names of expert slices `w[a:b]` and runs of a
sharded AdamW parameter `w{a:b}` say which part), master copies, and which state entries are
laid out like their parameter. A single-process optimizer gets the default view; the
distributed optimizers return their own from `state_view()`.

Before anything is loaded the checkpoint is compared with the optimizer (parameter names
and shapes, the optimizer of each group, hyper-parameters that change what the state means);
every difference is listed in one `CheckpointMismatchError` and nothing is modified.
Hyper-parameters a scheduler may change (`SCHEDULED_HYPERS`) are restored from the
checkpoint, as torch does; every other hyper-parameter must be equal.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from orthoptim.optim.shapes import stack_shape

_WARNED_LAYOUT: list[bool] = []


def _warn_layout() -> None:
    """`StateView.layout` is now `metadata`: one FutureWarning per process."""
    if not _WARNED_LAYOUT:
        _WARNED_LAYOUT.append(True)
        warnings.warn(
            "StateView.layout() is now StateView.metadata() (orthoptim 0.2; 'layout' names "
            "the parallel layout): call or define metadata() instead",
            FutureWarning,
            stacklevel=3,
        )


class StateView:
    """What a checkpoint reads and writes of `opt`, by parameter name (the default: a
    single-process optimizer whose groups carry `param_names`).

    `kinds(name)` gives the `state_kinds` of the optimizer stepping parameter `name` (see
    `orthoptim.optim.contract`); entries it does not list, and every entry of an optimizer
    that declares none (torch's AdamW), are elementwise.
    """

    #: the process group the state is spread over: `full_state_dict` gathers over it
    gather_group: ProcessGroup | None = None
    #: whether the state is spread over ranks at all (False: every rank holds all of it)
    spread = False
    #: the group a DCP save or load runs over (None: the default group)
    dcp_group: ProcessGroup | None = None

    def __init__(
        self, opt: torch.optim.Optimizer, kinds: Callable[[str], dict[str, str]] | None = None
    ) -> None:
        self.opt = opt
        self.kinds = kinds or (lambda name: {})

    def sync(self) -> None:
        """Finish work in flight that still writes parameters or state (none here)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "layout" in vars(cls) and "metadata" not in vars(cls):  # written before 0.2
            _warn_layout()
            cls.metadata = vars(cls)["layout"]  # type: ignore[method-assign]

    def layout(self) -> dict[str, Any]:
        """Deprecated spelling of `metadata` (a FutureWarning until 0.3.0): "layout" is the
        parallel layout's name (`orthoptim.parallel.layout`)."""
        _warn_layout()
        return self.metadata()

    def metadata(self) -> dict[str, Any]:
        """Per group its hyper-parameters and parameter names; every parameter's shape."""
        groups = []
        shapes: dict[str, list[int]] = {}
        for gi, g in enumerate(self.opt.param_groups):
            names = g.get("param_names")
            if names is None:
                raise ValueError(
                    f"param group {gi} has no 'param_names': checkpoints are keyed by name; "
                    "build the optimizer with named parameters (orthoptim.build_optimizer does)"
                )
            groups.append({"hypers": hypers(g), "names": list(names)})
            for n, p in zip(names, g["params"]):
                shapes[n] = list(p.shape)
        return {"format": FORMAT_VERSION, "groups": groups, "shapes": shapes}

    def owned_params(self) -> dict[str, Tensor]:
        """Name → the tensor keying `opt.state`, for every parameter whose state lives here."""
        out: dict[str, Tensor] = {}
        for g in self.opt.param_groups:
            out.update(zip(g.get("param_names") or [], g["params"]))
        return out

    def owned_state(self) -> dict[str, dict[str, Any]]:
        """Name → state (the live tensors) of the owned parameters that have state."""
        state = self.opt.state
        return {n: dict(state[p]) for n, p in self.owned_params().items() if state.get(p)}

    def masters(self) -> dict[str, Tensor]:
        """Name → the owner's master copy of a parameter whose replicas are rounded."""
        return {}

    def params(self) -> dict[str, Tensor]:
        """Name → the whole parameter (its global shape and, as a DTensor, its layout)."""
        return self.owned_params()

    def sends(self, name: str, key: str, value: Any) -> bool:
        """Whether this rank's `value` of state entry `key` of parameter `name` goes into a
        gathered full state dict: all it owns here (the default)."""
        return True

    def keeps(self, name: str, key: str) -> bool:
        """Whether this rank keeps state entry `key` of parameter `name` (all it owns here)."""
        return True

    def elementwise(self, name: str, key: str) -> bool:
        """Whether state entry `key` of parameter `name` is laid out like the parameter (and
        sharded with it when it is a DTensor)."""
        return self.kinds(base_name(name)).get(key, "elementwise") == "elementwise"


def state_view(opt: torch.optim.Optimizer) -> StateView:
    """`opt.state_view()` where the optimizer offers one, else the single-process default."""
    make = getattr(opt, "state_view", None)
    return make() if callable(make) else StateView(opt)


def ranged(name: str, brackets: str) -> tuple[str, tuple[int, int] | None]:
    """ "w[2:4]" → ("w", (2, 4)) with brackets "[]"; "w{2:9}" → ("w", (2, 9)) with "{}";
    a name without such a suffix → (name, None)."""
    left, right = brackets
    if name.endswith(right) and left in name:
        base, _, rest = name[:-1].rpartition(left)
        start, _, stop = rest.partition(":")
        if start.isdigit() and stop.isdigit():
            return base, (int(start), int(stop))
    return name, None


def base_name(name: str) -> str:
    """The parameter a state name belongs to: "w[0:2]" (experts 0..1 of w), "w{0:9}" (a run
    of w's elements) and "w" → "w"."""
    return ranged(ranged(name, "{}")[0], "[]")[0]


def flat_label(name: str, lo: int, hi: int) -> str:
    """The name of elements lo:hi of the flattened parameter `name` (one rank's run of a
    sharded AdamW parameter): `name{lo:hi}`."""
    return f"{name}{{{lo}:{hi}}}"


FORMAT_VERSION = 1


SCHEDULED_HYPERS = frozenset(
    {
        "lr",
        "initial_lr",
        "weight_decay",
        "momentum",
        "betas",
        "max_lr",
        "min_lr",
        "base_lr",
        "base_momentum",
        "max_momentum",
    }
)


# Implementation switches that do not change the maths, so a checkpoint may differ in them
# (the optimizer keeps its own). `ns_dtype` is among them: the Newton-Schulz precision does
# not change what the state means (momentum stays float32), and its default "auto" resolves
# per device, so a checkpoint resumes across devices and from before "auto" (None); nor does
# `ns_batch_mb`, how many matrices one Newton-Schulz call takes.
IMPLEMENTATION_HYPERS = frozenset(
    {"foreach", "fused", "capturable", "differentiable", "ns_dtype", "ns_batch_mb"}
)

# hyper-parameter values an earlier release stored under another name, by what they are now:
# 0.1.0 stored √max(rows, cols) as lr_scale "spectral" (CHANGELOG.md)
RENAMED_HYPER_VALUES: dict[tuple[str, str], str] = {("lr_scale", "spectral"): "sqrt_max_dim"}


# group keys a loader never copies from a checkpoint into a group
NOT_HYPERS = ("params", "param_names", "optimizer")


class CheckpointMismatchError(ValueError):
    """The checkpoint was written for another model or optimizer; lists every difference."""

    def __init__(self, mismatches: list[str]) -> None:
        self.mismatches = mismatches
        listed = "\n".join(f"  - {m}" for m in mismatches)
        super().__init__(
            f"checkpoint does not match this model/optimizer ({len(mismatches)} "
            f"mismatch{'es' if len(mismatches) != 1 else ''}); nothing was loaded:\n{listed}"
        )


def check_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The checkpoint functions take a torch optimizer (any orthoptim optimizer is one)."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"opt must be a torch.optim.Optimizer (Muon, SOAP, build_optimizer(...), "
            f"LayerwiseDistributedOptimizer, FSDPOptimizer), got {type(opt).__name__}"
        )
    return opt


def hypers(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters: everything but its parameters and their names."""
    return {k: v for k, v in group.items() if k not in ("params", "param_names")}


def describe(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What a checkpoint of `opt` must agree with: per group its optimizer and hyper-parameters
    and the names of ALL its parameters (on every rank, not only the owned ones), and the
    shape of every parameter (`StateView.metadata`)."""
    return state_view(opt).metadata()


def compare(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Every difference between two `describe()` results, as readable lines ([] if none)."""
    out: list[str] = []
    if saved.get("format") != here["format"]:
        out.append(f"checkpoint format {saved.get('format')!r}, this code reads {here['format']}")
        return out
    sg, hg = saved["groups"], here["groups"]
    kinds_s = [g["hypers"].get("optimizer") for g in sg]
    kinds_h = [g["hypers"].get("optimizer") for g in hg]
    if kinds_s != kinds_h:
        out.append(
            f"param groups: optimizers {kinds_s} in the checkpoint, {kinds_h} here "
            "(another optimizer or routing)"
        )
    group_of_s = {n: g["hypers"].get("optimizer") for g in sg for n in g["names"]}
    group_of_h = {n: g["hypers"].get("optimizer") for g in hg for n in g["names"]}
    for n in sorted(set(group_of_h) - set(group_of_s)):
        out.append(f"parameter {n}: in this model, missing from the checkpoint")
    for n in sorted(set(group_of_s) - set(group_of_h)):
        out.append(f"parameter {n}: in the checkpoint, not in this model")
    for n in sorted(set(group_of_s) & set(group_of_h)):
        if group_of_s[n] != group_of_h[n]:
            out.append(
                f"parameter {n}: optimized by {group_of_s[n]} in the checkpoint, "
                f"by {group_of_h[n]} here"
            )
        ss, hs = saved["shapes"].get(n), here["shapes"].get(n)
        if ss != hs:
            out.append(f"parameter {n}: shape {tuple(ss)} in the checkpoint, {tuple(hs)} here")
    if kinds_s == kinds_h:
        for i, (a, b) in enumerate(zip(sg, hg)):
            label = f"param group {i} ({kinds_h[i]})"
            free = SCHEDULED_HYPERS | IMPLEMENTATION_HYPERS | {"optimizer"}
            ha = {k: v for k, v in a["hypers"].items() if k not in free}
            hb = {k: v for k, v in b["hypers"].items() if k not in free}
            for k in sorted(set(ha) - set(hb)):
                out.append(f"{label}: hyper-parameter {k!r} in the checkpoint, unknown here")
            for k in sorted(set(hb) - set(ha)):
                out.append(f"{label}: hyper-parameter {k!r} here, missing from the checkpoint")
            for k in sorted(set(ha) & set(hb)):
                saved_value = ha[k]
                if isinstance(saved_value, str):
                    saved_value = RENAMED_HYPER_VALUES.get((k, saved_value), saved_value)
                if not _equal(saved_value, hb[k]):
                    out.append(f"{label}: {k} = {ha[k]!r} in the checkpoint, {hb[k]!r} here")
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return isinstance(a, Tensor) and isinstance(b, Tensor) and torch.equal(a, b)
    try:
        return bool(a == b)
    except Exception:
        return repr(a) == repr(b)


def validate(opt: torch.optim.Optimizer, saved_meta: dict[str, Any]) -> None:
    """Raise `CheckpointMismatchError` listing every difference from `opt`; None if none."""
    mismatches = compare(saved_meta, describe(opt))
    if mismatches:
        raise CheckpointMismatchError(mismatches)


def is_full_state_dict(sd: dict[str, Any]) -> bool:
    """True for a dict in torch's optimizer format (what `full_state_dict` returns)."""
    return "param_groups" in sd and all("params" in g for g in sd["param_groups"])


def meta_from_full(sd: dict[str, Any]) -> dict[str, Any]:
    """The layout a full (torch-format) state dict was written for: its own record, or, for a
    plain torch dict, its groups' hyper-parameters and names (shapes unknown)."""
    extra = sd.get("orthoptim")
    if extra is not None:
        return extra["meta"]
    # A plain torch dict from a single-process optimizer: names from param_names, shapes
    # unknown (taken from the state tensors' parameters where the loader has them).
    groups, shapes = [], {}
    for gi, g in enumerate(sd["param_groups"]):
        names = g.get("param_names")
        if names is None:
            raise CheckpointMismatchError(
                [
                    f"param group {gi} of the state dict has no 'param_names'; it cannot be "
                    "matched to parameters by name"
                ]
            )
        groups.append({"hypers": hypers(g), "names": list(names)})
    return {"format": FORMAT_VERSION, "groups": groups, "shapes": shapes}


def require_full(sd: Any) -> None:
    """Raise a ValueError naming what `sd` is when it is not a torch-format optimizer dict."""
    if not isinstance(sd, dict) or not is_full_state_dict(sd):
        if not isinstance(sd, dict):
            got = type(sd).__name__
        elif not sd:
            got = "{} (what state_dict_to='rank0' returns on ranks other than 0)"
        else:
            got = f"a dict with keys {sorted(map(str, sd))[:6]}"
        raise ValueError(
            "state_dict must be a full optimizer state dict (torch's format: 'state' and "
            f"'param_groups' with 'params'), got {got}; load the dict rank 0 saved on every "
            "rank, or use load_sharded for DCP checkpoints"
        )


def shapes_from_state(
    sd: dict[str, Any], meta: dict[str, Any], here: dict[str, Any]
) -> dict[str, list[int]]:
    """Shapes of a plain torch dict's parameters, read off state tensors shaped like them
    (momentum, exp_avg); parameters without such state are assumed to match. `meta`'s names
    are taken position by position for the dict's parameter indices."""
    names = {i: n for g, mg in zip(sd["param_groups"], meta["groups"]) for i, n in
             zip(g["params"], mg["names"])}  # fmt: skip
    out = {n: here["shapes"].get(n) for g in meta["groups"] for n in g["names"]}
    for i, st in sd["state"].items():
        for k in _SHAPED_STATE:
            if i in names and isinstance(st.get(k), Tensor):
                shape, want = list(st[k].shape), out.get(names[i])
                # SOAP keeps a matrix's moments as its stack of matrices [k, rows, cols]
                matrix = want is not None and len(want) >= 2 and shape == list(stack_shape(want))
                out[names[i]] = want if matrix else shape
    return out


# State keys whose tensor has its parameter's shape (Muon / SGD momentum, Adam(W) and SOAP
# first moments): a plain dict's parameter shapes are read off them.
_SHAPED_STATE = ("momentum_buffer", "exp_avg")


def _with_kinds(
    saved: dict[str, Any], here: dict[str, Any], opt: torch.optim.Optimizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copies of two metas whose groups all name their optimizer: a plain optimizer's groups
    carry no "optimizer" key, so here it is the optimizer's class ("muon" for Muon, as the
    layer-wise and hybrid optimizers name it); a saved plain group's is unknown and taken as
    this one's (its hyper-parameters then tell another optimizer apart)."""
    own = type(opt).__name__.lower()

    def named(meta: dict[str, Any], kinds: list[Any]) -> dict[str, Any]:
        groups = [
            {**g, "hypers": {**g["hypers"], "optimizer": g["hypers"].get("optimizer", k)}}
            for g, k in zip(meta["groups"], kinds)
        ]
        return {**meta, "groups": groups}

    here = named(here, [own] * len(here["groups"]))
    kinds = [g["hypers"]["optimizer"] for g in here["groups"]]
    saved_kinds = [kinds[i] if i < len(kinds) else own for i in range(len(saved["groups"]))]
    return named(saved, saved_kinds), here


def _positional_meta(groups: list[tuple[dict[str, Any], list[str]]]) -> dict[str, Any]:
    return {
        "format": FORMAT_VERSION,
        "groups": [{"hypers": hypers(g), "names": names} for g, names in groups],
        "shapes": {},
    }


def _slots(sizes: list[int]) -> list[list[str]]:
    """Positional names of the parameters of groups of `sizes` ("param_groups[0][1]")."""
    return [[f"param_groups[{gi}][{pi}]" for pi in range(n)] for gi, n in enumerate(sizes)]


def check_state_dict(opt: torch.optim.Optimizer, sd: Any) -> None:
    """Compare a torch-format optimizer dict with a single-process optimizer (Muon, SOAP,
    `build_optimizer(...)`) before torch's loader installs it, as the layer-wise loader
    does (`compare`): parameter names and shapes, the optimizer of each group (which
    optimizer wrote it, read off its group's optimizer or hyper-parameters) and every
    hyper-parameter but those a scheduler moves (`SCHEDULED_HYPERS`) and implementation
    switches (`IMPLEMENTATION_HYPERS`). Raises one `CheckpointMismatchError` listing every
    difference; returns None when the dict loads.

    torch's loader matches parameters by position, so parameter names must also come in
    the same order. A dict or optimizer without `param_names` (older torch, an optimizer
    built from unnamed parameters) is checked by position: group count and sizes, state
    shapes, hyper-parameters; the error says names could not be checked.
    """
    require_full(sd)
    saved_groups = sd["param_groups"]
    named = all("param_names" in g for g in saved_groups) and all(
        g.get("param_names") is not None for g in opt.param_groups
    )
    if named:
        saved_meta = meta_from_full(sd)
        here = describe(opt)
    else:
        saved_meta = _positional_meta(
            list(zip(saved_groups, _slots([len(g["params"]) for g in saved_groups])))
        )
        slots = _slots([len(g["params"]) for g in opt.param_groups])
        here = _positional_meta(list(zip(opt.param_groups, slots)))
        here["shapes"] = {
            n: list(p.shape) for g, ns in zip(opt.param_groups, slots) for n, p in
            zip(ns, g["params"])
        }  # fmt: skip
    if not saved_meta["shapes"]:
        saved_meta = {**saved_meta, "shapes": shapes_from_state(sd, saved_meta, here)}
    saved_meta, here = _with_kinds(saved_meta, here, opt)
    mismatches = compare(saved_meta, here)
    if named and not mismatches:
        for i, (a, b) in enumerate(zip(saved_meta["groups"], here["groups"])):
            if a["names"] != b["names"]:
                mismatches.append(
                    f"param group {i}: the same parameters in another order (torch's loader "
                    "matches them by position)"
                )
    if mismatches:
        if not named:
            mismatches.append(
                "(the checkpoint or this optimizer has no 'param_names', so parameters were "
                "matched by position and their names could not be checked)"
            )
        raise CheckpointMismatchError(mismatches)
