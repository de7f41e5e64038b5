"""Optimizer state stored in bfloat16 (`state_dtype=torch.bfloat16`), computed in float32.

Muon's momentum (and its variants') and AdamW's moments may be kept in bfloat16: 2 bytes per
state element instead of 4. Every step reads the stored value into the compute dtype (float32;
float64 for float64 parameters), updates it there, takes this step's update from the unrounded
value, and stores it back by stochastic rounding: up to the next bfloat16 with probability
equal to the distance from the one below, over their spacing (one ulp, 2⁻⁷ relative at most).
The stored value is then unbiased, E[round(x)] = x, so the rounding errors of successive steps
average out in the moving average instead of piling up in one direction (round to nearest
would drop every increment below half an ulp: an EMA with (1 − β)·g below that never moves).
No correction term is stored: a bfloat16 correction would cost the 2 bytes it saves.

The random bits are deterministic. Each parameter keeps, in its state, the seed of its next
rounding (`STREAM_KEY`, a Python int: a "scalar" state entry, checkpointed and resharded with
the rest); it starts from the optimizer's `rounding_seed` and the parameter's name
(`stream_start`) and advances once per step (`next_stream`). Two runs with the same seed are
bitwise equal, a resumed run continues each parameter's stream, and the bits a matrix gets do
not depend on which rank owns it (the pieces of a parameter split over ranks, a sharded AdamW
parameter's runs, each draw from the start of the parameter's stream: their bits repeat one
another's, and each rounding stays unbiased).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor

from orthoptim.optim.state import base_name
from orthoptim.shards import is_dtensor

#: the state entry holding the seed of a parameter's next stochastic rounding
STREAM_KEY = "rounding_stream"
_MASK64 = (1 << 64) - 1


def check_state_dtype(value: Any) -> torch.dtype | None:
    """A `state_dtype` argument as the optimizers keep it: None for float32 state (None or
    torch.float32: the default, nothing changes), torch.bfloat16 for bfloat16 state; anything
    else raises a ValueError naming the argument."""
    if value is None or value == torch.float32:
        return None
    if value == torch.bfloat16:
        return torch.bfloat16
    raise ValueError(
        f"state_dtype must be None or torch.float32 (float32 state, the default) or "
        f"torch.bfloat16 (bfloat16 storage, stochastic rounding), got {value!r}"
    )


def check_rounding_seed(seed: Any) -> int:
    """A `rounding_seed` argument: an int in [0, 2**63)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"rounding_seed must be an int in [0, 2**63), got {seed!r}")
    return seed


def check_plain(owner: str, param: Tensor) -> None:
    """Refuse a DTensor parameter under bfloat16 state (its shards would need a stream of
    their own per placement, which is not built)."""
    if is_dtensor(param):
        raise ValueError(
            f"{owner}(state_dtype=torch.bfloat16) takes plain tensors; a DTensor parameter "
            "(FSDP2, tensor parallelism) keeps float32 state: leave state_dtype unset there"
        )


def stream_start(seed: int, name: str) -> int:
    """The seed of the first rounding of parameter `name` under `rounding_seed` `seed`. Every
    piece of a parameter (an expert slice `w[0:2]`, a rank's run `w{0:9}` of a sharded AdamW
    parameter) starts from the parameter's, as a scalar state entry is the same in every
    piece (checkpoints keep one)."""
    digest = hashlib.blake2b(f"{seed}\0{base_name(name)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def next_stream(stream: int) -> int:
    """The seed after `stream` (SplitMix64's output function over the advanced state)."""
    z = (stream + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator for random bits on `device`, seeded with `seed` (a CPU one for the CPU and
    meta devices)."""
    kind = device.type if device.type not in ("cpu", "meta") else "cpu"
    return torch.Generator(device=kind).manual_seed(seed)


def stochastic_round_(dst: Tensor, src: Tensor, gen: torch.Generator | None) -> Tensor:
    """Write `src` (float32, or wider: first rounded to float32) into the bfloat16 `dst` by
    stochastic rounding and return `dst`: 16 uniform random bits are added to the low half of
    each float32 pattern, which is then cut off, so the magnitude goes up one bfloat16 ulp
    with probability (|x| − |lower|) / ulp (unbiased; finite values only, an overflow rounds
    to infinity). Holds one int32 tensor the size of `src` while it runs."""
    x = src if src.dtype == torch.float32 else src.to(torch.float32)
    bits = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=gen)
    bits.add_(x.view(torch.int32)).bitwise_and_(-(1 << 16))
    return dst.copy_(bits.view(torch.float32))


def take_generator(state: dict[str, Any], device: torch.device) -> torch.Generator:
    """The generator of this step's roundings of a parameter with `state`, seeded from its
    stream (`STREAM_KEY`), which moves on: one per parameter and step, for all its entries."""
    gen = generator(device, state[STREAM_KEY])
    state[STREAM_KEY] = next_stream(state[STREAM_KEY])
    return gen


def store_(held: Tensor, value: Tensor, gen: torch.Generator | None) -> None:
    """Store `value` (the compute dtype) into the state tensor `held`: a copy when they have
    the same dtype, else by stochastic rounding with `gen` (`stochastic_round_`)."""
    if held.dtype == value.dtype:
        held.copy_(value)
    else:
        stochastic_round_(held, value, gen)
