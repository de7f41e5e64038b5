"""The Triton SYRK (under the CPU interpreter) and the per-shape choice between it and torch's
product: tables, lookup, the measured fallback."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from orthoptim import kernels
from orthoptim.kernels import tuning
from orthoptim.kernels.tuning import MATMUL, Entry, SyrkConfig

HERE = Path(__file__).resolve().parent


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (optional extra: pip install .[triton])",
)
@pytest.mark.parametrize("check", ["products", "order", "tune"])
def test_triton_syrk_under_interpreter(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE.parent / "src"), *filter(None, [env.get("PYTHONPATH")])]
    )
    proc = subprocess.run(
        [sys.executable, str(HERE / "triton_interpreter_checks.py"), check],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok" in proc.stdout or "worst" in proc.stdout


def test_lookup_takes_the_nearest_measured_shape_of_the_same_kind() -> None:
    big = SyrkConfig(128, 256, 64, 8, 3, group=8, persistent=True)
    batched = SyrkConfig(64, 64, 64, 4, 4)
    entries = [
        Entry("bfloat16", 1, 1024, 1024, False, MATMUL),
        Entry("bfloat16", 1, 4096, 4096, False, big),
        Entry("bfloat16", 8, 4096, 4096, False, batched),
        Entry("bfloat16", 1, 4096, 4096, True, MATMUL),
    ]
    bf16 = torch.bfloat16
    assert tuning.lookup(entries, bf16, 1, 256, 256, False) == MATMUL
    assert tuning.lookup(entries, bf16, 1, 1500, 1500, False) == MATMUL
    assert tuning.lookup(entries, bf16, 1, 3000, 3000, False) == big
    assert tuning.lookup(entries, bf16, 1, 16384, 16384, False) == big
    assert tuning.lookup(entries, bf16, 4, 2048, 2048, False) == batched  # a stack
    assert tuning.lookup(entries, bf16, 1, 4096, 4096, True) == MATMUL  # the epilogue's own
    assert tuning.lookup(entries, torch.float16, 1, 4096, 4096, False) is None


def test_table_round_trip_and_choice_on_its_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = SyrkConfig(64, 128, 32, 4, 3, group=8)
    rows = [
        dict(dtype="float32", batch=1, m=64, n=64, has_c=False, choice=MATMUL, ms={MATMUL: 1.0}),
        dict(dtype="float32", batch=1, m=512, n=512, has_c=False, choice=cfg, ms={cfg.name: 1}),
    ]
    path = tmp_path / "table.json"
    tuning.write_table(path, "cpu", rows, measured="test")
    name, entries = tuning.read_table(path)
    assert name == "cpu" and [e.choice for e in entries] == [MATMUL, cfg]
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    tuning.forget()
    try:
        assert tuning.choose(torch.zeros(600, 700), has_c=False) == cfg
        assert tuning.choose(torch.zeros(50, 70), has_c=False) == MATMUL
        # nothing measured with the epilogue on this device: torch's product
        assert tuning.choose(torch.zeros(600, 600), has_c=True) == MATMUL
        big = torch.zeros(1, tuning.FALLBACK_MIN_ROWS, 1, dtype=torch.bfloat16)
        assert tuning.choose(big, has_c=True) == MATMUL
    finally:
        monkeypatch.delenv(tuning.TABLE_ENV)
        tuning.forget()


def test_a_gpu_model_without_a_table_takes_the_plain_product(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No shipped table and no tuning: torch's product on every shape of a planted GPU model;
    the row threshold serves only the model it was measured on, in bf16 only."""
    big = torch.zeros(1, tuning.FALLBACK_MIN_ROWS, 1, dtype=torch.bfloat16)
    monkeypatch.delenv(tuning.TABLE_ENV, raising=False)
    monkeypatch.delenv(tuning.TUNE_ENV, raising=False)
    try:
        for name in ("NVIDIA B300 (planted)", "NVIDIA GeForce RTX 5090 (planted)"):
            monkeypatch.setattr(tuning, "device_name", lambda device, name=name: name)
            tuning.forget()
            assert tuning._entries_for(name, tuple(tuning.table_paths())) == ()
            for X in (big, big.float(), torch.zeros(2, 8192, 64, dtype=torch.bfloat16)):
                for has_c in (False, True):
                    assert tuning.choose(X, has_c=has_c) == MATMUL
        monkeypatch.setattr(tuning, "device_name", lambda device: tuning.FALLBACK_DEVICES[0])
        tuning.forget()
        assert tuning.choose(big, has_c=True) == tuning.default_config(torch.bfloat16)
        assert tuning.choose(big.half(), has_c=True) == MATMUL  # measured in bf16 only
        small = torch.zeros(tuning.FALLBACK_MIN_ROWS // 2, 8, dtype=torch.bfloat16)
        assert tuning.choose(small, has_c=False) == MATMUL
    finally:
        tuning.forget()


def test_a_bad_table_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "broken.json"
    path.write_text(json.dumps({"format": 1, "device": "cpu", "entries": [{"dtype": "x"}]}))
    with pytest.raises(ValueError, match="broken.json.*bench syrk --tune"):
        tuning.read_table(path)
    monkeypatch.setenv(tuning.TABLE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json.*not a file"):
        tuning.table_paths()
    path.write_text(
        json.dumps(
            {
                "format": 1,
                "device": "cpu",
                "entries": [
                    {
                        "dtype": "float32",
                        "batch": 1,
                        "m": 0,
                        "n": 4,
                        "has_c": False,
                        "choice": MATMUL,
                    }
                ],
            }
        )
    )
    with pytest.raises(ValueError, match="broken.json.*size below 1"):
        tuning.read_table(path)
    assert tuning.choose(torch.zeros(0, 5), has_c=False) == MATMUL
    with pytest.raises(ValueError, match="fields.*block"):
        tuning.choice_from_json({"block": 64})


def test_candidates_fit_shared_memory_and_the_matrix() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        width = torch.empty((), dtype=dtype).element_size()
        for m in (1, 100, 256, 4096):
            found = tuning.candidates(m, dtype)
            assert found, (m, dtype)
            for c in found:
                assert c.smem_bytes(width) <= tuning.SMEM_LIMIT
                assert c.block_n in (c.block_m, 2 * c.block_m)
                assert c.block_n <= 2 * max(64, 1 << max(0, m - 1).bit_length())
    assert any(c.block_n == 256 for c in tuning.candidates(4096, torch.bfloat16))
    assert all(c.block_n <= 128 for c in tuning.candidates(64, torch.bfloat16))
    assert tuning.candidates(1, torch.bfloat16) == tuning.candidates(64, torch.bfloat16)


def test_cpu_dispatch_is_untouched_by_the_cuda_choice() -> None:
    X = torch.randn(600, 700)
    with kernels.force_path("cpu_syrk"):
        assert kernels.backend_for(X) == "cpu_syrk"
        assert kernels.syrk_for(X) is not kernels._cuda_syrk


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="triton is not installed (optional extra: pip install .[triton])",
)
def test_a_config_that_fails_falls_back_to_the_plain_product_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table naming a config that cannot run here (the kernel launch fails on CPU tensors
    without the interpreter) must not stop training: torch's product serves the shape, with
    one warning naming the config."""
    cfg = SyrkConfig(64, 64, 32, 4, 3)
    row = dict(dtype="float32", batch=1, m=96, n=128, has_c=False, choice=cfg)
    path = tmp_path / "table.json"
    tuning.write_table(path, "cpu", [row])
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    tuning.forget()
    X = torch.randn(96, 128)
    try:
        with pytest.warns(RuntimeWarning, match=f"{cfg.name} failed on \\(96, 128\\)"):
            got = kernels._cuda_syrk(X, None, 0.0, 1.0)
        torch.testing.assert_close(got, X @ X.T)
        assert tuning.choose(X, has_c=False) == MATMUL
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            kernels._cuda_syrk(X, None, 0.0, 1.0)  # decided: no second warning
    finally:
        monkeypatch.delenv(tuning.TABLE_ENV)
        tuning.forget()
