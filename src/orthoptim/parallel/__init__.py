"""Distributed machinery: who owns which matrix, and the collectives that move them."""

from orthoptim.parallel.assignment import Assignment, Unit, assign, unit_cost, units_from_model
from orthoptim.parallel.collectives import CommStats
from orthoptim.parallel.fsdp import FSDPOptimizer
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer

__all__ = [
    "Assignment",
    "CommStats",
    "FSDPOptimizer",
    "LayerwiseDistributedOptimizer",
    "Unit",
    "assign",
    "unit_cost",
    "units_from_model",
]
