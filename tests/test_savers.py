"""Every saver writes the whole layer-wise model, and loads it back.

Under `LayerwiseDistributedOptimizer` the parameters are views of flat buffers; the optimizer's
state-dict hook (`orthoptim.parallel.layerwise.saving`) gives each entry a storage of its own
over the same memory. One spawn of 2 real gloo ranks trains the tiny GPT-2 of
`integration_models` one step under accelerate (the model prepared, so wrapped in DDP), takes
the oracle (every parameter, cloned, by its state-dict name), saves by each of accelerate's
`save_model` and `save_state` (safetensors, their default), transformers' `save_pretrained`,
`torch.save` and DCP, steps again (the parameters move), and loads back. Every saved or
reloaded tensor equals the oracle bit for bit; every file holds the model's whole state-dict
key set, less the tied `lm_head.weight` where the library drops ties (accelerate, transformers
for safetensors), as it does for the same model without the optimizer.
"""

from __future__ import annotations

import copy
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from integration_models import BATCH, LR, byte_data, gpt2, set_rank_env

from distributed import run_ranks

pytest.importorskip("accelerate", reason="accelerate's savers need the [accelerate] extra")
pytest.importorskip("transformers", reason="the model and save_pretrained are transformers'")

TIED = "lm_head.weight"  # GPT-2's head is its token embedding, one Parameter under two names


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer by each of its names, cloned (not read through state_dict)."""
    named = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    return {k: v.detach().clone() for k, v in named}


def _attempt(out: dict, name: str, fn: Callable[[], Any]) -> None:
    """out[name] = fn(), or what it raised (every rank runs the same savers, so all raise
    alike): each saver's test then fails on its own."""
    try:
        out[name] = fn()
    except Exception as exc:
        out[name] = f"raised {type(exc).__name__}: {exc}"


def _saves(rank: int, world_size: int, base: str) -> dict:
    """Save by every saver, step, load back; what was read, for the tests to compare."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from accelerate import Accelerator, load_checkpoint_in_model
    from accelerate.state import AcceleratorState
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    import orthoptim

    set_rank_env(rank, world_size)
    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(cpu=True)
    model = gpt2()
    layerwise = orthoptim.LayerwiseDistributedOptimizer(model, optimizer="muon", lr=LR)
    wrapped, opt = accelerator.prepare(model, layerwise)
    data = byte_data(6 * BATCH * world_size)[rank::world_size]

    def step(i: int) -> None:
        _step(wrapped, opt, data[i * BATCH : (i + 1) * BATCH])
        layerwise.wait_for_params()

    step(0)
    want = _params(model)
    out: dict = {"want": want, "keys": sorted(model.state_dict())}
    out["storages"] = len({p.untyped_storage().data_ptr() for p in model.parameters()})
    out["n_params"] = len(list(model.parameters()))
    d = Path(base)
    (d / "torch_save").mkdir(exist_ok=True)
    saves = {
        "save_model": lambda: accelerator.save_model(wrapped, d / "save_model"),
        "save_state": lambda: accelerator.save_state(str(d / "save_state")),
        "pretrained": lambda: model.save_pretrained(d / "pretrained", is_main_process=rank == 0),
        "torch_save": lambda: torch.save(model.state_dict(), d / "torch_save" / f"rank{rank}.pt"),
        "dcp": lambda: dcp.save({"model": model.state_dict()}, checkpoint_id=str(d / "dcp")),
    }
    for name, save in saves.items():
        _attempt(out, name, save)
    dist.barrier()

    step(1)
    out["moved"] = [k for k, v in _params(model).items() if not torch.equal(v, want[k])]

    def load_state() -> dict:  # safetensors' load_model
        accelerator.load_state(str(d / "save_state"))
        return _params(model)

    def dcp_in_place() -> dict:
        # into the dict state_dict() returned, with no load_state_dict after it (as
        # orthoptim.checkpoint.load_sharded loads the model)
        step(2)
        dcp.load({"model": model.state_dict()}, checkpoint_id=str(d / "dcp"))
        return _params(model)

    def dcp_fresh() -> dict:
        fresh = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
        dcp.load({"model": fresh}, checkpoint_id=str(d / "dcp"))
        return fresh

    def torch_load() -> dict:
        loaded = torch.load(d / "torch_save" / f"rank{rank}.pt", weights_only=True)
        ptrs = [loaded[k].untyped_storage().data_ptr() for k in (TIED, "transformer.wte.weight")]
        out["torch_save_tied"] = ptrs[0] == ptrs[1]
        return loaded

    _attempt(out, "load_state", load_state)
    _attempt(out, "dcp_in_place", dcp_in_place)
    _attempt(out, "dcp", dcp_fresh)
    _attempt(out, "torch_save", torch_load)
    if rank == 0:
        for name in ("save_model", "save_state", "pretrained"):
            file = d / name / "model.safetensors"
            _attempt(out, name, lambda file=file: load_file(file))

        def reload_save_model() -> dict:
            plain = gpt2()
            load_checkpoint_in_model(plain, str(d / "save_model"))
            return _params(plain)

        _attempt(out, "save_model_reloaded", reload_save_model)
        _attempt(
            out, "pretrained_reloaded",
            lambda: _params(GPT2LMHeadModel.from_pretrained(d / "pretrained")),
        )  # fmt: skip
    out["dtensor"] = _dtensor_entry(world_size)
    dist.barrier()
    return out


def _dtensor_entry(world_size: int) -> tuple[bool, bool, bool]:
    """A DTensor entry whose local shard views a flat buffer, through the hook: (still a
    DTensor, its local shard covers its storage, over the flat buffer's memory)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from orthoptim.parallel.layerwise import saving

    mesh = init_device_mesh("cpu", (world_size,))
    flat = torch.arange(10.0)
    sd = {"w": DTensor.from_local(flat[2:6].view(2, 2), mesh, [Shard(0)], run_check=False)}
    saving.alias_views(nn.Module(), sd, "", {})
    local = sd["w"].to_local()
    return (
        isinstance(sd["w"], DTensor),
        saving.covers(local),
        local.data_ptr() == flat[2:].data_ptr(),
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = tmp_path_factory.mktemp("savers")
    return run_ranks(_saves, 2, args=(str(base),))


def _assert_equal(got: dict | str, want: dict, keys: set, what: str) -> None:
    assert isinstance(got, dict), f"{what}: {got}"
    assert set(got) == keys, (what, sorted(set(got) ^ keys))
    for k in keys:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs from the model's parameter"


def test_the_flat_buffers_back_the_model_and_a_step_moves_it(saved):
    for r in saved:
        assert r["storages"] < r["n_params"], r["storages"]  # views of shared flat buffers
        assert set(r["keys"]) == set(r["want"])  # the oracle names every state-dict entry
        assert r["moved"], "the second step left the parameters in place"


def test_accelerate_save_model_writes_every_tensor(saved):
    r = saved[0]
    keys = set(r["keys"])
    _assert_equal(r["save_model"], r["want"], keys - {TIED}, "save_model file")
    _assert_equal(r["save_model_reloaded"], r["want"], keys, "load_checkpoint_in_model")


def test_accelerate_save_state_writes_and_loads_every_tensor(saved):
    keys = set(saved[0]["keys"])
    _assert_equal(saved[0]["save_state"], saved[0]["want"], keys - {TIED}, "save_state file")
    for r in saved:
        _assert_equal(r["load_state"], r["want"], keys, "after load_state")


def test_transformers_save_pretrained_writes_every_tensor(saved):
    r = saved[0]
    keys = set(r["keys"])
    _assert_equal(r["pretrained"], r["want"], keys - {TIED}, "save_pretrained file")
    _assert_equal(r["pretrained_reloaded"], r["want"], keys, "from_pretrained")


def test_torch_save_writes_every_tensor_and_keeps_the_tie(saved):
    for r in saved:
        _assert_equal(r["torch_save"], r["want"], set(r["keys"]), "torch.save file")
        assert r.get("torch_save_tied"), "the tied head was written apart from the embedding"


def test_dcp_saves_every_tensor_and_loads_in_place(saved):
    for r in saved:
        keys = set(r["keys"])
        _assert_equal(r["dcp"], r["want"], keys, "DCP into fresh tensors")
        _assert_equal(r["dcp_in_place"], r["want"], keys, "DCP into model.state_dict()")


def test_a_dtensor_entry_gets_its_local_shard_aliased(saved):
    for r in saved:
        assert r["dtensor"] == (True, True, True)


# -- the hook itself, in one process --------------------------------------------------------


class _Flat(nn.Module):
    """Two linears and a tied head whose parameters are views of one flat buffer, as the
    layer-wise optimizer lays them out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(3, 4), nn.Linear(4, 3, bias=False)
        self.head = nn.Linear(3, 4)
        self.head.weight = self.a.weight
        flat = torch.zeros(sum(p.numel() for p in self.parameters()) + 5)
        pos = 5  # padding first, so no view starts the storage
        with torch.no_grad():
            for p in self.parameters():
                flat[pos : pos + p.numel()].copy_(p.reshape(-1))
                p.data = flat[pos : pos + p.numel()].view(p.shape)
                pos += p.numel()


def test_alias_views_gives_each_entry_its_own_storage_over_the_same_memory():
    from orthoptim.parallel.layerwise import saving

    model = _Flat()
    assert not any(saving.covers(v) for v in model.state_dict().values())
    handle = saving.register(model)
    sd = model.state_dict()
    named = dict(model.named_parameters(remove_duplicate=False))
    assert sd.keys() == named.keys()
    for k, v in sd.items():
        assert saving.covers(v), k
        assert v.data_ptr() == named[k].data_ptr(), k  # the parameter's memory, not a copy
        assert torch.equal(v, named[k]), k
    tied = sd["head.weight"].untyped_storage(), sd["a.weight"].untyped_storage()
    assert tied[0].data_ptr() == tied[1].data_ptr() and tied[0].nbytes() == tied[1].nbytes()
    sd["b.weight"].fill_(7.0)
    assert (model.b.weight == 7.0).all()  # writing an entry writes the parameter
    kept = model.state_dict(keep_vars=True)
    assert all(kept[k] is p for k, p in named.items())  # keep_vars: the Parameters themselves
    wrapped = nn.ModuleDict({"inner": model}).state_dict()  # under a parent: its prefix
    assert all(saving.covers(v) for v in wrapped.values())
    handle.remove()
    assert not any(saving.covers(v) for v in model.state_dict().values())


def _via_pickle(opt):
    return pickle.loads(pickle.dumps(opt))


def _via_torch_save(opt):
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", [copy.deepcopy, _via_pickle, _via_torch_save])
def test_the_hook_follows_a_copy_of_the_optimizer_and_remove_hooks_removes_it(how):
    """A copy's model carries the hook and the copy's `remove_hooks()` removes it there only.
    World size 1 (a copy over a process group is refused) has no flat buffers: a parameter of
    each model is made a view by hand, as the buffers would after the copy's first forward."""
    from orthoptim import LayerwiseDistributedOptimizer
    from orthoptim.parallel.layerwise import saving

    def viewed(model: nn.Module) -> dict:
        p = model.b.weight
        p.data = torch.cat([torch.zeros(2), p.detach().reshape(-1)])[2:].view(p.shape)
        return model.state_dict()

    opt = LayerwiseDistributedOptimizer(_Flat(), bucket_mb=1e-4)
    other = how(opt)
    assert other.model is not opt.model
    assert saving.covers(viewed(other.model)["b.weight"])
    other.remove_hooks()
    assert not saving.covers(viewed(other.model)["b.weight"])
    assert saving.covers(viewed(opt.model)["b.weight"])
    opt.remove_hooks()
    assert not saving.covers(viewed(opt.model)["b.weight"])
