"""`orthoptim train --global-batch / --reproducible` and `orthoptim verify` (issue 53): the
refusals (one line, before any rank starts), micro-batches keyed by their global index, the
logged means summed in a fixed order, and the CLI's runs bitwise the same at every --nproc
(and resumed at another), with the default mode as the control that shows a difference."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from models.corpus import write_corpus
from orthoptim.cli import build_parser, main
from orthoptim.train import launcher
from orthoptim.train import verify as verify_mod
from orthoptim.train.args import REPRODUCIBLE_SCOPE, TrainArgs
from orthoptim.train.cli import train_args_from
from orthoptim.train.data import get_batch
from orthoptim.train.microbatch import (
    micro_batches,
    ordered_evaluate,
    ordered_sum,
    rank_block,
    step_loss,
)
from orthoptim.train.resume import layout_change
from orthoptim.train.verify import (
    OUTSIDE_GUARANTEE,
    compare_runs,
    compare_tensors,
    train_flags,
)

from distributed import run_ranks

# A short run of the tiny GPT: 4 micro-batches of 1 sequence per step (1, 2 or 4 per rank).
RUN = ["--config", "tiny", "--steps", "3", "--batch", "1", "--global-batch", "4"]
RUN += ["--eval-every", "3", "--eval-batches", "2", "--warmup", "1", "--no-progress"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small text file (seeded words) as --data: loading the stdlib source costs seconds."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))


# -- refusals, before any rank starts ---------------------------------------------------


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting ranks fails the test: a refusal must come before."""

    def started(*_: Any, **__: Any) -> None:
        raise AssertionError("ranks were started")

    monkeypatch.setattr(launcher, "_launch_ranks", started)


@pytest.mark.parametrize(
    ("flags", "nproc", "names"),
    [
        (["--tp", "2"], 2, "--tp 2"),
        (["--pp", "2"], 2, "--pp 2"),
        (["--ep", "2", "--config", "tiny-moe"], 2, "--ep 2"),
        (["--fsdp"], 2, "--fsdp"),
        (["--compile"], 2, "--compile"),
        (["--hf-config", "gpt2"], 2, "--hf-config"),
        (["--global-batch", "12"], 2, "6 micro-batches, not a power of two"),
    ],
)
def test_reproducible_outside_its_scope_is_refused_in_one_line(
    tmp_path, capsys, no_launch, flags, nproc, names
):
    argv = ["train", "--reproducible", "--global-batch", "8", "--batch", "2", *flags]
    code = main([*argv, "--nproc", str(nproc), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1, err
    assert names in err, err
    assert REPRODUCIBLE_SCOPE in err
    assert not (tmp_path / "run").exists()


def test_reproducible_needs_a_global_batch(tmp_path, capsys, no_launch):
    code = main(["train", "--reproducible", "--nproc", "2", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and "--reproducible needs --global-batch" in err, err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--global-batch", "6", "--batch", "2"], "--global-batch 6 is 3 micro-batches"),
        (["--global-batch", "5", "--batch", "2"], "--global-batch must be a positive multiple"),
    ],
)
def test_a_global_batch_that_does_not_divide_is_refused_before_launch(
    tmp_path, capsys, no_launch, flags, message
):
    code = main(["train", *flags, "--nproc", "2", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_accumulation_follows_the_data_parallel_size():
    args = TrainArgs(batch=2, global_batch=16)
    assert [args.accumulation(n) for n in (1, 2, 4, 8)] == [8, 4, 2, 1]
    assert TrainArgs(batch=2).accumulation(4) == 1  # no --global-batch: as before
    assert TrainArgs(batch=2).global_batch_at(4) == 8


# -- the data: micro-batch j of a step is the same sequences at every layout -------------


def test_micro_batches_are_keyed_by_their_global_index():
    data = torch.arange(5000, dtype=torch.int64) % 256
    cpu = torch.device("cpu")

    def step_at(dp: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        k = 8 // dp
        return [
            b for r in range(dp) for b in micro_batches(data, 2, 16, 3, 5, rank_block(r, k), cpu)
        ]

    one = step_at(1)
    for dp in (2, 4, 8):
        assert all(torch.equal(a[0], b[0]) for a, b in zip(one, step_at(dp)))
    # control: another step's micro-batches differ
    other = micro_batches(data, 2, 16, 3, 6, range(8), cpu)
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(one, other))
    # without --global-batch (one micro-batch per rank) rank r's batch is the one it had
    x, _ = get_batch(data, 2, 16, 3, 5, 1)
    assert torch.equal(micro_batches(data, 2, 16, 3, 5, rank_block(1, 1), cpu)[0][0], x)


# -- the logged means, in a fixed order -------------------------------------------------

LOSSES = [random.Random(7).uniform(1, 9) for _ in range(8)]


def _step_loss_rank(rank: int, world: int, ordered: bool) -> float:
    k = len(LOSSES) // world
    return step_loss(LOSSES[rank * k : (rank + 1) * k], 0.0, rank, world, ordered)[0]


@pytest.mark.parametrize("world", [2, 4])
def test_the_train_loss_is_summed_in_global_order_at_every_size(world):
    one = step_loss(LOSSES, 0.0, 0, 1, ordered=True)[0]
    assert one == ordered_sum(LOSSES) / 8
    got = run_ranks(_step_loss_rank, world, args=(True,), timeout=60)
    assert all(g.hex() == one.hex() for g in got), (got, one)
    # control: the default mean (per rank, then across ranks) differs in its bits here
    default = run_ranks(_step_loss_rank, world, args=(False,), timeout=60)
    assert default[0].hex() != one.hex(), (default, one)


class _Loss(torch.nn.Module):
    """A model whose loss is the mean of x·w over the batch (w ones)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (x.float() * self.w).mean()


def _val_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Five batches of 32 tokens whose losses × tokens are 2**58, 32, 32, 32, 32: added one
    by one each 32 is lost to rounding (half the ulp of 2**58, a tie to even), while two
    added first (64) survive, so a sum grouped by rank shows in the bits."""
    y = torch.zeros(2, 16, dtype=torch.int64)
    return [(torch.full((2, 16), 2**53 if j == 0 else 1), y) for j in range(5)]


def _val_rank(rank: int, world: int) -> float:
    return ordered_evaluate(_Loss(), _val_batches(), rank, world, "fp32")


def test_the_validation_loss_is_the_same_bits_at_every_size():
    one = ordered_evaluate(_Loss(), _val_batches(), 0, 1, "fp32")
    # control: these losses summed per rank first (as a plain all-reduce of each rank's
    # total does) give other bits
    slots = [2.0**58, 32.0, 32.0, 32.0, 32.0]
    grouped = ordered_sum([ordered_sum(slots[0::2]), ordered_sum(slots[1::2])])
    assert grouped / 160 != one == ordered_sum(slots) / 160
    for world in (2, 4):
        got = run_ranks(_val_rank, world, timeout=60)
        assert all(g.hex() == one.hex() for g in got), (world, got, one)


# -- verify's comparison ----------------------------------------------------------------


def test_compare_tensors_counts_differing_bits_and_sees_one_ulp():
    a = {"w": torch.linspace(-1, 1, 100), "b": torch.ones(3)}
    same = compare_tensors("weights", a, {k: v.clone() for k, v in a.items()})
    assert same.equal and same.total == 103
    b = {k: v.clone() for k, v in a.items()}
    b["w"][7] = torch.nextafter(b["w"][7], torch.tensor(2.0))  # one ulp
    diff = compare_tensors("weights", a, b)
    assert (diff.differing, diff.equal) == (1, False) and 0 < diff.max_abs < 1e-6
    # -0.0 and 0.0 are equal numbers but not the same bits
    z = compare_tensors("w", {"w": torch.tensor([0.0])}, {"w": torch.tensor([-0.0])})
    assert z.differing == 1


def test_train_flags_give_back_the_run():
    args = TrainArgs(
        config="tiny", steps=3, batch=1, global_batch=4, reproducible=True, lr=0.0123456789,
        grad_clip=0.5, data="x.txt", progress=False, out="elsewhere",
    )  # fmt: skip
    # --out and --no-progress are verify's own for each run
    own = ["--out", "elsewhere", "--no-progress"]
    ns = build_parser().parse_args(["train", *train_flags(args), *own])
    assert train_args_from(ns) == args


def _fake_run(out: Path, bump: float = 0.0, loss: float = 2.5) -> None:
    """A run folder as `orthoptim train` leaves it: metrics and a last checkpoint."""
    folder = out / "checkpoints" / "step_000002"
    folder.mkdir(parents=True)
    (out / "checkpoints" / "latest.json").write_text(json.dumps({"folder": folder.name}))
    torch.save({"w": torch.tensor([0.5 + bump, 0.5, 0.5, 0.5])}, folder / "model.pt")
    torch.save({"state": {0: {"m": torch.zeros(4)}}}, folder / "optim.pt")
    rows = [
        dict(step=0, val_loss=3.0, tokens=0),
        dict(step=1, train_loss=loss, grad_norm=1.0, step_time_s=0.1, cold=True),
        dict(step=2, train_loss=2.0, step_time_s=0.7, telemetry={"x": 1}),
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compare_runs_leaves_out_the_figures_outside_the_guarantee(tmp_path):
    _fake_run(tmp_path / "a")
    _fake_run(tmp_path / "b")
    rows = [json.loads(x) for x in (tmp_path / "b/metrics.jsonl").read_text().splitlines()]
    rows[2]["step_time_s"] = 9.9  # a wall-clock figure: not compared
    (tmp_path / "b/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    diffs = compare_runs(tmp_path / "a", tmp_path / "b")
    assert {d.what for d in diffs} == {"weights", "optimizer state", "train_loss", "grad_norm",
                                       "val_loss", "tokens"}  # fmt: skip
    assert all(d.equal for d in diffs)
    assert "step_time_s" in OUTSIDE_GUARANTEE


@pytest.fixture
def fake_layouts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[int, dict[str, Any]]:
    """verify's runs replaced by fake run folders: {nproc: _fake_run's keywords}."""
    made: dict[int, dict[str, Any]] = {}

    def run_train(args: TrainArgs, nproc: int, out: Path, extra: list[str]) -> None:
        if "--resume" not in extra:  # a resumed one continues the copy verify made
            _fake_run(out, **made.get(nproc, {}))

    monkeypatch.setattr(verify_mod, "run_train", run_train)
    return made


def _verify(tmp_path: Path, *flags: str) -> int:
    base = ["verify", "--nproc", "1,2,4", "--global-batch", "8", "--batch", "2"]
    return main([*base, "--keep", str(tmp_path / "runs"), *flags])


def test_verify_exits_0_when_all_are_bitwise_equal(tmp_path, capsys, fake_layouts):
    assert _verify(tmp_path, "--reproducible") == 0
    out = capsys.readouterr().out
    assert "micro-batches per rank: --nproc 1: 4, --nproc 2: 2, --nproc 4: 1" in out
    assert "outside the guarantee" in out and "verify: all bitwise equal" in out
    assert out.count("vs") == 3  # every pair


@pytest.mark.parametrize(
    ("change", "what"),
    [(dict(bump=2**-20), "weights"), (dict(loss=2.5000000000000004), "train_loss")],
)
def test_verify_exits_1_on_one_differing_bit(tmp_path, capsys, fake_layouts, change, what):
    fake_layouts[4] = change
    assert _verify(tmp_path, "--reproducible") == 1
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.strip().startswith(what) and "DIFFERENT" in x)
    assert "differing         1 of" in line, out


def test_verify_checks_a_resume_against_the_uninterrupted_run(tmp_path, capsys, fake_layouts):
    assert _verify(tmp_path, "--reproducible", "--resume-from-nproc", "2") == 0
    out = capsys.readouterr().out
    assert "--nproc 2 vs --nproc 2→4 resumed:" in out and "resume at another size: yes" in out


def test_verify_refuses_a_layout_before_running_any(tmp_path, capsys, fake_layouts):
    code = main(["verify", "--nproc", "1,3", "--global-batch", "8", "--batch", "2"])
    assert code == 2 and "--nproc 3" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


# -- the resume notice ------------------------------------------------------------------


def test_a_resume_at_another_size_keeps_the_global_batch():
    args = TrainArgs(batch=2, global_batch=8)
    info = dict(args=args.to_dict(), world_size=2)
    assert layout_change(info, args, 4) == (
        "--nproc 2 → 4: global batch unchanged (8 sequences; micro-batches per rank 2 → 1)"
    )
    # without --global-batch the global batch follows the size (as before)
    plain = TrainArgs(batch=2)
    assert "global batch 4 → 8 sequences" in layout_change(
        dict(args=plain.to_dict(), world_size=2), plain, 4
    )


# -- the command line end to end (needs the library's reproducible=True) ---------------


def _train(root: Path, name: str, nproc: int, *flags: str) -> Path:
    out = root / name
    assert main(["train", *RUN, "--nproc", str(nproc), "--out", str(out), *flags]) == 0
    return out


@pytest.fixture(scope="module")
def runs(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny run with --reproducible at --nproc 1 and 2, stopped at 2 after step 1 and
    resumed at 4, and the default mode at 1 and 2 (the control)."""
    root = tmp_path_factory.mktemp("repro")
    data = ["--data", corpus]
    out = {
        "r1": _train(root, "r1", 1, "--reproducible", *data),
        "r2": _train(root, "r2", 2, "--reproducible", *data),
        "d1": _train(root, "d1", 1, *data),
        "d2": _train(root, "d2", 2, *data),
    }
    half = _train(root, "half", 2, "--reproducible", "--stop-after", "1", *data)
    shutil.copytree(half, root / "r2to4")
    out["r2to4"] = _train(root, "r2to4", 4, "--reproducible", "--resume", *data)
    return out


def _unequal(diffs: list[Any]) -> list[str]:
    return [
        f"{d.what}: {d.differing} of {d.total} (max {d.max_abs:g})" for d in diffs if not d.equal
    ]


def test_reproducible_cli_is_bitwise_the_same_at_nproc_1_and_2(runs):
    diffs = compare_runs(runs["r1"], runs["r2"])
    assert {"weights", "train_loss", "val_loss", "grad_norm"} <= {d.what for d in diffs}
    assert _unequal(diffs) == []
    # control: the default mode at the same global batch differs, and verify's check sees it
    assert _unequal(compare_runs(runs["d1"], runs["d2"])) != []


def test_reproducible_run_resumed_at_another_size_is_bitwise_the_uninterrupted_one(runs):
    assert _unequal(compare_runs(runs["r2"], runs["r2to4"])) == []
    log = (runs["r2to4"] / "logs" / "rank0.log").read_text()
    assert "global batch unchanged (4 sequences; micro-batches per rank 2 → 1)" in log


@pytest.mark.slow
def test_verify_end_to_end_exits_0_reproducible_and_1_without(corpus, capsys):
    flags = ["--config", "tiny", "--global-batch", "8", "--batch", "2", "--steps", "6"]
    flags += ["--data", corpus, "--eval-batches", "2"]
    assert main(["verify", "--nproc", "1,2,4", "--reproducible", *flags]) == 0
    assert "verify: all bitwise equal" in capsys.readouterr().out
    assert main(["verify", "--nproc", "1,2,4", *flags]) == 1
    assert "DIFFERENT" in capsys.readouterr().out
