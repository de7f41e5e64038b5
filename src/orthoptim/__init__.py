"""orthoptim: matrix-aware optimizers (Muon and its variants, SOAP) at data-, tensor-, expert-
and pipeline-parallel scale."""

from orthoptim.newton_schulz import COEFFICIENT_SETS, newton_schulz, polar_factor
from orthoptim.optim import (
    SOAP,
    AdaMuon,
    HybridOptimizer,
    Lion,
    MatrixOptimizer,
    Muon,
    NorMuon,
    PolarGrad,
    Scion,
    build_optimizer,
    routing_table,
)
from orthoptim.optim.base import NonFiniteGradientError
from orthoptim.optim.guards import ParameterSetError, SteppedTwiceError
from orthoptim.optim.qk_clip import QKClip
from orthoptim.optim.routing import explain_routing
from orthoptim.parallel import FSDPOptimizer, LayerwiseDistributedOptimizer, ParallelDims
from orthoptim.parallel.base import StepRefusedError
from orthoptim.telemetry import Telemetry

__version__ = "0.1.0"

__all__ = [
    "COEFFICIENT_SETS",
    "SOAP",
    "AdaMuon",
    "FSDPOptimizer",
    "HybridOptimizer",
    "LayerwiseDistributedOptimizer",
    "Lion",
    "MatrixOptimizer",
    "Muon",
    "NonFiniteGradientError",
    "NorMuon",
    "ParallelDims",
    "ParameterSetError",
    "PolarGrad",
    "QKClip",
    "Scion",
    "StepRefusedError",
    "SteppedTwiceError",
    "Telemetry",
    "build_optimizer",
    "explain_routing",
    "newton_schulz",
    "polar_factor",
    "routing_table",
]
