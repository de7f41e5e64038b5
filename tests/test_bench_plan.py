"""`orthoptim bench plan`: the plan's predicted step time beside the real step's, at data-,
tensor- and expert-parallel layouts. No test here compares a time: they check the layouts
it parses and refuses, and that every case runs end to end and reports what it measured."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from orthoptim.bench.plan import (
    PROBE_SIDE,
    comm_probe_factor,
    parse_layouts,
    predicted,
    probe_factor,
    scale_compute,
    scale_links,
    sharing_cores,
)
from orthoptim.cli import main
from orthoptim.plan.hardware import load_hardware


def test_layouts_name_their_cases() -> None:
    layouts = parse_layouts("dp1, tp2,ep2", "tiny", "tiny-moe", ["auto", "gram"])
    labels = [[lay.label(v) for v in lay.variants] for lay in layouts]
    assert labels == [
        ["dp1-muon", "dp1-adamw"],
        ["tp2-auto-muon", "tp2-gram-muon"],
        ["ep2-muon", "ep2-adamw"],
    ]
    assert [lay.config for lay in layouts] == ["tiny", "tiny", "tiny-moe"]
    assert [(d.dp, d.tp, d.ep) for d in (lay.dims() for lay in layouts)] == [
        (1, 1, 1),
        (1, 2, 1),
        (2, 1, 2),
    ]


def test_ranks_outnumbering_the_cores_share_their_rates() -> None:
    """Rates halve and fixed costs double for 4 ranks on 2 cores; collectives, which were
    measured with the ranks they run on, stay."""
    hw = dataclasses.replace(
        load_hardware("h100"),
        matmul_tflops={"fp32": {"linear": 0.1, "gram": 0.2}},
        activation_gb_per_s=1.0,
        optimizer_gb_per_s=5.0,
        optimizer_us_per_tensor={"matrix": 200.0, "elementwise": 50.0},
        tp_us_per_linear=2000.0,
        comm_overlap=0.25,
    )
    assert sharing_cores(hw, 2, 2) is hw and sharing_cores(hw, 1, 2) is hw
    half = sharing_cores(hw, 4, 2)
    assert half.bf16_tflops == hw.bf16_tflops / 2 and half.fp32_tflops == hw.fp32_tflops / 2
    assert half.memory_bytes_per_s() == hw.memory_bytes_per_s() / 2
    assert half.matmul_tflops == {"fp32": {"linear": 0.05, "gram": 0.1}}
    assert (half.activation_gb_per_s, half.optimizer_gb_per_s) == (0.5, 2.5)
    assert half.optimizer_us_per_tensor == {"matrix": 400.0, "elementwise": 100.0}
    assert half.tp_us_per_linear == 4000.0
    assert (half.link(2), half.collectives, half.comm_overlap) == (hw.link(2), {}, 0.25)


def test_the_probe_scales_the_profile_by_the_machines_speed_during_the_run() -> None:
    """The probe's rate over the profile's fp32 square rate is the factor every compute
    figure is scaled by (`scale_compute`, as `sharing_cores` scales them), the profile's
    all-reduce latency over the comm probe's the factor the links' latencies are
    (`scale_links`); a profile without the measured figure has none."""
    hw = dataclasses.replace(load_hardware("h100"), matmul_tflops={"fp32": {"square": 0.1}})
    seconds = 2 * PROBE_SIDE**3 / 0.05e12  # the probe at half the profile's rate
    assert probe_factor(hw, seconds) == pytest.approx(0.5)
    assert probe_factor(load_hardware("h100"), seconds) is None
    assert scale_compute(hw, 0.5) == sharing_cores(hw, 4, 2)
    link = {"all_reduce": {"2": {"gb_per_s": 1.0, "latency_us": 1000.0}}}
    hw = dataclasses.replace(hw, collectives=link)
    assert comm_probe_factor(hw, 2e-3, 2) == pytest.approx(0.5)  # twice the latency
    assert comm_probe_factor(hw, 2e-3, 4) is None and comm_probe_factor(hw, None, 2) is None
    slow = scale_links(hw, 0.5)  # latencies twice as long, bandwidths as measured
    assert slow.collective("all_reduce", 2) == (1e9, 2e-3)
    assert slow.link(2) == (hw.intra_node_gb_per_s * 1e9, hw.intra_node_latency_us * 2e-6)


def test_a_rescaled_prediction_plans_as_the_runtime_and_prices_on_the_probe(tmp_path) -> None:
    """`--rescale` leaves the plan (auto's picks: the runtime's cost model reads the profile
    as measured) and scales only the prices: at half the speed, compute takes twice as long
    and the collectives as long as they did."""
    hw = dataclasses.replace(load_hardware("h100"), matmul_tflops={"fp32": {"square": 0.1}})
    path = tmp_path / "hw.json"
    path.write_text(hw.to_json())
    args = argparse.Namespace(hardware=str(path), batch=2)
    (layout,) = parse_layouts("tp2", "tiny", "tiny-moe", ["auto"])
    (v,) = layout.variants
    as_measured, half = predicted(args, layout, v), predicted(args, layout, v, 0.5)
    assert half["auto_picks"] == as_measured["auto_picks"]
    # the matmuls twice as long; the activation all-reduces, collectives, as long
    assert as_measured["compute_s"] < half["compute_s"] < 2 * as_measured["compute_s"]


@pytest.mark.parametrize("entry", ["dp0", "tp1", "ep1", "pp2", "dp", "tp2x"])
def test_a_bad_layout_is_refused_by_name(entry: str) -> None:
    with pytest.raises(ValueError, match=f"got '{entry}'"):
        parse_layouts(f"dp1,{entry}", "tiny", "tiny-moe", ["auto"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--layouts", "ep2", "--moe-config", "tiny"], "tiny has no experts"),
        (["--layouts", "tp2", "--tp-modes", "fastest"], "--tp-modes takes some of"),
        (["--layouts", "tp3"], "tp"),
        (["--steps", "0"], "--steps"),
    ],
)
def test_bad_flags_are_refused_before_any_rank_starts(flags: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["bench", "plan", "--hardware", "h100", *flags])


def test_bench_plan_runs_end_to_end(tmp_path, capsys) -> None:
    """`orthoptim bench calibrate` measures a profile, and `orthoptim bench plan` runs the
    real step of the tiny GPT at dp 1 (Muon, AdamW), at tp 2 in two modes and of the tiny
    MoE at ep 2 (Muon, AdamW), and writes each case's predicted and measured seconds (which
    this test reads, never compares) and the modes `auto` took."""
    profile, cases = tmp_path / "hw.json", tmp_path / "cases.json"
    argv = ["bench", "calibrate", "--out", str(profile), "--nproc", "2", "--quick"]
    assert main([*argv, "--repeats", "1"]) == 0
    argv = ["bench", "plan", "--hardware", str(profile), "--layouts", "dp1,tp2,ep2"]
    argv += ["--tp-modes", "auto,gram", "--batch", "1", "--steps", "1", "--warmup", "0"]
    argv += ["--no-rescale"]  # the probe is timed and written, not applied
    assert main([*argv, "--json", str(cases)]) == 0
    rows = json.loads(cases.read_text())
    assert [r["case"] for r in rows] == [
        "dp1-muon",
        "dp1-adamw",
        "tp2-auto-muon",
        "tp2-gram-muon",
        "ep2-muon",
        "ep2-adamw",
    ]
    for r in rows:
        assert r["predicted_s"] > 0 and r["measured_s"] > 0
        assert r["probe_factor"] > 0 and not r["rescaled"]
        # one rank has no collective to probe
        assert (r["comm_probe_factor"] is None) == (r["layout"] == "dp1")
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        for part in ("compute_s", "optimizer_s"):
            assert r[f"predicted_{part}"] > 0 and r[f"measured_{part}"] > 0
        assert r["predicted_compute_s"] + r["predicted_optimizer_s"] == pytest.approx(
            r["predicted_s"]
        )
    auto, gram = rows[2]["modes_taken"], rows[3]["modes_taken"]
    assert set(gram) == {"gram"} and sum(auto.values()) == sum(gram.values()) > 0
    # the runtime's auto, priced with the plan's cost model, takes the modes the plan picks,
    # matrix for matrix (which modes depends on the profile measured here; the stacks' test
    # below checks the pricing where it changes the picks)
    assert auto == rows[2]["plan_auto_picks"]
    out = capsys.readouterr().out
    assert "dp1 muon/adamw: predicted" in out and "ep2 muon/adamw: predicted" in out
    assert "tp2: fastest measured" in out and "auto took" in out


def test_the_plan_prices_each_stack_as_the_runtime_calls_the_orthogonalizer() -> None:
    """Muon hands the tensor-parallel orthogonalizer one stack per shape and split dim; the
    plan's `auto` picks, matrix for matrix, what `choose_mode` takes for those stacks with the
    plan's cost model. The control: one matrix at a time, `auto` picks otherwise on this
    link (so pricing matrix by matrix would be seen)."""
    from collections import Counter

    from orthoptim.parallel.tensor_parallel import TensorParallelOrthogonalizer, _Layout
    from orthoptim.plan.layouts import Layout
    from orthoptim.plan.model import train_model
    from orthoptim.plan.planner import make_plan, tp_cost_model
    from orthoptim.train.model import CONFIGS, GPT

    slow = dict(intra_node_gb_per_s=1.0, inter_node_gb_per_s=1.0, collectives={})
    hw = dataclasses.replace(
        load_hardware("h100"), intra_node_latency_us=100.0, inter_node_latency_us=100.0, **slow
    )
    layout = Layout(dp=1, tp=2, device="cpu", ns_dtype="fp32", tokens_per_step=512)
    plan = make_plan(train_model("tiny"), hw, layout)
    picks = {m: n for m, n in plan["tp"]["auto_picks"].items() if " form " not in m}
    # the tiny GPT's split matrices as `parallelize` splits them: (shape, split dim) → count
    split = {"q": 0, "k": 0, "v": 0, "fc": 0, "proj": 1}
    stacks: Counter[tuple[tuple[int, ...], int]] = Counter()
    for name, p in GPT(CONFIGS["tiny"]).named_parameters():
        parts = name.split(".")
        if parts[0] == "blocks" and parts[-1] == "weight" and parts[-2] in split:
            stacks[(tuple(p.shape), split[parts[-2]])] += 1
    orth = TensorParallelOrthogonalizer(cost_model=tp_cost_model(hw, layout))

    def taken(size: int | None) -> dict[str, int]:
        out: Counter[str] = Counter()
        for ((rows, cols), dim), k in stacks.items():
            side = (rows, cols)[dim]
            where = _Layout(None, 2, 0, -2 if dim == 0 else -1, (side // 2,) * 2)
            out[orth.choose_mode(size or k, rows, cols, where, "cpu")] += k
        return dict(out)

    assert sum(stacks.values()) == 24 and len(stacks) == 4
    assert picks == taken(None)
    assert picks != taken(1)
