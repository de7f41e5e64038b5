import pytest
import torch


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
