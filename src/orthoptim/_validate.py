"""Argument checks shared by every public constructor and entry point.

Each check raises at construction with a message that names the argument, the bad value and
what is allowed (TypeError for a value of the wrong type, ValueError for one out of range),
and returns the value so that callers can validate and assign in one line.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _real(name: str, value: Any) -> float:
    """`value` as a float; a 1-element real tensor of any shape counts as its one number (a
    tensor LR, which a scheduler changes in place without recompiling a compiled step)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(
                f"{name} must be a real number or a 1-element real tensor, got a {value.dtype} "
                f"tensor of shape {tuple(value.shape)}; pass one value, e.g. "
                f"{name}=torch.tensor(0.01)"
            )
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {value!r} ({type(value).__name__})")
    return float(value)


def check_choice(name: str, value: T, allowed: Sequence[Any]) -> T:
    """`value` must be one of `allowed` (mode names, policies, conventions)."""
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")
    return value


def check_nonnegative(name: str, value: T) -> T:
    """A finite number >= 0 (learning rates, weight decay); a 1-element tensor too."""
    v = _real(name, value)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def check_positive(name: str, value: T) -> T:
    """A finite number > 0 (eps, bucket sizes)."""
    v = _real(name, value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def check_unit_interval(name: str, value: T) -> T:
    """A number in [0, 1) (momentum, betas)."""
    v = _real(name, value)
    if not 0.0 <= v < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def check_betas(name: str, value: T) -> T:
    """Two EMA coefficients, each in [0, 1) (Adam's, Lion's and SOAP's betas)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name} must be two numbers in [0, 1), got {value!r}")
    check_unit_interval(f"{name}[0]", value[0])
    check_unit_interval(f"{name}[1]", value[1])
    return value


def _is_int_at_least(value: Any, minimum: int) -> bool:
    """An int (not a bool, not 2.0) >= `minimum`."""
    return not isinstance(value, bool) and isinstance(value, int) and value >= minimum


def check_int(name: str, value: T, minimum: int) -> T:
    """An int (not a bool, not 2.0) >= `minimum` (step counts, frequencies)."""
    if not _is_int_at_least(value, minimum):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_positive_int(name: str, value: T) -> T:
    """`check_int(name, value, 1)` worded for a size (a parallel layout's)."""
    if not _is_int_at_least(value, 1):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_float_dtype(name: str, value: T) -> T:
    """None or a floating-point torch dtype (compute and wire dtypes)."""
    if value is None:
        return value
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be a torch floating-point dtype or None, got {value!r}")
    if not value.is_floating_point:
        raise ValueError(f"{name} must be a torch floating-point dtype or None, got {value}")
    return value


def check_dtype_or_auto(name: str, value: T) -> T:
    """`ns_dtype`: "auto", None or a floating-point torch dtype (the Newton-Schulz dtype)."""
    allowed = "'auto', None or a torch floating-point dtype (e.g. torch.float32, torch.bfloat16)"
    if value is None or (isinstance(value, str) and value == "auto"):
        return value
    if isinstance(value, str):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{name} must be {allowed}, got {value!r} ({type(value).__name__})")
    if not value.is_floating_point:
        raise ValueError(f"{name} must be {allowed}, got {value}")
    return value


def check_member(name: str, group: Any) -> Any:
    """A process group this rank belongs to (None: the default group)."""
    import torch.distributed as dist

    if group is None or not (dist.is_available() and dist.is_initialized()):
        return group
    if dist.get_rank(group) < 0:
        raise ValueError(
            f"{name}: this rank (global rank {dist.get_rank()}) is not a member of the given "
            "process group; pass a group that contains every rank holding these parameters "
            "(or None for the default group)"
        )
    return group
