"""`orthoptim train --hf-config`: Hugging Face causal LMs (built from configs, no download)
trained by the same loop under every data-parallel layout we have.

On 2 real gloo ranks (one process group, the loop's `run` called once per layout): Llama and
Qwen3-MoE for 10 steps with the layer-wise optimizer, the same run stopped after step 5 and
resumed, and `--fsdp`. The oracle is the single-process optimizer (`build_optimizer`) on the
two ranks' batches together, clipped by torch's `clip_grad_norm_`: the ranks' losses must
equal its losses within 1e-5 (float32 sums in another order); the resumed run must equal the
uninterrupted one bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from orthoptim.train.args import TrainArgs
from orthoptim.train.data import get_batch, load_corpus
from orthoptim.train.hf import HFCausalLM, build_hf_model, hf_config
from orthoptim.train.loop import lr_multiplier, make_optimizer
from orthoptim.train.model import get_config

from distributed import run_ranks

pytest.importorskip("transformers", reason="--hf-config needs the [hf] extra (transformers)")

STEPS, BATCH, RANKS = 10, 2, 2
SPECS = ("llama", "qwen3_moe")


def _args(spec: str, out: Path, **kw) -> TrainArgs:
    return TrainArgs(
        hf_config=spec, config="tiny", steps=STEPS, batch=BATCH, warmup=2, eval_every=5,
        eval_batches=1, ckpt_every=5, out=str(out), progress=False, **kw,
    )  # fmt: skip


def _losses(out: Path) -> list[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["train_loss"] for r in rows if "train_loss" in r]


def _layouts(rank: int, world_size: int, base: str) -> None:
    from orthoptim.train.launcher import run

    for spec in SPECS:
        root = Path(base) / spec
        run(_args(spec, root / "layerwise"))
        run(_args(spec, root / "resumed", stop_after=5))
        run(_args(spec, root / "resumed", resume=True))
        run(_args(spec, root / "fsdp", fsdp=True))


def _oracle(spec: str) -> list[float]:
    """The losses of the single-process optimizer on both ranks' batches."""
    args = _args(spec, Path("unused"))
    seq = get_config(args.config).seq_len
    corpus = load_corpus(None, min_bytes=seq + 1)
    torch.manual_seed(args.seed)
    model = build_hf_model(spec, seq)
    opt = make_optimizer(model, args, world_size=1)
    initial = [g["lr"] for g in opt.param_groups]
    losses = []
    for step in range(1, STEPS + 1):
        for g, lr in zip(opt.param_groups, initial):
            g["lr"] = lr * lr_multiplier(step, args)
        xs, ys = zip(
            *(get_batch(corpus.train, BATCH, seq, args.seed, step, r) for r in range(RANKS))
        )
        loss = model(torch.cat(xs), torch.cat(ys))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("hf")
    run_ranks(_layouts, RANKS, args=(str(base),))
    return base


@pytest.mark.parametrize("spec", SPECS)
def test_hf_model_trains_under_every_layout_like_one_process(trained, spec):
    want = _oracle(spec)
    assert want[-1] < want[0]
    for layout in ("layerwise", "fsdp"):
        got = _losses(trained / spec / layout)
        assert got == pytest.approx(want, rel=1e-5), layout
    assert _losses(trained / spec / "resumed") == _losses(trained / spec / "layerwise")
    result = json.loads((trained / spec / "fsdp" / "result.json").read_text())
    assert result["optimizer_class"] == "FSDPOptimizer" and result["model"]["hf_config"] == spec


def test_hf_config_from_a_file_and_clear_errors(tmp_path):
    config = hf_config("llama", 64)
    config.num_hidden_layers = 1
    config.save_pretrained(tmp_path)
    model = HFCausalLM(hf_config(str(tmp_path), 64))
    assert len(model.blocks) == 1 and model.get_input_embeddings().weight.shape[0] == 256
    # the decoder layers are listed, not registered twice
    assert not any(k.startswith("blocks.") for k in model.state_dict())
    with pytest.raises(ValueError, match="--hf-config nope: not a preset"):
        hf_config("nope", 64)
    short = hf_config("llama", 64)
    short.max_position_embeddings = 32
    short.save_pretrained(tmp_path / "short")
    with pytest.raises(ValueError, match="max_position_embeddings = 32 is shorter"):
        hf_config(str(tmp_path / "short"), 64)
    with pytest.raises(ValueError, match="--hf-config with --tp 2"):
        TrainArgs(hf_config="llama", tp=2).validate()
