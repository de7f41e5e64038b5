"""One table of tensor-parallel modes (`tensor_parallel.TP_MODES`) feeds the runtime and the
planner: a mode planted in the table alone is a choice of `orthoptim plan --tp-mode`, a row of
the plan's per-mode figures, its memory model's entry, a mode the orthogonalizer runs and a
candidate of `auto` in the orthogonalizer and in the planner; one the table keeps from `auto`
is a choice and a row but no candidate."""

from __future__ import annotations

import argparse
from typing import get_args

import pytest
import torch
from torch import Tensor

from orthoptim.cli import build_parser
from orthoptim.parallel import tensor_parallel
from orthoptim.parallel.tensor_parallel import (
    MODES,
    TP_MODES,
    TensorParallelOrthogonalizer,
    TPMode,
    TPModeSpec,
    _Layout,
    auto_modes,
    tp_mode_names,
)
from orthoptim.parallel.tp_model import TPBatch, TPCost
from orthoptim.plan import Layout, load_hardware, load_model, make_plan

from distributed import run_ranks

PLANTED = "echo"
# cheaper than every shipped mode under any cost model: nothing sent, one flop
FREE = TPCost(0.0, 0, 1.0)
TRANSIENT = 12345


def _free(*args: object) -> TPCost:
    return FREE


def _echo(orth: TensorParallelOrthogonalizer, X: Tensor, layout: _Layout) -> Tensor:
    """The planted mode's run: the shards back, copied."""
    return X.clone()


def plant(pickable: bool) -> list[TPBatch]:
    """Add the mode to the table, the one place; returns the batches its memory entry saw."""
    seen: list[TPBatch] = []

    def transient(batch: TPBatch) -> int:
        seen.append(batch)
        return TRANSIENT

    TP_MODES[PLANTED] = TPModeSpec(_free, _echo, transient, auto=pickable)
    return seen


@pytest.fixture
def planted(request: pytest.FixtureRequest):
    seen = plant(request.param)
    yield seen
    del TP_MODES[PLANTED]


def tp_mode_choices() -> tuple[str, ...]:
    plan = next(
        a.choices["plan"]
        for a in build_parser(["plan"])._actions
        if isinstance(a, argparse._SubParsersAction)
    )
    (flag,) = [a for a in plan._actions if "--tp-mode" in a.option_strings]
    return tuple(flag.choices)


def tiny_plan(tp_mode: str) -> dict:
    layout = Layout(dp=2, tp=2, tp_mode=tp_mode, device="cpu", ns_dtype="fp32")  # type: ignore[arg-type]
    return make_plan(load_model("train:tiny"), load_hardware("h200"), layout)


def test_the_literal_names_the_shipped_table():
    assert get_args(TPMode) == MODES == ("auto", *TP_MODES) == tp_mode_names()
    assert tp_mode_choices() == tp_mode_names()


@pytest.mark.parametrize("planted", [True], indirect=True)
def test_a_planted_mode_is_seen_everywhere(planted):
    assert PLANTED in tp_mode_choices()
    assert PLANTED in auto_modes(2) and PLANTED in auto_modes(4)
    layout = _Layout(None, 4, 0, -1, (256,) * 4)
    assert TensorParallelOrthogonalizer().choose_mode(4, 256, 1024, layout, "cpu") == PLANTED

    plan = tiny_plan(PLANTED)
    assert plan["tp"][PLANTED]["bytes_max"] == 0
    picks = plan["tp"]["auto_picks"]
    assert picks.get(PLANTED, 0) > 0
    assert not set(picks) & {"duplicated", "distributed", "gram"}  # the planted one wins all
    # its memory entry priced the split matrices' batches, and the plan holds its bytes
    assert planted and all(b.shard_dim is not None for b in planted)
    assert plan["memory_per_rank"]["per_rank"][0]["transient"] >= TRANSIENT


@pytest.mark.parametrize("planted", [False], indirect=True)
def test_a_planted_mode_kept_from_auto_is_no_candidate(planted):
    assert PLANTED in tp_mode_choices()
    assert PLANTED not in auto_modes(4)
    layout = _Layout(None, 4, 0, -1, (256,) * 4)
    assert TensorParallelOrthogonalizer().choose_mode(4, 256, 1024, layout, "cpu") != PLANTED
    plan = tiny_plan("auto")
    assert PLANTED in plan["tp"] and PLANTED not in plan["tp"]["auto_picks"]


def _run_planted(rank: int, world_size: int) -> dict:
    """Each rank plants the mode (a spawned process imports the table afresh) and runs the
    orthogonalizer in it, and in auto."""
    plant(True)
    local = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(rank))
    out = {}
    for mode in (PLANTED, "auto"):
        orth = TensorParallelOrthogonalizer(mode=mode, shard_dim=0, ns_dtype=torch.float32)
        out[mode] = (torch.equal(orth(local), local), orth.last_modes)
    return out


def test_the_orthogonalizer_runs_a_planted_mode():
    for got in run_ranks(_run_planted, 2):
        assert got == {PLANTED: (True, [PLANTED]), "auto": (True, [PLANTED])}
    assert tensor_parallel.TP_MODES.keys() == {"duplicated", "distributed", "gram", "blockwise"}
