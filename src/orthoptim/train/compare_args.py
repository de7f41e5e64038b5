"""The options of `orthoptim compare` (`CompareArgs`) and its machine-dependent defaults
(`device_defaults`), apart from the comparison itself (`orthoptim.train.compare`): the
command's parser reads them, and builds without torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from orthoptim.train.args import DEFAULT_LR, OPTIMIZERS, TrainArgs

COMPARED = ("adamw", "muon")


def device_defaults(device_type: str) -> dict[str, Any]:
    """The comparison's default model, batch per rank, steps and evaluation interval on a
    machine whose ranks run on `device_type` ("cpu" or "cuda").

    Newton-Schulz costs ~3·d/B of a step's flops (d: width, B: tokens per step). CPU: the tiny
    model (d = 128) at 64 sequences of 128 per rank (16k tokens a step at 2 ranks) keeps it to
    ~2 %, and 100 steps take minutes. CUDA: the base model (126M parameters, d = 1024, context
    1024) at 32 sequences per rank (32k tokens per rank per step; by estimate, not yet
    measured, ~20 GiB of activations in bf16 with some fp32 ones: far inside one H200); 500
    steps are 16M tokens per GPU, about half an epoch of the stdlib corpus on one GPU.
    Newton-Schulz is then ~9 % of the flops on one GPU and ~1 % at 8, where each rank
    orthogonalizes an eighth of the matrices."""
    if device_type == "cuda":
        return dict(config="base", batch=32, steps=500, eval_every=25)
    return dict(config="tiny", batch=64, steps=100, eval_every=10)


@dataclass
class CompareArgs:
    """Options of one comparison; every run shares everything except the optimizer and LR.

    None (nproc, steps, batch, config, eval_every): the machine's default, filled in by
    `resolve` (`plan_ranks` and `device_defaults`)."""

    optimizers: tuple[str, ...] = COMPARED
    nproc: int | None = None
    steps: int | None = None
    batch: int | None = None
    config: str | None = None
    out: str = "runs/compare"
    sweep: bool = False
    data: str | None = None
    seed: int = 0
    eval_every: int | None = None
    adamw_lr: float | None = None
    muon_lr: float | None = None
    lrs: dict[str, float] | None = None  # --lr NAME=LR: any compared optimizer's LR
    precision: str = "auto"
    state_dtype: str = "fp32"  # every run's --state-dtype
    compile: bool = False
    shared_gpu: bool = False
    progress: bool = True
    # The runs' layout, `orthoptim train`'s --pp, --ep and --dp (None: train's default)
    pp: int | None = None
    ep: int | None = None
    dp: int | None = None
    # The runs take turns in this many segments (at most one per step), each resuming from
    # its own checkpoint (bitwise the same run), so drifts in the machine's load over minutes
    # hit every run alike: the throughput ratio is measured side by side.
    segments: int = 5

    def resolve(self, gpus: int) -> CompareArgs:
        """A copy with every None replaced by the default of a machine with `gpus` visible GPUs
        (refusing more ranks than GPUs, as `plan_ranks` does)."""
        from orthoptim.train.devices import plan_ranks

        plan = plan_ranks(self.nproc, gpus, self.shared_gpu)
        defaults = device_defaults(plan.device_type)
        chosen = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return replace(self, nproc=plan.nproc, **chosen)

    def validate(self) -> None:
        """Refuse option values the comparison cannot honour, naming the flag."""
        if self.segments < 1:
            raise ValueError(f"--segments must be at least 1, got {self.segments}")
        unknown = [n for n in self.optimizers if n not in OPTIMIZERS]
        if unknown:
            raise ValueError(
                f"--optimizers: {', '.join(map(repr, unknown))} not among {', '.join(OPTIMIZERS)}"
            )
        if len(set(self.optimizers)) != len(self.optimizers) or len(self.optimizers) < 2:
            raise ValueError(
                "--optimizers must name at least two different optimizers, got "
                f"{','.join(self.optimizers)}"
            )
        for name in self.lrs or {}:
            if name not in self.optimizers:
                raise ValueError(f"--lr {name}=...: {name!r} is not among --optimizers")
        given = [("--adamw-lr", self.adamw_lr), ("--muon-lr", self.muon_lr)]
        given += [(f"--lr {n}=", lr) for n, lr in (self.lrs or {}).items()]
        for flag, lr in given:
            if lr is not None and not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"{flag} must be a finite number > 0, got {lr}")
        for name in self.optimizers:
            self.train_args(name, DEFAULT_LR[name], Path(self.out)).validate()

    @property
    def baseline(self) -> str:
        """The optimizer every other is measured against: AdamW when compared, else the first."""
        return "adamw" if "adamw" in self.optimizers else self.optimizers[0]

    def chosen_lr(self, name: str) -> float | None:
        """The LR given for optimizer `name` (None: its default, or its sweep)."""
        given = {"adamw": self.adamw_lr, "muon": self.muon_lr, **(self.lrs or {})}
        return given.get(name)

    def train_args(self, optimizer: str, lr: float, out: Path) -> TrainArgs:
        """The run of `optimizer` at `lr` writing to `out` (call `resolve` first)."""
        if None in (self.steps, self.batch, self.config, self.eval_every):
            raise ValueError("CompareArgs.train_args: call resolve() first")
        given = (("pp", self.pp), ("ep", self.ep), ("dp", self.dp))
        return TrainArgs(
            optimizer=optimizer,
            config=self.config,
            steps=self.steps,
            batch=self.batch,
            lr=lr,
            eval_every=self.eval_every,
            log_every=self.eval_every,  # telemetry.png's points at the loss plot's steps
            ckpt_every=self.steps,
            out=str(out),
            seed=self.seed,
            data=self.data,
            precision=self.precision,
            state_dtype=self.state_dtype,
            compile=self.compile,
            shared_gpu=self.shared_gpu,
            progress=self.progress,
            **{k: v for k, v in given if v is not None},
        )

    def layout(self) -> dict[str, int]:
        """The runs' pipeline stages, data-parallel ranks per stage and expert-parallel size,
        as train derives what is not given (`ParallelDims.for_world`; compare runs no tensor
        parallelism)."""
        from orthoptim.parallel.layout import ParallelDims, as_flags

        with as_flags():
            dims = ParallelDims.for_world(
                self.nproc or 1, ep=self.ep or 1, pp=self.pp or 1, dp=self.dp
            )
        return {"pp": dims.pp, "dp": dims.dp, "ep": dims.ep}
