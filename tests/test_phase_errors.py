"""`collectives.phase`: a failed collective says another rank died; a local error stays itself.

A rank's own error inside a named phase (an out-of-memory while serialising the state for a
full state-dict gather, a bug in local code) must come out as that exception, same type, with
the phase named in a note, and must not tell the user another rank died. Only a failure
raised by a collective itself (gloo's "Connection closed by peer", a timeout, NCCL's
`DistBackendError`) becomes the `CollectiveError` that does. Planted on 2 real gloo ranks in
the layer-wise optimizer's full state-dict gather, then a real dead peer, which the state dict's
rendezvous notices before any gather starts.
"""

import datetime
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.checkpoint import KW, make_model, train
from orthoptim import checkpoint as ckpt
from orthoptim import collectives as C
from orthoptim.collectives import errors, objects, store
from orthoptim.parallel import LayerwiseDistributedOptimizer

from distributed import free_port, run_ranks

OOM = "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 139.8 GiB total capacity)"
GATHER = "full state dict gather"
COPY = "full state dict (unshard and copy to the CPU)"
# a state dict first waits for every rank to enter it
RENDEZVOUS = "LayerwiseDistributedOptimizer.state_dict()"


def _described(exc: BaseException) -> dict:
    return {
        "type": type(exc).__name__,
        "message": str(exc),
        "notes": list(getattr(exc, "__notes__", [])),
        "is_collective_error": isinstance(exc, C.CollectiveError),
    }


def _planted(rank, world_size):
    """Three local errors planted in the full state-dict gather, on both ranks (so neither
    waits in a collective the other never joins), then a clean gather."""
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **KW)
    train(model, opt, range(1), rank, world_size)

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError(OOM)

    def bug(*args, **kwargs):
        raise RuntimeError("planted local bug: unreadable bytes")

    def value_bug(*args, **kwargs):
        raise ValueError("planted local bug in a copy")

    out = {}
    # serialising this rank's state, before any collective of the gather
    for key, module, name, fake, call in [
        ("oom", objects, "_to_bytes", oom, opt.state_dict),
        ("bug", objects, "_from_bytes", bug, lambda: ckpt.full_state_dict(opt)),
        ("copy", ckpt, "_cpu", value_bug, lambda: ckpt.full_state_dict(opt, to_rank0=True)),
    ]:
        real = getattr(module, name)
        setattr(module, name, fake)
        try:
            call()
            out[key] = None
        except Exception as exc:
            out[key] = _described(exc)
        finally:
            setattr(module, name, real)
    out["after"] = sorted(opt.state_dict()["state"])  # the group still works
    return out


def test_local_errors_in_a_state_dict_gather_stay_themselves_naming_the_phase():
    for rank, res in enumerate(run_ranks(_planted, 2)):
        oom, bug, copy = res["oom"], res["bug"], res["copy"]
        assert oom is not None and oom["type"] == "OutOfMemoryError", oom
        assert oom["message"].startswith(OOM), oom
        assert bug is not None and bug["type"] == "RuntimeError", bug
        assert bug["message"].startswith("planted local bug"), bug
        assert copy is not None and copy["type"] == "ValueError", copy
        for err, phase in ((oom, GATHER), (bug, GATHER), (copy, COPY)):
            assert not err["is_collective_error"], err
            text = " ".join([err["message"], *err["notes"]])
            assert "died" not in text and "Restart every rank" not in text, err
            assert any(phase in n and f"rank {rank} of 2" in n for n in err["notes"]), err
        assert res["after"], res


def _dead_peer(rank, port, outdir):
    """Rank 1 dies just before the gather; rank 0 gathers."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    store.RENDEZVOUS_TIMEOUT_S = 3.0  # the state dict's rendezvous notices the dead peer
    model = make_model()
    opt = LayerwiseDistributedOptimizer(model, **KW)
    train(model, opt, range(1), rank, 2)
    dist.barrier()
    if rank == 1:
        os._exit(0)
    try:
        opt.state_dict()
        out = None
    except Exception as exc:
        out = _described(exc)
    torch.save(out, os.path.join(outdir, "rank0.pt"))
    sys.stdout.flush()
    os._exit(0)  # no teardown with a dead peer


def test_a_dead_peer_in_a_state_dict_gather_says_another_rank_died(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_dead_peer, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    err = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert err is not None and err["is_collective_error"], err
    assert f"rank 0 of 2: {RENDEZVOUS} (rendezvous) failed" in err["message"], err
    assert "only 1 of the 2 ranks" in err["message"], err
    assert "Another rank probably died or stalled" in err["message"], err


# -- the classification, in one process -------------------------------------------------------


def test_a_failure_raised_by_a_collective_names_the_phase_and_a_dead_rank():
    cause = RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    inner = C.phase("parameter all-gather of bucket 3")
    with pytest.raises(C.CollectiveError) as info, C.phase("outer"), inner, C.issuing("all_gather"):
        raise cause
    exc = info.value
    assert exc.__cause__ is cause and exc.phase == "parameter all-gather of bucket 3"
    assert exc.collective == "all_gather"
    assert str(exc).startswith("rank 0 of 1: parameter all-gather of bucket 3 (all_gather) ")
    assert "Connection closed by peer" in str(exc) and "died or stalled" in str(exc)


def test_a_collective_failure_outside_a_phase_names_the_collective():
    expected = pytest.raises(C.CollectiveError, match=r"^rank 0 of 1: broadcast failed: Timed out")
    with expected, C.issuing("broadcast"):
        raise RuntimeError("Timed out waiting 4000ms for recv operation to complete")


@pytest.mark.parametrize("kind", ["DistBackendError", "DistNetworkError", "DistStoreError"])
def test_torch_distributed_errors_count_as_collective_failures(kind):
    cause = getattr(dist, kind)("Watchdog caught collective operation timeout")
    expected = pytest.raises(C.CollectiveError, match="died or stalled")
    with expected as info, C.phase("gradient norm (all-reduce)"):
        raise cause
    assert info.value.__cause__ is cause and info.value.collective == kind


def test_an_out_of_memory_inside_a_collective_call_stays_itself():
    oom = torch.OutOfMemoryError(OOM)
    expected = pytest.raises(torch.OutOfMemoryError)
    with expected as info, C.phase("full state dict gather"), C.issuing("all_gather"):
        raise oom
    assert info.value is oom and str(oom) == OOM
    assert info.value.__notes__ == [
        "rank 0 of 1: raised by this rank during full state dict gather (not a failed collective)"
    ]


def test_nested_phases_note_a_local_error_once():
    with pytest.raises(KeyError) as info, C.phase("outer"), C.phase("inner"):
        raise KeyError("w")
    assert len(info.value.__notes__) == 1 and "inner" in info.value.__notes__[0]


def test_a_device_refusal_is_still_a_device_error():
    refusal = RuntimeError("No backend type associated with device type cpu")
    for ctx in (lambda: C.phase("probe"), lambda: C.issuing("all_reduce")):
        expected = pytest.raises(C.CollectiveDeviceError, match="probe|all_reduce")
        with expected as info, ctx():
            raise refusal
        assert "died" not in str(info.value)


def test_the_note_reaches_the_message_on_python_3_10(monkeypatch):
    monkeypatch.setattr(errors, "_ADD_NOTE", False)
    with pytest.raises(RuntimeError) as info, C.phase("checkpoint save"):
        raise RuntimeError("local")
    assert info.value.__notes__ == [
        "rank 0 of 1: raised by this rank during checkpoint save (not a failed collective)"
    ]
    assert str(info.value) == f"local\n{info.value.__notes__[0]}"
