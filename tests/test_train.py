"""The main job: corpus loading, `orthoptim train` over 2 real ranks (resume included) and
`orthoptim compare`. Runs are a few steps of the tiny model on small batches."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from orthoptim.cli import build_parser, main
from orthoptim.optim.hybrid import build_optimizer, routing_table
from orthoptim.train.args import TrainArgs
from orthoptim.train.cli import train_args_from
from orthoptim.train.data import (
    DataError,
    get_batch,
    load_corpus,
    split_files,
    stdlib_root,
    val_batches,
)
from orthoptim.train.model import CONFIGS, GPT, GPTConfig
from orthoptim.train.runfolder import sealed
from reference_runs import reference_run, relative, saved_model

SEQ = CONFIGS["tiny"].seq_len


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- corpus


def test_stdlib_corpus_is_deterministic_and_splits_by_file():
    a = load_corpus(min_bytes=SEQ + 1)
    b = load_corpus(min_bytes=SEQ + 1)
    assert a.train_files == b.train_files and a.val_files == b.val_files
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert not set(a.train_files) & set(a.val_files)
    # Every stdlib .py file (outside site-packages) is on exactly one side.
    on_disk = {
        p.relative_to(stdlib_root()).as_posix()
        for p in stdlib_root().rglob("*.py")
        if "site-packages" not in p.parts and "__pycache__" not in p.parts
    }
    assert set(a.train_files) | set(a.val_files) == on_disk
    sizes = {n: (stdlib_root() / n).stat().st_size for n in on_disk}
    assert a.val.numel() == sum(sizes[n] for n in a.val_files)
    assert a.train.numel() == sum(sizes[n] for n in a.train_files)
    assert 0 < len(a.val_files) < len(a.train_files)


def test_split_files_is_seeded_disjoint_and_complete():
    files = [f"f{i:03d}.txt" for i in range(50)]
    tr, va = split_files(files, 0.1, seed=1)
    assert (tr, va) == split_files(files, 0.1, seed=1)
    assert split_files(files, 0.1, seed=2)[1] != va
    assert sorted(tr + va) == files and not set(tr) & set(va) and len(va) == 5


def test_data_folder_and_file(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    texts = {f"doc{i}.txt": (f"document {i} " * 200).encode() for i in range(10)}
    for name, body in texts.items():
        (folder / name).write_bytes(body)
    (folder / "empty.txt").write_bytes(b"")  # an empty file in a folder adds nothing
    c = load_corpus(folder, val_fraction=0.2, min_bytes=SEQ + 1)
    assert len(c.val_files) == 2 and not set(c.train_files) & set(c.val_files)
    assert c.val.numel() == sum(len(texts.get(n, b"")) for n in c.val_files)
    assert bytes(c.train[: len(texts[c.train_files[0]])].tolist()) == texts[c.train_files[0]]

    single = folder / "doc1.txt"
    c1 = load_corpus(single, val_fraction=0.25, min_bytes=SEQ + 1)
    body = texts["doc1.txt"]
    assert bytes(c1.train.tolist()) + bytes(c1.val.tolist()) == body
    assert c1.val.numel() == round(0.25 * len(body))


def test_empty_or_binary_data_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match=r"empty\.txt is empty"):
        load_corpus(empty)
    binary = tmp_path / "blob.bin"
    binary.write_bytes(bytes(range(256)) * 10)
    with pytest.raises(DataError, match=r"blob\.bin looks binary"):
        load_corpus(binary)
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("hello " * 100)
    (folder / "b.dat").write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DataError, match=r"b\.dat looks binary"):
        load_corpus(folder)
    with pytest.raises(DataError, match="does not exist"):
        load_corpus(tmp_path / "nope")
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(DataError, match="fewer than"):
        load_corpus(short, min_bytes=SEQ + 1)


def test_data_that_is_neither_file_nor_folder_is_named_as_such(tmp_path, capsys):
    """`--data /dev/zero` or a FIFO used to be refused as "the folder holds no files"."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (Path("/dev/zero"), fifo):
        assert main(["train", "--data", str(path), "--out", str(tmp_path / "run")]) == 2
        assert capsys.readouterr().err == (
            f"orthoptim: error: --data: {path} is neither a regular file nor a folder (a "
            "device, FIFO or socket); pass a text file or a folder of them\n"
        )


def test_batches_are_a_function_of_seed_step_rank():
    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    x, y = get_batch(data, 4, 16, seed=0, step=3, rank=1)
    x2, y2 = get_batch(data, 4, 16, seed=0, step=3, rank=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, get_batch(data, 4, 16, seed=0, step=3, rank=0)[0])
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the next bytes
    v = val_batches(data, 3, 4, 16, seed=0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(v, val_batches(data, 3, 4, 16, seed=0)))


# ---------------------------------------------------------------- model


def test_model_routing_and_causality():
    model = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16))
    table = routing_table(build_optimizer(model, optimizer="muon"))
    assert table["embed.weight"] == "adamw" and table["lm_head.weight"] == "adamw"
    assert table["blocks.0.attn_norm.weight"] == "adamw"
    for name in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj"):
        assert table[f"blocks.1.{name}.weight"] == "muon"
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)  # the future never leaks back
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    with pytest.raises(ValueError, match="heads of even size"):
        GPTConfig(d_model=30, n_head=2)


# ---------------------------------------------------------------- end to end


def _train_argv(out: Path, *extra: str) -> list[str]:
    return [
        "train", "--optimizer", "muon", "--nproc", "2", "--config", "tiny",
        "--steps", "6", "--batch", "2", "--eval-every", "3", "--eval-batches", "2",
        "--ckpt-every", "3", "--warmup", "2", "--out", str(out), "--no-progress", *extra,
    ]  # fmt: skip


def _train(out: Path, *extra: str) -> int:
    return main(_train_argv(out, *extra))


FP64 = ("--param-dtype", "fp64")
# The layer-wise run's optimizers: a Muon variant, and Lion for the non-matrix part (the
# default Muon and AdamW: the tensor-parallel and bf16 runs), in float64, where the
# uninterrupted single-process reference (`_uninterrupted`) follows it to `TOL`.
VARIANT = ("--optimizer", "normuon", "--elementwise", "lion", *FP64)
# float64 runs and their single-process reference differ only in the order of their sums
# (~1e-16 relative each); over 6 steps of Newton-Schulz that stays far under 1e-10.
TOL = 1e-10


@functools.cache
def _stdlib_train() -> torch.Tensor:
    """The default corpus's training split (`--data` not given), loaded once."""
    return load_corpus(min_bytes=SEQ + 1).train


def _uninterrupted(sizes: list[int], *flags: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The oracle of a `_train` run with `flags` resumed at another layout: the
    single-process float64 run of the same arguments (`reference_run`, nothing of the
    checkpoint or its resharding in it) whose step s takes the global batch of `sizes[s - 1]`
    data-parallel ranks. Its losses and its parameters after the last step."""
    args = train_args_from(build_parser().parse_args(_train_argv(Path("unused"), *flags)))
    return reference_run(CONFIGS["tiny"], _stdlib_train(), args, sizes)


def _check_follows(out: Path, want: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    """The run under `out` equals `want` (`_uninterrupted`) to `TOL`: each step's train
    loss, and every parameter after the last step."""
    losses, params = want
    got = [r["train_loss"] for r in _metrics(out) if "train_loss" in r]
    assert len(got) == len(losses), (got, losses)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, losses))
    assert worst <= TOL, (worst, got, losses)
    have = saved_model(out)
    assert have.keys() == params.keys(), sorted(have.keys() ^ params.keys())
    worst = max(relative(have[k].to(torch.float64), params[k]) for k in params)
    assert worst <= TOL, worst


@pytest.fixture(scope="module")
def layerwise_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 6-step 2-rank run of the layer-wise optimizer (`VARIANT`): the reference of the
    other runs. It keeps the checkpoints of steps 2, 4 and 6 (a run to rewind with two
    behind it)."""
    full = tmp_path_factory.mktemp("layerwise") / "full"
    assert _train(full, *VARIANT, "--ckpt-every", "2", "--keep-checkpoints", "3") == 0
    return full


def _rewind(run: Path, step: int, dest: Path) -> Path:
    """A copy of the finished `run` as it stood once its checkpoint of `step` was committed:
    the later step folders removed and latest.json naming that one. Resumed, it redoes the
    steps after `step` from the checkpoint the uninterrupted run itself wrote, as a run
    stopped there (which saves that step's checkpoint the same way) would; one run is then
    both the oracle and the interrupted run (`--stop-after` itself: the tests that use it)."""
    shutil.copytree(run, dest)
    ckpts = dest / "checkpoints"
    kept = ckpts / f"step_{step:06d}"
    for later in ckpts.glob("step_*"):
        if later.name > kept.name:
            shutil.rmtree(later)
    shutil.copyfile(kept / "checkpoint.json", ckpts / "latest.json")
    return dest


def _cold(rows: list[dict]) -> list[int]:
    """The steps logged as the first two after a start or a resume: [1, 2, 4, 5] for a run
    resumed at step 3 (so a rewound copy really trained on)."""
    return [r["step"] for r in rows if r.get("cold")]


def test_train_two_ranks_end_to_end_and_resume(tmp_path, layerwise_run):
    full = layerwise_run
    step6 = "checkpoints/step_000006"
    for f in ("metrics.jsonl", "result.json", "logs/rank0.log", "logs/rank1.log",
              "checkpoints/latest.json", f"{step6}/model.pt", f"{step6}/optim.pt"):  # fmt: skip
        assert (full / f).is_file(), f
    rows = _metrics(full)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert [r["step"] for r in rows] == list(range(7))
    assert len(vals) == 3 and vals[-1] < vals[0]
    result = json.loads((full / "result.json").read_text())
    assert result["world_size"] == 2 and len(result["peak_memory_bytes_per_rank"]) == 2
    assert all(b > 0 for b in result["comm_sent_bytes_per_step_per_rank"])

    # The run as it stood after step 4, with step 4's checkpoint damaged: every rank passes
    # over it (rank 0 checks, all follow), resumes from step 2's and repeats the run. (No
    # intact checkpoint left: test_resume's refusal. --stop-after: the FSDP test's.)
    part = _rewind(full, 4, tmp_path / "part")
    optim = part / "checkpoints/step_000004/optim.pt"
    data = bytearray(optim.read_bytes())
    data[-100] ^= 1
    optim.write_bytes(bytes(data))
    assert _train(part, *VARIANT, "--resume") == 0
    for rank in (0, 1):
        log = (part / f"logs/rank{rank}.log").read_text()
        assert "passed over step_000004: optim.pt fails its SHA-256 check" in log, (rank, log)
        assert "resuming from step_000002 (step 2)" in log, (rank, log)
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == list(range(7)) and _cold(resumed) == [1, 2, 3, 4]
    for a, b in zip(rows[3:], resumed[3:]):
        assert a["train_loss"] == b["train_loss"], (a, b)
    assert rows[-1]["val_loss"] == resumed[-1]["val_loss"]


def test_train_tensor_parallel_and_resume(tmp_path):
    """--nproc 2 --tp 2: one data-parallel rank of two tensor-parallel ranks (the GPT's
    matrices DTensors, Newton-Schulz by the TP orthogonalizer); it trains, and resumed from its
    step-3 checkpoint (`_rewind`) it follows the uninterrupted run."""
    full = tmp_path / "full"
    assert _train(full, "--tp", "2") == 0
    rows = _metrics(full)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert [r["step"] for r in rows] == list(range(7))
    assert vals[-1] < vals[0] - 0.5, vals
    result = json.loads((full / "result.json").read_text())
    assert result["args"]["tp"] == 2 and result["tokens_per_step"] == 2 * SEQ  # one dp rank
    assert (full / "checkpoints/step_000006/dcp/.metadata").is_file()

    part = _rewind(full, 3, tmp_path / "part")
    assert _train(part, "--tp", "2", "--resume") == 0
    resumed = _metrics(part)
    assert [r["step"] for r in resumed] == list(range(7)) and _cold(resumed) == [1, 2, 4, 5]
    for a, b in zip(rows[4:], resumed[4:]):
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6), (a, b)


def test_train_fsdp_matches_layerwise_and_resumes(tmp_path, layerwise_run, capsys):
    """`--fsdp`: the model sharded by FSDP2 and stepped by FSDPOptimizer, interrupted after
    step 3 and resumed from its DCP checkpoint, follows the layer-wise run (same model, data
    and routing) step for step; the ranks only sum in another order (rtol 1e-5). The run is
    `--optimizer normuon --elementwise lion`: both through the one contract, Lion's state
    carried by the DCP checkpoint (a resume with it zeroed leaves the reference by 1e-3), and
    the non-matrix part's optimizer must match on resume."""
    ref = _metrics(layerwise_run)
    part = tmp_path / "fsdp"
    assert _train(part, *VARIANT, "--fsdp", "--stop-after", "3") == 0
    assert [r["step"] for r in _metrics(part)] == [0, 1, 2, 3]
    assert (part / "checkpoints/step_000003/dcp/.metadata").is_file()
    assert not list((part / "checkpoints/step_000003").glob("*.pt"))
    assert _train(part, *VARIANT, "--fsdp", "--resume") == 0
    rows = _metrics(part)
    assert [r["step"] for r in rows] == list(range(7))
    for a, b in zip(rows, ref):
        for key in ("train_loss", "val_loss"):
            assert (key in a) == (key in b), (key, a, b)  # step 0 logs no train_loss
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-5), (key, a, b)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0]
    result = json.loads((part / "result.json").read_text())
    assert result["optimizer_class"] == "FSDPOptimizer" and result["args"]["fsdp"]
    assert (result["args"]["optimizer"], result["args"]["elementwise"]) == ("normuon", "lion")
    assert all(b > 0 for b in result["comm_sent_bytes_per_step_per_rank"])
    # The sharded (DCP) checkpoint of step 3 resumes unsharded in one process too: the run
    # equals the uninterrupted single-process one whose global batch goes from 2 ranks' to
    # 1's after step 3, to 1e-10 (float64).
    one = _rewind(part, 3, tmp_path / "one")
    capsys.readouterr()
    assert _train(one, *VARIANT, "--nproc", "1", "--resume") == 0
    assert "--nproc 2 → 1, --fsdp on → off: global batch 4 → 2 sequences" in capsys.readouterr().err
    _check_follows(one, _uninterrupted([2, 2, 2, 1, 1, 1], *VARIANT))
    # The run's elementwise part must match.
    assert _train(part, "--optimizer", "normuon", "--fsdp", "--resume") == 2
    assert "--elementwise: checkpoint 'lion', now 'adamw'" in capsys.readouterr().err


def _losses(rows: list[dict]) -> list[tuple]:
    return [(r["step"], r.get("train_loss"), r.get("val_loss")) for r in rows]


@pytest.mark.parametrize("fsdp", [True, False])
def test_train_bf16_parameters_resume_exactly_and_at_either_dtype(tmp_path, fsdp):
    """`--param-dtype bf16` at 2 ranks: under --fsdp FSDP2's mixed precision (bf16 forward
    and backward, fp32 master shards and optimizer state, gradients reduced in fp32), without
    it the layer-wise optimizer (bf16 parameters, fp32 masters and state on their owners).
    The loss falls; resumed from its step-3 checkpoint (`_rewind`), the run repeats the
    uninterrupted one bit for bit (the checkpoint holds every fp32 master and state tensor,
    and the resumed ranks redo the same arithmetic); the same checkpoint resumes at
    --param-dtype fp32 too, each metrics row naming its dtype."""
    from torch.distributed.checkpoint import FileSystemReader

    mode = ("--fsdp",) if fsdp else ()
    bf16 = (*mode, "--param-dtype", "bf16")
    whole = tmp_path / "whole"
    assert _train(whole, *bf16) == 0
    part, other = _rewind(whole, 3, tmp_path / "part"), _rewind(whole, 3, tmp_path / "other")
    assert _train(part, *bf16, "--resume") == 0
    rows, resumed = _metrics(whole), _metrics(part)
    assert [r["step"] for r in resumed] == list(range(7)) and _cold(resumed) == [1, 2, 4, 5]
    assert _losses(resumed) == _losses(rows)
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(vals) == 3 and vals[-1] < vals[0] - 0.5, vals
    assert {r["param_dtype"] for r in rows} == {"bf16"}
    result = json.loads((whole / "result.json").read_text())
    assert result["param_dtype"] == "bf16" and result["args"]["param_dtype"] == "bf16"
    record = json.loads((part / "checkpoints/latest.json").read_text())
    assert record["param_dtype"] == "bf16"
    if fsdp:
        meta = FileSystemReader(str(part / "checkpoints/step_000006/dcp")).read_metadata()
        dtypes = {
            (key.split("/")[0], v.properties.dtype)
            for key, v in meta.state_dict_metadata.items()
            if hasattr(v, "properties")
        }
        assert dtypes == {("model", torch.float32), ("optim", torch.float32)}, dtypes
    # The same checkpoint at fp32 parameters trains on.
    assert _train(other, *mode, "--param-dtype", "fp32", "--resume") == 0
    mixed = _metrics(other)
    assert [r["param_dtype"] for r in mixed] == ["bf16"] * 4 + ["fp32"] * 3
    assert _cold(mixed) == [1, 2, 4, 5]
    assert _losses(mixed[:4]) == _losses(rows[:4])
    assert mixed[-1]["val_loss"] < vals[1]


def _committed(out: Path, args: TrainArgs, world_size: int, step: int = 3) -> None:
    """A committed checkpoint record of `args` at `step` under `out` that verifies (a sealed
    latest.json and its step folder's record, no files): enough for --resume's checks."""
    ckpt = out / "checkpoints"
    folder = f"step_{step:06d}"
    (ckpt / folder).mkdir(parents=True)
    record = sealed(
        dict(args=args.to_dict(), world_size=world_size, step=step, folder=folder, files={})
    )
    for path in (ckpt / folder / "checkpoint.json", ckpt / "latest.json"):
        path.write_text(json.dumps(record))


def test_resume_refuses_another_run(tmp_path, capsys):
    out = tmp_path / "run"
    _committed(out, TrainArgs(batch=2, steps=6, out=str(out)), world_size=2)
    argv = ["train", "--nproc", "2", "--steps", "6", "--out", str(out), "--resume"]
    assert main([*argv, "--batch", "3"]) == 2
    err = capsys.readouterr().err
    assert "--batch: checkpoint 2, now 3" in err and "--nproc" not in err
    # another layout is no mismatch (it is resharded: test_resume_at_another_size_*)
    assert main([*argv[:2], "4", *argv[3:], "--tp", "2", "--batch", "3"]) == 2
    err = capsys.readouterr().err
    assert "--batch: checkpoint 2, now 3" in err and "--nproc" not in err and "--tp" not in err
    assert main(["train", "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_resume_refusing_min_lr_ratio_names_a_flag_train_has(tmp_path, capsys):
    """The refusal named `--min-lr-ratio`, which `orthoptim train` did not take."""
    out = tmp_path / "run"
    _committed(out, TrainArgs(batch=2, steps=6, out=str(out), min_lr_ratio=0.2), world_size=1)
    argv = ["train", "--nproc", "1", "--batch", "2", "--steps", "6", "--out", str(out), "--resume"]
    assert main(argv) == 2
    assert "--min-lr-ratio: checkpoint 0.2, now 0.1" in capsys.readouterr().err
    assert main([*argv, "--min-lr-ratio", "0.2", "--seed", "1"]) == 2
    err = capsys.readouterr().err
    assert "--seed: checkpoint 0, now 1" in err and "--min-lr-ratio" not in err, err
    ns = build_parser().parse_args(["train", "--min-lr-ratio", "0.25"])
    assert train_args_from(ns).min_lr_ratio == 0.25
    for bad in ("1.5", "-0.1", "nan"):
        assert main(["train", "--min-lr-ratio", bad, "--out", str(tmp_path / "x")]) == 2
        assert capsys.readouterr().err == (
            f"orthoptim: error: --min-lr-ratio must be in [0, 1] (the LR at --steps over the "
            f"peak), got {float(bad)}\n"
        )


def test_layout_change_names_the_flags_and_the_global_batch():
    """The notice of a resumed run at another layout: the flags that changed and the global
    batch, `--batch` per data-parallel rank (nproc / tp of them); None when nothing did."""
    from orthoptim.train.runfolder import layout_change

    def record(nproc: int, **flags) -> dict:
        return dict(args=TrainArgs(batch=16, **flags).to_dict(), world_size=nproc)

    assert layout_change(record(2), TrainArgs(batch=16), 2) is None
    assert layout_change(record(2), TrainArgs(batch=16), 3) == (
        "--nproc 2 → 3: global batch 32 → 48 sequences (3 data-parallel ranks × --batch 16)"
    )
    assert layout_change(record(2), TrainArgs(batch=16, tp=2), 4) == (
        "--nproc 2 → 4, --tp 1 → 2: global batch unchanged (32 sequences)"
    )
    assert layout_change(record(2, fsdp=True), TrainArgs(batch=16), 1) == (
        "--nproc 2 → 1, --fsdp on → off: global batch 32 → 16 sequences "
        "(1 data-parallel rank × --batch 16)"
    )


@pytest.fixture(scope="module")
def resized(layerwise_run, tmp_path_factory) -> dict[int, tuple[Path, str]]:
    """The 2-rank run's step-4 checkpoint resumed at --nproc 1 and at --nproc 3 (the
    elastic ranks one thread each, as the reference's): each run's folder and stderr."""
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        for nproc in (1, 3):
            out = _rewind(layerwise_run, 4, tmp_path_factory.mktemp("resized") / str(nproc))
            with _stderr() as err:
                assert _train(out, *VARIANT, "--nproc", str(nproc), "--resume") == 0, err()
                runs[nproc] = (out, err())
    return runs


@contextlib.contextmanager
def _stderr():
    """What the code inside writes to sys.stderr (a module fixture has no capsys)."""
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        yield buf.getvalue


@pytest.mark.parametrize("nproc", [1, 3])
def test_resume_at_another_size_follows_the_uninterrupted_reference(layerwise_run, resized, nproc):
    """Issue 32 item 6: `--resume` of a 2-rank checkpoint at --nproc 1 (the plain
    single-process optimizer, whose state dict is torch's) and at --nproc 3 (the layer-wise
    optimizer over 3 ranks) trains on; in float64 its losses of steps 1 to 6 and its
    parameters after step 6 equal, to 1e-10, the uninterrupted single-process run whose
    global batch is 2 ranks' for steps 1 to 4 and nproc ranks' for 5 and 6 (`_uninterrupted`:
    no checkpoint in it, so a state lost in resharding shows). The run names the change: each
    rank keeps --batch 2, so the global batch goes from 4 to 2·nproc sequences, and the tokens
    count on from the checkpoint's."""
    from orthoptim.train.loop import upper_median

    out, err = resized[nproc]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(7)) and _cold(rows) == [1, 2, 5, 6]
    assert rows[:5] == _metrics(layerwise_run)[:5]
    _check_follows(out, _uninterrupted([2, 2, 2, 2, nproc, nproc], *VARIANT))
    assert math.isfinite(rows[6]["val_loss"])
    notice = (
        f"--nproc 2 → {nproc}: global batch 4 → {2 * nproc} sequences "
        f"({nproc} data-parallel rank{'s' * (nproc > 1)} × --batch 2) from step 4"
    )
    for rank in range(nproc):
        assert notice in (out / f"logs/rank{rank}.log").read_text(), rank
    if nproc == 1:  # in this process: on the terminal too
        assert f"orthoptim: {notice}" in err, err
    per_step = {2: 2 * 2 * SEQ, nproc: nproc * 2 * SEQ}
    assert [r["tokens"] for r in rows] == [0, *(s * per_step[2] for s in range(1, 5)),
                                           4 * per_step[2] + per_step[nproc],
                                           4 * per_step[2] + 2 * per_step[nproc]]  # fmt: skip
    record = json.loads((out / "checkpoints/latest.json").read_text())
    assert (record["world_size"], record["tokens"], record["layout_since"]) == (
        nproc,
        rows[6]["tokens"],
        4,
    )
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == nproc and result["tokens_per_step"] == per_step[nproc]
    # its throughput is the new size's: over steps 5 and 6 only (else steps 3 and 4, the
    # old size's first steps not "cold")
    assert result["median_step_time_s"] == upper_median([r["step_time_s"] for r in rows[5:]])


# Layouts a checkpoint is resumed at: name → (data-parallel size, flags).
LAYOUTS = {
    "1": (1, "--nproc", "1"), "2": (2, "--nproc", "2"), "3": (3, "--nproc", "3"),
    "fsdp1": (1, "--nproc", "1", "--fsdp"), "fsdp2": (2, "--nproc", "2", "--fsdp"),
    "fsdp3": (3, "--nproc", "3", "--fsdp"), "tp2": (1, "--nproc", "2", "--tp", "2"),
    "2x tp2": (2, "--nproc", "4", "--tp", "2"),
}  # fmt: skip


def _resumed_at(tmp_path: Path, source: str, target: str) -> tuple[Path, list[int]]:
    """The float64 run (Muon and AdamW, which --tp needs) of layout `source` stopped after
    step 3 (once per `tmp_path`), a copy of it resumed at layout `target`: the copy's folder
    and the data-parallel size of each of its 6 steps."""
    first = tmp_path / source
    if not first.exists():
        assert _train(first, *FP64, *LAYOUTS[source][1:], "--stop-after", "3") == 0, source
    out = shutil.copytree(first, tmp_path / f"{source} to {target}")
    assert _train(out, *FP64, *LAYOUTS[target][1:], "--resume") == 0, (source, target)
    return out, [LAYOUTS[source][0]] * 3 + [LAYOUTS[target][0]] * 3


# Each checkpoint format (one process's full dicts, the 2-rank layer-wise optimizer's, 2-rank
# --fsdp DCP, --tp 2 DCP) into each kind of layout (one process, more data-parallel ranks,
# --fsdp, --tp), once each.
RESHARDS = [("1", "fsdp2"), ("2", "tp2"), ("fsdp2", "3"), ("tp2", "1")]


@pytest.mark.slow
@pytest.mark.parametrize("source, target", RESHARDS, ids=[f"{a} to {b}" for a, b in RESHARDS])
def test_each_checkpoint_format_resumes_at_each_kind_of_layout(tmp_path, source, target):
    """A checkpoint of layout `source`, resumed at layout `target`, trains on: its losses
    and its parameters after step 6 equal, to 1e-10 (float64), the uninterrupted
    single-process run whose global batch follows the data-parallel size (`_uninterrupted`),
    so every tensor of the optimizer's state came through the resharding."""
    out, sizes = _resumed_at(tmp_path, source, target)
    _check_follows(out, _uninterrupted(sizes, *FP64))


@pytest.mark.probe
def test_probe_resume_at_every_layout(tmp_path):
    """The figure of the resharding: every checkpoint format of `RESHARDS` resumed at every
    layout of `LAYOUTS` (32 resumes), each against the uninterrupted single-process run
    whose global batch follows the data-parallel size. Prints each resume's largest relative
    difference in the losses and the parameters (run with -s)."""
    worst = {}
    for source in dict(RESHARDS):
        for target in LAYOUTS:
            out, sizes = _resumed_at(tmp_path, source, target)
            losses, params = _uninterrupted(sizes, *FP64)
            got = [r["train_loss"] for r in _metrics(out) if "train_loss" in r]
            have = saved_model(out)
            far = max(
                max(abs(a - b) / abs(b) for a, b in zip(got, losses)),
                max(relative(have[k].to(torch.float64), params[k]) for k in params),
            )
            worst[source, target] = far
            print(f"{source:>5} → {target:<6} dp {sizes[0]} → {sizes[-1]}: largest relative "
                  f"difference {far:.1e}")  # fmt: skip
    print(f"{len(worst)} resumes: the largest relative difference {max(worst.values()):.1e}, "
          f"{sum(w > TOL for w in worst.values())} over {TOL:g}")  # fmt: skip
    assert len(worst) == 32 and max(worst.values()) <= TOL, worst


def test_train_rejects_bad_flags(tmp_path, capsys):
    assert main(["train", "--tp", "2", "--nproc", "3", "--out", str(tmp_path)]) == 2
    assert "--nproc 3 must be a multiple of --pp 1 × --tp 2" in capsys.readouterr().err
    assert main(["train", "--tp", "3", "--nproc", "3", "--out", str(tmp_path)]) == 2
    assert "--tp 3 must divide the model's 4 attention heads" in capsys.readouterr().err
    argv = ["train", "--tp", "2", "--nproc", "2", "--optimizer", "soap", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "--tp 2 runs with --optimizer muon" in capsys.readouterr().err
    assert main(["train", "--fsdp", "--tp", "2", "--nproc", "2", "--out", str(tmp_path)]) == 2
    assert "--fsdp with --tp 2" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main(["train", "--data", str(empty), "--out", str(tmp_path)]) == 2
    assert "is empty" in capsys.readouterr().err


def test_compare_writes_summary_and_plot(tmp_path):
    out = tmp_path / "cmp"
    argv = ["compare", "--nproc", "1", "--steps", "4", "--batch", "2", "--eval-every", "2",
            "--segments", "2", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"adamw", "muon"}
    # CPU defaults where no flag was given; --precision auto resolves to fp32 on CPU.
    assert (summary["config"], summary["precision"], summary["compiled"]) == ("tiny", "fp32", False)
    assert "fp32" in (out / "report.md").read_text()
    for run in summary["runs"].values():
        assert run["final_val_loss"] == run["val_curve"][-1][2]
        assert run["tokens_per_s"] > 0 and 0 < run["optimizer_share_of_step_time"] < 1
        assert [s for s, _, _ in run["val_curve"]] == [0, 2, 4]
    reach = summary["muon_steps_to_adamw_final_val_loss"]
    muon_curve = summary["runs"]["muon"]["val_curve"]
    if reach is None:
        assert min(v for _, _, v in muon_curve) > summary["adamw_final_val_loss"]
    else:
        assert dict((s, v) for s, _, v in muon_curve)[reach] <= summary["adamw_final_val_loss"]
    ratio = summary["runs"]["muon"]["tokens_per_s"] / summary["runs"]["adamw"]["tokens_per_s"]
    assert summary["tokens_per_s_ratio_muon_over_adamw"] == pytest.approx(ratio)
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    assert "| final validation loss (nats/byte) |" in report and "target" not in report
    # The report's figures are taken over the rows the loop's throughput uses.
    from orthoptim.train.compare import segment_ends
    from orthoptim.train.loop import timed_rows, upper_median
    from orthoptim.train.runfolder import read_metrics

    for name, run in summary["runs"].items():
        timed = timed_rows(read_metrics(out / name / "metrics.jsonl"))
        assert run["median_step_time_s"] == upper_median([r["step_time_s"] for r in timed])
    # The runs took turns in 2 segments, the second resumed: the same losses as one stretch
    # each. (One resume per run shows it; more segments are more of the same launches, and
    # where they end is `segment_ends`: at most one per step.)
    assert summary["segments"] == 2
    assert segment_ends(4, 5) == [1, 2, 3, 4] and segment_ends(4, 2) == [2, 4]
    whole = tmp_path / "whole"
    assert main([*argv[:-5], "--out", str(whole), "--no-progress", "--segments", "1"]) == 0
    once = json.loads((whole / "summary.json").read_text())
    for name, run in summary["runs"].items():
        assert [v for *_, v in run["val_curve"]] == [v for *_, v in once["runs"][name]["val_curve"]]
    assert main([*argv, "--segments", "0"]) == 2


def test_compare_several_optimizers_reports_each_against_the_baseline(tmp_path, capsys):
    """`--optimizers`: one run per optimizer, the first the baseline when AdamW is not among
    them; the report says, for each other one, whether and when it reached the baseline's
    final validation loss and at what throughput."""
    out = tmp_path / "many"
    argv = ["compare", "--optimizers", "muon,normuon,adamuon", "--lr", "adamuon=0.03",
            "--nproc", "1", "--steps", "2", "--batch", "2", "--eval-every", "1",
            "--segments", "1", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["optimizers"] == ["muon", "normuon", "adamuon"]
    assert summary["baseline"] == "muon" and set(summary["runs"]) == set(summary["optimizers"])
    assert summary["runs"]["adamuon"]["lr"] == 0.03
    assert summary["runs"]["normuon"]["optimizer_class"] == "HybridOptimizer"
    report = (out / "report.md").read_text()
    assert "# orthoptim compare: Muon vs NorMuon vs AdaMuon" in report
    target = summary["baseline_final_val_loss"]
    for name in ("normuon", "adamuon"):
        v = summary["versus_baseline"][name]
        curve = {s: loss for s, _, loss in summary["runs"][name]["val_curve"]}
        label = {"normuon": "NorMuon", "adamuon": "AdaMuon"}[name]
        line = next(x for x in report.splitlines() if x.startswith(f"- **{label}** (lr"))
        if v["steps_to_baseline_final_val_loss"] is None:
            assert min(curve.values()) > target and "did not reach Muon's" in line
        else:
            assert curve[v["steps_to_baseline_final_val_loss"]] <= target
            assert f"at step {v['steps_to_baseline_final_val_loss']}" in line
        ratio = summary["runs"][name]["tokens_per_s"] / summary["runs"]["muon"]["tokens_per_s"]
        assert v["tokens_per_s_ratio"] == pytest.approx(ratio)
        assert f"{ratio:.3f}× Muon's tokens/s" in line
    assert "| | Muon | NorMuon | AdaMuon |" in capsys.readouterr().out
    for bad, said in (
        (["--optimizers", "muon,sgd"], "'sgd' not among"),
        (["--optimizers", "muon,muon"], "at least two different optimizers"),
        (["--lr", "soap=0.1"], "'soap' is not among --optimizers"),
        (["--lr", "muon"], "--lr takes NAME=LR"),
    ):
        assert main(["compare", *bad, "--out", str(tmp_path / "x"), "--no-progress"]) == 2
        assert said in capsys.readouterr().err, bad


def test_compare_sweep_keeps_each_optimizers_best_lr(tmp_path):
    out = tmp_path / "sweep"
    argv = ["compare", "--nproc", "1", "--steps", "2", "--batch", "2", "--eval-every", "2",
            "--segments", "1", "--sweep", "--muon-lr", "0.05", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    from orthoptim.train.compare import SWEEP_GRID

    # AdamW swept over its grid; Muon's LR was given, so it ran once and is not in the sweep.
    assert set(summary["sweep"]) == {"adamw"}
    tried = summary["sweep"]["adamw"]
    assert set(tried) == {f"{lr:g}" for lr in SWEEP_GRID["adamw"]}
    best = min(tried, key=tried.get)
    assert f"{summary['runs']['adamw']['lr']:g}" == best
    assert summary["runs"]["adamw"]["final_val_loss"] == tried[best]
    assert summary["runs"]["muon"]["lr"] == 0.05
    assert (out / "muon" / "metrics.jsonl").exists()
    report = (out / "report.md").read_text()
    assert (
        f"the best of a sweep over 3 LRs (final validation loss: {SWEEP_GRID['adamw'][0]:g} → "
        in report
    )
    assert "- **Muon**: lr 0.05 for the hidden matrices" in report
    assert "as given on the command line, one run, not swept" in report


def test_hf_config_without_transformers_says_how_to_install(monkeypatch):
    """--hf-config is an optional extra: without transformers the error says how to get it."""
    import sys

    from orthoptim.train.hf import hf_config

    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails, as if absent
    with pytest.raises(ValueError, match=r"pip install 'orthoptim\[hf\]'"):
        hf_config("llama", 64)
