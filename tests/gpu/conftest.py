"""The GPU suite: every multi-rank path at 2 ranks sharing ONE GPU, against the single-process
result on the same device.

    python -m pytest -q tests/gpu                                # on a CUDA machine
    ORTHOPTIM_GPU_TESTS_ON_CPU=1 python -m pytest -q tests/gpu   # the same logic on CPU

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so the ranks join a
"cuda:gloo" process group with every rank on cuda:0: gloo runs the collectives on CUDA
tensors and, as NCCL does, refuses CPU tensors. Without CUDA every test here is skipped with
the reason; ORTHOPTIM_GPU_TESTS_ON_CPU=1 runs the suite on ("cpu", "gloo") instead, so its
logic can be checked on a machine without a GPU (the variable wins on a CUDA machine too).

Spawning ranks is the slow part, so each module starts its 2 ranks once and checks many
things in that run: 6 spawned runs and 3 `orthoptim train` processes in all (the budget is 8
minutes on one H200; about 2 minutes in CPU mode on 2 cores).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# tests/ on sys.path for `distributed` (pytest puts it there for this package already; this
# keeps `python -m pytest tests/gpu/test_x.py` and the spawned ranks independent of that).
_TESTS = str(Path(__file__).resolve().parents[1])
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

ENV_VAR = "ORTHOPTIM_GPU_TESTS_ON_CPU"
SKIP_REASON = f"needs a CUDA GPU; set {ENV_VAR}=1 to run this suite's logic on CPU with gloo"
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class SuiteEnv:
    """Where the suite runs: the device every rank uses and the process-group backend."""

    device: str
    backend: str

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")


def choose_env() -> SuiteEnv | None:
    """("cpu", "gloo") with ORTHOPTIM_GPU_TESTS_ON_CPU=1, else ("cuda:0", "cuda:gloo") on a
    CUDA machine, else None (the suite skips)."""
    if os.environ.get(ENV_VAR, "").strip() not in ("", "0"):
        return SuiteEnv("cpu", "gloo")
    if torch.cuda.is_available():
        return SuiteEnv("cuda:0", "cuda:gloo")
    return None


ENV = choose_env()
if ENV is not None and ENV.cuda:
    # cuBLAS needs this (set before it starts, inherited by the spawned ranks) for the
    # deterministic algorithms the ranks switch on (see _models.setup_rank).
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def pytest_collection_modifyitems(config, items):
    if ENV is not None:
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def env() -> SuiteEnv:
    """The session's (device, backend)."""
    if ENV is None:  # only reached if a test here runs despite the skip marker
        pytest.skip(SKIP_REASON)
    return ENV
