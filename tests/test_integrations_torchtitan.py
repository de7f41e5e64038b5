"""orthoptim.integrations.torchtitan: the OptimizersContainer through torchtitan's own
LRSchedulersContainer and CheckpointManager (DCP), at 2 gloo ranks and resharded to 1.

Every optimizer kind ("replicated", "layerwise", "fsdp") runs over two model parts (two
pipeline stages held by one rank, as an interleaved schedule holds them). The oracle for a
resumed run is the uninterrupted run on the same batches: bitwise at the same world size; at
another one the gradients are summed in another order, so the models are float64 and the runs
agree within RESHARD_TOL relative (the argument of tests/test_checkpoint.py).
"""

import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchtitan", reason="the torchtitan integration needs torchtitan")

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer import LRSchedulersContainer

from models.checkpoint import same
from orthoptim import checkpoint as ckpt
from orthoptim.integrations.torchtitan import (
    OrthoptimOptimizersContainer,
    build_optimizers,
)
from orthoptim.parallel.fsdp import shard_model
from orthoptim.shards import is_dtensor

from distributed import run_ranks

VOCAB, SEQ, WIDTH, BATCH = 16, 4, 8, 8
BEFORE, AFTER = 3, 4  # steps before the checkpoint, steps resumed after it
KINDS = ("replicated", "layerwise", "fsdp")
KW = dict(lr=0.02, adamw_lr=3e-3, weight_decay=0.01, adamw_weight_decay=0.01)
KIND_KW = {"replicated": {}, "layerwise": {"bucket_mb": 0.0005}, "fsdp": {"bucket_mb": 0.01}}
RESHARD_TOL = 1e-10
# a collective that one rank misses (a rank-dependent zero-gradient step) fails, not hangs
COLLECTIVE_TIMEOUT = 60


class Stage0(nn.Module):
    """The first pipeline stage: an embedding (AdamW) and an MLP (Muon, biases AdamW)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH, bias=False)

    def forward(self, idx):
        x = self.emb(idx)
        return x + self.fc2(F.gelu(self.fc1(x)))


class Lone(nn.Module):
    """A stage of one matrix (Muon): under "layerwise" one rank owns it, the other nothing."""

    def __init__(self):
        super().__init__()
        self.lone = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.lone(x))


class Stage1(nn.Module):
    """The last stage: a matrix (Muon), a norm and the head (AdamW)."""

    def __init__(self):
        super().__init__()
        self.mid = nn.Linear(WIDTH, WIDTH, bias=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, x):
        return self.head(self.norm(x + torch.tanh(self.mid(x))))


def make_parts(kind, seed=0):
    torch.manual_seed(seed)
    parts = [Stage0().double(), Lone().double(), Stage1().double()]
    return [shard_model(p) for p in parts] if kind == "fsdp" else parts


def make_container(kind, parts):
    return build_optimizers(parts, optimizer="muon", distributed=kind, **KW, **KIND_KW[kind])


def make_schedulers(container):
    config = LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine")
    return config.build(optimizers=container, training_steps=BEFORE + AFTER)


def make_checkpointer(folder, parts, container, schedulers, exclude=()):
    config = CheckpointManager.Config(
        enable=True, folder="checkpoint", interval=1, keep_latest_k=0,
        initial_load_model_only=False, exclude_from_loading=list(exclude),
    )  # fmt: skip
    return config.build(
        dataloader=None, model_parts=parts, optimizers=container, lr_schedulers=schedulers,
        states={}, sd_adapter=None, base_folder=folder,
    )  # fmt: skip


def batch(step, rank, world_size):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    per = BATCH // world_size
    return idx[rank * per : (rank + 1) * per]


def train(kind, parts, container, schedulers, steps, rank, world_size):
    """`steps` training steps; for "replicated" the test averages the gradients, as DDP would."""
    for step in steps:
        idx = batch(step, rank, world_size)
        out = parts[2](parts[1](parts[0](idx[:, :-1])))
        F.cross_entropy(out.flatten(0, 1), idx[:, 1:].flatten()).backward()
        if kind == "replicated" and world_size > 1:
            for part in parts:
                for p in part.parameters():
                    dist.all_reduce(p.grad)
                    p.grad /= world_size
        container.step()
        schedulers.step()
        container.zero_grad()
    return snapshot(container, parts)


def snapshot(container, parts):
    """Every parameter, whole (collective for FSDP)."""
    for opt in container:
        if hasattr(opt, "wait_for_params"):
            opt.wait_for_params()
    return {
        f"{i}.{n}": (p.full_tensor() if is_dtensor(p) else p).detach().clone()
        for i, part in enumerate(parts)
        for n, p in part.named_parameters()
    }


def lrs(container):
    return [[g["lr"] for g in opt.param_groups] for opt in container]


def local(v):
    """A state dict value as comparable plain data: a FlatShard's run, a DTensor's shard."""
    if isinstance(v, ckpt.FlatShard):
        return ("run", v.offset, tuple(v.shape), v.local.clone())
    if is_dtensor(v):
        return ("dtensor", tuple(v.placements), v.to_local().clone())
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, bytes):  # orthoptim's packed meta
        return torch.load(io.BytesIO(v), weights_only=True)
    return v


def frozen(container):
    return {k: local(v) for k, v in container.state_dict().items()}


def _two_ranks(rank, world_size, root):
    out = {}
    for kind in KINDS:
        folder = os.path.join(root, kind)
        r = out[kind] = {}
        # the run without any state_dict() call: what the others must reproduce
        parts = make_parts(kind)
        c = make_container(kind, parts)
        r["plain"] = train(kind, parts, c, make_schedulers(c), range(BEFORE + AFTER),
                           rank, world_size)  # fmt: skip

        # state_dict() of a fresh container (a placeholder state for DCP to load into) changes
        # nothing in training; loaded into another fresh container it loads as no state
        parts = make_parts(kind)
        c = make_container(kind, parts)
        fresh = c.state_dict()
        parts2 = make_parts(kind, seed=0)
        c2 = make_container(kind, parts2)
        c2.load_state_dict(fresh)
        r["fresh_loaded"] = train(kind, parts2, c2, make_schedulers(c2), range(BEFORE + AFTER),
                                  rank, world_size)  # fmt: skip

        schedulers = make_schedulers(c)
        r["lr_start"] = lrs(c)
        checkpointer = make_checkpointer(folder, parts, c, schedulers)
        train(kind, parts, c, schedulers, range(BEFORE), rank, world_size)
        r["lr_saved"] = lrs(c)
        r["initial_lr"] = [[g["initial_lr"] for g in opt.param_groups] for opt in c]
        r["factor"] = [schedulers.schedulers[0].lr_lambdas[0](s) for s in (0, BEFORE)]
        checkpointer.save(curr_step=BEFORE)
        r["keys"] = sorted(c.state_dict())
        r["holds_state"] = [bool(opt.state) for opt in c]

        # round trip: state_dict() → load_state_dict() of a fresh container → the same dict
        parts2 = make_parts(kind, seed=1)
        c2 = make_container(kind, parts2)
        c2.load_state_dict(c.state_dict())
        r["round_trip"] = same(frozen(c), frozen(c2))

        r["uninterrupted"] = train(kind, parts, c, schedulers, range(BEFORE, BEFORE + AFTER),
                                   rank, world_size)  # fmt: skip
        r["lr_end"] = lrs(c)
        checkpointer.close()

        # resume through torchtitan's CheckpointManager into fresh objects, at 2 ranks
        parts = make_parts(kind, seed=1)
        c = make_container(kind, parts)
        schedulers = make_schedulers(c)
        checkpointer = make_checkpointer(folder, parts, c, schedulers)
        assert checkpointer.load()
        r["lr_loaded"] = lrs(c)
        r["resumed"] = train(kind, parts, c, schedulers, range(BEFORE, BEFORE + AFTER),
                             rank, world_size)  # fmt: skip
        r["lr_resumed"] = lrs(c)
        checkpointer.close()
    return out


def _one_rank(rank, world_size, root):
    """The 2-rank checkpoints resumed at world size 1, each by the optimizer kind that wrote it."""
    out = {}
    for kind in KINDS:
        parts = make_parts(kind, seed=1)
        c = make_container(kind, parts)
        schedulers = make_schedulers(c)
        checkpointer = make_checkpointer(os.path.join(root, kind), parts, c, schedulers)
        assert checkpointer.load()
        out[kind] = train(kind, parts, c, schedulers, range(BEFORE, BEFORE + AFTER), 0, 1)
        checkpointer.close()
        # the model and schedulers without the optimizer's state: a fresh optimizer
        parts = make_parts(kind, seed=1)
        c = make_container(kind, parts)
        schedulers = make_schedulers(c)
        checkpointer = make_checkpointer(
            os.path.join(root, kind), parts, c, schedulers, exclude=["optimizer"]
        )
        assert checkpointer.load()
        out[f"{kind}/no_state"] = train(kind, parts, c, schedulers, range(BEFORE, BEFORE + AFTER),
                                        0, 1)  # fmt: skip
        checkpointer.close()
    return out


def rel_err(got, want):
    return max(((got[n] - w).norm() / w.norm()).item() for n, w in want.items())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("torchtitan"))
    two = run_ranks(_two_ranks, 2, args=(root,), timeout=COLLECTIVE_TIMEOUT)
    one = run_ranks(_one_rank, 1, args=(root,), timeout=COLLECTIVE_TIMEOUT)[0]
    return two, one


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_is_exact(runs, kind):
    two, _ = runs
    for rank in range(2):
        assert two[rank][kind]["round_trip"], (kind, rank)


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_manager_resume_at_two_ranks_is_bitwise(runs, kind):
    two, _ = runs
    for rank in range(2):
        r = two[rank][kind]
        assert r["uninterrupted"].keys() == r["resumed"].keys()
        for n, p in r["uninterrupted"].items():
            assert torch.equal(p, r["resumed"][n]), (kind, rank, n)
        assert r["lr_loaded"] == r["lr_saved"] and r["lr_resumed"] == r["lr_end"]
    # every rank ends with the same model (replicas agree)
    for n, p in two[0][kind]["resumed"].items():
        assert torch.equal(p, two[1][kind]["resumed"][n]), n


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_keys_name_no_rank(runs, kind):
    two, _ = runs
    keys = set(two[0][kind]["keys"]) | set(two[1][kind]["keys"])
    # one layout entry and one fresh flag per model part, keyed by its first parameter
    assert {k for k in keys if k.startswith(("optim/meta/", "optim/fresh/"))} == {
        "optim/meta/emb.weight", "optim/fresh/emb.weight",
        "optim/meta/lone.weight", "optim/fresh/lone.weight",
        "optim/meta/mid.weight", "optim/fresh/mid.weight",
    }  # fmt: skip
    assert "optim/state/fc1.weight/momentum_buffer" in keys
    assert "optim/state/head.weight/exp_avg" in keys
    assert not any("rank" in k for k in keys)
    if kind == "layerwise":  # the lone matrix's state is on its owner only
        assert sorted(two[rank][kind]["holds_state"][1] for rank in range(2)) == [False, True]


@pytest.mark.parametrize("kind", KINDS)
def test_resume_at_one_rank_matches_the_two_rank_run(runs, kind):
    two, one = runs
    want = two[0][kind]["uninterrupted"]
    err = rel_err(one[kind], want)
    assert err <= RESHARD_TOL, (kind, err)
    # the state matters: the checkpoint's model and schedulers with a fresh optimizer end far off
    assert rel_err(one[f"{kind}/no_state"], want) > 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_fresh_state_dict_changes_nothing(runs, kind):
    """state_dict() before the first step makes a placeholder state (DCP needs tensors to
    load into); the next step drops it, and a checkpoint of it loads as no state. torchtitan's
    own `init_optim_state` would keep it: AdamW's step count off by one, every bias
    correction after it different."""
    two, _ = runs
    for rank in range(2):
        r = two[rank][kind]
        for n, p in r["plain"].items():
            assert torch.equal(p, r["uninterrupted"][n]), (kind, rank, n)
            assert torch.equal(p, r["fresh_loaded"][n]), (kind, rank, n)


@pytest.mark.parametrize("kind", KINDS)
def test_lr_schedulers_move_every_group(runs, kind):
    two, _ = runs
    for rank in range(2):
        r = two[rank][kind]
        start, end = r["factor"]
        assert start != end
        assert [len(g) for g in r["lr_saved"]] == [2, 1, 2]  # muon and adamw; muon; both
        for opt_lrs, opt_initial in zip(r["lr_saved"], r["initial_lr"]):
            for lr, initial in zip(opt_lrs, opt_initial):
                assert lr == initial * end
        for opt_lrs, opt_initial in zip(r["lr_start"], r["initial_lr"]):
            for lr, initial in zip(opt_lrs, opt_initial):
                assert lr == initial * start


def test_torchtitans_command_line_sets_the_config():
    """torchtitan's ConfigManager parses `--optimizer.<field>` with tyro over the config's
    default (here ours: `config.optimizer = OrthoptimOptimizersContainer.Config(...)` in a
    config_registry function); the optimizer's part of that parse, without importing the
    Trainer (seconds)."""
    import tyro
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.config.manager import custom_registry

    default = OrthoptimOptimizersContainer.Config(lr=0.02, optimizer_kwargs={"adamw_lr": 8e-4})

    def parse(*args):
        return tyro.cli(
            OptimizersContainer.Config, args=list(args), default=default, registry=custom_registry
        )

    config = parse("--lr", "0.01", "--distributed", "layerwise", "--name", "normuon")
    assert isinstance(config, OrthoptimOptimizersContainer.Config)
    assert (config.name, config.distributed, config.lr) == ("normuon", "layerwise", 0.01)
    assert config.optimizer_kwargs == {"adamw_lr": 8e-4}
    with pytest.raises(SystemExit):  # tyro lists the Literal's choices
        parse("--name", "sgd")


def test_config_is_torchtitans_and_errors_name_the_fix():
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

    assert issubclass(OrthoptimOptimizersContainer, OptimizersContainer)
    assert issubclass(OrthoptimOptimizersContainer.Config, OptimizersContainer.Config)
    parts = make_parts("replicated")
    c = OrthoptimOptimizersContainer.Config(name="muon", distributed="replicated", lr=0.02).build(
        model_parts=parts
    )
    assert isinstance(c, OrthoptimOptimizersContainer) and len(c) == 3
    with pytest.raises(ValueError, match="distributed must be one of"):
        build_optimizers(parts, distributed="ddp")
    with pytest.raises(ValueError, match="optimizer name must be one of"):
        build_optimizers(parts, optimizer="sgd", distributed="replicated")
    with pytest.raises(ValueError, match="param_groups: orthoptim routes parameters itself"):
        OrthoptimOptimizersContainer.Config(
            param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW")]
        )
    with pytest.raises(ValueError, match=r"optimizer_kwargs\['lr'\]: give it as 'lr'"):
        OrthoptimOptimizersContainer.Config(optimizer_kwargs={"lr": 0.1})
    with pytest.raises(ValueError, match="pass distributed='layerwise' or 'replicated'"):
        build_optimizers(parts, distributed="fsdp")
    with pytest.raises(ValueError, match="model_parts must be a non-empty list"):
        OrthoptimOptimizersContainer.Config(distributed="replicated").build(model_parts=[])
    with pytest.raises(ValueError, match="same name"):
        build_optimizers([parts[0], make_parts("replicated")[0]], distributed="replicated")
