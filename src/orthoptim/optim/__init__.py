"""Per-matrix optimizers and the hybrid builder that routes parameters to them."""

from orthoptim.optim.hybrid import HybridOptimizer, build_optimizer, default_route, routing_table
from orthoptim.optim.muon import Muon, lr_scale_factor
from orthoptim.optim.soap import SOAP

__all__ = [
    "SOAP",
    "HybridOptimizer",
    "Muon",
    "build_optimizer",
    "default_route",
    "lr_scale_factor",
    "routing_table",
]
