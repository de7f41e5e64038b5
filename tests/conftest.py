import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Kernel paths are the same on every machine under test: no racing (the plain product unless a
# test forces or plants one), and no user's cache file read or written.
os.environ["ORTHOPTIM_KERNEL_CALIBRATION"] = "0"
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="orthoptim-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


def ill_conditioned(
    m: int, n: int, cond: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A float64 m×n matrix with log-spaced singular values from 1 down to 1/cond, plus U, V, σ."""
    g = torch.Generator().manual_seed(seed)
    U, _ = torch.linalg.qr(torch.randn(m, m, dtype=torch.float64, generator=g))
    V, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    k = min(m, n)
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return (U[:, :k] * s) @ V[:, :k].T, U[:, :k], V[:, :k], s


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `probe` (repeated trials that print a report's figures, minutes each) run
    only when selected with `-m probe`. A correctness check is never a probe: what a claim
    rests on runs in `.ci/run` (the default stage, or the `slow` one)."""
    if "probe" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="a figure probe: select with -m probe")
    for item in items:
        if "probe" in item.keywords:
            item.add_marker(skip)
