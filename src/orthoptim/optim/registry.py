"""The matrix optimizers by name: what `build_optimizer(optimizer=...)`, `orthoptim train
--optimizer` and the distributed optimizers accept. Each keeps the contract of
`orthoptim.optim.contract.MatrixOptimizer`, so nothing else needs to know it by name."""

from __future__ import annotations

from orthoptim.optim.adamuon import AdaMuon
from orthoptim.optim.contract import MatrixOptimizer
from orthoptim.optim.muon import Muon
from orthoptim.optim.normuon import NorMuon
from orthoptim.optim.polargrad import PolarGrad
from orthoptim.optim.scion import Scion
from orthoptim.optim.soap import SOAP

MATRIX_OPTIMIZERS: dict[str, type[MatrixOptimizer]] = {
    "muon": Muon,
    "soap": SOAP,
    "normuon": NorMuon,
    "adamuon": AdaMuon,
    "polargrad": PolarGrad,
    "scion": Scion,
}

# every name `build_optimizer(optimizer=...)` takes: a matrix optimizer, or AdamW for all
OPTIMIZER_NAMES = (*MATRIX_OPTIMIZERS, "adamw")
