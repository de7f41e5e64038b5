"""A 2-rank gloo run ends with exit status 0: nothing of orthoptim's (nor the process group it
ran over) is still running when the interpreter tears down.

gloo's worker threads release a finished collective after waking its waiter, and releasing it
needs the interpreter (a tensor's Python object, a Python object in the work's thread-local
state); once the interpreter's teardown has begun, that thread is killed inside a noexcept
destructor and the process aborts ("terminate called without an active exception"). So a
clean exit needs the group destroyed, and its threads joined, before the teardown: by
`destroy_process_group()`, which orthoptim makes effective (torch.distributed.nn, imported after
the group started, keeps it alive otherwise), or by orthoptim at exit when the program leaves
the group.

Scenarios, alternated: the layer-wise optimizer with AdaMuon in float64, a few steps and one
more forward (its parameter gathers land), then `destroy_process_group()`; and DDP with
`build_optimizer` in a function (a script's `main()`) that never destroys the group. Both
import torch.distributed.nn after the group starts, as torch._dynamo's import does when the
first optimizer step comes after `init_process_group`. Each teardown is two real process
exits: ranks are forks (`os.fork`) of one driver process that imported torch, torch._dynamo
and orthoptim once, and each leaves by the end of the driver script. A CPU-bound process runs
beside them (the abort came on a busy machine). Every rank must exit with status 0, and no
gloo thread may be alive at its last exit handler (checked by a handler registered before
orthoptim is imported, so after orthoptim's own): that thread is what the abort needs, so the
check does not depend on winning the race.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

TEARDOWNS = 50  # across both scenarios; 2 rank exits each

DRIVER = r'''
import atexit, gc, os, socket, sys, time

CHILD = False
GLOO_THREADS_LEFT = 3  # a rank's exit status when a gloo thread is alive at its last handler


def gloo_threads():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    return [n for n in names if "gloo" in n]


def last_handler():  # registered before orthoptim's: runs after it
    if CHILD and gloo_threads():
        sys.stderr.write(f"gloo threads alive at exit: {gloo_threads()}\n")
        sys.stderr.flush()
        os._exit(GLOO_THREADS_LEFT)


atexit.register(last_handler)

import importlib

import torch
import torch._dynamo  # once here, not in every rank (the first optimizer step imports it)
import torch.distributed as dist
import torch.distributed.nn.functional

import orthoptim


def start_group():
    """init_process_group, then torch.distributed.nn imported after it, as torch._dynamo's
    import does when the first optimizer step runs after the group started (a reload: the
    driver imported it before)."""
    dist.init_process_group("gloo")
    importlib.reload(torch.distributed.nn.functional)


def layerwise():
    global model, opt  # alive into the teardown, as a script's globals are
    start_group()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8)
    ).double()
    opt = orthoptim.LayerwiseDistributedOptimizer(model, optimizer="adamuon", lr=0.02)
    x = torch.randn(4, 16, dtype=torch.float64)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    model(x)  # the last gathers land
    dist.destroy_process_group()


def ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP

    start_group()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    model = DDP(net.double())
    opt = orthoptim.build_optimizer(model.module, optimizer="adamuon", lr=0.02)
    x = torch.randn(4, 16, dtype=torch.float64)
    for _ in range(3):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    # no destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(n):
    """The parent: n teardowns, scenarios alternating; returns (scenario, status) per rank.
    A rank: returns its scenario, run below before the script (and the interpreter) ends."""
    global CHILD
    statuses = []
    for i in range(n):
        scenario = (layerwise, ddp)[i % 2]
        port, pids = free_port(), []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                CHILD = True
                os.environ.update(
                    RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                )
                torch.set_num_threads(1)
                return scenario
            pids.append(pid)
        for pid in pids:
            statuses.append((scenario.__name__, os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])))
    return statuses


# The driver's objects are left out of the ranks' collections: a fork's collector would touch
# (and so copy) every page of them, seconds per exit. What the ranks make is collected as ever.
gc.freeze()
start = time.time()
out = spawn(int(sys.argv[1]))
if callable(out):
    out()
else:
    bad = [s for s in out if s[1] != 0]
    print(f"teardowns={len(out) // 2} rank_exits={len(out)} failed={len(bad)} {bad} "
          f"time={time.time() - start:.1f}s", flush=True)
'''


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="os.fork and /proc")
def test_two_rank_teardowns_exit_cleanly(tmp_path: Path) -> None:
    script = tmp_path / "teardowns.py"
    script.write_text(DRIVER)
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        start = time.time()
        run = subprocess.run(
            [sys.executable, str(script), str(TEARDOWNS)],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    finally:
        burner.kill()
        burner.wait()
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("teardowns=")]
    print(lines[-1] if lines else run.stdout, f"(wall {time.time() - start:.1f} s)")
    assert run.returncode == 0, run.stderr[-4000:]
    assert lines and f"teardowns={TEARDOWNS} " in lines[-1], run.stdout + run.stderr[-4000:]
    assert " failed=0 " in lines[-1], lines[-1] + "\n" + run.stderr[-4000:]
