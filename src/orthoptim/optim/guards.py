"""The guards every step runs, so that a misconfiguration is one clear line, not a run that
trains wrongly: the model's trainable parameters are the ones the optimizer was built over
(`ParamSet`), and within one optimizer step each parameter is stepped once, by one optimizer
(`one_step` and `mark_stepped`: Newton-Schulz runs once per step, never per micro-batch).

Both work on the host from what Python holds already (no device value is read); each
violation names the parameter, the cause and the fix, and is raised before any weight of
the step moves (a parameter stepped twice: before its second step).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn


class ParameterSetError(RuntimeError):
    """The model's trainable parameters are no longer the ones the optimizer was built over;
    one line per parameter in the message, `names` lists them."""

    def __init__(self, lines: list[str], names: list[str]) -> None:
        super().__init__("\n".join(lines))
        self.lines, self.names = lines, names


class SteppedTwiceError(RuntimeError):
    """A parameter was about to be stepped a second time within one optimizer step."""


REBUILD = (
    "build the optimizer after the model is final (after materializing, wrapping, replacing "
    "or freezing parameters), or build a new one now"
)


class ParamSet:
    """The trainable parameters an optimizer was built over, by name, checked against the
    model at each step (`check`): a trainable parameter the optimizer does not step (added,
    or replaced by a new tensor: a module re-assigned, `to_empty()` after building on the
    meta device), one it steps that is no longer the model's, and one frozen since. `whole`:
    the optimizer was built over all of the model's trainable parameters (not a subset
    given by the caller), so a trainable one it lacks is a violation too.

    The model is held weakly when given (`model=`); a copy of the guard guards nothing (a
    copied optimizer steps a copied model the guard cannot know)."""

    def __init__(
        self,
        owner: str,
        built: Mapping[str, Tensor],
        whole: bool = True,
        model: nn.Module | None = None,
    ) -> None:
        self.owner = owner
        self.whole = whole
        self.names = {id(p): n for n, p in built.items()}
        self.built = set(built)
        self._model = weakref.ref(model) if model is not None else None
        self._seen: tuple[int, ...] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "owner": self.owner,
            "whole": self.whole,
            "names": {},
            "built": set(),
            "_model": None,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _seen=None)

    def problems(self, model: nn.Module, params: Iterable[Tensor]) -> tuple[list[str], list[str]]:
        """(one line per violation, the parameters named) for `model` and the parameters
        `params` the optimizer steps; ([], []) when they agree."""
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        stepped = {id(p): p for p in params}
        key = tuple(id(p) for _, p in trainable)
        if key == self._seen and len(stepped) == len(key):
            return [], []
        lines, names = [], []
        current = dict(model.named_parameters())
        in_model = {id(p) for p in current.values()}
        for n, p in trainable:
            if id(p) in stepped or (not self.whole and n not in self.built):
                continue
            if n in self.built:
                cause = "was replaced by a new tensor after the optimizer was built (a module "
                cause += "re-assigned, to_empty() after building on the meta device), so the "
                cause += "optimizer steps the old one and this one never trains"
            else:
                cause = "was added after the optimizer was built and would never be trained"
            lines.append(f"{self.owner}: parameter {n!r} {cause}; {REBUILD}")
            names.append(n)
        for i, p in stepped.items():
            n = self.names.get(i)
            if n is None or n in names:
                continue
            if i not in in_model:
                cause = "is no longer a parameter of the model (replaced or removed after the "
                cause += "optimizer was built), so its steps reach nothing the model uses"
            elif not p.requires_grad:
                cause = "was frozen (requires_grad=False) after the optimizer was built, which "
                cause += "still holds it and its state"
            else:
                continue
            lines.append(f"{self.owner}: parameter {n!r} {cause}; {REBUILD}")
            names.append(n)
        if not lines:
            self._seen = key
        return lines, names

    def check(self, params: Iterable[Tensor], model: nn.Module | None = None) -> None:
        """Raise `ParameterSetError` for every violation (`problems`) of `model` (default:
        the model given at construction, while it lives; a copy checks nothing)."""
        if model is None:
            model = self._model() if self._model is not None else None
        if model is None or torch.compiler.is_compiling():
            return
        lines, names = self.problems(model, params)
        if lines:
            raise ParameterSetError(lines, names)


class _Ledger(threading.local):
    stepped: dict[int, str] | None = None


_ledger = _Ledger()


@contextlib.contextmanager
def one_step() -> Iterator[None]:
    """The scope of one optimizer step (the outermost one: an inner optimizer's step inside
    a hybrid's or a driver's joins it), within which `mark_stepped` counts each parameter."""
    if _ledger.stepped is not None or torch.compiler.is_compiling():
        yield
        return
    _ledger.stepped = {}
    try:
        yield
    finally:
        _ledger.stepped = None


def mark_stepped(
    params: Iterable[Tensor],
    by: str,
    names: Iterable[str] | Callable[[], Mapping[int, str]] | None = None,
) -> None:
    """Count `params` as stepped by optimizer `by` in the current `one_step`, raising
    `SteppedTwiceError` for one already stepped in it (before its second step). `names`: the
    parameters' names in order, or a function giving id(param) → name, called only to name
    one in the error. Nothing outside a step scope or under `torch.compile`."""
    stepped = _ledger.stepped
    if stepped is None:
        return
    params = list(params)
    lazy = callable(names)
    labels = list(names) if names is not None and not lazy else [None] * len(params)
    for p, name in zip(params, labels):
        first = stepped.get(id(p))
        if first is not None:
            if lazy:
                name = names().get(id(p))  # type: ignore[operator]
            label = repr(name) if name is not None else f"of shape {tuple(p.shape)}"
            raise SteppedTwiceError(
                f"parameter {label} was about to be stepped a second time in one optimizer "
                f"step (by {first}, then by {by}): each parameter must be stepped by one "
                "optimizer once per step (Newton-Schulz once per step, not per micro-batch); "
                "a parameter in two param groups or two optimizers, or an inner optimizer "
                "stepped twice, does this; give each parameter to one optimizer and call "
                "step() once, after the last micro-batch"
            )
        stepped[id(p)] = by
