"""Host reads per optimizer step (issue 28, item 5): at most one for every non-finite and
agreement check of a step together, and one for clipping only when `error_if_nonfinite`
asks for it; SOAP adds one on the steps that build or refresh its eigenbases.

Each step is counted twice: by `orthoptim.host.host_reads()` (what the code routes through
the helper) and by `ReadCounter`, an oracle that sees a read whether or not it goes through
the helper. On a GPU every one of them is a device→host stall; these tests run on the CPU,
where `.cpu()` and `.tolist()` of a CPU tensor reach no dispatcher, so the oracle watches
those methods at the Python level too.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import _get_value
from torch.utils._python_dispatch import TorchDispatchMode

from orthoptim import LayerwiseDistributedOptimizer, build_optimizer
from orthoptim.host import host_reads, reset_host_reads
from orthoptim.newton_schulz import newton_schulz
from orthoptim.parallel import FSDPOptimizer, TensorParallelOrthogonalizer

from distributed import run_ranks

# Ops whose output size depends on the data: the host waits for the device to know it.
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive"}


class ReadCounter(TorchDispatchMode):
    """Counts device→host reads: `aten._local_scalar_dense` (`item`, `bool`, `float`), ops
    with data-dependent output sizes, copies from a non-CPU device to the CPU, and, since
    those are invisible on a CPU tensor, `.cpu()`, `.tolist()` and `.numpy()` (`.to(device)`
    is left out: here the device is the CPU, so it cannot be told from a read).
    A tensor that came out of a read is on the host: reading it, or anything computed only
    from such tensors, is host work and not counted again."""

    METHODS = ("cpu", "tolist", "numpy")

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self._host: dict[int, torch.Tensor] = {}  # id → tensor (kept alive while counting)
        self._saved: dict[str, object] = {}

    def _is_host(self, t: object) -> bool:
        return isinstance(t, torch.Tensor) and self._host.get(id(t)) is t

    def _mark(self, out: object) -> None:
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if isinstance(t, torch.Tensor):
                self._host[id(t)] = t

    def _watch(self, name: str) -> None:
        original = getattr(torch.Tensor, name)
        counter = self

        def method(t, *args, **kwargs):
            if not counter._is_host(t):
                counter.reads += 1
            out = original(t, *args, **kwargs)
            counter._mark(out)
            return out

        self._saved[name] = original
        setattr(torch.Tensor, name, method)

    def __enter__(self):
        for name in self.METHODS:
            self._watch(name)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [
            a
            for a in torch.utils._pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        ]
        if tensors and all(self._is_host(t) for t in tensors):
            self._mark(out)
            return out
        name = func.overloadpacket.__name__
        leaving = (
            name in ("_to_copy", "copy_")
            and isinstance(out, torch.Tensor)
            and out.device.type == "cpu"
            and any(t.device.type != "cpu" for t in tensors)
        )
        if (name == "_local_scalar_dense" and not _torch_step_count()) or (
            name in DATA_DEPENDENT or leaving
        ):
            self.reads += 1
            self._mark(out)
        return out


def _torch_step_count() -> bool:
    """Whether the scalar being read is one of torch.optim's step counters, which torch
    keeps on the host (`torch.optim.optimizer._get_value`): no device read on a GPU."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is _get_value.__code__:
            return True
        frame = frame.f_back
    return False


def counted(fn) -> tuple[int, int]:
    """(reads through `orthoptim.host`, reads the oracle saw) while `fn()` runs."""
    reset_host_reads()
    with ReadCounter() as oracle:
        fn()
    return sum(host_reads().values()), oracle.reads


def test_the_oracle_sees_reads_that_bypass_the_helper():
    x = torch.randn(4, 4)
    flags = torch.isfinite(x)
    assert counted(lambda: bool(flags.all()))[1] == 1
    assert counted(lambda: flags.tolist())[1] == 1
    assert counted(lambda: flags.cpu().tolist())[1] == 1  # one read, then host work
    assert counted(lambda: x.nonzero())[1] == 1
    assert counted(lambda: (x + 1) @ x)[1] == 0


def test_a_healthy_agreement_reads_zeros(monkeypatch):
    """What the agreement reads counts what is wrong (a missing or non-finite gradient), so
    a dry run that answers every read with zeros sees a step where all is well."""
    from orthoptim import collectives, host

    seen = []
    read = host.read
    monkeypatch.setattr(host, "read", lambda t, what: seen.append(t.tolist()) or read(t, what))
    assert collectives.agree([True, True], torch.zeros(1)) == ([True, True], [False])
    assert collectives.agree([True, False], [True]) == ([True, False], [True])
    assert seen == [[0, 0, 0], [0, 1, 1]]


# -- models -------------------------------------------------------------------------------

WIDTH, BATCH, STEPS = 16, 8, 4


class MLP(nn.Module):
    """Six matrices and their biases: at bucket_mb=0.0005, seven buckets, four owned per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _steps(model, opt, clip: bool = False, rank: int = 0, world: int = 1) -> list[tuple]:
    """(step reads, clip reads) per step, each as (helper, oracle)."""
    per = BATCH // world
    out = []
    for step in range(STEPS):
        x, y = _batch(step)
        F.mse_loss(
            model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per]
        ).backward()
        clipped = counted(lambda: opt.clip_grad_norm_(1.0)) if clip else (0, 0)
        out.append((counted(opt.step), clipped))
        opt.zero_grad()
    return out


MUON = dict(optimizer="muon", lr=0.02, adamw_lr=3e-3)
SOAP = dict(optimizer="soap", lr=3e-3, adamw_lr=3e-3, precondition_frequency=2)
# SOAP builds its eigenbases at the first call and refreshes them at every 2nd step after.
SOAP_DUE = [True, False, True, False]


def _checks(rank: int, world: int) -> dict[str, list]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    out = {}
    for name, kw in (("layerwise muon", MUON), ("layerwise soap", SOAP)):
        torch.manual_seed(0)
        model = MLP()
        opt = LayerwiseDistributedOptimizer(model, bucket_mb=0.0005, **kw)
        out[name + " owned buckets"] = sum(bool(b.mine) for b in opt.grad_sync.buckets)
        out[name] = _steps(model, opt, clip=True, rank=rank, world=world)
        out[name + " error_if_nonfinite"] = [
            counted(lambda o=opt: o.clip_grad_norm_(1.0, error_if_nonfinite=True))
        ]
        opt.wait_for_params()

    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    out["fsdp muon"] = _steps(
        model, FSDPOptimizer(model, **MUON), clip=True, rank=rank, world=world
    )

    # Muon with the TP orthogonalizer over a tp = 2 mesh, both modes that touch a read.
    for mode in ("duplicated", "distributed"):
        torch.manual_seed(0)
        model = MLP()
        tp = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
        plan = {
            f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(6)
        }
        model = parallelize_module(model, tp, plan)
        orth = TensorParallelOrthogonalizer(mode=mode, steps=5)
        opt = build_optimizer(model, orthogonalizer=orth, **MUON)
        out[f"tp muon {mode}"] = _steps(model, opt)

    # The layer-wise optimizer over dp = 1 with tp = 2: its agreement spans both groups.
    torch.manual_seed(0)
    model = MLP()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(model, mesh["tp"], plan)
    opt = LayerwiseDistributedOptimizer(
        model,
        orthogonalizer=TensorParallelOrthogonalizer(mode="distributed", steps=5),
        process_group=mesh["dp"].get_group(),
        bucket_mb=0.0005,
        **MUON,
    )
    out["layerwise tp muon"] = _steps(model, opt, clip=True)
    opt.wait_for_params()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, list]]:
    return run_ranks(_checks, 2)


def _assert_at_most(per_step: list[tuple], step_reads: list[int], clip_reads: int = 0):
    for i, ((helper, oracle), (c_helper, c_oracle)) in enumerate(per_step):
        assert oracle <= step_reads[i], (i + 1, helper, oracle)
        assert helper == oracle, (i + 1, helper, oracle)
        assert c_oracle <= clip_reads and c_helper == c_oracle, (i + 1, c_helper, c_oracle)


def test_layerwise_muon_reads_once_per_step(results):
    for per_rank in results:
        assert per_rank["layerwise muon owned buckets"] >= 3  # the old code read once each
        _assert_at_most(per_rank["layerwise muon"], [1] * STEPS)
        # asked to raise on a non-finite norm, clipping reads it: one read
        assert per_rank["layerwise muon error_if_nonfinite"] == [(1, 1)]


def test_layerwise_soap_reads_once_plus_once_where_bases_change(results):
    for per_rank in results:
        _assert_at_most(per_rank["layerwise soap"], [1 + due for due in SOAP_DUE])


def test_layerwise_with_tensor_parallel_reads_once_per_step(results):
    for per_rank in results:
        _assert_at_most(per_rank["layerwise tp muon"], [1] * STEPS)


def test_fsdp_reads_once_per_step(results):
    for per_rank in results:
        _assert_at_most(per_rank["fsdp muon"], [1] * STEPS)


def test_tensor_parallel_muon_reads_once_per_step(results):
    for per_rank in results:
        for mode in ("duplicated", "distributed"):
            steps = [(s, (0, 0)) for s, _ in per_rank[f"tp muon {mode}"]]
            # the one read is optim/base.py's gradient check
            for i, ((_, oracle), _) in enumerate(steps):
                assert oracle <= 1, (mode, i + 1, oracle)


def _single(kw: dict) -> list[tuple]:
    torch.manual_seed(0)
    model = MLP()
    return _steps(model, build_optimizer(model, **kw))


def test_single_process_muon_reads_once_per_step():
    # optim/base.py's gradient check reads once, through the helper; nothing else
    for (helper, oracle), _ in _single(MUON):
        assert (helper, oracle) == (1, 1)


def test_single_process_soap_reads_once_plus_once_where_bases_change():
    for ((helper, oracle), _), due in zip(_single(SOAP), SOAP_DUE):
        assert (helper, oracle) == (1 + due, 1 + due)


def test_newton_schulz_without_its_check_reads_nothing_and_still_rescues_overflow():
    X = torch.randn(3, 8, 12)
    reads, seen = counted(lambda: newton_schulz(X * 1e25, check_finite=False))
    assert (reads, seen) == (0, 0)
    # the float32 sum of squares overflows: the rescaled norm is chosen on the device
    big = newton_schulz(X * 1e25, check_finite=False)
    torch.testing.assert_close(big, newton_schulz(X), atol=1e-6, rtol=0)
    X[1, 2, 3] = float("nan")
    out = newton_schulz(X, check_finite=False)  # no check: the NaN comes out as NaN
    assert out[1].isnan().all() and torch.isfinite(out[[0, 2]]).all()
    # the default keeps its check: one read, through the helper
    assert counted(lambda: newton_schulz(X[[0, 2]])) == (1, 1)
