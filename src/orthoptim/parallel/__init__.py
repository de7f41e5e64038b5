"""Distributed machinery: who owns which matrix, and the collectives that move them."""

from orthoptim.parallel.collectives import CommStats
from orthoptim.parallel.tensor_parallel import CostModel, TensorParallelOrthogonalizer

__all__ = ["CommStats", "CostModel", "TensorParallelOrthogonalizer"]
