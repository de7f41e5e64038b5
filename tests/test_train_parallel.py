"""`orthoptim train` under pipeline and expert parallelism (`--pp`, `--ep`, `--dp`) over
real gloo ranks: the runs equal a single-process float64 reference on the same global batch,
and a run stopped after step 2 and resumed equals the uninterrupted one.

The oracle (`_reference`: `reference_runs.reference_run`) is a plain loop: the model built
with the run's seed, `build_optimizer`'s Muon and AdamW in one process, each step's global
batch (every
data-parallel rank's (seed, step, rank) batch, in micro-batches as the pipeline cuts them)
with accumulated gradients, the LR schedule, clipping at 1 and QK-clip. Everything runs in
float64 (`--param-dtype fp64`), where the layouts' different reduction orders differ by
~1e-16 per operation: the runs must agree to 1e-10 (relative) on the losses and on every
parameter after 3 steps. The ranks run the loop's own `train()` in-process (`run_ranks`),
on configs shrunk to a few thousand parameters and a small corpus, to keep the cost down.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from models.corpus import write_corpus
from orthoptim.train.args import TrainArgs
from orthoptim.train.data import load_corpus
from orthoptim.train.model import CONFIGS, GPTConfig, MoEConfig
from reference_runs import reference_run, relative, saved_model

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
        # the router's balancing loss on (over the global counts of each micro-batch)
        moe=MoEConfig(n_expert=4, top_k=2, hidden=32, aux_loss_coef=0.01),
        qk_clip=100.0,
    ),
}
STEPS = 3
BATCH = 2  # sequences per data-parallel rank per step
TOL = 1e-10


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small text file (seeded words) as --data: loading the stdlib source costs seconds."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


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
    """The whole model after the run's last step, from its last checkpoint: the union of its
    stages' full model files (both per-stage formats write them)."""
    record = json.loads((out / "checkpoints/latest.json").read_text())
    folder = out / "checkpoints" / record["folder"]
    assert record["format"] == "stages"
    full: dict[str, torch.Tensor] = {}
    for s in range(args.layout(nproc).pp):
        full.update(torch.load(folder / f"model-stage{s}.pt"))
    return full


def _reference(
    config: str,
    data: str,
    dp: int | list[int],
    microbatches: int,
    tau: float | None,
    optimizer: str = "muon",
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process float64 run on the layout's global batch (`reference_run`): its
    losses (the mean over the data-parallel ranks' batches) and its parameters after `STEPS`
    steps. `dp`: the data-parallel size, or one per step (a run resumed at another size)."""
    sizes = dp if isinstance(dp, list) else [dp] * STEPS
    cfg = SMALL[config]
    args = TrainArgs(config=config, steps=STEPS, batch=BATCH, warmup=1, optimizer=optimizer)
    train = load_corpus(data, min_bytes=cfg.seq_len + 1).train
    return reference_run(cfg, train, args, sizes, microbatches, tau)


def _check_equal(out: Path, args: TrainArgs, nproc: int, want: tuple) -> None:
    losses, params = want
    got = _losses(out)
    assert len(got) == STEPS
    for a, b in zip(got, losses):
        assert abs(a - b) <= TOL * abs(b), (got, losses)
    have = _params(out, args, nproc)
    assert have.keys() == params.keys()
    worst = max(relative(have[k], params[k]) for k in params)
    assert worst <= TOL, worst


# name → (config, nproc, flags, data-parallel size): the two 8-rank layouts, and
# one 4-rank layout of each kind (tensor, expert parallel, the GPipe schedule). QK-clip at
# τ = 0.045, under the shrunk MoE's first max logits (0.035 to 0.054), so heads are clipped
# on stages.
LAYOUTS = {
    "pp2 tp2 dp2": ("test-gpt", 8, dict(pp=2, tp=2, qk_clip=0.0), 2),
    "pp2 dp4 ep2": ("test-moe", 8, dict(pp=2, ep=2, qk_clip=0.045), 4),
    "pp2 tp2": ("test-gpt", 4, dict(pp=2, tp=2, qk_clip=0.0), 1),
    "pp2 dp2 ep2": ("test-moe", 4, dict(pp=2, ep=2, qk_clip=0.045), 2),
    "pp2 dp2 gpipe": ("test-gpt", 4, dict(pp=2, pp_schedule="gpipe", qk_clip=0.0), 2),
}


def _stopped_and_resumed(corpus: str, out: Path, layout: str) -> tuple[TrainArgs, int]:
    """`layout`'s run stopped after step 2 (`--stop-after`) and resumed to step 3."""
    config, nproc, flags, _ = LAYOUTS[layout]
    _run(_args(corpus, out, config, stop_after=2, **flags), nproc)
    assert len(_losses(out)) == 2
    args = _args(corpus, out, config, resume=True, **flags)
    _run(args, nproc)
    return args, nproc


def _want(layout: str, corpus: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    config, _, flags, dp = LAYOUTS[layout]
    return _reference(config, corpus, dp, 2, flags["qk_clip"])


@pytest.mark.parametrize("layout", ["pp2 tp2 dp2", "pp2 dp4 ep2"])
def test_stopped_and_resumed_run_equals_one_process(corpus, tmp_path, layout):
    """8 gloo ranks, `--pp 2 --tp 2 --dp 2` on the (shrunk) tiny GPT and `--pp 2 --dp 4
    --ep 2` on the tiny MoE (two experts per rank, tokens dispatched by all-to-all, QK-clip
    clipping heads on both stages), in float64: stopped after step 2 and resumed (the model
    and the optimizer saved per stage, the experts whole), the run's losses of steps 1 to 3 and its
    parameters after step 3 equal the single-process run on the same global batch (dp
    batches of 2 sequences, 2 micro-batches each) to 1e-10."""
    args, nproc = _stopped_and_resumed(corpus, tmp_path / "run", layout)
    _check_equal(tmp_path / "run", args, nproc, _want(layout, corpus))
    if args.qk_clip:
        rows = [json.loads(r) for r in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
        assert sum(r.get("clipped_heads", 0) for r in rows) > 0, rows


def test_adamw_steps_expert_parallel_experts_over_their_expert_group(corpus, tmp_path):
    """`--ep 2 --optimizer adamw` (compare's AdamW baseline under --ep): the experts, AdamW
    parameters there, are reduced and stepped over the ranks holding the same experts, not
    averaged with the other ep rank's (which hold other experts under the same names), so
    the 2-rank run equals the single-process one to 1e-10."""
    args = _args(corpus, tmp_path / "run", "test-moe", ep=2, optimizer="adamw", qk_clip=0.0)
    _run(args, 2)
    _check_equal(tmp_path / "run", args, 2, _reference("test-moe", corpus, 2, 1, None, "adamw"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2 tp2", "pp2 dp2 ep2", "pp2 dp2 gpipe"])
def test_each_layout_kind_equals_one_process_and_resumes_bitwise(corpus, tmp_path, layout):
    """A 4-rank layout of each kind (`--tp`, `--ep` with QK-clip, `--pp-schedule gpipe`; the
    1f1b schedule in the first two): the uninterrupted 3-step run equals the single-process
    one to 1e-10, and the run stopped after step 2 and resumed equals it bit for bit."""
    config, nproc, flags, _ = LAYOUTS[layout]
    whole = _args(corpus, tmp_path / "whole", config, **flags)
    _run(whole, nproc)
    _check_equal(tmp_path / "whole", whole, nproc, _want(layout, corpus))
    _stopped_and_resumed(corpus, tmp_path / "part", layout)
    assert _losses(tmp_path / "part") == _losses(tmp_path / "whole")
    a, b = _params(tmp_path / "part", whole, nproc), _params(tmp_path / "whole", whole, nproc)
    diffs = {k: relative(a[k], b[k]) for k in b if not torch.equal(a[k], b[k])}
    assert not diffs, diffs


def test_hybrid_sharded_fsdp_run_equals_one_process(corpus, tmp_path):
    """`--fsdp --dp-replicate 2` on 4 ranks: FSDP2 shards over 2 ranks in each of 2
    replicas (the layout's `fsdp_mesh`, 2-D (replicate, shard)). Stopped after step 2 and
    resumed with plain `--fsdp` on 2 ranks (its DCP checkpoint resharded), the run equals the
    single-process run on the same global batches (4, 4, then 2 a step) to 1e-10 on the
    losses and the parameters after step 3."""
    out = tmp_path / "run"
    hybrid = _args(corpus, out, "test-gpt", stop_after=2, fsdp=True, dp_replicate=2, qk_clip=0.0)
    _run(hybrid, 4)
    assert json.loads((out / "result.json").read_text())["layout"].endswith("--dp-replicate 2")
    _run(_args(corpus, out, "test-gpt", resume=True, fsdp=True, qk_clip=0.0), 2)
    losses, params = _reference("test-gpt", corpus, [4, 4, 2], 1, None)
    got = _losses(out)
    assert len(got) == STEPS
    assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(got, losses)), (got, losses)
    have = saved_model(out)
    worst = max(relative(have[k], params[k]) for k in params)
    assert worst <= TOL, worst
    assert "--nproc 4 → 2, --dp-replicate 2 → 1" in (out / "logs/rank0.log").read_text()


# ---------------------------------------------------------------- flags and refusals


@pytest.mark.parametrize(
    "flags, nproc, message",
    [
        (dict(ep=2), 2, "--ep 2: the model has no routed experts"),
        (dict(config="tiny-moe", ep=3), 3, "--ep 3 must divide the model's 8 experts"),
        (dict(pp=5), 5, "--pp 5 exceeds the model's 4 layers"),
        (dict(pp=2, fsdp=True), 2, "--fsdp with --pp 2: FSDP2 sharding of pipeline stages"),
        (dict(config="tiny-moe", ep=2, compile=True), 2, "--compile with --ep 2"),
        (dict(pp=2, batch=3), 2, "--microbatches 2 (by default --pp) must divide --batch 3"),
        (dict(pp=2, microbatches=3, batch=4), 2, "--microbatches 3 must divide --batch 4"),
        (dict(microbatches=2), 1, "--microbatches 2 splits the batch of a pipeline"),
        (dict(pp=2, microbatches=1), 2, "--microbatches 1 with --pp 2: the 1f1b schedule"),
        (dict(pp=2, pp_schedule="zb"), 2, "--pp-schedule must be one of ('gpipe', '1f1b')"),
        (dict(param_dtype="fp64", precision="bf16"), 1, "--param-dtype fp64 (the reference"),
        (dict(pp=2, tp=2), 6, "--nproc 6 must be a multiple of --pp 2 × --tp 2"),
        (dict(pp=2, dp=2), 6, "--pp 2 × --dp 2 × --tp 1 is 4 ranks, but --nproc is 6"),
        (dict(config="tiny-moe", ep=2), 3, "--ep 2 must divide --dp 3"),
        (dict(dp_replicate=2), 4, "--dp-replicate 2 sets FSDP2's replicas (hybrid sharding)"),
        (dict(fsdp=True, dp_replicate=3), 4, "--dp-replicate 3 must divide --dp 4"),
    ],
)
def test_bad_layouts_are_refused_naming_the_flag(flags, nproc, message):
    """Each refusal names its flag (and the fix) before any rank starts: `validate`, then
    `check_nproc` (the layout of --nproc ranks)."""
    args = TrainArgs(qk_clip=0.0, **flags)
    with pytest.raises(ValueError) as e:
        args.validate()
        args.check_nproc(nproc, "cpu")
    assert message in str(e.value), str(e.value)


def test_layout_flags_parse_and_derive_dp():
    from orthoptim.cli import build_parser
    from orthoptim.train.cli import train_args_from

    argv = ["train", "--pp", "2", "--ep", "2", "--dp", "2", "--microbatches", "4",
            "--pp-schedule", "gpipe", "--param-dtype", "fp64", "--config", "tiny-moe"]  # fmt: skip
    args = train_args_from(build_parser().parse_args(argv))
    assert (args.pp, args.ep, args.dp, args.microbatches) == (2, 2, 2, 4)
    assert (args.pp_schedule, args.param_dtype) == ("gpipe", "fp64")
    args.validate()
    assert args.layout(4).describe() == "--pp 2 --dp 2 --ep 2 --tp 1"
    # --dp left out: nproc / (pp · tp)
    assert TrainArgs(pp=2, tp=2).layout(8).describe() == "--pp 2 --dp 2 --ep 1 --tp 2"
    assert TrainArgs(pp=2).n_microbatches == 2


def _record(fmt: str, nproc: int, **flags: Any) -> dict[str, Any]:
    return dict(args=TrainArgs(**flags).to_dict(), world_size=nproc, format=fmt)


def test_resume_at_another_pipeline_size_is_refused_naming_both():
    """A stage's files hold its blocks only: --resume at another --pp says the checkpoint's
    size, this run's and the fix; any other layout change (--ep, --dp, --tp) reshards."""
    from orthoptim.train.runfolder import check_layout_resumable

    with pytest.raises(ValueError) as e:
        check_layout_resumable(_record("stages", 4, pp=2), TrainArgs(), 4)
    assert str(e.value) == (
        "--resume: the checkpoint was written with --pp 2 and this run has --pp 1; a "
        "checkpoint is read at the pipeline size that wrote it (each stage's files hold its "
        "own layers): resume with --pp 2"
    )
    moe = dict(config="tiny-moe", qk_clip=0.0)
    check_layout_resumable(_record("stages", 4, ep=2, **moe), TrainArgs(ep=4, **moe), 4)
    check_layout_resumable(_record("stages", 8, pp=2, ep=2, **moe), TrainArgs(pp=2, **moe), 2)
    check_layout_resumable(_record("stages", 8, pp=2), TrainArgs(pp=2), 2)
    check_layout_resumable(_record("full", 2), TrainArgs(tp=2), 4)


# (nproc, flags) before and after: an --ep checkpoint (the experts whole, their optimizer
# state under global names) resumed at another expert-parallel and data-parallel size, of
# one process and of a pipeline stage (8 ranks: slow)
EP_RESHARDS = {
    "ep2 -> one process": ((2, dict(ep=2)), (1, {})),
    "pp2 dp2 ep2 -> pp2 dp4 ep4": ((4, dict(pp=2, ep=2)), (8, dict(pp=2, ep=4))),
}


@pytest.mark.parametrize(
    "case", [pytest.param(k, marks=[pytest.mark.slow] if "pp2" in k else []) for k in EP_RESHARDS]
)
def test_an_expert_parallel_checkpoint_resumes_at_another_ep(corpus, tmp_path, case):
    """Stopped after step 2 at one --ep and resumed at another (one process, or fewer experts
    per rank), the run equals the single-process run whose global batch follows
    the data-parallel size, to 1e-10."""
    (n0, f0), (n1, f1) = EP_RESHARDS[case]
    out = tmp_path / "run"
    _run(_args(corpus, out, "test-moe", stop_after=2, qk_clip=0.0, **f0), n0)
    args = _args(corpus, out, "test-moe", resume=True, qk_clip=0.0, **f1)
    _run(args, n1)
    pp = f0.get("pp", 1)
    dp = [n0 // pp] * 2 + [n1 // pp]
    want = _reference("test-moe", corpus, dp, pp, None)
    losses, params = want
    got = _losses(out)
    assert all(abs(a - b) <= TOL * abs(b) for a, b in zip(got, losses)), (got, losses)
    if n1 == 1:  # the one-process run writes the full format
        folder = (
            out
            / "checkpoints"
            / json.loads((out / "checkpoints/latest.json").read_text())["folder"]
        )
        have = torch.load(folder / "model.pt")
    else:
        have = _params(out, args, n1)
    worst = max(relative(have[k], params[k]) for k in params)
    assert worst <= TOL, worst
    log = (out / "logs/rank0.log").read_text()
    assert f"--nproc {n0} → {n1}, --ep {f0['ep']} → {f1.get('ep', 1)}" in log, log


def test_the_launcher_refuses_another_pp_before_any_rank_starts(tmp_path, capsys):
    """`orthoptim train --resume` of a --pp 2 checkpoint without --pp: one line, exit 2."""
    from orthoptim.cli import main
    from orthoptim.train.runfolder import sealed

    out = tmp_path / "run"
    folder = out / "checkpoints/step_000002"
    folder.mkdir(parents=True)
    args = TrainArgs(pp=2, batch=2, steps=3, out=str(out))
    record = sealed(
        dict(_record("stages", 2, **args.to_dict()), step=2, folder=folder.name, files={})
    )
    for path in (folder / "checkpoint.json", out / "checkpoints/latest.json"):
        path.write_text(json.dumps(record))
    argv = ["train", "--nproc", "2", "--batch", "2", "--steps", "3", "--out", str(out)]
    assert main([*argv, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "written with --pp 2 and this run has --pp 1" in err, err
    assert "resume with --pp 2" in err


@pytest.mark.parametrize(
    "before, after",
    [((4, 1), (4, 2)), pytest.param((4, 2), (4, 1), marks=pytest.mark.slow)],
    ids=["dp2 tp1 -> dp1 tp2", "dp1 tp2 -> dp2 tp1"],
)
def test_a_stage_checkpoint_resumes_at_another_dp_and_tp(corpus, tmp_path, before, after):
    """The per-stage format reshards within a stage: `--pp 2` at (nproc, tp) `before`
    stopped after step 2 and resumed at `after` (another --dp and another --tp at once, each
    way) equals the uninterrupted single-process run whose global batch follows the
    data-parallel size (nproc / (2 · tp) batches a step), to 1e-10."""
    (n0, tp0), (n1, tp1) = before, after
    _run(_args(corpus, tmp_path / "run", "test-gpt", stop_after=2, pp=2, tp=tp0, qk_clip=0.0), n0)
    args = _args(corpus, tmp_path / "run", "test-gpt", resume=True, pp=2, tp=tp1, qk_clip=0.0)
    _run(args, n1)
    dp = [n0 // (2 * tp0)] * 2 + [n1 // (2 * tp1)]
    _check_equal(tmp_path / "run", args, n1, _reference("test-gpt", corpus, dp, 2, None))
    log = (tmp_path / "run/logs/rank0.log").read_text()
    notice = f"--tp {tp0} → {tp1}: global batch {BATCH * dp[0]} → {BATCH * dp[-1]} sequences"
    assert notice in log, log
