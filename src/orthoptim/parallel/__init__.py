"""Distributed machinery: who owns which matrix, and the collectives that move them."""

from orthoptim.comm_bytes import CommStats
from orthoptim.parallel.assignment import Assignment, Unit, assign, unit_cost, units_from_model
from orthoptim.parallel.base import DistributedOptimizer
from orthoptim.parallel.fsdp import FSDPOptimizer
from orthoptim.parallel.layerwise import LayerwiseDistributedOptimizer
from orthoptim.parallel.layout import ParallelDims, ParallelMesh
from orthoptim.parallel.tensor_parallel import CostModel, TensorParallelOrthogonalizer

__all__ = [
    "Assignment",
    "CommStats",
    "CostModel",
    "DistributedOptimizer",
    "FSDPOptimizer",
    "LayerwiseDistributedOptimizer",
    "ParallelDims",
    "ParallelMesh",
    "TensorParallelOrthogonalizer",
    "Unit",
    "assign",
    "unit_cost",
    "units_from_model",
]
