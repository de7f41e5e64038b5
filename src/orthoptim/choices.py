"""The names the `orthoptim` command's flags choose among, in one module that imports no
torch, so that building the parser (`--help`, usage errors) needs none. The modules that
implement them read their names from here: the optimizer registry, the devices, the
pipeline's schedules; the built-in GPT's configs are checked against theirs by a test
(`tests/test_cli.py`)."""

from __future__ import annotations

from typing import Literal, get_args

MatrixOptimizerName = Literal["muon", "soap", "normuon", "adamuon", "polargrad", "scion"]
ElementwiseOptimizerName = Literal["adamw", "lion"]
#: what `build_optimizer(optimizer=...)` takes: a matrix optimizer, or "adamw" for everything
OptimizerName = MatrixOptimizerName | Literal["adamw"]
MATRIX_OPTIMIZER_NAMES: tuple[MatrixOptimizerName, ...] = get_args(MatrixOptimizerName)
ELEMENTWISE_OPTIMIZER_NAMES: tuple[ElementwiseOptimizerName, ...] = get_args(
    ElementwiseOptimizerName
)
# every name `build_optimizer(optimizer=...)` takes: a matrix optimizer, or AdamW for all
OPTIMIZER_NAMES: tuple[str, ...] = (*MATRIX_OPTIMIZER_NAMES, "adamw")

# `orthoptim train --config`: the built-in GPT's sizes (`orthoptim.train.model.CONFIGS`)
CONFIG_NAMES = ("tiny", "small", "base", "tiny-moe")

# --precision and --param-dtype (`orthoptim.train.devices`)
PRECISIONS = ("auto", "bf16", "fp32")
ParamDtype = Literal["auto", "bf16", "fp32", "fp64"]
PARAM_DTYPES: tuple[ParamDtype, ...] = get_args(ParamDtype)

# --pp-schedule: the pipeline runner's schedules (`orthoptim.train.pipeline`)
ScheduleName = Literal["gpipe", "1f1b"]
SCHEDULES: tuple[ScheduleName, ...] = get_args(ScheduleName)

# The exit status of a run stopped by a signal once its step is saved (sysexits'
# EX_TEMPFAIL: try again; `orthoptim.train.loop.Preempted`)
PREEMPTED_EXIT_CODE = 75
