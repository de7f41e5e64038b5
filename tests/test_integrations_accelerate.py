"""orthoptim inside Hugging Face accelerate: the documented loop, with no glue module.

`accelerator.prepare(model, opt, loader)` wraps the model in DDP, whose all-reduced gradients
the layer-wise optimizer takes as they are; `accelerator.accumulate` (DDP's `no_sync`),
`accelerator.clip_grad_norm_(model.parameters(), ...)` (torch's, over gradients every rank
holds whole) and `save_state` / `load_state` (safetensors, their default; every rank calls the
optimizer's `state_dict()` and `load_state_dict()`) then work as for any optimizer.

One spawn of 2 real gloo ranks runs the legs in process over the tiny GPT-2 of
`integration_models`, 20 optimizer steps, accumulation 2, clipping every step: replicated
(`build_optimizer(model, optimizer="muon")`, the oracle), layer-wise with `save_state` at step
10, and layer-wise resumed from that state. Losses at every step equal within `RTOL`.
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
    assert_losses_close,
    assert_state_close,
    byte_data,
    gpt2,
    set_rank_env,
)

from distributed import run_ranks

pytest.importorskip("accelerate", reason="the accelerate integration needs the [accelerate] extra")
pytest.importorskip("transformers", reason="its test model is transformers' GPT-2 ([hf] extra)")


def _train(
    kind: str, save_to: Path | None = None, resume_from: Path | None = None
) -> tuple[list, list, dict]:
    """One run of accelerate's documented loop: (losses, gradient norms, final model state).
    `kind` is "replicated" or "layerwise"; `save_to`: `save_state` there at step SAVE_AT
    and `save_model` at the end; `resume_from`: `load_state` from there and run the steps
    after SAVE_AT."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import orthoptim

    AcceleratorState._reset_state(reset_partial_state=False)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = gpt2()
    if kind == "replicated":
        opt = orthoptim.build_optimizer(model, optimizer="muon", lr=LR)
    else:
        opt = orthoptim.LayerwiseDistributedOptimizer(model, optimizer="muon", lr=LR)
    loader = torch.utils.data.DataLoader(byte_data(), batch_size=BATCH, shuffle=False)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    step, losses, norms, total = 0, [], [], 0.0
    if resume_from is not None:
        accelerator.load_state(str(resume_from / "state"))
        loader = accelerator.skip_first_batches(loader, SAVE_AT * ACCUM)
        step = SAVE_AT
    for x in loader:
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norms.append(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            opt.step()
            opt.zero_grad()
        total += accelerator.gather(loss.detach()).mean().item() / ACCUM
        if accelerator.sync_gradients:
            step += 1
            losses.append(total)
            total = 0.0
            if step == SAVE_AT and save_to is not None:
                accelerator.save_state(str(save_to / "state"))  # safetensors
    state = {k: v.clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    if save_to is not None:  # the trained model, as a torch file and as safetensors
        accelerator.save_model(model, str(save_to / "bin"), safe_serialization=False)
        accelerator.save_model(model, str(save_to / "safetensors"))
    return losses, norms, state


KIND = "layerwise"


def _legs(rank: int, world_size: int, base: str) -> dict:
    set_rank_env(rank, world_size)
    ckpt = Path(base)
    return {
        "replicated": _train("replicated"),
        "layerwise": _train(KIND, save_to=ckpt),
        "resumed": _train(KIND, resume_from=ckpt),
    }


@pytest.fixture(scope="module")
def legs(tmp_path_factory):
    base = tmp_path_factory.mktemp("accelerate")
    return base, run_ranks(_legs, 2, args=(str(base),))


def test_accelerate_layerwise_equals_replicated(legs):
    base, (r0, r1) = legs
    want, norms, params = r0["replicated"]
    assert all(n > MAX_NORM for n in norms), norms  # every step clipped
    assert want[-1] < want[0] - 0.3, want  # it trains
    for r in (r0, r1):
        losses, got_norms, got_params = r["layerwise"]
        assert_losses_close(losses, want, "layer-wise against replicated")
        assert_losses_close(got_norms, norms, "layer-wise gradient norms")
        assert_state_close(got_params, params, "layer-wise model")
        resumed, _, resumed_params = r["resumed"]
        assert_losses_close([*losses[:SAVE_AT], *resumed], losses, "resumed against uninterrupted")
        assert_state_close(resumed_params, got_params, "resumed model")
    # save_model(safe_serialization=False) wrote the trained weights (the tied head too)
    written = torch.load(base / "bin" / "pytorch_model.bin", weights_only=True)
    assert_state_close(written, params, "save_model() file")


def test_accelerate_safetensors_save_of_the_layerwise_model(legs):
    """save_model's default (safetensors) writes every tensor of the layer-wise model, whose
    parameters are views of flat buffers, less the tied head, as for any GPT-2."""
    from safetensors.torch import load_file

    base, (r0, _) = legs
    written = load_file(base / "safetensors" / "model.safetensors")
    params = r0["replicated"][2]
    assert written.keys() == params.keys() - {"lm_head.weight"}
    assert_state_close(written, {k: params[k] for k in written}, "save_model() safetensors file")
