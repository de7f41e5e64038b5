"""Where `orthoptim train` / `compare` ranks run and in what precision: the rank plan (with a
made-up GPU count), --precision (bf16 autocast really applied), --compile (compiled blocks
follow eager ones, also under the layer-wise optimizer's forward pre-hooks), the GPU-sized
`base` config (built on the meta device), compare's device defaults, and the loop's own
collectives on a CUDA-only backend."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from orthoptim.cli import main
from orthoptim.train import devices
from orthoptim.train.args import TrainArgs
from orthoptim.train.compare import CompareArgs, device_defaults
from orthoptim.train.devices import RankPlan, plan_ranks, resolve_param_dtype, resolve_precision
from orthoptim.train.model import CONFIGS, GPT, GPTConfig, compile_blocks

from distributed import run_ranks

# ---------------------------------------------------------------- rank plan


def test_plan_ranks_cpu_gpus_and_shared_gpu():
    # CPU: gloo, 2 ranks by default, any number allowed.
    assert plan_ranks(None, 0) == RankPlan(2, "gloo", "cpu")
    assert plan_ranks(5, 0).nproc == 5
    assert plan_ranks(3, 0).device(2) == torch.device("cpu")
    # CUDA: one NCCL rank per GPU by default, rank r on cuda:r.
    plan = plan_ranks(None, 4)
    assert plan == RankPlan(4, "nccl", "cuda")
    assert [plan.device(r) for r in range(4)] == [torch.device("cuda", r) for r in range(4)]
    assert plan_ranks(2, 8).nproc == 2
    # Shared GPU: every rank on cuda:0 over cuda:gloo, 2 ranks by default, beyond the GPUs.
    shared = plan_ranks(None, 1, shared_gpu=True)
    assert shared == RankPlan(2, "cuda:gloo", "cuda", shared_gpu=True)
    assert plan_ranks(4, 1, True).device(3) == torch.device("cuda", 0)


def test_plan_ranks_refuses_with_the_flag_the_count_and_the_fix():
    with pytest.raises(ValueError) as e:
        plan_ranks(2, 1)
    msg = str(e.value)
    assert "--nproc 2" in msg and "only 1 GPU is visible" in msg
    assert "--nproc 1 or fewer" in msg and "--shared-gpu" in msg
    with pytest.raises(ValueError, match="only 4 GPUs are visible.*--nproc 4 or fewer"):
        plan_ranks(8, 4)
    with pytest.raises(ValueError, match="--shared-gpu .* no CUDA GPU is visible"):
        plan_ranks(2, 0, shared_gpu=True)
    with pytest.raises(ValueError, match="--nproc must be >= 1, got 0"):
        plan_ranks(0, 0)


def test_cli_refuses_more_ranks_than_gpus_before_launching(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(devices, "visible_gpus", lambda: 1)
    launched = []
    monkeypatch.setattr("orthoptim.train.launcher.run", lambda args: launched.append(args))
    out = tmp_path / "run"
    assert main(["train", "--nproc", "2", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--nproc 2" in err and "only 1 GPU is visible" in err and "--shared-gpu" in err
    assert main(["compare", "--nproc", "3", "--out", str(out), "--no-progress"]) == 2
    assert "--nproc 3" in capsys.readouterr().err
    assert not launched and not out.exists()


def test_cli_nproc_defaults_to_the_gpu_count(tmp_path, monkeypatch):
    """With 3 (made-up) GPUs `orthoptim train` asks the elastic launcher for 3 ranks."""
    import torch.distributed.launcher.api as launcher

    seen = {}

    def fake_launch(config, entry):
        seen["nproc"] = config.nproc_per_node
        return lambda args: {0: dict(last_step=0, final_val_loss=None)}

    monkeypatch.setattr(devices, "visible_gpus", lambda: 3)
    monkeypatch.setattr(launcher, "elastic_launch", fake_launch)
    assert main(["train", "--out", str(tmp_path), "--no-progress"]) == 0
    assert seen["nproc"] == 3


# ---------------------------------------------------------------- precision


def test_precision_resolution_and_validation(tmp_path, capsys):
    assert resolve_precision("auto", "cuda") == "bf16"
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"  # allowed on CPU, only slow
    assert resolve_precision("fp32", "cuda") == "fp32"
    with pytest.raises(ValueError, match=r"--precision must be one of .*got 'fp16'"):
        resolve_precision("fp16", "cuda")
    with pytest.raises(ValueError, match=r"--precision must be one of .*got 'half'"):
        TrainArgs(precision="half").validate()
    with pytest.raises(SystemExit):
        main(["train", "--precision", "fp16", "--out", str(tmp_path)])
    assert "--precision: invalid choice: 'fp16'" in capsys.readouterr().err
    # --compile is not wired with FSDP2 or tensor parallelism: refused by name.
    with pytest.raises(ValueError, match="--compile with --fsdp"):
        TrainArgs(compile=True, fsdp=True).validate()
    with pytest.raises(ValueError, match="--compile with --tp 2"):
        TrainArgs(compile=True, tp=2).validate()


@pytest.mark.parametrize("cuda", [True, False])
def test_param_dtype_defaults_to_bf16_on_cuda_fp32_on_cpu(cuda, monkeypatch):
    """`orthoptim train` without --param-dtype: auto, which each rank reads on the device the
    rank plan gives it (as `_init_distributed` and `build_run` do): bf16 on CUDA, fp32 on
    CPU; a flag given wins on either."""
    from orthoptim.cli import build_parser
    from orthoptim.train.cli import train_args_from

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)
    device = plan_ranks(None, devices.visible_gpus()).device_type
    assert device == ("cuda" if cuda else "cpu")
    parse = build_parser().parse_args
    args = train_args_from(parse(["train"]))
    assert args.param_dtype == "auto"
    assert args.param_dtype_on(device) == ("bf16" if cuda else "fp32")
    for flag in ("bf16", "fp32"):
        args = train_args_from(parse(["train", "--param-dtype", flag]))
        assert args.param_dtype_on(device) == flag


def test_param_dtype_validation_and_fsdp_on_one_rank(tmp_path, capsys):
    assert resolve_param_dtype("auto", "cuda") == "bf16"
    assert resolve_param_dtype("auto", "cpu") == "fp32"
    with pytest.raises(ValueError, match=r"--param-dtype must be one of .*got 'fp16'"):
        resolve_param_dtype("fp16", "cpu")
    with pytest.raises(ValueError, match=r"--param-dtype must be one of .*got 'half'"):
        TrainArgs(param_dtype="half").validate()  # type: ignore[arg-type]
    with pytest.raises(SystemExit):
        main(["train", "--param-dtype", "fp16", "--out", str(tmp_path)])
    assert "--param-dtype: invalid choice: 'fp16'" in capsys.readouterr().err
    # FSDP2's mixed precision comes with its sharding: one rank is refused, naming the fix.
    with pytest.raises(ValueError, match="--fsdp with --param-dtype bf16 needs --nproc 2"):
        TrainArgs(fsdp=True, param_dtype="bf16").check_nproc(1, "cpu")
    with pytest.raises(ValueError, match=r"bf16 \(the default on CUDA\) needs --nproc 2"):
        TrainArgs(fsdp=True).check_nproc(1, "cuda")
    TrainArgs(fsdp=True).check_nproc(1, "cpu")  # auto: fp32 on CPU
    TrainArgs(fsdp=True, param_dtype="bf16").check_nproc(2, "cpu")
    argv = ["train", "--fsdp", "--nproc", "1", "--param-dtype", "bf16", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "--param-dtype fp32" in capsys.readouterr().err


def test_layerwise_optimizer_gets_param_dtype_only_for_bf16(monkeypatch):
    """Without --fsdp, bf16 parameters are the layer-wise optimizer's (`param_dtype=`), on one
    rank too; fp32 runs build what they always built (no keyword; `build_optimizer` on one
    rank). A stand-in records the call: the keyword's implementation is the optimizer's."""
    from orthoptim.train import loop

    calls = []
    monkeypatch.setattr(
        loop, "LayerwiseDistributedOptimizer", lambda model, **kw: calls.append(kw) or "lw"
    )
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16))
    args = TrainArgs()
    assert loop.make_optimizer(model, args, 2, param_dtype="bf16") == "lw"
    assert loop.make_optimizer(model, args, 1, param_dtype="bf16") == "lw"
    assert [c["param_dtype"] for c in calls] == [torch.bfloat16] * 2
    assert loop.make_optimizer(model, args, 2, param_dtype="fp32") == "lw"
    assert "param_dtype" not in calls[-1]
    one = loop.make_optimizer(model, args, 1, param_dtype="fp32")
    assert type(one).__name__ != "str" and len(calls) == 3
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bf16_autocast_keeps_fp32_parameters_and_gradients():
    model = GPT(GPTConfig(n_layer=1, n_head=2, d_model=32, seq_len=16))
    seen = {}
    model.blocks[0].attn.q.register_forward_hook(lambda m, i, o: seen.update(q=o.dtype))
    idx = torch.randint(0, 256, (2, 16))
    with devices.autocast(idx.device, "bf16"):
        logits = model(idx)
        loss = model(idx, idx)
    assert seen["q"] == logits.dtype == torch.bfloat16
    assert loss.dtype == torch.float32  # the loss is taken in fp32
    loss.backward()
    assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    with devices.autocast(idx.device, "fp32"):
        assert model(idx).dtype == torch.float32


# ---------------------------------------------------------------- compile


def _compiled_next_to_eager(rank, world_size):
    """Rank 0 runs compiled blocks, rank 1 eager ones, on the same batches and (through the
    layer-wise optimizer's parameter gathers) the same parameters. Small buckets give the
    blocks' submodules forward pre-hooks with gathers of their own to wait for."""
    from torch._dynamo.utils import counters

    from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer

    torch.manual_seed(0)
    model = GPT(CONFIGS["tiny"])
    opt = LayerwiseDistributedOptimizer(
        model, optimizer="muon", lr=0.05, adamw_lr=3e-3, bucket_mb=0.05
    )
    params = [id(p) for p in model.parameters()]
    if rank == 0:
        compile_blocks(model)
    assert [id(p) for p in model.parameters()] == params  # the optimizer's own parameters
    g = torch.Generator().manual_seed(1)  # same batches on both ranks
    losses = []
    for _ in range(3):
        x, y = torch.randint(0, 256, (2, 2, CONFIGS["tiny"].seq_len), generator=g)
        if rank == 0:
            opt.wait_for_params()  # what the training loop does under --compile
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    opt.wait_for_params()
    model.eval()
    with torch.no_grad():
        losses.append(model(x, y).item())
    return dict(
        losses=losses,
        graphs=counters["stats"]["unique_graphs"],
        breaks=sum(counters["graph_break"].values()),
        checksum=sum(p.double().sum().item() for p in model.parameters()),
    )


def test_compiled_blocks_follow_eager_under_layerwise_hooks():
    """Compiled and eager forwards differ only by fused-kernel rounding (fp32, ~1e-7 relative
    per op through 4 blocks): losses agree to 1e-5 relative, step after step, since both
    ranks always start from the same gathered parameters. The compiled rank traces one graph
    per mode (train, eval) and no graph breaks: the explicit wait leaves the hooks idle."""
    compiled, eager = run_ranks(_compiled_next_to_eager, 2)
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert compiled["checksum"] == eager["checksum"]  # replicas stay equal
    assert compiled["graphs"] == 2 and compiled["breaks"] == 0, compiled
    assert eager["graphs"] == 0


def _run(out: Path, *extra: str) -> list[dict]:
    argv = ["train", "--nproc", "1", "--config", "tiny", "--steps", "2", "--batch", "2",
            "--eval-every", "2", "--eval-batches", "1", "--warmup", "1", "--out", str(out),
            "--no-progress", *extra]  # fmt: skip
    assert main(argv) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_bf16_against_fp32_and_compile_flag(tmp_path, monkeypatch):
    """One rank: --precision auto is fp32 on CPU; bf16 autocast changes the losses at the
    same parameters (initial validation loss, first training loss; fp32 runs are bitwise
    repeatable here, so any difference is the autocast) but by little (bf16 keeps 8 mantissa
    bits, ~0.4 % per rounding, and the mean over 256 tokens averages it out: < 0.02 nats).
    The bf16 run also passes --compile with `compile_blocks` replaced by a spy: compiled
    numerics are checked above, here only that the flag reaches the model."""
    compiled = []
    monkeypatch.setattr("orthoptim.train.loop.compile_blocks", compiled.append)
    ref = _run(tmp_path / "fp32", "--stop-after", "1")
    assert not compiled
    bf16 = _run(tmp_path / "bf16", "--precision", "bf16", "--compile")
    assert len(compiled) == 1 and isinstance(compiled[0], GPT)
    assert {r["precision"] for r in ref} == {"fp32"} and {r["precision"] for r in bf16} == {"bf16"}
    for a, b, key in ((ref[0], bf16[0], "val_loss"), (ref[1], bf16[1], "train_loss")):
        assert a[key] != b[key] and abs(a[key] - b[key]) < 0.02, (key, a, b)
    result = json.loads((tmp_path / "bf16" / "result.json").read_text())
    assert result["precision"] == "bf16" and result["args"]["precision"] == "bf16"
    assert result["compiled"]
    # Resuming in another precision is allowed (the checkpoint is fp32 either way); each
    # step's row says which precision it ran in.
    ckpt = json.loads((tmp_path / "fp32" / "checkpoints" / "latest.json").read_text())
    assert ckpt["precision"] == "fp32"
    rows = _run(tmp_path / "fp32", "--resume", "--precision", "bf16")
    assert [r["precision"] for r in rows] == ["fp32", "fp32", "bf16"]
    assert not json.loads((tmp_path / "fp32" / "result.json").read_text())["compiled"]


# ---------------------------------------------------------------- configs and defaults


def test_base_config_is_gpt2_small_sized():
    cfg = CONFIGS["base"]
    with torch.device("meta"):
        model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    d, layers, vocab = cfg.d_model, cfg.n_layer, cfg.vocab_size
    per_block = 4 * d * d + 2 * 4 * d * d + 2 * d  # attention, MLP, two norm gains
    assert n == layers * per_block + 2 * vocab * d + d == 126_374_912
    assert (cfg.seq_len, cfg.head_dim) == (1024, 64)


def test_compare_defaults_follow_the_device():
    assert device_defaults("cpu") == dict(config="tiny", batch=64, steps=100, eval_every=10)
    gpu = device_defaults("cuda")
    assert gpu["config"] == "base" and 16 <= gpu["batch"] <= 32
    cpu = CompareArgs().resolve(gpus=0)
    assert (cpu.nproc, cpu.config, cpu.batch, cpu.steps) == (2, "tiny", 64, 100)
    h200 = CompareArgs().resolve(gpus=1)
    assert (h200.nproc, h200.config, h200.batch) == (1, "base", gpu["batch"])
    assert CompareArgs().resolve(gpus=8).nproc == 8
    mine = CompareArgs(nproc=1, steps=7, config="tiny").resolve(gpus=1)
    assert (mine.steps, mine.config, mine.batch) == (7, "tiny", gpu["batch"])
    assert CompareArgs(shared_gpu=True).resolve(gpus=1).nproc == 2
    with pytest.raises(ValueError, match="--nproc 2 .* only 1 GPU"):
        CompareArgs(nproc=2).resolve(gpus=1)


# ---------------------------------------------------------------- collectives


def test_train_issues_no_collective_past_parallel_collectives():
    """Every collective in train/ goes through `orthoptim.collectives`."""
    import orthoptim.train as train

    direct = re.compile(r"\bdist\.(barrier|all_reduce|all_gather\w*|broadcast\w*|reduce\w*)\(")
    for path in Path(train.__file__).parent.glob("*.py"):
        assert not direct.findall(path.read_text()), path.name


def _loop_collectives(rank, world_size):
    """Under "cuda:gloo" (CUDA tensors only, as under NCCL) on a machine without a GPU, the
    loop's collectives (`sum_floats`, `gather_floats`, `barrier`) must make their tensors for
    CUDA (which fails here: no CUDA), never hand the backend a CPU tensor (refused by
    `collectives` as a CollectiveDeviceError)."""
    from orthoptim import collectives

    calls = {
        "sum": lambda: collectives.sum_floats([1.0, 2.0]),
        "gather": lambda: collectives.gather_floats([1.0]),
        "barrier": collectives.barrier,
    }
    outcome = {}
    for name, call in calls.items():
        try:
            call()
            outcome[name] = "ok"
        except collectives.CollectiveDeviceError as exc:
            outcome[name] = f"handed the backend a wrong-device tensor: {exc}"
        except (RuntimeError, AssertionError) as exc:  # torch: no CUDA on this machine
            outcome[name] = "cuda" if "cuda" in str(exc).lower() else str(exc)
    return outcome


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CUDA placement without a GPU")
def test_loop_collectives_use_the_backends_device():
    for outcome in run_ranks(_loop_collectives, 2, backend="cuda:gloo"):
        assert outcome == {"sum": "cuda", "gather": "cuda", "barrier": "cuda"}, outcome
