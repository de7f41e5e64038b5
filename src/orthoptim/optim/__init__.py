"""Per-matrix optimizers and the hybrid builder that routes parameters to them."""

from orthoptim.optim.adamuon import AdaMuon
from orthoptim.optim.adamw import LeanAdamW
from orthoptim.optim.contract import MatrixOptimizer
from orthoptim.optim.hybrid import HybridOptimizer, build_optimizer, default_route, routing_table
from orthoptim.optim.lion import Lion
from orthoptim.optim.muon import Muon, lr_scale_factor
from orthoptim.optim.normuon import NorMuon
from orthoptim.optim.polargrad import PolarGrad
from orthoptim.optim.scion import Scion
from orthoptim.optim.soap import SOAP

__all__ = [
    "SOAP",
    "AdaMuon",
    "HybridOptimizer",
    "LeanAdamW",
    "Lion",
    "MatrixOptimizer",
    "Muon",
    "NorMuon",
    "PolarGrad",
    "Scion",
    "build_optimizer",
    "default_route",
    "lr_scale_factor",
    "routing_table",
]
