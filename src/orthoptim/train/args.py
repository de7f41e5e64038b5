"""What one training run is: `TrainArgs`, the flags of `orthoptim train` one to one, and the
checks that refuse a bad value naming its flag."""

from __future__ import annotations

import math
import signal
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Literal

# Names only: the command's parser reads this module, and builds without torch (the modules
# behind the checks import it, so the checks import them when they run).
from orthoptim.choices import (
    ELEMENTWISE_OPTIMIZER_NAMES,
    OPTIMIZER_NAMES,
    PARAM_DTYPES,
    PRECISIONS,
    SCHEDULES,
    ParamDtype,
    ScheduleName,
)

if TYPE_CHECKING:
    from orthoptim.parallel.layout import ParallelDims
    from orthoptim.train.model import GPTConfig

OPTIMIZERS = OPTIMIZER_NAMES
# what --state-dtype takes: the optimizer state's storage (bf16: Muon's momentum and AdamW's
# moments in bfloat16 by stochastic rounding, `orthoptim.optim.lean`)
STATE_DTYPES = ("fp32", "bf16")
# the pipeline's schedules (`--pp-schedule`): the runner's own names
PP_SCHEDULES = SCHEDULES


# Learning rates tuned on the tiny config at compare's defaults (100 steps of 32 x 128 tokens;
# AdamW over {1.5e-3, 3e-3, 6e-3}, Muon over {0.02, 0.05, 0.1}, best final validation loss):
# the matrix optimizer's LR, and the AdamW LR used for everything under "adamw" and for
# embeddings / head / gains otherwise. SOAP's is AdamW's (it runs Adam in a rotated basis).
# The Muon variants by `compare --sweep` on the tiny config, 1 rank, 60 steps of 16 x 128
# tokens (final validation loss at LR × 0.4, 1, 2.5 of a first guess): NorMuon 2.460 / 2.407 /
# 2.403 at 0.02 / 0.05 / 0.125 (Muon's 0.05 kept, as for Muon); AdaMuon 2.561 / 2.507 / 2.639
# at 0.008 / 0.02 / 0.05; PolarGrad 2.591 / 2.577 / 2.568 at 0.008 / 0.02 / 0.05; Scion
# 2.563 / 2.543 / 2.494 at 0.004 / 0.01 / 0.025 (the last two: best at the grid's edge).
DEFAULT_LR = {
    "muon": 0.05,
    "adamw": 3e-3,
    "soap": 3e-3,
    "normuon": 0.05,
    "adamuon": 0.02,
    "polargrad": 0.05,
    "scion": 0.025,
}


DEFAULT_ADAMW_LR = 3e-3
DEFAULT_WEIGHT_DECAY = 0.0
DEFAULT_GRAD_CLIP = 1.0
# What `--save-on-signal` takes besides SIGTERM (always handled): the signals schedulers send
# ahead of a stop (Slurm's --signal: SIGUSR1 by default; SIGXCPU at a CPU limit). SIGINT keeps
# Ctrl-C's meaning; SIGKILL and SIGSTOP cannot be caught.
# What `--reproducible` guarantees (the one line each refusal ends with).
REPRODUCIBLE_SCOPE = (
    "the bitwise guarantee covers data parallelism only: the layer-wise optimizer at a "
    "power-of-two number of data-parallel ranks dividing a power-of-two number of "
    "micro-batches (--global-batch / --batch), the built-in GPT, no --tp, --ep, --pp, --fsdp "
    "or --compile"
)


def is_power_of_two(n: int) -> bool:
    """Whether `n` is 1, 2, 4, 8, ..."""
    return n >= 1 and n & (n - 1) == 0


SAVE_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT", "SIGXCPU")


def _config(name: str) -> GPTConfig:
    """The built-in GPT's config `name` (`model.get_config`: a clear error lists the names)."""
    from orthoptim.train.model import get_config

    return get_config(name)


@dataclass
class TrainArgs:
    """Everything one training run needs; the CLI flags map one to one onto these fields."""

    optimizer: str = "muon"
    elementwise: str = "adamw"  # the non-matrix part's optimizer: "adamw" or "lion"
    config: str = "tiny"
    hf_config: str | None = None  # a transformers model (preset or config.json) to train
    steps: int = 200
    batch: int = 16  # sequences per rank per micro-batch (per step without --global-batch)
    # sequences per optimizer step over every data-parallel rank; None → batch · dp (no
    # accumulation). Given, each rank accumulates global_batch / (batch · dp) micro-batches.
    global_batch: int | None = None
    reproducible: bool = False  # bitwise the same run at every data-parallel size
    lr: float | None = None  # None → DEFAULT_LR[optimizer]
    adamw_lr: float | None = None  # None → DEFAULT_ADAMW_LR (embeddings, head, gains)
    weight_decay: float | None = None  # None → 0, or with --resume the checkpoint's
    warmup: int = 10
    min_lr_ratio: float = 0.1  # the cosine schedule's last LR over its peak
    eval_every: int = 10
    eval_batches: int = 8
    log_every: int = 10  # steps between optimizer telemetry rows (0: off)
    tensorboard: str | None = None  # also write the metrics as TensorBoard events here
    ckpt_every: int = 50
    out: str = "runs/train"
    resume: bool = False
    overwrite: bool = False  # remove the run --out holds and start afresh
    stop_after: int | None = None  # leave after this step (as if interrupted)
    seed: int = 0
    data: str | None = None
    tp: int = 1
    pp: int = 1  # pipeline stages
    ep: int = 1  # expert-parallel ranks (inside the data-parallel ones)
    dp: int | None = None  # data-parallel ranks per stage; None → nproc / (pp · tp)
    microbatches: int | None = None  # pipeline micro-batches per step; None → --pp
    pp_schedule: ScheduleName = "1f1b"
    fsdp: bool = False  # shard the model with FSDP2 and step it with FSDPOptimizer
    dp_replicate: int = 1  # FSDP2 replicas (hybrid sharding: shard within, replicate across)
    qk_clip: float | None = None  # MuonClip τ; None → the config's default, 0 → off
    grad_clip: float | None = None  # global gradient-norm threshold; 0 → off; None → 1.0,
    # or with --resume the checkpoint's
    keep_checkpoints: int = 2  # the newest step folders kept
    precision: str = "auto"  # "bf16" autocast, "fp32", or "auto": bf16 on CUDA, fp32 on CPU
    param_dtype: ParamDtype = "auto"  # parameters in bf16 (fp32 masters) or fp32; auto as above
    state_dtype: str = "fp32"  # Muon's momentum and AdamW's moments stored in fp32 or bf16
    compile: bool = False  # torch.compile every transformer block
    shared_gpu: bool = False  # every rank on cuda:0 over "cuda:gloo" (multi-rank tests, 1 GPU)
    pg_timeout: float = 600.0  # s a rank waits in a collective; the watchdog's stall limit
    save_on_signal: str | None = None  # one of SAVE_SIGNALS: save and stop on it, as on SIGTERM
    max_restarts: int = 0  # torchelastic restarts the ranks this often after a failure
    progress: bool = True
    # the routing table and "resuming from" on the terminal (off: compare's later segments)
    announce: bool = True

    def validate(self) -> None:
        """Reject bad values up front, naming the flag."""
        self._validate_choices()
        _config(self.config)
        self._validate_numbers()
        self._validate_parallel()
        self._validate_combinations()
        self._validate_reproducible()

    def _validate_choices(self) -> None:
        """The flags that name one of a set: --optimizer, --elementwise, --precision and
        --param-dtype, alone and together."""
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.elementwise not in ELEMENTWISE_OPTIMIZER_NAMES:
            raise ValueError(
                f"--elementwise must be one of {ELEMENTWISE_OPTIMIZER_NAMES}, "
                f"got {self.elementwise!r}"
            )
        if self.optimizer == "adamw" and self.elementwise != "adamw":
            raise ValueError(
                f"--elementwise {self.elementwise} chooses the optimizer of the non-matrix part "
                "next to a matrix optimizer; --optimizer adamw is AdamW for every parameter"
            )
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(
                f"--param-dtype must be one of {PARAM_DTYPES}, got {self.param_dtype!r}"
            )
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(
                f"--state-dtype must be one of {STATE_DTYPES}, got {self.state_dtype!r}"
            )
        lean = self.state_dtype == "bf16"
        if lean and (self.optimizer == "soap" or self.elementwise == "lion"):
            which = "--optimizer soap" if self.optimizer == "soap" else "--elementwise lion"
            raise ValueError(
                f"--state-dtype bf16 stores Muon's (and its variants') momentum and AdamW's "
                f"moments; {which} keeps fp32 state: pass --state-dtype fp32 with it"
            )
        if self.param_dtype == "fp64" and self.precision == "bf16":
            raise ValueError(
                "--param-dtype fp64 (the reference dtype of equivalence checks) runs without "
                "autocast; pass --precision fp32 or auto with it"
            )

    def _validate_numbers(self) -> None:
        """The counts, rates, limits and the seed each in its range, --resume against
        --overwrite and --stop-after against --steps."""
        for name in (
            "steps",
            "batch",
            "eval_every",
            "eval_batches",
            "ckpt_every",
            "keep_checkpoints",
            "tp",
            "pp",
            "ep",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        if self.global_batch is not None and (
            self.global_batch < 1 or self.global_batch % self.batch
        ):
            raise ValueError(
                f"--global-batch must be a positive multiple of --batch {self.batch} (it is "
                f"split into micro-batches of --batch sequences), got {self.global_batch}"
            )
        if self.log_every < 0:
            raise ValueError(f"--log-every must be >= 0 (0: no telemetry), got {self.log_every}")
        if self.qk_clip is not None and not (math.isfinite(self.qk_clip) and self.qk_clip >= 0):
            raise ValueError(f"--qk-clip must be a finite number >= 0 (0: off), got {self.qk_clip}")
        if not (math.isfinite(self.clip_norm) and self.clip_norm >= 0):
            raise ValueError(
                f"--grad-clip must be a finite number >= 0 (0: off), got {self.clip_norm}"
            )
        if self.warmup < 0:
            raise ValueError(f"--warmup must be >= 0, got {self.warmup}")
        if not 0 <= self.min_lr_ratio <= 1:  # NaN fails too
            raise ValueError(
                f"--min-lr-ratio must be in [0, 1] (the LR at --steps over the peak), got "
                f"{self.min_lr_ratio}"
            )
        for name in ("lr", "adamw_lr"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a finite number > 0, got {v}")
        if not (math.isfinite(self.decay) and self.decay >= 0):
            raise ValueError(
                f"--weight-decay must be a finite number >= 0 (0: off), got {self.decay}"
            )
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
        if not (math.isfinite(self.pg_timeout) and self.pg_timeout > 0):
            raise ValueError(
                f"--pg-timeout must be a finite number of seconds > 0, got {self.pg_timeout}"
            )
        if self.save_on_signal is not None and self.save_on_signal not in SAVE_SIGNALS:
            raise ValueError(
                f"--save-on-signal must be one of {', '.join(SAVE_SIGNALS)}, "
                f"got {self.save_on_signal!r}"
            )
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0 (0: none), got {self.max_restarts}")
        if self.resume and self.overwrite:
            raise ValueError(
                "--resume continues the run in --out and --overwrite replaces it; pass one"
            )
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(
                f"--stop-after must be in [1, --steps={self.steps}], got {self.stop_after}"
            )

    def _validate_combinations(self) -> None:
        """--compile, --fsdp, --hf-config, --qk-clip and --tp against each other and the
        model."""
        if self.compile and (self.fsdp or self.tp > 1):
            flag = "--fsdp" if self.fsdp else f"--tp {self.tp}"
            raise ValueError(
                f"--compile with {flag}: compiling blocks whose modules carry FSDP2's or tensor "
                "parallelism's hooks is not wired into `orthoptim train`; drop --compile (it "
                "runs with the layer-wise optimizer)"
            )
        if self.state_dtype == "bf16" and (self.fsdp or self.tp > 1):
            flag = "--fsdp" if self.fsdp else f"--tp {self.tp}"
            fix = "pass --state-dtype fp32 with it"
            if self.resume:  # fp32 state would not match the checkpoint's
                fix = f"a checkpoint of bf16 state cannot resume under {flag}: drop {flag}"
            raise ValueError(
                f"--state-dtype bf16 with {flag}: bf16 state takes plain tensors, and {flag} "
                f"steps DTensor parameters; {fix}"
            )
        if self.fsdp and self.qk_clip_tau is not None:
            raise ValueError(
                f"--fsdp does not run QK-clip yet (it would rescale rows of sharded q/k "
                f"weights); pass --qk-clip 0 with --config {self.config}"
            )
        if self.hf_config is not None and self.tp > 1:
            raise ValueError(
                f"--hf-config with --tp {self.tp}: tensor parallelism of transformers models is "
                "not wired into `orthoptim train`; use --tp 1 (layer-wise or --fsdp)"
            )
        if self.hf_config is not None and self.qk_clip_tau is not None:
            raise ValueError(
                "--hf-config with --qk-clip: MuonClip finds the built-in GPT's attention only; "
                "pass --qk-clip 0"
            )
        if self.tp > 1:
            if self.fsdp:
                raise ValueError(
                    f"--fsdp with --tp {self.tp}: FSDP2 sharding of a tensor-parallel model is "
                    "not wired into `orthoptim train`; use one of them"
                )
            if self.optimizer != "muon":
                raise ValueError(
                    f"--tp {self.tp} runs with --optimizer muon (its Newton-Schulz is tensor-"
                    f"parallel), got --optimizer {self.optimizer}; use --tp 1 for it"
                )
            from orthoptim.train.model import check_tensor_parallel

            check_tensor_parallel(_config(self.config), self.tp)
            if self.qk_clip_tau is not None:
                raise ValueError(
                    f"--tp {self.tp}: MuonClip (--qk-clip {self.qk_clip_tau}) rescales whole "
                    "query/key heads and does not run on tensor-parallel shards; pass --qk-clip 0"
                )

    def _validate_parallel(self) -> None:
        """The pipeline and expert-parallel flags (--pp, --ep, --dp, --microbatches,
        --pp-schedule) alone and against the model; the sizes against --nproc are
        `check_nproc`'s."""
        for name in ("dp", "microbatches"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name} must be >= 1 (or left out), got {v}")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ValueError(
                f"--pp-schedule must be one of {PP_SCHEDULES}, got {self.pp_schedule!r}"
            )
        if self.pp == 1 and (self.microbatches or 1) > 1:
            raise ValueError(
                f"--microbatches {self.microbatches} splits the batch of a pipeline; it takes "
                "--pp 2 or more (without a pipeline each step is one batch)"
            )
        if self.dp_replicate < 1:
            raise ValueError(f"--dp-replicate must be >= 1, got {self.dp_replicate}")
        if self.dp_replicate > 1 and not self.fsdp:
            raise ValueError(
                f"--dp-replicate {self.dp_replicate} sets FSDP2's replicas (hybrid sharding); it "
                "takes --fsdp (the layer-wise optimizer owns each matrix on one rank and "
                "replicates it to all)"
            )
        if self.pp == 1 and self.ep == 1:
            return
        flags = " ".join(f"--{k} {getattr(self, k)}" for k in ("pp", "ep") if getattr(self, k) > 1)
        if self.fsdp:
            raise ValueError(
                f"--fsdp with {flags}: FSDP2 sharding of pipeline stages or of expert-parallel "
                "experts is not wired into `orthoptim train`; drop --fsdp (the layer-wise "
                "optimizer owns each stage's weights over its data-parallel ranks)"
            )
        if self.hf_config is not None:
            raise ValueError(
                f"--hf-config with {flags}: pipeline and expert parallelism run on the built-in "
                "GPT only; drop --hf-config or the flag"
            )
        if self.compile:
            raise ValueError(
                f"--compile with {flags} is not wired into `orthoptim train`; drop --compile"
            )
        from orthoptim.parallel.layout import ParallelDims, as_flags

        # dp as small as the flags allow: the sizes against --nproc are check_nproc's
        with as_flags():
            dims = ParallelDims(dp=self.dp or self.ep, tp=self.tp, ep=self.ep, pp=self.pp)
            self._check_model(dims)
        if self.batch % self.n_microbatches:
            given = "" if self.microbatches is not None else " (by default --pp)"
            raise ValueError(
                f"--microbatches {self.n_microbatches}{given} must divide --batch {self.batch} "
                "(each micro-batch is batch / microbatches sequences); pass a --microbatches "
                "that divides it"
            )

        if self.pp > 1 and self.pp_schedule == "1f1b" and self.n_microbatches < self.pp:
            raise ValueError(
                f"--microbatches {self.n_microbatches} with --pp {self.pp}: the 1f1b schedule "
                f"needs a micro-batch per stage; pass --microbatches {self.pp} or more, or "
                "--pp-schedule gpipe"
            )

    def _validate_reproducible(self) -> None:
        """--reproducible against the flags whose layouts its guarantee does not cover (the
        data-parallel size against --global-batch is `accumulation`'s)."""
        if not self.reproducible:
            return
        if self.global_batch is None:
            raise ValueError(
                "--reproducible needs --global-batch G (the sequences of one step, the same "
                f"at every --nproc); {REPRODUCIBLE_SCOPE}"
            )
        outside = [
            f"--{name} {getattr(self, name)}"
            for name in ("tp", "ep", "pp")
            if getattr(self, name) > 1
        ]
        outside += [f"--{name}" for name in ("fsdp", "compile") if getattr(self, name)]
        if self.hf_config is not None:
            outside.append("--hf-config")
        if outside:
            raise ValueError(
                f"--reproducible with {' '.join(outside)}: {REPRODUCIBLE_SCOPE}; drop "
                f"{' and '.join(outside)} or --reproducible"
            )
        micro = self.global_batch // self.batch
        if not is_power_of_two(micro):
            raise ValueError(
                f"--reproducible with --global-batch {self.global_batch} / --batch {self.batch} "
                f"= {micro} micro-batches, not a power of two: {REPRODUCIBLE_SCOPE}; pass a "
                "--global-batch of --batch × 1, 2, 4, 8, ..."
            )

    def accumulation(self, nproc: int) -> int:
        """The micro-batches each data-parallel rank runs per step at `nproc` ranks:
        --global-batch / (--batch · dp), 1 without --global-batch; a --global-batch the
        data-parallel size does not divide is refused naming the flags (under --reproducible
        the micro-batches are a power of two, so a size that divides them is one too)."""
        dims = self.layout(nproc)
        if self.global_batch is None:
            return 1
        micro = self.global_batch // self.batch
        if micro % dims.dp:
            raise ValueError(
                f"--global-batch {self.global_batch} is {micro} micro-batches of --batch "
                f"{self.batch}, which {dims.dp} data-parallel ranks (--nproc {nproc}) cannot "
                f"share evenly; pass a --global-batch that --batch × {dims.dp} divides, or "
                f"another --nproc"
            )
        if self.pp > 1 and micro != dims.dp:
            raise ValueError(
                f"--global-batch {self.global_batch} with --pp {self.pp} asks for "
                f"{micro // dims.dp} micro-batches per rank; the pipeline splits --batch into "
                f"its own --microbatches instead: pass --global-batch "
                f"{self.batch * dims.dp} (--batch × dp) or leave it off"
            )
        return micro // dims.dp

    def global_batch_at(self, nproc: int) -> int:
        """Sequences per optimizer step at `nproc` ranks: --global-batch, or --batch · dp."""
        return self.global_batch or self.batch * self.layout(nproc).dp

    @property
    def n_microbatches(self) -> int:
        """The pipeline's micro-batches per step (--microbatches; default --pp)."""
        return self.microbatches if self.microbatches is not None else self.pp

    def layout(self, nproc: int) -> ParallelDims:
        """This run's parallel layout over `nproc` ranks (--pp × --dp × --tp, --ep inside
        --dp), checked against the model (`ParallelDims.check`)."""
        from orthoptim.parallel.layout import ParallelDims, as_flags

        with as_flags():
            dims = ParallelDims.for_world(
                nproc,
                tp=self.tp,
                ep=self.ep,
                pp=self.pp,
                dp=self.dp,
                dp_replicate=self.dp_replicate,
            )
            self._check_model(dims)
        return dims

    def _check_model(self, dims: ParallelDims) -> None:
        """`dims` against the built-in model's layers and experts (`ParallelDims.check`; a
        transformers model is not checked here)."""
        if self.hf_config is None:
            cfg = _config(self.config)
            dims.check(n_layer=cfg.n_layer, n_expert=cfg.moe.n_expert if cfg.moe else None)

    def check_nproc(self, nproc: int, device_type: str) -> None:
        """Refuse a number of ranks the layout does not fit (`layout`: nproc = pp · dp · tp,
        --ep dividing dp), and --fsdp with bf16 parameters on one rank (FSDP2's mixed
        precision comes with its sharding, which needs a process group: one rank steps the
        unsharded model)."""
        if nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {nproc}")
        self.accumulation(nproc)  # the layout, and --global-batch against it
        if self.fsdp and nproc == 1 and self.param_dtype_on(device_type) == "bf16":
            auto = " (the default on CUDA)" if self.param_dtype == "auto" else ""
            raise ValueError(
                f"--fsdp with --param-dtype bf16{auto} needs --nproc 2 or more: FSDP2's mixed "
                "precision comes with its sharding, and one rank runs unsharded; pass "
                "--param-dtype fp32, or drop --fsdp (one rank then keeps fp32 masters in the "
                "layer-wise optimizer)"
            )

    def param_dtype_on(self, device_type: str) -> Literal["bf16", "fp32", "fp64"]:
        """This run's parameter dtype ("bf16", "fp32" or "fp64") on a `device_type` rank."""
        from orthoptim.train.devices import resolve_param_dtype

        return resolve_param_dtype(self.param_dtype, device_type)

    @property
    def stop_signals(self) -> tuple[signal.Signals, ...]:
        """The signals on which every rank finishes its step, saves it and stops: SIGTERM,
        and --save-on-signal's."""
        names = dict.fromkeys(("SIGTERM", self.save_on_signal or "SIGTERM"))
        return tuple(getattr(signal, n) for n in names)

    @property
    def matrix_lr(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.optimizer]

    @property
    def qk_clip_tau(self) -> float | None:
        """The MuonClip threshold of this run (None: no clipping)."""
        tau = self.qk_clip
        if tau is None and self.hf_config is None:
            tau = _config(self.config).qk_clip
        return tau or None

    @property
    def embed_lr(self) -> float:
        return self.adamw_lr if self.adamw_lr is not None else DEFAULT_ADAMW_LR

    @property
    def decay(self) -> float:
        """The weight decay of this run's AdamW parameters (and of the matrices when
        --weight-decay is given; else the matrix optimizer's own default)."""
        return self.weight_decay if self.weight_decay is not None else DEFAULT_WEIGHT_DECAY

    @property
    def clip_norm(self) -> float:
        """The global gradient-norm clipping threshold of this run (0: off)."""
        return self.grad_clip if self.grad_clip is not None else DEFAULT_GRAD_CLIP

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
