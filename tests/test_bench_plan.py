"""`orthoptim bench plan`: the plan's predicted step time beside the real step's, at data-,
tensor- and expert-parallel layouts. No test here compares a time: they check the layouts
it parses and refuses, and that every case runs end to end and reports what it measured."""

from __future__ import annotations

import json

import pytest

from orthoptim.bench.plan import parse_layouts
from orthoptim.cli import main


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
        assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
    auto, gram = rows[2]["modes_taken"], rows[3]["modes_taken"]
    assert set(gram) == {"gram"} and sum(auto.values()) == sum(gram.values()) > 0
    out = capsys.readouterr().out
    assert "dp1 muon/adamw: predicted" in out and "ep2 muon/adamw: predicted" in out
    assert "tp2: fastest measured" in out and "auto took" in out
