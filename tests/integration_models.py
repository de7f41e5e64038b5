"""What the trainer-integration tests share: a tiny GPT-2 from a config, fixed byte data, the
rank environment the frameworks read, and the comparisons every framework's legs make.

The model is `transformers.GPT2LMHeadModel` (vocab 256, 2 layers, width 64, dropout 0: the
`gpt2` preset of `orthoptim.train.hf`), built from torch's generator seeded with `SEED`, so
every leg and every rank starts from the same weights. The data are `SAMPLES` windows of
`SEQ` bytes of a fixed text, the stdlib's `os.py` (labels = inputs: the model shifts them).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

SEED = 0
SEQ = 16
BATCH = 2  # per rank and micro-batch
ACCUM = 2  # micro-batches per optimizer step
STEPS = 20  # optimizer steps
SAVE_AT = 10  # the step whose checkpoint the resumed leg starts from
RANKS = 2
SAMPLES = STEPS * ACCUM * BATCH * RANKS  # one epoch is the whole run
LR = 0.02
# Small enough that every step clips (the tiny GPT-2's gradient norm starts near 3 and stays
# above 0.5 over 20 steps).
MAX_NORM = 0.1
# The losses of a layer-wise run against the replicated run: the same averaged gradients and
# the same float32 arithmetic on the owner, so they differ only by the order of a few float32
# sums (a relative 1e-7 a step, compounded over 20 steps).
RTOL = 1e-6
# The weights of a run whose clipping coefficient comes from `opt.clip_grad_norm_` (its norm
# summed in float64) against one from torch's (float32): the coefficients differ in their
# last bits, and 20 Muon steps grow that to at most 3.5e-5 of how far each tensor moved
# (measured, tiny GPT-2, 2 ranks). One step moves a tensor about 1/20 of that: a parameter one
# step stale would be ~50 times over this bound.
MOVED = 1e-3


def gpt2(seq: int = SEQ) -> nn.Module:
    """The tiny GPT-2 (`orthoptim.train.hf.PRESETS["gpt2"]`, vocab 256), seeded with SEED."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from orthoptim.train.hf import BYTE_VOCAB, PRESETS

    preset = {k: v for k, v in PRESETS["gpt2"].items() if k != "model_type"}
    config = GPT2Config(
        vocab_size=BYTE_VOCAB,
        n_positions=max(seq, 32),
        bos_token_id=None,
        eos_token_id=None,
        **preset,
    )
    torch.manual_seed(SEED)
    return GPT2LMHeadModel(config).float()


def byte_data(n: int = SAMPLES, seq: int = SEQ) -> torch.Tensor:
    """`n` consecutive windows of `seq` bytes of the stdlib's `os.py`, [n, seq] int64."""
    text = Path(os.__file__).read_bytes()[: n * seq]
    return torch.tensor(list(text), dtype=torch.int64).view(n, seq)


def set_rank_env(rank: int, world_size: int) -> None:
    """The environment torchrun would give this rank (HF, accelerate and Lightning read it;
    the process group itself is already up: `tests/distributed.py` started it)."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0", GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
    )  # fmt: skip


def assert_losses_close(got: list[float], want: list[float], what: str) -> None:
    """Every step's loss of `got` equals `want`'s within RTOL (relative)."""
    assert len(got) == len(want) == STEPS, (what, len(got), len(want))
    bad = [
        (i + 1, g, w)
        for i, (g, w) in enumerate(zip(got, want))
        if not math.isclose(g, w, rel_tol=RTOL, abs_tol=0.0)
    ]
    assert not bad, f"{what}: losses differ at (step, got, want) {bad}"


def assert_state_close(
    got: dict[str, Any], want: dict[str, Any], what: str, init: dict[str, Any] | None = None
) -> None:
    """Two model state dicts hold the same tensors: bit for bit, or, given the `init`ial
    state, within MOVED of how far training moved each tensor (max |want - init|)."""
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()))
    for k in want:
        atol = 0.0 if init is None else MOVED * (want[k] - init[k]).abs().max().item()
        torch.testing.assert_close(
            got[k], want[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{what}: {k}: {m}"
        )
