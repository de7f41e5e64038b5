"""Faults: a rank killed mid-step, and degenerate matrices.

One 3-rank gloo run (processes started here, not through run_ranks, because a rank must be
able to die without the launcher tearing the others down) first steps a model of degenerate
parameters, then saves a checkpoint and steps again while the last rank SIGKILLs itself
during backward. The survivors must fail at once (the dead rank's connections close) with an
error that names the phase they were waiting in; the checkpoint must still load and train. A
rank that stalls instead (alive, silent) is ended by the process-group timeout.
"""

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.distributed_c10d import _set_pg_timeout

from models.checkpoint import KW, every_matrix, make_model, train
from orthoptim import build_optimizer
from orthoptim import checkpoint as ckpt
from orthoptim.collectives import CollectiveError
from orthoptim.parallel import LayerwiseDistributedOptimizer

from distributed import free_port

WORLD = 3
# Process-group timeouts. On a loaded machine (2 shared cores, 3 ranks) a live rank can lag
# its peers by seconds (spawn and imports, the DCP save, a first step), so a short timeout
# can fire before any fault: a 6 s one once failed this file under load. The groups therefore
# start with SETUP_TIMEOUT_S, far above any such lag and never waited for when all goes well:
# a SIGKILLed rank's sockets close and the survivors fail at once (KILL_FAIL_S bounds that).
# Only the stall test waits for a timeout: after a barrier (the ranks in step) it lowers the
# timeout to TIMEOUT_S for the one step that stalls, so the suite stays as fast as before.
SETUP_TIMEOUT_S = 300
TIMEOUT_S = 6  # the stalled step's timeout, which the survivor must fail within
KILL_FAIL_S = 60  # a killed peer is noticed at once; the slack is for a loaded machine
PHASES = ("reduce-scatter of bucket", "reduce of bucket", "agreement", "all-gather", "broadcast")


class Degenerate(nn.Module):
    """One parameter per degenerate case of the table in docs/checkpoints.md."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.zero = nn.Parameter(torch.randn(6, 5, generator=g))  # gets a zero gradient
        self.rank1 = nn.Parameter(torch.randn(6, 5, generator=g))  # rank-1 gradient
        self.row = nn.Parameter(torch.randn(1, 7, generator=g))
        self.col = nn.Parameter(torch.randn(7, 1, generator=g))
        self.wide = nn.Parameter(torch.randn(2, 1024, generator=g))
        self.tall = nn.Parameter(torch.randn(1024, 2, generator=g))
        self.bf16 = nn.Parameter(torch.randn(4, 6, generator=g).bfloat16())
        self.fp16 = nn.Parameter(torch.randn(6, 4, generator=g).half())
        self.vec_bf16 = nn.Parameter(torch.randn(5, generator=g).bfloat16())
        self.nograd = nn.Parameter(torch.randn(3, 3, generator=g))  # never gets a gradient
        self.frozen = nn.Parameter(torch.randn(3, 3, generator=g), requires_grad=False)


def degenerate_grads(model, step):
    g = torch.Generator().manual_seed(step)
    for name, p in model.named_parameters():
        if name in ("nograd", "frozen"):
            continue
        if name == "zero":
            p.grad = torch.zeros_like(p)
        elif name == "rank1":
            p.grad = torch.outer(torch.randn(6, generator=g), torch.randn(5, generator=g))
        else:
            p.grad = torch.randint(-8, 9, p.shape, generator=g).to(p.dtype) / 16


def step_degenerate(opt, model, steps=3):
    for step in range(steps):
        degenerate_grads(model, step)
        opt.step()
        opt.zero_grad()
    if hasattr(opt, "wait_for_params"):
        opt.wait_for_params()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


DEGEN_KW = dict(lr=0.02, adamw_lr=1e-2, route=lambda n, p: p.ndim >= 2)


def _rank(rank, port, path, outdir, world=WORLD, stall=False):
    """kill: degenerate steps, checkpoint, then the last rank SIGKILLs itself mid-backward.
    stall: the last rank SIGSTOPs itself instead (alive, silent): only the timeout ends it."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    out = {}
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=SETUP_TIMEOUT_S),
        )
        if stall:
            model = make_model()
            opt = LayerwiseDistributedOptimizer(model, **KW)
            train(model, opt, range(1), rank, world)
            if rank == world - 1:
                model.fc1.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGSTOP))
            dist.barrier()
            _set_pg_timeout(datetime.timedelta(seconds=TIMEOUT_S))
            start = time.monotonic()
            try:
                train(model, opt, range(1, 2), rank, world)
                out["error"] = None
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
                out["is_collective_error"] = isinstance(exc, CollectiveError)
            out["elapsed"] = time.monotonic() - start
            raise SystemExit
        model = Degenerate()
        opt = LayerwiseDistributedOptimizer(model, **DEGEN_KW, bucket_mb=0.001)
        out["degenerate"] = step_degenerate(opt, model)

        model = make_model()
        opt = LayerwiseDistributedOptimizer(model, **KW)
        train(model, opt, range(2), rank, WORLD)
        ckpt.save_sharded(path, opt, model, extra={"step": 2})
        out["saved"] = opt.full_state_dict()
        out["saved_model"] = {k: v.clone() for k, v in model.state_dict().items()}
        if rank == world - 1:  # dies during backward, after some buckets were launched
            model.fc1.weight.register_hook(lambda g: os.kill(os.getpid(), signal.SIGKILL))
        start = time.monotonic()
        try:
            train(model, opt, range(2, 4), rank, world)
            out["error"] = None
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            out["is_collective_error"] = isinstance(exc, CollectiveError)
        out["elapsed"] = time.monotonic() - start
    except SystemExit:
        pass
    except BaseException as exc:
        out["crash"] = repr(exc)
    torch.save(out, os.path.join(outdir, f"rank{rank}.pt"))
    os._exit(1 if out.get("error") or out.get("crash") else 0)  # no teardown with a dead peer


def test_dead_rank_names_phase_and_checkpoint_resumes(tmp_path):
    path = str(tmp_path / "ckpt")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, path, str(tmp_path))) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 600  # generous: the machine is shared and slow
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"ranks {hung} hung instead of failing"
    assert procs[-1].exitcode == -signal.SIGKILL
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD - 1)]
    for rank, res in enumerate(results):
        assert "crash" not in res, res.get("crash")
        assert procs[rank].exitcode == 1
        assert res["is_collective_error"], res["error"]
        err = res["error"]
        assert any(phase in err for phase in PHASES), err
        assert "died or stalled" in err and f"rank {rank} of {WORLD}" in err
        # at once: the dead rank's connections closed (no timeout is waited for)
        assert res["elapsed"] < KILL_FAIL_S, res["elapsed"]

    # the checkpoint written before the failure loads (here, at world size 1) and trains
    model = make_model(seed=1)
    opt = LayerwiseDistributedOptimizer(model, **KW)
    assert ckpt.load_sharded(path, opt, model) == {"step": 2}
    saved = results[0]["saved"]
    got = opt.full_state_dict()
    assert got["state"].keys() == saved["state"].keys()
    for i, st in saved["state"].items():
        for k, v in st.items():
            assert torch.equal(got["state"][i][k], v), (i, k)
    for k, v in model.state_dict().items():
        assert torch.equal(v, results[0]["saved_model"][k]), k
    after = train(model, opt, range(2, 4))
    assert all(torch.isfinite(p).all() for p in after.values())

    # degenerate matrices: the same on every rank, near the single-process optimizer
    single = Degenerate()
    before = {n: p.detach().clone() for n, p in single.named_parameters()}
    want = step_degenerate(build_optimizer(single, **DEGEN_KW), single)
    check_degenerate(want, before)
    for res in results:
        got = res["degenerate"]
        check_degenerate(got, before)
        for n, p in got.items():
            assert torch.equal(p, results[0]["degenerate"][n]), n
            tol = 1e-5 if p.dtype == torch.float32 else 2e-2
            err = ((p.float() - want[n].float()).norm() / want[n].float().norm()).item()
            assert err <= tol, (n, err)


def check_degenerate(params, before):
    """The documented behaviour of each case (docs/checkpoints.md, "Degenerate parameters")."""
    for n, p in params.items():
        assert torch.isfinite(p).all(), n
        assert p.dtype == before[n].dtype, n
    for n in ("zero", "nograd", "frozen"):
        assert torch.equal(params[n], before[n]), n  # no gradient signal, no decay: unchanged
    for n in ("rank1", "row", "col", "wide", "tall", "bf16", "fp16"):
        assert not torch.equal(params[n], before[n]), n


def test_degenerate_newton_schulz_and_state_dtypes():
    """Single process: each degenerate case's orthogonalized update and state dtype."""
    from orthoptim import newton_schulz

    for shape in [(6, 5), (1, 7), (7, 1), (2, 1024), (1024, 2)]:
        zero = newton_schulz(torch.zeros(shape))
        assert torch.equal(zero, torch.zeros(shape)), shape
        g = torch.randn(shape)
        out = newton_schulz(g)
        assert torch.isfinite(out).all(), shape
        # a rank-one (or vector) input maps to its normalised direction, scaled into the
        # coefficient set's band around 1
        u = torch.linalg.svdvals(out)
        assert 0.6 < u[0] < 1.3, (shape, u)
    rank1 = torch.outer(torch.randn(6), torch.randn(5))
    s = torch.linalg.svdvals(newton_schulz(rank1))
    assert 0.6 < s[0] < 1.3 and s[1:].max() < 1e-3, s

    model = Degenerate()
    opt = build_optimizer(model, **DEGEN_KW)
    step_degenerate(opt, model, steps=1)
    assert opt.state[model.bf16]["momentum_buffer"].dtype == torch.float32
    assert opt.state[model.fp16]["momentum_buffer"].dtype == torch.float32
    assert model.nograd not in opt.state and model.frozen not in opt.state
    assert torch.isfinite(model.vec_bf16.detach()).all()


def test_degenerate_under_layerwise_optimizer():
    """The table of docs/checkpoints.md under the layer-wise optimizer (one process; 3 ranks
    above): the same parameters as the single-process optimizer, frozen and gradient-less
    parameters without state and, frozen, outside the checkpoint; fp16/bf16 matrices with fp32
    state."""
    single, model = Degenerate(), Degenerate()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    want = step_degenerate(build_optimizer(single, **DEGEN_KW), single)
    opt = LayerwiseDistributedOptimizer(model, **DEGEN_KW, bucket_mb=0.001)
    got = step_degenerate(opt, model)
    check_degenerate(got, before)
    for n, p in got.items():
        assert torch.equal(p, want[n]), n
    sd = opt.state_dict()
    names = {i: n for g in sd["param_groups"] for i, n in zip(g["params"], g["param_names"])}
    assert "frozen" not in names.values() and "nograd" in names.values()
    with_state = {names[i]: st for i, st in sd["state"].items()}
    assert "nograd" not in with_state
    for n in ("fp16", "bf16"):
        assert with_state[n]["momentum_buffer"].dtype == torch.float32, n
    fresh = LayerwiseDistributedOptimizer(Degenerate(), **DEGEN_KW, bucket_mb=0.001)
    fresh.load_state_dict(sd)
    assert fresh.state[fresh.model.fp16]["momentum_buffer"].dtype == torch.float32
    frozen = nn.Linear(3, 3)
    frozen.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        LayerwiseDistributedOptimizer(frozen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_checkpoint_keeps_fp32_state(dtype, tmp_path):
    """The fp32 momentum of a bf16/fp16 matrix survives both checkpoint paths in fp32."""
    model = nn.Sequential(nn.Linear(4, 6, bias=False), nn.Linear(6, 4, bias=False)).to(dtype)
    opt = LayerwiseDistributedOptimizer(model, lr=0.02, route=every_matrix)
    for p in model.parameters():
        p.grad = torch.randn(p.shape).to(dtype)
    opt.step()
    ckpt.save_sharded(tmp_path / "c", opt)
    want = opt.full_state_dict()
    for load in ("dcp", "full"):
        fresh = LayerwiseDistributedOptimizer(model, lr=0.02, route=every_matrix)
        if load == "dcp":
            ckpt.load_sharded(tmp_path / "c", fresh)
        else:
            fresh.load_state_dict(want)
        for i, st in fresh.full_state_dict()["state"].items():
            buf = st["momentum_buffer"]
            assert buf.dtype == torch.float32, load
            assert torch.equal(buf, want["state"][i]["momentum_buffer"]), load


def test_stalled_rank_times_out_naming_phase(tmp_path):
    """A rank that stops answering (SIGSTOP) without closing its connections: the other
    fails after the process-group timeout, not before and not much after."""
    ctx = mp.get_context("spawn")
    port = free_port()
    args = [(r, port, "", str(tmp_path), 2, True) for r in range(2)]
    procs = [ctx.Process(target=_rank, args=a) for a in args]
    for p in procs:
        p.start()
    procs[0].join(600)
    alive = procs[0].is_alive()
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not alive, "rank 0 hung past its timeout"
    res = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert "crash" not in res, res.get("crash")
    assert procs[0].exitcode == 1 and res["is_collective_error"], res
    assert "rank 0 of 2" in res["error"], res["error"]
    assert any(phase in res["error"] for phase in PHASES), res["error"]
    assert TIMEOUT_S - 1 <= res["elapsed"] < TIMEOUT_S + 30, res["elapsed"]
