"""`orthoptim bench calibrate` and the hardware profile format: a measured profile is one
`plan --hardware` loads and prices with, a malformed one is refused naming its key, and the
shipped profiles say where each figure comes from. No measured speed is asserted."""

from __future__ import annotations

import json
import math
import re
from dataclasses import fields, replace

import pytest
import torch

from orthoptim.bench.calibrate import link_figures
from orthoptim.cli import main
from orthoptim.plan.hardware import TEXT_FIELDS, Hardware, load_hardware, shipped_hardware

PROVENANCE = re.compile(r"^(datasheet: |assumed: |not measured: |measured \d{4}-\d\d-\d\d )")


def figures(hw: Hardware) -> dict[str, object]:
    """The figures `hw` gives (its text fields and the optional ones left unset aside)."""
    return {
        f.name: getattr(hw, f.name)
        for f in fields(hw)
        if f.name not in TEXT_FIELDS and getattr(hw, f.name) not in (None, {})
    }


def numbers(value: object) -> list[float]:
    """Every number in a figure or a nested table of them."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    return [float(value)]  # type: ignore[arg-type]


def test_calibrate_writes_a_profile_that_plan_loads_and_prices_with(tmp_path, capsys):
    out = tmp_path / "hw.json"
    argv = ["bench", "calibrate", "--out", str(out), "--nproc", "2", "--quick", "--repeats", "2"]
    assert main([*argv, "--name", "here"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    hw = load_hardware(out)
    assert hw.name == "here"
    assert sorted(hw.matmul_tflops) == ["bf16", "fp32"]
    assert sorted(hw.matmul_tflops["bf16"]) == ["gram", "small", "square"]
    assert sorted(hw.matmul_tflops["fp32"]) == ["gram", "linear", "small", "square"]
    assert sorted(hw.optimizer_us_per_tensor) == ["elementwise", "matrix", "matrix_tp"]
    assert hw.tp_us_per_linear is not None and hw.tp_us_per_linear > 0
    assert hw.comm_overlap is not None and 0 <= hw.comm_overlap <= 1
    kinds = ["all_gather", "all_reduce", "all_to_all", "reduce_scatter"]
    assert sorted(hw.collectives) == kinds
    assert all(list(by_size) == ["2"] for by_size in hw.collectives.values())
    for name, value in figures(hw).items():
        least = 0 if name == "comm_overlap" else math.ulp(0)  # a fraction; the rest rates
        assert all(math.isfinite(x) and x >= least for x in numbers(value)), name
        assert PROVENANCE.match(hw.sources[name]), (name, hw.sources[name])
    # a figure the run could not get (a difference that came out <= 0) says why
    assert all(
        PROVENANCE.match(hw.sources[k]) for k in ("activation_gb_per_s", "optimizer_gb_per_s")
    )
    stamp = f"torch {torch.__version__}, gloo, cpu"
    measured = [k for k, s in hw.sources.items() if s.startswith("measured")]
    assert {"bf16_tflops", "matmul_tflops", "memory_gb_per_s", "collectives"} <= set(measured)
    assert all(stamp in hw.sources[k] for k in measured)

    plan_argv = ["plan", "--model", "llama3-8b", "--dp", "2", "--tp", "2", "--json"]
    assert main([*plan_argv, "--hardware", str(out)]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["hardware"] == "here"
    assert plan["overhead"]["ns_matmul_flops_per_s"] == hw.matmul_tflops["bf16"]["gram"] * 1e12
    assert plan["memory_per_rank"]["hardware_bytes"] == hw.memory_gb * 1e9
    assert plan["tp"]["duplicated"]["time_max_s"] > 0
    muon = plan["step_time"]["muon"]
    assert muon["phases_s"]["per_tensor"] > 0 and muon["phases_s"]["activation_collectives"] > 0


def test_a_link_is_positive_when_the_noise_hides_the_message():
    """The large message's cost beside its compute can come out no larger than the tiny
    one's, or below zero: the bandwidth is then its bytes over the call with its compute,
    a lower bound, and the latency a floor; never a figure the profile would refuse."""
    row = {"tiny_s": 2e-3, "tiny_sent": 8.0, "large_sent": 1e6, "large_pair_s": 4e-3}
    assert link_figures({**row, "large_s": 3e-3}) == {
        "gb_per_s": pytest.approx((1e6 - 8) / 1e-3 / 1e9),
        "latency_us": pytest.approx(2e3),
    }
    noisy = link_figures({**row, "tiny_s": -1e-4, "large_s": -2e-4})
    assert noisy == {"gb_per_s": pytest.approx(1e6 / 4e-3 / 1e9), "latency_us": pytest.approx(0.1)}


def test_calibrate_refuses_a_one_rank_group(tmp_path, capsys):
    argv = ["bench", "calibrate", "--out", str(tmp_path / "hw.json"), "--nproc", "1,2"]
    with pytest.raises(SystemExit, match=r"--nproc 1,2: every group size must be >= 2"):
        main(argv)
    assert not (tmp_path / "hw.json").exists()


H200 = json.loads(load_hardware("h200").to_json())


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"bf16_tflops": None}, "missing key(s) ['bf16_tflops']"),
        ({"fp32_tflops": True}, "'fp32_tflops' must be a positive number, got True"),
        ({"memory_gb_per_s": "fast"}, "'memory_gb_per_s' must be a positive number"),
        ({"matmul_tflops": {"fp16": {"gram": 1.0}}}, "'matmul_tflops' has unknown key(s) ['fp16']"),
        ({"matmul_tflops": {"fp32": {"gram": 0}}}, "'matmul_tflops.fp32.gram' must be a positive"),
        (
            {"collectives": {"all_reduce": {"2": {"gb_per_s": -1.0, "latency_us": 5.0}}}},
            "'collectives.all_reduce.2.gb_per_s' must be a positive number, got -1.0",
        ),
        (
            {"collectives": {"all_reduce": {"1": {"gb_per_s": 1.0, "latency_us": 5.0}}}},
            "'collectives.all_reduce.1': a group size is a whole number >= 2",
        ),
        (
            {"collectives": {"broadcast": {}}},
            "'collectives' has unknown key(s) ['broadcast']; it takes ['all_reduce'",
        ),
        (
            {"sources": {"bf16_tflop": "datasheet: x"}},
            "'sources' has unknown key(s) ['bf16_tflop']",
        ),
        ({"sources": {"memory_gb": ""}}, "'sources.memory_gb' must say where the figure comes"),
    ],
)
def test_a_malformed_profile_is_refused_naming_the_key(tmp_path, capsys, change, words):
    raw = {k: v for k, v in {**H200, **change}.items() if v is not None}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError) as exc:
        load_hardware(bad)
    assert str(exc.value).startswith(f"{bad}: ") and words in str(exc.value)
    assert main(["plan", "--model", "gpt-small", "--dp", "2", "--hardware", str(bad)]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("name", shipped_hardware())
def test_the_shipped_profiles_say_where_every_figure_comes_from(name):
    hw = load_hardware(name)
    assert set(hw.sources) == set(figures(hw)), name
    assert all(PROVENANCE.match(text) for text in hw.sources.values()), hw.sources
    assert hw.memory_gb_per_s is not None


def test_the_h100_profile_is_the_datasheet():
    hw = load_hardware("h100")
    assert (hw.bf16_tflops, hw.fp32_tflops, hw.memory_gb, hw.nvlink_domain) == (989, 67, 80, 8)
    assert (hw.intra_node_gb_per_s, hw.inter_node_gb_per_s) == (450, 50)
    for key in ("bf16_tflops", "fp32_tflops", "memory_gb", "memory_gb_per_s"):
        assert hw.sources[key].startswith("datasheet: NVIDIA H100 SXM"), key
    for key in ("nvlink_domain", "intra_node_gb_per_s", "inter_node_gb_per_s"):
        assert hw.sources[key].startswith("datasheet: "), key


def test_measured_tables_take_precedence_and_the_rest_falls_back(tmp_path):
    """The shipped profiles give what they gave before the tables (peak × efficiency, the
    link of the span); a measured entry replaces exactly the figure it measures."""
    h200 = load_hardware("h200")
    assert h200.matmul_flops_per_s(2) == 989e12 * 0.7
    assert h200.matmul_flops_per_s(4, "square") == 494e12 * 0.7
    assert h200.link(8) == h200.collective("all_to_all", 8) == (450e9, 10 * 1e-6)
    assert h200.link(16) == (50e9, 25 * 1e-6)
    mine = replace(
        h200,
        name="mine",
        matmul_tflops={"fp32": {"gram": 2.0, "small": 0.5}},
        collectives={"all_gather": {"4": {"gb_per_s": 3.0, "latency_us": 40.0}}},
    )
    assert mine.matmul_flops_per_s(4) == 2e12 and mine.matmul_flops_per_s(4, "small") == 0.5e12
    assert mine.matmul_flops_per_s(4, "square") == h200.matmul_flops_per_s(4, "square")
    assert mine.matmul_flops_per_s(2) == h200.matmul_flops_per_s(2)
    assert mine.collective("all_gather", 4) == (3e9, 40 * 1e-6)
    assert mine.collective("all_gather", 2) == mine.collective("all_reduce", 4) == h200.link(4)
    path = tmp_path / "mine.json"
    path.write_text(mine.to_json())
    assert load_hardware(path) == mine


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_plan_prices_tensor_parallelism_on_the_profile_and_the_device(device: str) -> None:
    """The plan's TP cost model takes the link, the Newton-Schulz rate and the memory
    bandwidth from the profile, and what no profile gives (the symmetric products' speed-up,
    the launch cost) from the layout's device, as the runtime's `auto` takes them there."""
    from orthoptim.parallel.tp_model import CostModel
    from orthoptim.plan.layouts import Layout
    from orthoptim.plan.planner import tp_cost_model

    hw = load_hardware("h100")
    layout = Layout(dp=1, tp=2, device=device, ns_dtype="fp32")
    model, own = tp_cost_model(hw, layout), CostModel.for_device(device)
    assert (model.bandwidth, model.latency) == hw.link(2)
    assert model.throughput == hw.matmul_flops_per_s(4)
    assert model.memory_bandwidth == hw.memory_bytes_per_s()
    assert (model.symmetric, model.launch) == (own.symmetric, own.launch)
    bare = replace(hw, memory_gb_per_s=None)
    assert tp_cost_model(bare, layout).memory_bandwidth == own.memory_bandwidth
