"""Optimizer telemetry (`orthoptim.Telemetry`) against oracles that do not use it: every
parameter copied before the step and compared after (update and weight RMS), the LR scale
worked out from the shapes by hand, the momentum read from the optimizer's state, the
Newton-Schulz residual from a float64 SVD, and the single-process optimizer for the
layer-wise driver at 2 gloo ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch

from orthoptim import LayerwiseDistributedOptimizer, build_optimizer, newton_schulz
from orthoptim.optim.telemetry import CLASSES, param_class
from orthoptim.telemetry import Telemetry
from orthoptim.train.model import GPT, GPTConfig

from distributed import run_ranks

CFG = GPTConfig(n_layer=2, n_head=2, d_model=32, seq_len=16, vocab_size=64)
# the GPT's matrices by role, written out (not `param_class`): q, k, v, proj of attention;
# fc and proj of the MLP; the rest is the elementwise part
ROLES = {"attn.q.": "attn_q", "attn.k.": "attn_k", "attn.v.": "attn_v", "attn.proj.": "attn_o"}
ROLES |= {"mlp.fc.": "mlp", "mlp.proj.": "mlp"}
KW = dict(optimizer="muon", lr=0.02, adamw_lr=1e-3, weight_decay=0.1, adamw_weight_decay=0.1)


def role(name: str) -> str:
    return next((c for key, c in ROLES.items() if key in name), "elementwise")


def model_and_batch(seed: int = 0) -> tuple[GPT, torch.Tensor]:
    torch.manual_seed(seed)
    return GPT(CFG), torch.randint(0, CFG.vocab_size, (4, CFG.seq_len))


def backward(model: GPT, x: torch.Tensor) -> None:
    model(x, x).backward()


def recorded_step(model: GPT, x: torch.Tensor, telemetry: Telemetry) -> dict[str, torch.Tensor]:
    """A backward and a recorded step of the telemetry's optimizer: the parameters before it."""
    backward(model, x)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with telemetry.recording():
        telemetry.optimizer.step()
    return before


def rms(tensors: list[torch.Tensor]) -> float:
    total = sum(float(t.double().square().sum()) for t in tensors)
    return math.sqrt(total / sum(t.numel() for t in tensors))


def close(a: float, b: float, rel: float = 1e-5) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def test_the_classes_of_the_gpt_are_its_roles():
    model, _ = model_and_batch()
    for n, p in model.named_parameters():
        assert param_class(n, p.ndim) == role(n), n
    assert param_class("model.layers.0.self_attn.o_proj.weight", 2) == "attn_o"
    assert param_class("model.layers.0.mlp.gate.weight", 2) == "router"
    assert param_class("model.layers.0.mlp.experts.3.down_proj.weight", 2) == "experts"
    assert param_class("model.layers.0.mlp.gate_proj.weight", 2) == "mlp"
    assert param_class("transformer.h.0.attn.c_attn.weight", 2) == "attn_qkv"
    assert param_class("lm_head.weight", 2) == "elementwise"


def test_a_recorded_step_reports_what_a_copy_of_every_parameter_sees():
    """Two steps (the second recorded): per class the RMS of W_after − W_before and of
    W_after over every parameter of the class, the momentum RMS from the optimizer's state,
    the effective LR from Muon's keller scale √max(1, out/in) worked out from the shapes."""
    model, x = model_and_batch()
    opt = build_optimizer(model, **KW)
    telemetry = Telemetry(opt, model)
    assert telemetry.report() == {}
    backward(model, x)
    opt.step()
    opt.zero_grad()
    before = recorded_step(model, x, telemetry)
    got = telemetry.report()["classes"]
    params = dict(model.named_parameters())
    assert set(got) == {role(n) for n in params}
    for cls, figures in got.items():
        names = [n for n in params if role(n) == cls]
        update = rms([params[n].detach() - before[n] for n in names])
        weight = rms([params[n].detach() for n in names])
        assert close(figures["update_rms"], update), (cls, figures, update)
        assert close(figures["weight_rms"], weight)
        assert close(figures["ratio"], update / weight)
        assert figures["tensors"] == len(names)
        key = "exp_avg" if cls == "elementwise" else "momentum_buffer"
        assert close(figures["momentum_rms"], rms([opt.state[params[n]][key] for n in names]))
        if cls == "elementwise":
            assert close(figures["lr"], 1e-3)
        else:
            scales = [math.sqrt(max(1.0, params[n].shape[0] / params[n].shape[1])) for n in names]
            sizes = [params[n].numel() for n in names]
            lr = 0.02 * sum(s * k for s, k in zip(scales, sizes)) / sum(sizes)
            assert close(figures["lr"], lr), (cls, figures["lr"], lr)
    assert got["mlp"]["lr"] == pytest.approx(0.02 * 1.5)  # fc 4·d×d at ×2, proj d×4·d at ×1


def test_the_newton_schulz_residual_is_that_of_one_matrix_of_the_class_by_svd():
    """On the first step Nesterov's update is a multiple of the gradient, and Newton-Schulz
    normalises first, so the step orthogonalizes each gradient: the residual reported for a
    class is √mean(σᵢ² − 1)² of Newton-Schulz's output, by float64 SVD, for one matrix of
    the class, and far from it for an exact polar factor (σ = 1)."""
    model, x = model_and_batch(1)
    opt = build_optimizer(model, **KW)
    telemetry = Telemetry(opt, model)
    backward(model, x)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with telemetry.recording():
        opt.step()
    got = telemetry.report()["classes"]
    assert got["elementwise"]["ns_residual"] is None
    for cls in ("attn_q", "attn_k", "attn_v", "attn_o", "mlp"):
        candidates = []
        for n, g in grads.items():
            if role(n) != cls:
                continue
            o = newton_schulz(g, steps=5, coefficients="quintic", dtype=torch.float32)
            sigma = torch.linalg.svdvals(o.double())
            candidates.append(float((sigma.square() - 1).square().mean().sqrt()))
        residual = got[cls]["ns_residual"]
        assert any(close(residual, c, rel=1e-4) for c in candidates), (cls, residual, candidates)
        assert residual > 1e-3  # quintic Newton-Schulz leaves σ in about [0.7, 1.2]


def test_an_unrecorded_step_leaves_the_report_as_it_was():
    model, x = model_and_batch()
    opt = build_optimizer(model, **KW)
    telemetry = Telemetry(opt, model)
    backward(model, x)
    with telemetry.recording():
        opt.step()
    first = telemetry.report()
    opt.zero_grad()
    backward(model, x)
    with telemetry.recording(active=False):
        opt.step()
    assert telemetry.report() == first


def test_a_torch_optimizer_is_measured_from_outside():
    """torch's own AdamW over the whole model (no orthoptim step to record from within):
    its update per class, from copies taken around the step."""
    model, x = model_and_batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    telemetry = Telemetry(opt, model)
    before = recorded_step(model, x, telemetry)
    got = telemetry.report()["classes"]
    params = dict(model.named_parameters())
    names = [n for n in params if role(n) == "mlp"]
    update = rms([params[n].detach() - before[n] for n in names])
    assert close(got["mlp"]["update_rms"], update)
    assert got["mlp"]["ns_residual"] is None


def _layerwise_telemetry(rank: int, world_size: int) -> dict:
    """The layer-wise driver at `world_size` ranks, every rank on the same batch (so the
    averaged gradient is the single process's), its telemetry with a clock that advances
    rank + 1 per reading pair."""
    model, x = model_and_batch(2)
    opt = LayerwiseDistributedOptimizer(model, **KW)
    ticks = iter([0.0, rank + 1.0, 10.0, 10.0 + 2 * (rank + 1)])
    telemetry = Telemetry(opt, model, clock=lambda: next(ticks))
    reports = []
    for _ in range(2):
        backward(model, x)
        with telemetry.recording():
            opt.step()
        opt.wait_for_params()
        sent = float(opt.comm_stats()["total"]["sent"])
        reports.append((telemetry.report(), sent))
        opt.zero_grad()
    return {"reports": reports}


def _single_process_reports() -> list[dict]:
    model, x = model_and_batch(2)
    opt = build_optimizer(model, **KW)
    telemetry = Telemetry(opt, model)
    out = []
    for _ in range(2):
        backward(model, x)
        with telemetry.recording():
            opt.step()
        out.append(telemetry.report())
        opt.zero_grad()
    return out


def test_the_layerwise_driver_reports_the_single_process_figures_and_each_rank():
    """At 2 gloo ranks every rank reports the single-process optimizer's figures per class
    (each matrix counted on its owner, each AdamW element on one rank), the busiest and mean
    rank's time by the injected clock, and bytes: the max and mean of what each rank's
    `comm_stats()` says it sent."""
    ranks = run_ranks(_layerwise_telemetry, 2, timeout=120)
    reference = _single_process_reports()
    for step, ref in enumerate(reference):
        sent = [r["reports"][step][1] for r in ranks]
        for r in ranks:
            got, _ = r["reports"][step]
            assert got["ranks"] == 2
            assert set(got["classes"]) == set(ref["classes"])
            for cls, figures in ref["classes"].items():
                for key in ("update_rms", "weight_rms", "lr", "momentum_rms", "ns_residual"):
                    want, have = figures[key], got["classes"][cls][key]
                    assert (want is None) == (have is None), (cls, key)
                    if key == "ns_residual":
                        continue  # each rank samples the first matrix of a class it owns
                    assert want is None or close(have, want, rel=1e-4), (step, cls, key)
            assert got["opt_time_s"] == {"max": 2.0 * (step + 1), "mean": 1.5 * (step + 1)}
            assert got["comm_bytes"] == {"max": max(sent), "mean": sum(sent) / 2}
        assert min(sent) > 0


def _telemetry_run(tmp_path, log_every: int) -> list[dict]:
    from orthoptim.train.args import TrainArgs
    from orthoptim.train.launcher import launch

    out = tmp_path / "run"
    args = TrainArgs(
        optimizer="muon", config="tiny", steps=4, batch=2, eval_every=4, out=str(out),
        log_every=log_every, tensorboard=str(tmp_path / "tb"),
    )  # fmt: skip
    launch(args, nproc=1)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_tiny_run_logs_telemetry_rows_and_tensorboard_reads_them_back(tmp_path):
    """`orthoptim train --log-every 2 --tensorboard DIR`: the rows of steps 2 and 4 carry the
    telemetry (every class of the model, its documented fields), the others do not; the
    event file, read with TensorBoard's own reader, holds each figure at its step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = _telemetry_run(tmp_path, log_every=2)
    logged = {r["step"]: r["telemetry"] for r in rows if "telemetry" in r}
    assert sorted(logged) == [2, 4]
    fields = {"update_rms", "weight_rms", "ratio", "lr", "momentum_rms", "ns_residual", "tensors"}
    for telemetry in logged.values():
        assert set(telemetry["classes"]) == {"attn_q", "attn_k", "attn_v", "attn_o", "mlp",
                                             "elementwise"}  # fmt: skip
        assert all(set(c) == fields for c in telemetry["classes"].values())
        assert set(telemetry) == {"classes", "opt_time_s", "comm_bytes", "ranks"}
        assert set(telemetry["classes"]) <= set(CLASSES)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    for step, telemetry in logged.items():
        for cls, figures in telemetry["classes"].items():
            tag = f"telemetry/classes/{cls}/update_rms"
            assert tag in tags
            value = {e.step: e.value for e in events.Scalars(tag)}[step]
            assert value == pytest.approx(figures["update_rms"], rel=1e-6)
    loss = {e.step: e.value for e in events.Scalars("train_loss")}
    assert loss == {r["step"]: pytest.approx(r["train_loss"], rel=1e-6) for r in rows[1:]}


def test_log_every_zero_turns_telemetry_off(tmp_path):
    rows = _telemetry_run(tmp_path, log_every=0)
    assert len(rows) == 5 and not any("telemetry" in r for r in rows)


def _fsdp_report(rank: int, world_size: int) -> dict:
    """FSDP2 in float64 over the world, each rank on its share of the batch: the report of
    one recorded step (the second)."""
    from models import fsdp as FS
    from orthoptim import FSDPOptimizer

    model = FS.sharded_model(world_size, torch.float64)
    opt = FSDPOptimizer(model, bucket_mb=0.01, **FS.KW)
    telemetry = Telemetry(opt, model)
    per = FS.BATCH // world_size
    for step in range(2):
        x, y = FS.batch(step)
        FS.loss_fn(
            model, x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        ).backward()
        with telemetry.recording(step == 1):
            opt.step()
        opt.zero_grad()
    return telemetry.report()


def test_fsdp_reports_the_single_process_figures():
    """FSDPOptimizer at 2 gloo ranks (each rank steps its rows of every matrix; the owner
    orthogonalizes the whole): per class the single-process optimizer's update and weight
    RMS, effective LR (from the whole matrix's shape, not the shard's) and momentum RMS."""
    from models import fsdp as FS

    ranks = run_ranks(_fsdp_report, 2, timeout=120)
    model = FS.make_model(torch.float64)
    opt = build_optimizer(model, **FS.KW)
    telemetry = Telemetry(opt, model)
    for step in range(2):
        FS.loss_fn(model, *FS.batch(step)).backward()
        with telemetry.recording(step == 1):
            opt.step()
        opt.zero_grad()
    want = telemetry.report()["classes"]
    for got in ranks:
        assert set(got["classes"]) == set(want)
        for cls, figures in want.items():
            for key in ("update_rms", "weight_rms", "lr", "momentum_rms"):
                assert close(got["classes"][cls][key], figures[key], rel=1e-5), (cls, key)
            assert (got["classes"][cls]["ns_residual"] is None) == (figures["ns_residual"] is None)
