"""`orthoptim train` under pipeline and expert parallelism (`--pp`, `--ep`, `--dp`) over
real gloo ranks: the runs equal a single-process float64 reference on the same global batch,
and a run stopped after step 2 and resumed equals the uninterrupted one.

The oracle (`_reference`) is a plain loop in this file: the model built with the run's seed,
`build_optimizer`'s Muon and AdamW in one process, each step's global batch (every
data-parallel rank's (seed, step, rank) batch, in micro-batches as the pipeline cuts them)
with accumulated gradients, the LR schedule, clipping at 1 and QK-clip. Everything runs in
float64 (`--param-dtype fp64`), where the layouts' different reduction orders differ by
~1e-16 per operation: the runs must agree to 1e-10 (relative) on the losses and on every
parameter after 3 steps. The ranks run the loop's own `train()` in-process (`run_ranks`),
on configs shrunk to a few thousand parameters and a small corpus, to keep the cost down.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from orthoptim.optim.hybrid import build_optimizer
from orthoptim.optim.qk_clip import QKClip
from orthoptim.train.args import TrainArgs
from orthoptim.train.data import get_batch, load_corpus
from orthoptim.train.model import CONFIGS, GPT, GPTConfig, MoEConfig

from distributed import run_ranks

# Shrunk configs: the tiny GPT's and tiny MoE's shapes (separate Q/K/V and a GELU MLP that
# --tp 2 splits; fused QKV with grouped-query attention and routed SwiGLU experts), smaller.
SMALL = {
    "test-gpt": GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, mlp_ratio=2),
    "test-moe": GPTConfig(
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        d_model=32,
        seq_len=16,
        fused=True,
        moe=MoEConfig(n_expert=4, top_k=2, hidden=32),
        qk_clip=100.0,
    ),
}
STEPS = 3
BATCH = 2  # sequences per data-parallel rank per step
TOL = 1e-10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small text file (seeded words) as --data: loading the stdlib source costs seconds."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "self", "=", "\n"]
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(6000)))
    return str(path)


@pytest.fixture(autouse=True)
def _small_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, cfg in SMALL.items():
        monkeypatch.setitem(CONFIGS, name, cfg)


def _args(data: str, out: Path, config: str, **flags: Any) -> TrainArgs:
    args = TrainArgs(
        config=config, steps=STEPS, batch=BATCH, warmup=1, eval_every=STEPS, eval_batches=2,
        ckpt_every=STEPS, out=str(out), data=data, param_dtype="fp64", progress=False, **flags,
    )  # fmt: skip
    args.validate()
    return args


def _train_rank(rank: int, world_size: int, args_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of `orthoptim train` (the loop's `train()`, as the launcher calls it)."""
    from orthoptim.train.loop import setup_logging, train

    CONFIGS.update(SMALL)  # this process's configs (a fork of the server, not of the test)
    args = TrainArgs.from_dict(args_dict)
    out = Path(args.out)
    log = setup_logging(out, rank)
    try:
        return train(args, rank, world_size, torch.device("cpu"), out, log)
    finally:
        for h in list(log.handlers):
            log.removeHandler(h)
            h.close()


def _run(args: TrainArgs, nproc: int) -> None:
    run_ranks(_train_rank, nproc, args=(args.to_dict(),), timeout=120)


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r]


def _params(out: Path, args: TrainArgs, nproc: int) -> dict[str, torch.Tensor]:
    """The whole model after the run's last step, from its last checkpoint: each stage's
    full dicts ("stages"), or each rank's own ("ranks": the expert stacks joined over the
    ep ranks of data-parallel index group 0)."""
    record = json.loads((out / "checkpoints/latest.json").read_text())
    folder = out / "checkpoints" / record["folder"]
    dims = args.layout(nproc)
    if record["format"] == "stages":
        full: dict[str, torch.Tensor] = {}
        for s in range(dims.pp):
            full.update(torch.load(folder / f"model-stage{s}.pt"))
        return full
    assert record["format"] == "ranks", record["format"]
    full = {}
    for s in range(dims.pp):
        parts = [
            torch.load(folder / f"rank{dims.rank_of(s, e)}.pt")["model"] for e in range(dims.ep)
        ]
        for k, v in parts[0].items():
            full[k] = torch.cat([p[k] for p in parts]) if "experts" in k else v
    return full


def _reference(
    config: str, data: str, dp: int, microbatches: int, tau: float | None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process float64 run on the layout's global batch: its losses (the mean over
    the data-parallel ranks' batches) and its parameters after `STEPS` steps."""
    from orthoptim.train.loop import lr_multiplier

    cfg = SMALL[config]
    args = TrainArgs(config=config, steps=STEPS, batch=BATCH, warmup=1)
    train = load_corpus(data, min_bytes=cfg.seq_len + 1).train
    torch.manual_seed(0)
    model = GPT(cfg).to(torch.float64)
    opt = build_optimizer(
        model, optimizer="muon", lr=args.matrix_lr, adamw_lr=args.embed_lr,
        adamw_weight_decay=0.0, elementwise="adamw",
    )  # fmt: skip
    qk = QKClip(model, tau=tau) if tau else None
    initial = [g["lr"] for g in opt.param_groups]
    losses = []
    for step in range(1, STEPS + 1):
        for g, lr in zip(opt.param_groups, initial):
            g["lr"] = lr * lr_multiplier(step, args)
        total = 0.0
        for d in range(dp):
            x, y = get_batch(train, BATCH, cfg.seq_len, args.seed, step, d)
            for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
                logits = model(xm)
                loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), ym.reshape(-1))
                (loss / (dp * microbatches)).backward()
                total += loss.item() / (dp * microbatches)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if qk is not None:
            qk.step()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _check_equal(out: Path, args: TrainArgs, nproc: int, want: tuple) -> None:
    losses, params = want
    got = _losses(out)
    assert len(got) == STEPS
    for a, b in zip(got, losses):
        assert abs(a - b) <= TOL * abs(b), (got, losses)
    have = _params(out, args, nproc)
    assert have.keys() == params.keys()
    worst = max(_relative(have[k], params[k]) for k in params)
    assert worst <= TOL, worst


def test_pipeline_with_tensor_parallelism_equals_one_process_and_resumes(corpus, tmp_path):
    """8 ranks `--pp 2 --tp 2 --dp 2` on the (shrunk) tiny GPT: its losses and parameters
    after 3 steps equal the single-process run on the same global batch (2 data-parallel
    batches, 2 micro-batches each) to 1e-10; stopped after step 2 (`--stop-after`) and
    resumed, it equals the uninterrupted run bit for bit."""
    flags = dict(pp=2, tp=2, qk_clip=0.0)
    whole = _args(corpus, tmp_path / "whole", "test-gpt", **flags)
    _run(whole, 8)
    _check_equal(tmp_path / "whole", whole, 8, _reference("test-gpt", corpus, 2, 2, None))

    part = _args(corpus, tmp_path / "part", "test-gpt", stop_after=2, **flags)
    _run(part, 8)
    assert len(_losses(tmp_path / "part")) == 2
    _run(_args(corpus, tmp_path / "part", "test-gpt", resume=True, **flags), 8)
    assert _losses(tmp_path / "part") == _losses(tmp_path / "whole")
    a, b = _params(tmp_path / "part", whole, 8), _params(tmp_path / "whole", whole, 8)
    diffs = {k: _relative(a[k], b[k]) for k in b if not torch.equal(a[k], b[k])}
    assert not diffs, diffs
