"""orthoptim's layer-wise optimizer inside Lightning (`orthoptim.integrations.lightning`).

One spawn of 2 real gloo ranks runs the legs in process, each a real `lightning.Trainer` over
the tiny GPT-2 of `integration_models`: 20 optimizer steps (2 epochs of 10), gradient
accumulation 2, `gradient_clip_val` small enough to clip every step:
- replicated: `build_optimizer(model, optimizer="muon")` under `strategy="ddp"`: the oracle;
- layer-wise: `LayerwiseDistributedOptimizer` under `LayerwiseStrategy()`, a checkpoint at
  steps 10 and 20 (`every_n_train_steps`: a checkpoint written at the end of an epoch,
  `every_n_epochs`, resumes here with accumulation 2 after one micro-batch, a Lightning
  behaviour of any optimizer);
- resumed: the same under `strategy="layerwise"`, `fit(ckpt_path=<the step-10 checkpoint>)`.
The layer-wise losses at every step equal the replicated ones within `RTOL`, the resumed run's
the uninterrupted one's, and the final weights those of the replicated run.
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

pytest.importorskip("lightning", reason="the Lightning integration needs the [lightning] extra")
pytest.importorskip("transformers", reason="its test model is transformers' GPT-2 ([hf] extra)")

EPOCHS = STEPS // SAVE_AT


def _module(kind: str):
    import lightning

    import orthoptim

    class LM(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = gpt2()
            self.losses: list[float] = []
            self.norms: list[float] = []

        def training_step(self, x: torch.Tensor, i: int) -> torch.Tensor:
            loss = self.model(input_ids=x, labels=x).loss
            self.losses.append(loss.item())
            return loss

        def on_before_optimizer_step(self, optimizer) -> None:
            if kind == "replicated":  # DDP's reduced gradients, before clipping
                grads = [p.grad for p in self.parameters() if p.grad is not None]
                self.norms.append(torch.nn.utils.get_total_norm(grads).item())

        def configure_optimizers(self):
            if kind == "replicated":
                return orthoptim.build_optimizer(self, optimizer="muon", lr=LR)
            opt = orthoptim.LayerwiseDistributedOptimizer(self, optimizer="muon", lr=LR)
            clip = opt.clip_grad_norm_

            def recorded(*args, **kw):  # what the strategy's clipping calls, and its norm
                norm = clip(*args, **kw)
                self.norms.append(float(norm))
                return norm

            opt.clip_grad_norm_ = recorded
            return opt

        def train_dataloader(self):
            data = byte_data(n=len(byte_data()) // EPOCHS)  # one epoch: SAVE_AT steps
            return torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)

    return LM()


def _fit(
    kind: str, strategy, root: Path | None = None, ckpt: Path | None = None, **trainer_kw
) -> dict:
    """One `Trainer.fit`: its per-step losses (mean over micro-batches and ranks), pre-clip
    gradient norms and final weights. `root`: checkpoint there every
    SAVE_AT steps; `ckpt`: resume from that file."""
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    callbacks = []
    if root is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=root, every_n_train_steps=SAVE_AT, save_top_k=-1, filename="{step}"
            )
        )
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, max_steps=STEPS,
        max_epochs=EPOCHS, accumulate_grad_batches=ACCUM, gradient_clip_val=MAX_NORM,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=root is not None, callbacks=callbacks, num_sanity_val_steps=0,
        **trainer_kw,
    )  # fmt: skip
    module = _module(kind)
    trainer.fit(module, ckpt_path=None if ckpt is None else str(ckpt))
    losses = torch.tensor(module.losses).view(-1, ACCUM).mean(1)
    torch.distributed.all_reduce(losses)
    return {
        "losses": (losses / 2).tolist(),
        "norms": module.norms,
        "params": {k: v.clone() for k, v in module.model.state_dict().items()},
    }


def _legs(rank: int, world_size: int, base: str) -> dict:
    set_rank_env(rank, world_size)
    from orthoptim.integrations.lightning import LayerwiseStrategy

    root = Path(base)
    out = {
        "replicated": _fit("replicated", "ddp"),
        "layerwise": _fit("layerwise", LayerwiseStrategy(), root=root),
        "resumed": _fit("layerwise", "layerwise", ckpt=root / f"step={SAVE_AT}.ckpt"),
    }
    try:
        _fit("layerwise", "ddp")
    except RuntimeError as exc:
        out["plain ddp"] = str(exc)
    refusals = {
        "replicated optimizer": dict(kind="replicated"),
        "value clipping": dict(kind="layerwise", gradient_clip_algorithm="value"),
    }
    for what, kw in refusals.items():
        try:
            _fit(strategy=LayerwiseStrategy(), **kw)
        except ValueError as exc:
            out[what] = str(exc)
    return out


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    return run_ranks(_legs, 2, args=(str(tmp_path_factory.mktemp("lightning")),))


def test_lightning_layerwise_equals_replicated(legs):
    r0, r1 = legs
    init = gpt2().state_dict()
    want = r0["replicated"]
    assert all(n > MAX_NORM for n in want["norms"]), want["norms"]  # every step clipped
    assert want["losses"][-1] < want["losses"][0] - 0.3, want["losses"]  # it trains
    for r in (r0, r1):
        got = r["layerwise"]["losses"]
        assert_losses_close(got, want["losses"], "layer-wise against replicated")
        assert_losses_close(r["layerwise"]["norms"], want["norms"], "opt.clip_grad_norm_ norms")
        assert_losses_close(
            [*got[:SAVE_AT], *r["resumed"]["losses"]], got, "resumed against uninterrupted"
        )
        assert_state_close(r["layerwise"]["params"], want["params"], "layer-wise model", init)
        assert_state_close(r["resumed"]["params"], r["layerwise"]["params"], "resumed model")
        # what the strategy cannot do right is refused, naming the fix
        assert 'strategy="ddp"' in r["replicated optimizer"]
        assert "gradient_clip_algorithm='norm'" in r["value clipping"]


def test_lightning_plain_ddp_strategy_with_the_layerwise_optimizer_is_refused(legs):
    """Under plain `strategy="ddp"` Lightning would clip torch's way over
    `precision_plugin.main_params(optimizer)`, the parameters of `optimizer.param_groups`: for
    the layer-wise optimizer only what each rank owns, so every rank would clip by another,
    wrong norm. The optimizer notices Lightning's DDP wrap and refuses, naming the strategy."""
    for r in legs:
        assert "LayerwiseStrategy" in r.get("plain ddp", ""), r.get("plain ddp")
