"""A plan's layout (`Layout`: the parallel sizes and numeric choices `orthoptim plan` takes)
and its checks against a model (`check_layout`, `check_stage`), each naming the flag."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from orthoptim._validate import check_positive
from orthoptim.newton_schulz import NS_BATCH_MB
from orthoptim.ns_cost import NS_STEPS
from orthoptim.parallel.layout import ParallelDims
from orthoptim.parallel.tensor_parallel import TPMode, tp_mode_names
from orthoptim.plan.activations import RECOMPUTES, Recompute
from orthoptim.plan.model import ModelDescription

BALANCES = ("cost", "round_robin", "capped")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# the optimizers the planner models (`memory_per_rank`): the layout's `optimizer`; "adamw" is
# AdamW for every parameter, sharded element-wise (`plan_matrices`)
PlanOptimizer = Literal["muon", "soap", "adamw"]
PLAN_OPTIMIZERS: tuple[PlanOptimizer, ...] = get_args(PlanOptimizer)


def keeps_masters(param_dtype: str, gather: str) -> bool:
    """Whether the layer-wise optimizer's owners keep an fp32 master copy of what they own:
    the parameters are held below fp32 (`param_dtype`), or gathered in another dtype than
    theirs (`gather_dtype`, which rounds them)."""
    return param_dtype != "fp32" or gather != param_dtype


@dataclass(frozen=True)
class Layout:
    """Parallel sizes and numeric choices of one plan."""

    dp: int
    tp: int = 1
    ep: int = 1
    pp: int = 1
    tokens_per_step: int = 0
    ns_steps: int = NS_STEPS
    ns_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    bucket_mb: float = 25.0
    # the dtype parameters are gathered in (None: the parameters', no master copies): what
    # `LayerwiseDistributedOptimizer(gather_dtype=...)` would be given, for `memory_per_rank`
    gather_dtype: str | None = None
    # the dtype every rank holds the parameters in, what `LayerwiseDistributedOptimizer(
    # param_dtype=...)` would be given (under `fsdp`: FSDP2's compute dtype, the sharded
    # parameters staying fp32); below fp32 the owners keep fp32 masters (`memory_per_rank`)
    param_dtype: str = "fp32"
    # where Newton-Schulz runs ("cuda": the GPU path, Triton SYRK; "cpu"): `MatrixCost`
    device: str = "cuda"
    # the matrix optimizer (`LayerwiseDistributedOptimizer(model, optimizer)`): its state
    # and its step's temporaries in `memory_per_rank`, its work in the cost balancing
    optimizer: PlanOptimizer = "muon"
    # `FSDPOptimizer` over FSDP2's `fully_shard` instead of the layer-wise optimizer, for
    # `memory_per_rank` (the balancing, bytes and TP figures stay the layer-wise ones)
    fsdp: bool = False
    # the tensor-parallel orthogonalizer's mode (`TensorParallelOrthogonalizer(mode=...)`),
    # for its gathers and Gram buffers in `memory_per_rank`
    tp_mode: TPMode = "auto"
    # the cap on one stacked Newton-Schulz call in MiB of float32 (`Muon(ns_batch_mb=...)`;
    # None: one call per shape), for the step's transient in `memory_per_rank`
    ns_batch_mb: float | None = NS_BATCH_MB
    # the activations of one micro-batch of `micro_batch` sequences of `seq_len` tokens (0:
    # the description's `seq_len`) under `recompute` (`orthoptim.plan.activations`)
    micro_batch: int = 1
    seq_len: int = 0
    recompute: Recompute = "none"
    # the storage of Muon's momentum and AdamW's moments (`state_dtype=torch.bfloat16`:
    # "bf16", stochastic rounding, `orthoptim.optim.lean`), for the state in `memory_per_rank`
    state_dtype: str = "fp32"
    # `LayerwiseDistributedOptimizer(reproducible=True)`: the ordered reduction's all-to-all
    # and inboxes, AdamW runs on whole norm blocks, each matrix orthogonalized on its own
    reproducible: bool = False

    @property
    def gather(self) -> str:
        """The dtype parameters are gathered in: `gather_dtype`, else the parameters'."""
        return self.gather_dtype or self.param_dtype

    @property
    def masters(self) -> bool:
        """Whether the owners keep fp32 master copies (`keeps_masters`)."""
        return keeps_masters(self.param_dtype, self.gather)

    @property
    def dims(self) -> ParallelDims:
        """The sizes as the run's layout object (which refuses sizes below one and an --ep
        that does not divide --dp), its rank order and groups."""
        return ParallelDims(dp=self.dp, tp=self.tp, ep=self.ep, pp=self.pp)

    @property
    def gpus(self) -> int:
        return self.dims.world

    @property
    def expert_dp(self) -> int:
        return self.dims.expert_dp


def check_layout(desc: ModelDescription, layout: Layout) -> None:
    """Raise a ValueError naming the flag when the layout does not fit the model: its sizes
    by the run's own checks (`ParallelDims`, `ParallelDims.check`), then the plan's dtypes,
    optimizer and paths."""
    layout.dims.check(
        n_layer=desc.num_hidden_layers, n_expert=desc.n_routed_experts if desc.is_moe else None
    )
    for flag, v in (
        ("--ns-dtype", layout.ns_dtype),
        ("--grad-dtype", layout.grad_dtype),
        ("--param-dtype", layout.param_dtype),
        ("--gather-dtype", layout.gather),
        ("--state-dtype", layout.state_dtype),
    ):
        if v not in DTYPE_BYTES:
            raise ValueError(f"{flag} must be one of {sorted(DTYPE_BYTES)}, got {v!r}")
    lean = layout.state_dtype != "fp32"
    if lean and (layout.optimizer not in ("muon", "adamw") or layout.fsdp or layout.tp > 1):
        raise ValueError(
            f"--state-dtype {layout.state_dtype} stores Muon's momentum and AdamW's moments of "
            "plain tensors: it takes --optimizer muon or adamw, no --fsdp and --tp 1"
        )
    if layout.optimizer not in PLAN_OPTIMIZERS:
        raise ValueError(f"--optimizer must be one of {PLAN_OPTIMIZERS}, got {layout.optimizer!r}")
    if layout.tp_mode not in tp_mode_names():
        raise ValueError(f"--tp-mode must be one of {tp_mode_names()}, got {layout.tp_mode!r}")
    if layout.optimizer != "muon" and layout.tp > 1:
        raise ValueError(
            f"--optimizer {layout.optimizer} with --tp {layout.tp}: the tensor-parallel path "
            "is Muon's orthogonalizer; use --optimizer muon or --tp 1"
        )
    if layout.fsdp and (layout.tp > 1 or layout.ep > 1):
        raise ValueError(
            f"--fsdp with --tp {layout.tp} --ep {layout.ep}: FSDPOptimizer shards every "
            "parameter over the data-parallel group alone; use --tp 1 --ep 1 with --fsdp"
        )
    if layout.fsdp and layout.gather_dtype not in (None, layout.param_dtype):
        raise ValueError(
            "--gather-dtype with --fsdp: FSDPOptimizer gathers no parameters (FSDP2 does); "
            "leave --gather-dtype unset"
        )
    dims = (layout.tp, layout.ep, layout.pp)
    if layout.reproducible and (layout.fsdp or dims != (1, 1, 1) or layout.dp & (layout.dp - 1)):
        raise ValueError(
            "--reproducible covers data parallelism alone over 1, 2, 4, 8, ... ranks "
            f"(the layer-wise driver, --tp 1 --ep 1 --pp 1, no --fsdp); got --dp {layout.dp} "
            f"--tp {layout.tp} --ep {layout.ep} --pp {layout.pp}{' --fsdp' * layout.fsdp}"
        )
    if layout.ns_steps < 1:
        raise ValueError(f"--ns-steps must be >= 1, got {layout.ns_steps}")
    check_positive("--bucket-mb", layout.bucket_mb)
    if layout.ns_batch_mb is not None:
        check_positive("--ns-batch-mb", layout.ns_batch_mb)
    if layout.tokens_per_step < 0:
        raise ValueError(f"--tokens-per-step must be >= 0, got {layout.tokens_per_step}")
    if layout.micro_batch < 1:
        raise ValueError(f"--micro-batch must be >= 1, got {layout.micro_batch}")
    if layout.seq_len < 0:
        raise ValueError(f"--seq-len must be >= 1 (0: the model's), got {layout.seq_len}")
    if layout.recompute not in RECOMPUTES:
        raise ValueError(f"--recompute must be one of {RECOMPUTES}, got {layout.recompute!r}")


def check_stage(stage: int, pp: int) -> None:
    """Raise a ValueError naming --stage when `stage` is not one of the `pp` stages."""
    if not 0 <= stage < pp:
        raise ValueError(f"--stage {stage} must be in [0, {pp}) for --pp {pp}")
