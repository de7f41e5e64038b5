"""orthoptim: matrix-aware optimizers (Muon, SOAP) at data- and tensor-parallel scale."""

from orthoptim.newton_schulz import COEFFICIENT_SETS, newton_schulz, polar_factor
from orthoptim.optim import SOAP, HybridOptimizer, Muon, build_optimizer, routing_table
from orthoptim.optim.base import NonFiniteGradientError
from orthoptim.optim.qk_clip import QKClip
from orthoptim.optim.routing import explain_routing
from orthoptim.parallel import FSDPOptimizer, LayerwiseDistributedOptimizer

__version__ = "0.1.0"

__all__ = [
    "COEFFICIENT_SETS",
    "SOAP",
    "FSDPOptimizer",
    "HybridOptimizer",
    "LayerwiseDistributedOptimizer",
    "Muon",
    "NonFiniteGradientError",
    "QKClip",
    "build_optimizer",
    "explain_routing",
    "newton_schulz",
    "polar_factor",
    "routing_table",
]
