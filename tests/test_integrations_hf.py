"""orthoptim inside Hugging Face `transformers.Trainer` (`orthoptim.integrations.hf`).

One spawn of 2 real gloo ranks runs every leg in process, each a real Trainer (accelerate
wraps the model in DDP) over the tiny GPT-2 of `integration_models` for 20 optimizer steps,
gradient accumulation 2, `max_grad_norm` small enough to clip every step, a checkpoint at steps
10 and 20:
- replicated: `build_optimizer(model, optimizer="muon")` through the `optimizer_cls_and_kwargs`
  factory recipe: the oracle;
- layer-wise: `LayerwiseDistributedOptimizer` through `optimizers=(opt, None)` with
  `LayerwiseCheckpointCallback`, then `save_model()`;
- resumed: the layer-wise optimizer through the factory recipe, resumed from the layer-wise
  leg's step-10 checkpoint.
The layer-wise losses at every step equal the replicated ones within `RTOL`, the resumed run's
equal the uninterrupted one's, and the saved model holds the replicated run's trained weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from integration_models import (
    ACCUM,
    BATCH,
    LR,
    MAX_NORM,
    SAVE_AT,
    STEPS,
    assert_losses_close,
    assert_state_close,
    byte_data,
    gpt2,
    set_rank_env,
)

from distributed import run_ranks

pytest.importorskip("transformers", reason="the HF Trainer integration needs the [hf] extra")


class _Bytes(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.data = byte_data()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def _args(out: Path, **overrides):
    from transformers import TrainingArguments

    kw = dict(
        output_dir=str(out), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=BATCH,
        gradient_accumulation_steps=ACCUM, max_grad_norm=MAX_NORM, learning_rate=LR,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="steps", save_steps=SAVE_AT,
        report_to=[], disable_tqdm=True, dataloader_num_workers=0, seed=0, data_seed=0,
        ddp_find_unused_parameters=False,
    )  # fmt: skip
    return TrainingArguments(**{**kw, **overrides})


def _losses(trainer) -> tuple[list[float], list[float]]:
    rows = [r for r in trainer.state.log_history if "loss" in r]
    return [r["loss"] for r in rows], [r["grad_norm"] for r in rows]


def _legs(rank: int, world_size: int, base: str) -> dict:
    set_rank_env(rank, world_size)
    from transformers import Trainer

    import orthoptim
    from orthoptim.integrations.hf import LayerwiseCheckpointCallback, optimizer_cls_and_kwargs

    root = Path(base)
    out: dict = {}

    # replicated, the factory recipe
    model = gpt2()
    trainer = Trainer(
        model, _args(root / "replicated"), train_dataset=_Bytes(),
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs("replicated", optimizer="muon", lr=LR),
    )  # fmt: skip
    trainer.train()
    out["replicated"] = _losses(trainer)
    out["replicated_params"] = {k: v.clone() for k, v in model.state_dict().items()}

    # layer-wise, an optimizer built by hand (after TrainingArguments: it starts the group)
    args = _args(root / "layerwise")
    model = gpt2()
    opt = orthoptim.LayerwiseDistributedOptimizer(model, optimizer="muon", lr=LR)
    trainer = Trainer(
        model, args, train_dataset=_Bytes(), optimizers=(opt, None),
        callbacks=[LayerwiseCheckpointCallback()],
    )  # fmt: skip
    try:
        trainer.train()
    except RuntimeError as exc:
        assert "arrived twice before step()" in str(exc)  # this defect, not another error
        raise
    trainer.save_model()
    out["layerwise"] = _losses(trainer)
    out["layerwise_params"] = {k: v.clone() for k, v in model.state_dict().items()}
    out["owned"] = sorted(n for n, r in opt.owner_of.items() if r == rank)

    # layer-wise through the factory recipe, resumed from the step-10 checkpoint
    model = gpt2()
    trainer = Trainer(
        model, _args(root / "resumed"), train_dataset=_Bytes(),
        optimizer_cls_and_kwargs=optimizer_cls_and_kwargs("layerwise", optimizer="muon", lr=LR),
        callbacks=[LayerwiseCheckpointCallback()],
    )  # fmt: skip
    trainer.train(resume_from_checkpoint=str(root / "layerwise" / f"checkpoint-{SAVE_AT}"))
    out["resumed"] = _losses(trainer)
    out["resumed_params"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def test_trainer_layerwise_equals_replicated(tmp_path):
    from safetensors.torch import load_file

    r0, r1 = run_ranks(_legs, 2, args=(str(tmp_path),))
    want, norms = r0["replicated"]
    assert all(n > MAX_NORM for n in norms), norms  # every step clipped
    assert want[-1] < want[0] - 0.3, want  # it trains
    for r in (r0, r1):
        assert_losses_close(r["layerwise"][0], want, "layer-wise against replicated")
        assert_losses_close(r["layerwise"][1], norms, "layer-wise gradient norms")
        assert_losses_close(r["resumed"][0], r["layerwise"][0], "resumed against uninterrupted")
        assert_state_close(r["layerwise_params"], r0["replicated_params"], "layer-wise model")
        assert_state_close(r["resumed_params"], r0["layerwise_params"], "resumed model")
    # both ranks own something: the parameters they do not own came through the gathers
    assert r0["owned"] and r1["owned"]
    # rank 0 alone wrote the optimizer's full state at each checkpoint
    for step in (SAVE_AT, STEPS):
        saved = torch.load(
            tmp_path / "layerwise" / f"checkpoint-{step}" / "optimizer.pt", weights_only=True
        )
        assert len(saved["state"]) == len(r0["replicated_params"]) - 1  # lm_head is wte
    # save_model() after train() wrote the trained weights (the tied head is left out)
    written = load_file(tmp_path / "layerwise" / "model.safetensors")
    assert written.keys() == r0["replicated_params"].keys() - {"lm_head.weight"}
    assert_state_close(
        written, {k: r0["replicated_params"][k] for k in written}, "save_model() file"
    )


def test_unknown_kind_is_refused():
    from orthoptim.integrations.hf import optimizer_cls_and_kwargs

    with pytest.raises(ValueError, match="kind must be one of"):
        optimizer_cls_and_kwargs("zero")  # type: ignore[arg-type]


def test_trainer_single_process_accumulation_with_the_layerwise_optimizer(tmp_path):
    """On one process (no DDP wrap; accelerate's no_sync a no-op) Trainer's accumulation
    backwards twice before each step: the layer-wise optimizer, with nothing to reduce,
    trains as the replicated one, losses and weights bit for bit."""
    from transformers import Trainer

    import orthoptim
    from orthoptim.integrations.hf import LayerwiseCheckpointCallback

    runs = {}
    for kind in ("replicated", "layerwise"):
        model = gpt2()
        if kind == "layerwise":
            opt = orthoptim.LayerwiseDistributedOptimizer(model, optimizer="muon", lr=LR)
        else:
            opt = orthoptim.build_optimizer(model, optimizer="muon", lr=LR)
        trainer = Trainer(
            model, _args(tmp_path / kind, max_steps=3, save_strategy="no"),
            train_dataset=_Bytes(), optimizers=(opt, None),
            callbacks=[LayerwiseCheckpointCallback()],
        )  # fmt: skip
        trainer.train()
        runs[kind] = (_losses(trainer), model.state_dict())
    assert runs["layerwise"][0] == runs["replicated"][0]
    for k, v in runs["replicated"][1].items():
        assert torch.equal(runs["layerwise"][1][k], v), k
