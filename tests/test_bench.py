"""Smoke runs of `orthoptim bench` at tiny sizes: the registry, the JSON report, the ratios."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.optim import _muon

from orthoptim import cli
from orthoptim.bench import cli as bench_cli
from orthoptim.bench import torch_muon_fp32, torch_zeropower_fp32
from orthoptim.newton_schulz import COEFFICIENT_SETS, newton_schulz


def _run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    threads = torch.get_num_threads()
    assert cli.main(argv) == 0
    assert torch.get_num_threads() == threads  # --threads is restored afterwards
    return json.loads(capsys.readouterr().out)


def _positive_finite(x: object) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_bench_registry_lists_every_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert "orthoptim.bench.cli" in cli.SUBCOMMAND_MODULES
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for module in bench_cli.BENCH_MODULES:
        assert module.rsplit(".", 1)[1] in out
    assert cli.main(["bench"]) == 2  # no benchmark named: help, failure status


def test_bench_ns_json(capsys: pytest.CaptureFixture[str]) -> None:
    report = _run_json(
        capsys,
        [
            "bench",
            "ns",
            "--shapes",
            "24x40,2x16x24",
            "--dtypes",
            "float32,bfloat16",
            "--repeats",
            "2",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--json",
        ],
    )
    assert report["benchmark"] == "ns" and report["baseline"] == "matmul_ns"
    assert len(report["results"]) == 4
    for res in report["results"]:
        assert _positive_finite(res["matmul_gflops"])
        if res["dtype"] == "bfloat16":  # scaled down by 4 on cpu, and said so
            assert res["shape"][1:] == [r // 4 for r in res["requested_shape"][1:]]
        names = {c["name"]: c for c in res["cases"]}
        assert {"orthoptim", "matmul_ns", "torch_muon", "emerging_optimizers", "heavyball"} <= set(
            names
        )
        for name in ("orthoptim", "matmul_ns", "torch_muon"):
            case = names[name]
            assert _positive_finite(case["speedup_vs_baseline"])
            assert _positive_finite(case["effective_gflops"])
            assert _positive_finite(case["fraction_of_matmul"])
            assert len(case["times_s"]) == res["repeats"]
        assert names["matmul_ns"]["speedup_vs_baseline"] == 1.0
        for peer in ("emerging_optimizers", "heavyball"):
            assert "skipped" in names[peer] or _positive_finite(names[peer]["speedup_vs_baseline"])
        for gemm in ("gemm_gram", "gemm_square", "gemm_apply", "kernel_gram"):
            assert _positive_finite(names[gemm]["gflops"])
        # the matmul rate is the best plain GEMM, never the SYRK's effective rate
        plain = [names[g]["gflops"] for g in ("gemm_gram", "gemm_square", "gemm_apply")]
        assert res["matmul_gflops"] == max(plain)


def test_bench_step_json(capsys: pytest.CaptureFixture[str]) -> None:
    report = _run_json(
        capsys,
        [
            "bench",
            "step",
            "--layers",
            "1",
            "--width",
            "16",
            "--repeats",
            "2",
            "--warmup",
            "1",
            "--threads",
            "1",
            "--json",
        ],
    )
    assert report["optimizer"] == "muon" and report["matrices"] == 6
    assert report["parameters"] == 4 * 16 * 16 + 2 * 16 * 64
    names = {c["name"]: c for c in report["cases"]}
    for name in ("orthoptim_muon", "orthoptim_muon_matmul", "torch_muon", "torch_adamw_foreach"):
        assert _positive_finite(names[name]["speedup_vs_baseline"]), name
    for name, case in names.items():
        assert "skipped" in case or _positive_finite(case["median_s"]), name
    headline = report["headline"]
    assert headline["ours"] == "orthoptim_muon"
    assert _positive_finite(headline["speedup_vs_fastest_peer"])
    ours, peer = names["orthoptim_muon"]["times_s"], names[headline["fastest_peer"]]["times_s"]
    assert headline["per_round_speedups"] == pytest.approx([p / o for p, o in zip(peer, ours)])
    assert len(headline["per_round_speedups"]) == 2


def test_bench_step_muon_suite_on_cuda_times_peers_as_shipped() -> None:
    """On CUDA the suite adds explicit bf16/fp32 Newton-Schulz beside the default, and times
    torch.optim.Muon unpatched (bf16); on CPU torch's is patched to float32."""
    import argparse

    from orthoptim.bench.step import muon_candidates

    def by_name(device: str) -> dict:
        ns = argparse.Namespace(device=device, bf16_peers=False)
        return {c.name: c for c in muon_candidates(ns)}

    cuda, cpu = by_name("cuda"), by_name("cpu")
    assert {"orthoptim_muon_bfloat16", "orthoptim_muon_float32"} <= set(cuda)
    assert "orthoptim_muon_bfloat16" not in cpu
    assert cuda["torch_muon"].wrap is None and cuda["torch_muon"].peer
    assert cpu["torch_muon"].wrap is not None
    p = torch.nn.Parameter(torch.randn(8, 8))
    assert cuda["orthoptim_muon_bfloat16"].build([p]).param_groups[0]["ns_dtype"] == torch.bfloat16


def test_bench_step_rejects_unknown_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--optimizer"):
        cli.main(["bench", "step", "--optimizer", "nope", "--layers", "1", "--width", "8"])


def test_bench_ns_rejects_bad_shape() -> None:
    with pytest.raises(SystemExit, match="--shapes"):
        cli.main(["bench", "ns", "--shapes", "12by4"])


def test_torch_muon_fp32_patch_is_float32_newton_schulz() -> None:
    G = torch.randn(24, 40, dtype=torch.float64)
    original = _muon._zeropower_via_newtonschulz
    with torch_muon_fp32():
        assert _muon._zeropower_via_newtonschulz is torch_zeropower_fp32
        out = _muon._zeropower_via_newtonschulz(G.T, COEFFICIENT_SETS["simple"][0], 5, 1e-7)
    assert _muon._zeropower_via_newtonschulz is original
    assert out.dtype == torch.float32
    ref = newton_schulz(G.T, steps=5, coefficients="simple", dtype=torch.float64)
    assert (out.double() - ref).abs().max().item() < 1e-4


def test_bench_dist_fsdp_json(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench dist --fsdp`: FSDP2 + AdamW vs FSDPOptimizer side by side, bytes split by who
    sends them. FSDP2's own traffic does not depend on the optimizer; the optimizer's is
    2·(N−1)/N = 1× its sharded matrix gradient at 2 ranks (plus the small flag all-reduce),
    half of that with bfloat16 on the wire."""
    argv = ["bench", "dist", "--fsdp", "--nproc", "2", "--layers", "1", "--width", "32",
            "--heads", "2", "--seq-len", "16", "--batch", "2", "--steps", "1", "--warmup", "0",
            "--json"]  # fmt: skip
    report = _run_json(capsys, argv)
    rows = report["methods"]
    assert report["fsdp"] and list(rows) == ["fsdp_adamw", "fsdp_muon", "fsdp_muon_bf16"]
    params = report["model"]["params"] * 4
    fsdp2 = rows["fsdp_adamw"]["fsdp2_sent_bytes_mean"]
    # Gathers in forward (and again in backward for the blocks), one gradient reduce-scatter.
    assert 2 * 0.5 * params <= fsdp2 <= 3 * 0.5 * params * 1.1
    for name, row in rows.items():
        assert row["fsdp2_sent_bytes_mean"] == fsdp2, name
        assert row["sent_bytes_mean"] == fsdp2 + row["optimizer_sent_bytes_mean"], name
        assert _positive_finite(row["step_s"]) and row["state_bytes_max"] > 0
    assert rows["fsdp_adamw"]["optimizer_sent_bytes_mean"] == 0.0
    assert rows["fsdp_adamw"]["step_time_vs_fsdp_adamw"] == 1.0
    assert 1.0 <= rows["fsdp_muon"]["optimizer_bytes_over_sharded_grad"] < 1.01
    assert 0.5 <= rows["fsdp_muon_bf16"]["optimizer_bytes_over_sharded_grad"] < 0.51
    with pytest.raises(SystemExit, match="under --fsdp"):
        cli.main(["bench", "dist", "--fsdp", "--methods", "ddp_adamw"])
