"""Smoke runs of `orthoptim bench` at tiny sizes: the registry, the JSON report, the ratios."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.optim import _muon

from orthoptim import cli
from orthoptim.bench import cli as bench_cli
from orthoptim.bench import (
    measure_matmul_peak,
    rate_against_peak,
    torch_muon_fp32,
    torch_zeropower_fp32,
)
from orthoptim.bench import ns as bench_ns
from orthoptim.bench import step as bench_step
from orthoptim.newton_schulz import COEFFICIENT_SETS, newton_schulz
from orthoptim.ns_cost import ns_flops

NS_PEERS = (
    "emerging_optimizers",
    "emerging_optimizers_syrk",
    "heavyball",
    "dion_ns_triton",
    "dion_polar_express_triton",
    "dion_ns_compiled",
)


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
        assert {"orthoptim", "matmul_ns", "torch_muon", *NS_PEERS} <= set(names)
        for name in ("orthoptim", "matmul_ns", "torch_muon"):
            case = names[name]
            assert _positive_finite(case["speedup_vs_baseline"])
            assert _positive_finite(case["effective_gflops"])
            assert _positive_finite(case["fraction_of_matmul"])
            assert len(case["times_s"]) == res["repeats"]
        assert names["matmul_ns"]["speedup_vs_baseline"] == 1.0
        for peer in NS_PEERS:
            assert "skipped" in names[peer] or _positive_finite(names[peer]["speedup_vs_baseline"])
        # CUDA-only peers say so on CPU, whether or not they are installed
        for peer in ("emerging_optimizers_syrk", "dion_ns_triton", "dion_polar_express_triton"):
            assert "CUDA-only" in names[peer]["skipped"], peer
        if res["dtype"] == "float32":  # dion casts to bfloat16 whatever it is given
            assert "bfloat16 rows only" in names["dion_ns_compiled"]["skipped"]
        assert "effective_tflops" not in names["orthoptim"]  # no peak measured on cpu by default
        for gemm in ("gemm_gram", "gemm_square", "gemm_apply", "kernel_gram"):
            assert _positive_finite(names[gemm]["gflops"])
        # the matmul rate is the best plain GEMM, never the SYRK's effective rate
        plain = [names[g]["gflops"] for g in ("gemm_gram", "gemm_square", "gemm_apply")]
        assert res["matmul_gflops"] == max(plain)
    assert report["matmul_peak"] is None


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
    for name in ("emerging_optimizers_muon_syrk", "dion_muon_triton"):
        assert "CUDA-only" in names[name]["skipped"], name
    assert "skipped" in names["dion_muon"]  # bfloat16 by design: only with --bf16-peers on cpu
    assert report["matmul_peak"] is None and "effective_tflops" not in names["orthoptim_muon"]
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


def test_rate_against_peak_arithmetic() -> None:
    peak = {"tflops": 4.0}
    rate = rate_against_peak(flops=6e12, seconds=0.5, peak=peak)
    assert rate == pytest.approx({"effective_tflops": 12.0, "fraction_of_peak": 3.0})
    measured = measure_matmul_peak(torch.device("cpu"), 16, repeats=2, dtype=torch.float32)
    assert measured["flops"] == 2 * 16**3 and measured["dtype"] == "float32"
    assert measured["tflops"] == pytest.approx(measured["flops"] / measured["best_s"] / 1e12)


def test_bench_ns_rates_against_measured_peak(capsys: pytest.CaptureFixture[str]) -> None:
    """--peak-size on CPU: one peak per run; every timed row's effective TFLOP/s is its flops
    (plain Newton-Schulz, or the GEMM's own) over its median time, and its fraction of it."""
    argv = ["bench", "ns", "--shapes", "16x24,2x8x12", "--dtypes", "float32", "--repeats", "2",
            "--warmup", "0", "--threads", "1", "--peak-size", "32", "--json"]  # fmt: skip
    report = _run_json(capsys, argv)
    peak = report["matmul_peak"]
    assert peak["size"] == 32 and peak["dtype"] == "bfloat16" and peak["flops"] == 2 * 32**3
    assert peak["tflops"] == pytest.approx(peak["flops"] / peak["best_s"] / 1e12)
    for res in report["results"]:
        b, m, n = res["shape"]
        assert res["plain_flops"] == b * ns_flops(m, n, 5)
        timed = [row for row in res["cases"] if "median_s" in row]
        assert {"orthoptim", "matmul_ns", "gemm_gram"} <= {row["name"] for row in timed}
        for row in timed:
            flops = row.get("flops", res["plain_flops"])
            tflops = flops / row["median_s"] / 1e12
            assert row["effective_tflops"] == pytest.approx(tflops), row["name"]
            assert row["fraction_of_peak"] == pytest.approx(tflops / peak["tflops"]), row["name"]
        for row in res["cases"]:
            assert ("effective_tflops" in row) == ("median_s" in row), row["name"]
    assert bench_ns.render(report).count("matmul peak:") == 1


def test_bench_step_rates_against_measured_peak(capsys: pytest.CaptureFixture[str]) -> None:
    """Muon candidates get the plain Newton-Schulz flops of every matrix over their step time;
    AdamW's step does other work and gets none."""
    argv = ["bench", "step", "--layers", "1", "--width", "8", "--repeats", "1", "--warmup", "0",
            "--threads", "1", "--peak-size", "32", "--json"]  # fmt: skip
    report = _run_json(capsys, argv)
    shapes = bench_step.gpt_matrix_shapes(1, 8)
    assert report["step_flops"] == sum(ns_flops(r, c, 5) for r, c in shapes)
    peak = report["matmul_peak"]["tflops"]
    names = {c["name"]: c for c in report["cases"]}
    for name in ("orthoptim_muon", "orthoptim_muon_matmul", "torch_muon"):
        tflops = report["step_flops"] / names[name]["median_s"] / 1e12
        assert names[name]["effective_tflops"] == pytest.approx(tflops)
        assert names[name]["fraction_of_peak"] == pytest.approx(tflops / peak)
    assert "effective_tflops" not in names["torch_adamw_fused"]
    assert "matmul peak:" in bench_step.render(report)


class _FakeEmerging:
    """Stands in for Emerging-Optimizers' muon_utils and orthogonalized_optimizers modules."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[int, ...], bool, str]] = []

    def newton_schulz(
        self, x: torch.Tensor, steps: int, coefficient_type: str = "quintic", use_syrk: bool = False
    ) -> torch.Tensor:
        self.calls.append((tuple(x.shape), use_syrk, torch.get_float32_matmul_precision()))
        return x

    class Muon(torch.optim.SGD):
        def __init__(self, params, lr, fp32_matmul_prec="medium", use_syrk=False) -> None:  # type: ignore[no-untyped-def]
            super().__init__(params, lr=lr)
            self.use_syrk, self.fp32_matmul_prec = use_syrk, fp32_matmul_prec


def test_bench_ns_emerging_syrk_loops_over_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where use_syrk applies (CUDA, faked here), a batch is timed as a loop over its 2-D
    matrices under matmul precision 'medium', and the note says so; float32 rows skip it."""
    fake = _FakeEmerging()
    monkeypatch.setattr(bench_ns, "import_optional", lambda module: (fake, None))
    monkeypatch.setattr(bench_ns, "emerging_syrk_skip", lambda device: None)
    X = torch.randn(3, 8, 12)
    cases = {c.name: c for c in bench_ns._emerging_cases(X, torch.bfloat16, 5, "quintic")}
    syrk = cases["emerging_optimizers_syrk"]
    assert syrk.skip is None and syrk.extra["peer"] and "loop over its 3 matrices" in syrk.note
    before = torch.get_float32_matmul_precision()
    syrk.run()
    assert fake.calls == [((8, 12), True, "medium")] * 3
    assert torch.get_float32_matmul_precision() == before
    fp32 = {c.name: c for c in bench_ns._emerging_cases(X, torch.float32, 5, "quintic")}
    assert "bfloat16 rows only" in fp32["emerging_optimizers_syrk"].skip


def test_bench_step_emerging_syrk_and_dion_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA (faked here) the suite adds Emerging-Optimizers' Muon with use_syrk=True; dion's
    Muon, absent here, is listed as skipped with the way to get it."""
    import argparse

    from orthoptim.bench import DION_HINT

    fake = _FakeEmerging()
    real_import = bench_step.import_optional
    monkeypatch.setattr(
        bench_step,
        "import_optional",
        lambda module: (fake, None) if module.startswith("emerging") else real_import(module),
    )
    monkeypatch.setattr(bench_step, "emerging_syrk_skip", lambda device: None)
    args = argparse.Namespace(device="cuda", bf16_peers=False)
    cands = {c.name: c for c in bench_step.muon_candidates(args)}
    syrk = cands["emerging_optimizers_muon_syrk"]
    assert syrk.skip is None and syrk.peer
    opt = syrk.build([torch.nn.Parameter(torch.randn(4, 4))])
    assert opt.use_syrk and opt.fp32_matmul_prec == "medium"
    if real_import("dion")[0] is None:
        for name in ("dion_muon", "dion_muon_triton"):
            assert DION_HINT in cands[name].skip
    assert not cands["torch_adamw_fused"].counts_flops and cands["torch_muon"].counts_flops


def test_bench_step_rejects_unknown_optimizer(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit, match="--optimizer"):
        cli.main(["bench", "step", "--optimizer", "nope", "--layers", "1", "--width", "8"])


@pytest.mark.parametrize(
    ("bench", "shapes", "why"),
    [
        ("ns", "12by4", "'12by4' is not ROWSxCOLS or BATCHxROWSxCOLS"),
        # a size of 0 used to be refused as "not ROWSxCOLS", and crashed bench tp
        ("ns", "0x5", "'0x5': every size must be >= 1"),
        ("syrk", "2x4x0", "'2x4x0': every size must be >= 1"),
        ("tp", "0x5", "'0x5': every size must be >= 1"),
        ("tp", "2x3x4", "'2x3x4' is not ROWSxCOLS"),
    ],
)
def test_bench_rejects_bad_shapes_naming_them(
    bench: str, shapes: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", bench, "--shapes", shapes])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"orthoptim bench {bench}: error: argument --shapes: {why}", last


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


def test_bench_build_reports_construction_against_the_parameters(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`bench build` at 2 gloo ranks over 4 x Linear(512, 512) (4 MiB of parameters): each
    rank's peak RSS added by building and by the first step, and the ratio to the parameters'
    bytes (the figures themselves depend on the allocator: `docs/distributed.md` quotes
    them at 12 x 2048)."""
    argv = ["bench", "build", "--nproc", "2", "--layers", "4", "--width", "512", "--json"]
    report = _run_json(capsys, argv)
    params = 4 * 512 * 512 * 4
    assert report["model"]["param_bytes"] == params and len(report["ranks"]) == 2
    for row in report["ranks"]:
        assert row["construction_bytes"] >= 0 and row["first_step_bytes"] >= 0
        assert row["construction_over_params"] == row["construction_bytes"] / params
    assert report["construction_over_params_max"] == max(
        r["construction_over_params"] for r in report["ranks"]
    )
    with pytest.raises(SystemExit, match="--nproc must be >= 1"):
        cli.main(["bench", "build", "--nproc", "0"])


def test_bench_syrk_json_and_table(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from orthoptim.kernels import tuning

    table = tmp_path / "table.json"
    argv = ["bench", "syrk", "--dtype", "float32", "--shapes", "64x96,2x32x48", "--repeats", "1"]
    report = _run_json(capsys, [*argv, "--tune", "--write", str(table), "--json"])
    products = [(r["product"], r["shape"]) for r in report["results"]]
    assert products == [
        ("gram", [1, 64, 96]),
        ("poly", [1, 64, 64]),
        ("gram", [2, 32, 48]),
        ("poly", [2, 32, 32]),
    ]
    for res in report["results"]:
        rows = {c["name"]: c for c in res["cases"]}
        assert rows["torch"]["correct"] and rows["orthoptim"]["correct"]
        assert _positive_finite(rows["orthoptim"]["effective_tflops"])
        assert "CUDA" in rows["triton configs"]["skipped"]  # no Triton launch on CPU
        assert res["winner"] == "torch"  # the only candidate raced here
    name, entries = tuning.read_table(table)
    assert name == "cpu" and len(entries) == 4
    assert all(e.choice == tuning.MATMUL for e in entries)
    assert [e.has_c for e in entries] == [False, True, False, True]
    with pytest.raises(SystemExit, match="--write needs --tune"):
        cli.main([*argv, "--write", str(table)])


def test_bench_skip_leaves_named_candidates_out(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "ns", "--shapes", "16x24", "--dtypes", "float32", "--repeats", "1"]
    report = _run_json(capsys, [*argv, "--skip", "torch_muon", "--json"])
    rows = {c["name"]: c for c in report["results"][0]["cases"]}
    assert rows["torch_muon"]["skipped"] == "left out with --skip"
    assert "median_s" in rows["orthoptim"]
    with pytest.raises(SystemExit, match="--skip: no candidate named nope; candidates: orthoptim"):
        cli.main([*argv, "--skip", "nope"])


def test_bench_compile_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Eager and compiled Muon side by side on a 1-layer GPT, their parameters compared.

    Both copies take 4 steps (the compiling call, 1 warm-up, 2 timed) on the same gradients;
    compiled and eager Newton-Schulz round differently, |ΔO|/|O| ≲ 1e-5 per step (see
    tests/test_compile.py), so the total updates agree to ~1e-5 relative: 1e-4 bounds it."""
    report = _run_json(
        capsys,
        [
            "bench",
            "compile",
            "--optimizers",
            "muon",
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
    assert report["layers"] == 1 and report["width"] == 16
    assert [c["name"] for c in report["cases"]] == ["muon_eager", "muon_compiled"]
    (result,) = report["results"]
    assert result["optimizer"] == "muon"
    for key in ("eager_ms", "compiled_ms", "compile_s"):
        assert _positive_finite(result[key]), key
    assert result["compiled_over_eager"] == pytest.approx(
        result["compiled_ms"] / result["eager_ms"]
    )
    assert len(result["per_round_ratios"]) == 2
    assert 0 <= result["max_relative_difference"] <= 1e-4


def test_bench_compile_rejects_unknown_optimizer() -> None:
    with pytest.raises(SystemExit, match="hybrid_normuon"):
        cli.main(["bench", "compile", "--optimizers", "muon,soap", "--layers", "1"])


def test_bench_syrk_tune_fills_the_cpu_cache_and_bench_step_says_why(
    capsys: pytest.CaptureFixture[str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench syrk --tune` on CPU races the Newton-Schulz paths even with measuring off and
    writes them to the decisions file; `bench step` and `bench ns` then report each shape's
    path as cached, and an unlisted one as the default."""
    from orthoptim import kernels, ns_cost
    from orthoptim.kernels import calibration, syrk_cpu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(calibration, "CALIBRATOR", calibration.Calibrator())
    monkeypatch.setattr(calibration, "MIN_ROWS", 8)
    monkeypatch.setattr(syrk_cpu, "LEAF_ROWS", 8)
    assert not calibration.measuring_enabled()  # the tests turn measuring off
    argv = ["bench", "syrk", "--shapes", "16x64", "--repeats", "1", "--threads", "1"]
    report = _run_json(capsys, [*argv, "--tune", "--json"])
    (path,) = report["kernel_paths"]
    assert path["reason"] == "measured" and path["shape"] == [1, 16, 64]
    assert set(path["ms"]) == set(ns_cost.PATHS)
    entries = calibration.read_cache(calibration.cache_path())
    assert [e["path"] for e in entries.values()] == [path["path"]]

    kernels.forget()  # a new process
    step = ["bench", "step", "--layers", "1", "--width", "16", "--repeats", "1", "--warmup", "0"]
    report = _run_json(capsys, [*step, "--threads", "1", "--json"])
    paths = {tuple(p["shape"]): p for p in report["kernel_paths"]}
    assert paths[(1, 16, 64)]["reason"] == "cached"
    assert paths[(1, 16, 64)]["path"] == path["path"]
    assert paths[(1, 16, 16)]["reason"] == "default"  # never measured: the plain product
    assert paths[(1, 16, 16)]["path"] == "matmul"
    ns = ["bench", "ns", "--shapes", "64x16", "--dtypes", "float32", "--repeats", "1"]
    report = _run_json(capsys, [*ns, "--warmup", "0", "--threads", "1", "--json"])
    (res,) = report["results"]
    assert [p["reason"] for p in res["kernel_paths"]] == ["cached"]
    names = {c["name"]: c for c in res["cases"]}
    assert names["orthoptim"]["note"] == f"kernels: {path['path']}"
    assert cli.main([*ns, "--warmup", "0", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert f"16x64 float32: {path['path']} (cached" in text and "kernel paths" in text
