"""`orthoptim plan`: a real model's optimizer at 64-1024 GPUs, from the same assignment code
the layer-wise distributed optimizer runs.

    from orthoptim.plan import load_model, load_hardware, make_plan, Layout
    plan = make_plan(load_model("kimi-k2"), load_hardware("gb300"), Layout(dp=64, ep=64))
"""

from orthoptim.plan.baseline import adamw_baseline
from orthoptim.plan.cli import add_parser, format_report, plot_plan
from orthoptim.plan.hardware import Hardware, load_hardware, shipped_hardware
from orthoptim.plan.layouts import Layout
from orthoptim.plan.model import (
    Matrix,
    ModelDescription,
    expand,
    load_model,
    model_from_dict,
    param_counts,
    shipped_models,
)
from orthoptim.plan.planner import make_plan, to_units

__all__ = [
    "Hardware",
    "Layout",
    "Matrix",
    "ModelDescription",
    "adamw_baseline",
    "add_parser",
    "expand",
    "format_report",
    "load_hardware",
    "load_model",
    "make_plan",
    "model_from_dict",
    "param_counts",
    "plot_plan",
    "shipped_hardware",
    "shipped_models",
    "to_units",
]
