"""The step-time model of `orthoptim plan` (`orthoptim.plan.steptime`): its inputs are the
figures the planner counted and the dry run of the real code measures, it moves as its
rates say, and the report and JSON carry it. No test here times anything."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from orthoptim.cli import main
from orthoptim.plan import Layout, expand, load_hardware, load_model, make_plan
from orthoptim.plan.dryrun import dry_run
from orthoptim.plan.layouts import DTYPE_BYTES
from orthoptim.plan.planner import local_shape
from orthoptim.plan.steptime import (
    PHASES,
    format_published,
    published_comparison,
    step_terms,
    step_time,
)

ROOT = Path(__file__).resolve().parent.parent
H200 = load_hardware("h200")

# (model, layout, stage the dry run holds): a dense GPT, a MoE at --ep 2 with bf16
# parameters (gradients fp32, gather bf16: the two collectives' bytes differ), a pipeline
# stage, tensor parallelism in a fixed mode
LAYOUTS = [
    ("train:tiny", dict(dp=2), 0),
    ("train:tiny-moe", dict(dp=4, ep=2, param_dtype="bf16"), 0),
    ("train:tiny", dict(dp=2, pp=2), 1),
    ("train:tiny", dict(dp=2, tp=2, tp_mode="distributed"), 0),
]


@pytest.mark.parametrize("model, spec, stage", LAYOUTS, ids=lambda x: str(x))
def test_inputs_are_the_counted_bytes_and_flops(model: str, spec: dict, stage: int) -> None:
    """Each rank's reduction + gather bytes are what the dry run of the real code counted in a
    step; the Newton-Schulz flops, tensor-parallel bytes and rounds are the plan's per-rank
    figures (which tests/test_plan.py checks against gloo runs); the elementwise bytes are
    the rank's owned elements and held state; every element of the model (each TP rank's
    shard) is stepped by exactly one rank of its stage."""
    desc, layout = load_model(model), Layout(**spec)
    plan = make_plan(desc, H200, layout)
    terms = step_terms(plan, H200, layout)
    measured = dry_run(desc, layout, H200, stage=stage, adamw=False)
    tensors = terms["tensors_per_rank"]
    for r in measured["ranks"]:
        c = layout.dims.coordinate(r["rank"])
        i = c.pp * layout.dp + c.dp  # the plan's lists: stage-major, one TP rank
        moved = terms["reduce_bytes_per_rank"][i] + terms["gather_bytes_per_rank"][i]
        assert moved == pytest.approx(r["bytes_per_step"], rel=1e-12)
        # the tensors priced per tensor are the ones the real inner optimizer steps
        assert {k: v[i] for k, v in tensors.items()} == r["stepped_tensors"]
        assert r["memory"]["state"] == pytest.approx(plan["memory_per_rank"]["state_per_rank"][i])
    grad_b, gather_b = DTYPE_BYTES[layout.grad_dtype], DTYPE_BYTES[layout.gather]
    for reduce, gather in zip(terms["reduce_bytes_per_rank"], terms["gather_bytes_per_rank"]):
        assert reduce * gather_b == pytest.approx(gather * grad_b)
    if layout.tp == 1:
        assert terms["ns_flops_per_rank"] == plan["balancing"]["cost"]["ns_flops_per_rank"]
        assert set(terms["tp_bytes_per_rank"]) == {0.0}
    else:
        tp = plan["tp"][layout.tp_mode]
        assert terms["ns_flops_per_rank"] == tp["flops_per_rank"]
        assert terms["tp_bytes_per_rank"] == tp["bytes_per_rank"]
        assert max(terms["tp_rounds_per_rank"]) == tp["rounds_max"] > 0
        assert max(tp["bytes_per_rank"]) == tp["bytes_max"] > 0
    owned = plan["memory"]["owned_elements_per_rank"]
    local = sum(math.prod(local_shape(m, layout.tp)) for m in expand(desc))
    assert sum(owned) == local
    mem = plan["memory_per_rank"]
    per_element = grad_b + 2 * DTYPE_BYTES[layout.param_dtype]
    assert terms["elementwise_bytes_per_rank"] == [
        n * per_element + 2 * (s + m)
        for n, s, m in zip(owned, mem["state_per_rank"], mem["masters_per_rank"])
    ]
    assert terms["model_flops_per_gpu"] == plan["overhead"]["model_flops_per_gpu"]
    # on the datasheet rate, forward + backward is the plan's own modelled model time
    phases = terms["phases_s"]
    assert phases["forward"] + phases["backward"] == pytest.approx(plan["overhead"]["model_time_s"])


@pytest.mark.parametrize(
    "model, hardware, spec",
    [
        ("qwen3-30b-a3b", "gb300", dict(dp=8, ep=8)),
        ("gpt-small", "h200", dict(dp=8)),
        ("train:base", "h100", dict(dp=4, param_dtype="bf16")),
    ],
)
def test_muon_is_not_faster_than_adamw_where_it_does_more(
    model: str, hardware: str, spec: dict
) -> None:
    """Where Muon's Newton-Schulz outweighs what its one moment saves on AdamW's two in
    memory traffic, its step is the slower: the ratio is at least 1, and the difference is
    the optimizer phase's plus the collectives'."""
    desc, hw, layout = load_model(model), load_hardware(hardware), Layout(**spec)
    section = step_time(desc, hw, layout, make_plan(desc, hw, layout))
    muon, adamw = section["muon"]["phases_s"], section["adamw"]["phases_s"]
    assert muon["ns"] > adamw["elementwise"] - muon["elementwise"]
    assert section["over_adamw"] >= 1
    assert muon["forward"] == adamw["forward"] and muon["backward"] == adamw["backward"]
    assert adamw["ns"] == 0 and adamw["tp"] == 0


def test_a_planted_rate_moves_only_its_own_term() -> None:
    """Doubling the Newton-Schulz matmul rate halves the Newton-Schulz term, doubling the
    memory bandwidth the elementwise term, doubling the MFU forward and backward, and a
    measured square-matmul rate replaces the datasheet one; the rest stays as it was."""
    desc, layout = load_model("gpt-small"), Layout(dp=8)
    plan = make_plan(desc, H200, layout)
    base = step_terms(plan, H200, layout)["phases_s"]
    assert base["ns"] > 0 and base["elementwise"] > 0
    for change, moved in (
        (dict(matmul_efficiency=2 * H200.matmul_efficiency), ("ns",)),
        (dict(memory_gb_per_s=2 * H200.memory_gb_per_s), ("elementwise",)),
        (dict(model_mfu=2 * H200.model_mfu), ("forward", "backward")),
    ):
        phases = step_terms(plan, dataclasses.replace(H200, **change), layout)["phases_s"]
        for p in PHASES:
            expected = base[p] / 2 if p in moved else base[p]
            assert phases[p] == pytest.approx(expected, rel=1e-12), (change, p)
    rate = {"fp32": {"square": 10.0}}  # TFLOP/s, measured, in the parameters' dtype
    terms = step_terms(plan, dataclasses.replace(H200, matmul_tflops=rate), layout)
    assert terms["compute_rate_source"] == "measured"
    assert terms["phases_s"]["forward"] == pytest.approx(
        plan["overhead"]["model_flops_per_gpu"] / 3e13
    )


MEASURED = dict(
    matmul_tflops={"fp32": {"linear": 1.0, "gram": 2.0}},
    activation_gb_per_s=3.0,
    optimizer_gb_per_s=5.0,
    optimizer_us_per_tensor={"matrix": 100.0, "elementwise": 10.0, "matrix_tp": 300.0},
    tp_us_per_linear=1000.0,
)


def test_measured_figures_price_what_they_measure() -> None:
    """With a calibrated profile's figures, forward and backward are the 6·N·D and attention
    flops at the linear-layer rate plus the saved activations at `activation_gb_per_s`; the
    elementwise term is `step_traffic` at `optimizer_gb_per_s`; the per-tensor term each
    rank's stepped tensors × `optimizer_us_per_tensor`. Changing one figure moves only its
    terms."""
    desc, layout = load_model("train:tiny"), Layout(dp=2, tokens_per_step=4096, ns_dtype="fp32")
    hw = dataclasses.replace(H200, **MEASURED)
    plan = make_plan(desc, hw, layout)
    terms = step_terms(plan, hw, layout)
    work, o = plan["work"], plan["overhead"]
    flops = o["model_flops_per_gpu"] + work["attention_flops_per_gpu"]
    phases = terms["phases_s"]
    assert phases["forward"] + phases["backward"] == pytest.approx(
        flops / 1e12 + work["activation_bytes_per_gpu"] / 3e9, rel=1e-12
    )
    assert terms["elementwise_s_per_rank"] == [b / 5e9 for b in terms["elementwise_bytes_per_rank"]]
    tensors = plan["memory"]["owned_tensors_per_rank"]
    assert terms["per_tensor_s_per_rank"] == pytest.approx(
        [m * 1e-4 + e * 1e-5 for m, e in zip(tensors["matrix"], tensors["elementwise"])]
    )
    assert min(tensors["matrix"]) > 0 and min(tensors["elementwise"]) > 0
    for change, moved in (
        (dict(activation_gb_per_s=6.0), {"forward", "backward"}),
        (dict(optimizer_gb_per_s=10.0), {"elementwise"}),
        (dict(optimizer_us_per_tensor={"matrix": 50.0, "elementwise": 5.0}), {"per_tensor"}),
        (
            dict(optimizer_us_per_tensor={**MEASURED["optimizer_us_per_tensor"], "matrix_tp": 1.0}),
            set(),
        ),  # a split matrix's cost, and no matrix is split at --tp 1
        (dict(matmul_tflops={"fp32": {"linear": 1.0, "gram": 4.0}}), {"ns"}),
    ):
        other = step_terms(plan, dataclasses.replace(hw, **change), layout)["phases_s"]
        assert {p for p in PHASES if other[p] != pytest.approx(phases[p])} == moved, change


def test_collectives_beside_compute_and_under_tensor_parallelism() -> None:
    """`comm_overlap` 0 (a CPU's cores doing both) exposes the whole reduction and gather,
    1 hides them under the passes but their edge buckets; under --tp the activation
    all-reduces cost their bytes over the TP group's link plus `tp_us_per_linear` per split
    linear layer, the group's latency per call where the profile has no such figure."""
    desc, layout = load_model("gpt-small"), Layout(dp=8)
    plan = make_plan(desc, H200, layout)
    hidden = step_terms(plan, dataclasses.replace(H200, comm_overlap=1.0), layout)
    exposed = step_terms(plan, dataclasses.replace(H200, comm_overlap=0.0), layout)
    for name in ("reduce", "gather"):
        whole = max(exposed[f"{name}_s_per_rank"])
        assert exposed["phases_s"][f"{name}_exposed"] == pytest.approx(whole)
        assert hidden["phases_s"][f"{name}_exposed"] < whole
    desc, layout = load_model("train:tiny"), Layout(dp=1, tp=2, tokens_per_step=4096)
    for hw, fixed in ((dataclasses.replace(H200, **MEASURED), "split"), (H200, "latency")):
        plan = make_plan(desc, hw, layout)
        (c,) = plan["work"]["collectives"]
        bw, lat = hw.collective("all_reduce", 2)
        calls = c["forward_calls"] + c["backward_calls"]
        per = c["split_linears"] * 1e-3 if fixed == "split" else calls * lat
        terms = step_terms(plan, hw, layout)
        assert terms["phases_s"]["activation_collectives"] == (
            pytest.approx(calls * c["bytes_per_call"] / bw + per, rel=1e-12)
        )
        if fixed == "split":  # the split matrices priced at a split matrix's fixed cost
            tensors = terms["tensors_per_rank"]
            assert terms["per_tensor_s_per_rank"] == pytest.approx(
                [m * 3e-4 + e * 1e-5 for m, e in zip(tensors["matrix"], tensors["elementwise"])]
            )


def test_plan_prints_and_writes_the_step_time(capsys) -> None:
    """`orthoptim plan` prints the step-time table and `--json` carries every term under
    "step_time", Muon beside AdamW with their ratio; under --tp AdamW is not planned."""
    assert main(["plan", "--model", "train:tiny", "--dp", "2", "--json"]) == 0
    section = json.loads(capsys.readouterr().out)["step_time"]
    assert section["planned"] and section["over_adamw"] > 0
    for name in ("muon", "adamw"):
        t = section[name]
        assert set(t["phases_s"]) == set(PHASES)
        for key in ("step_s", "tokens_per_s", "step_s_per_rank", "busiest_rank",
                    "reduce_bytes_per_rank", "gather_bytes_per_rank", "ns_flops_per_rank",
                    "elementwise_bytes_per_rank", "tp_bytes_per_rank",
                    "tp_rounds_per_rank"):  # fmt: skip
            assert key in t
        assert len(t["step_s_per_rank"]) == 2
        assert t["step_s"] >= max(t["step_s_per_rank"])
    assert main(["plan", "--model", "llama3-8b", "--dp", "2", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "step time per GPU, predicted" in text and "optimizer: TP bytes and rounds" in text
    assert "AdamW is not planned under --tp" in text


def test_published_figures_beside_the_model_and_in_the_docs() -> None:
    """The GB300 layouts' Muon/AdamW ratios from the model, beside the published ones, are the
    table docs/planner.md shows (regenerate it with `format_published(published_comparison())`)."""
    rows = published_comparison()
    assert [r["model"] for r in rows] == ["kimi-k2", "qwen3-30b-a3b"]
    for r in rows:
        assert r["model_ratio"] > 1 and r["published_ratio"] > 1
        assert 0 < r["model_ns_time_share"] < 1 and 0 < r["model_ns_flops_share"] < 1
    assert format_published(rows) in (ROOT / "docs" / "planner.md").read_text()
