"""AdamW at a plan's layout: the baseline every plan sets its optimizer's memory against.

`orthoptim plan --optimizer adamw` plans the distributed AdamW the project ships: the
layer-wise optimizer with optimizer="adamw" (every parameter AdamW, sharded element-wise over
its group ZeRO-1 style, `shard_adamw`, with fp32 masters of each rank's elements under a lower
parameter dtype), or `FSDPOptimizer(optimizer="adamw")` under --fsdp. `adamw_baseline` plans
it at another plan's layout and precision (`memory_per_rank`, the model the dry run checks)
and sets that plan's whole peak per rank against AdamW's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from orthoptim.plan.hardware import Hardware
from orthoptim.plan.layouts import DTYPE_BYTES, Layout
from orthoptim.plan.memory import memory_per_rank
from orthoptim.plan.model import ModelDescription
from orthoptim.plan.planner import plan_matrices, plan_slots


def adamw_layout(layout: Layout) -> Layout | None:
    """`layout` with `optimizer` "adamw", everything else the same; None under tensor
    parallelism, where the plan does not model AdamW (`check_layout`)."""
    return None if layout.tp > 1 else dataclasses.replace(layout, optimizer="adamw")


def adamw_peaks(desc: ModelDescription, hardware: Hardware, layout: Layout) -> dict[str, Any]:
    """`memory_per_rank` of AdamW at `layout` (`adamw_layout`, which must not be None)."""
    base = adamw_layout(layout)
    if base is None:
        raise ValueError(f"AdamW is not planned at --tp {layout.tp}; use --tp 1")
    matrices = plan_matrices(desc, base)
    slots, by_stage = plan_slots(desc, base, "cost", hardware, matrices)
    return memory_per_rank(slots, by_stage, matrices, base, DTYPE_BYTES)


def adamw_baseline(
    desc: ModelDescription, hardware: Hardware, layout: Layout, plan: dict[str, Any]
) -> dict[str, Any]:
    """The whole peak per rank of `plan` (`make_plan` at `layout`) beside AdamW's at the same
    layout (`adamw_peaks`; the plan's own under --optimizer adamw), per rank and at the
    busiest rank of each: `ratio` is the plan's busiest peak over AdamW's (below 1: the
    plan's optimizer holds less). JSON-ready; `planned` False (with `why`) under tensor
    parallelism."""
    optimizer = layout.optimizer
    if adamw_layout(layout) is None:
        return {
            "optimizer": optimizer,
            "planned": False,
            "why": f"AdamW is not planned at --tp {layout.tp} (its units would be owned "
            "whole as DTensors); the comparison needs --tp 1",
        }
    mine = plan["memory_per_rank"]
    adamw = mine if optimizer == "adamw" else adamw_peaks(desc, hardware, layout)
    peaks, theirs = mine["peak_per_rank"], adamw["peak_per_rank"]
    return {
        "optimizer": optimizer,
        "planned": True,
        "peak_per_rank": peaks,
        "adamw_peak_per_rank": theirs,
        "ratio_per_rank": [a / b for a, b in zip(peaks, theirs, strict=True)],
        "peak_max": max(peaks),
        "adamw_peak_max": max(theirs),
        "max_peak_rank": mine["max_peak_rank"],
        "adamw_max_peak_rank": adamw["max_peak_rank"],
        "ratio": max(peaks) / max(theirs),
        "adamw_max": adamw["max"],  # AdamW's categories, each at its largest over ranks
    }


def versus(ratio: float) -> str:
    """A peak ratio to AdamW's in words: "30.5 % below AdamW's" (or above, or equal)."""
    if math.isclose(ratio, 1.0, abs_tol=5e-4):
        return "equal to AdamW's"
    return f"{abs(1 - ratio):.1%} {'below' if ratio < 1 else 'above'} AdamW's"
