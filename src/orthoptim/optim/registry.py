"""The optimizers by name: the matrix optimizers `build_optimizer(optimizer=...)`, `orthoptim
train --optimizer` and the distributed optimizers accept (each keeps the contract of
`orthoptim.optim.contract.MatrixOptimizer`, so nothing else needs to know it by name), and the
elementwise optimizers of the non-matrix part (`build_optimizer(elementwise=...)`)."""

from __future__ import annotations

import torch

from orthoptim.choices import (  # noqa: F401 (the registry's names, read from here too)
    OPTIMIZER_NAMES,
    ElementwiseOptimizerName,
    MatrixOptimizerName,
    OptimizerName,
)
from orthoptim.optim.adamuon import AdaMuon
from orthoptim.optim.contract import MatrixOptimizer
from orthoptim.optim.lion import Lion
from orthoptim.optim.muon import Muon
from orthoptim.optim.normuon import NorMuon
from orthoptim.optim.polargrad import PolarGrad
from orthoptim.optim.scion import Scion
from orthoptim.optim.soap import SOAP

# the names are `orthoptim.choices`' (torch-free, for the command's parser)
MATRIX_OPTIMIZERS: dict[MatrixOptimizerName, type[MatrixOptimizer]] = {
    "muon": Muon,
    "soap": SOAP,
    "normuon": NorMuon,
    "adamuon": AdaMuon,
    "polargrad": PolarGrad,
    "scion": Scion,
}

# the optimizers of the non-matrix part (embeddings, heads, vectors), with their state
# elements per parameter element (AdamW: two moments; Lion: one)
ELEMENTWISE_OPTIMIZERS: dict[ElementwiseOptimizerName, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "lion": Lion,
}
ELEMENTWISE_STATE = {"adamw": 2, "lion": 1}


def state_kinds_of(optimizer: str) -> dict[str, str]:
    """The `state_kinds` of the optimizer named `optimizer` ({} for an elementwise one: all of
    its state is elementwise)."""
    cls = MATRIX_OPTIMIZERS.get(optimizer)
    return dict(cls.state_kinds) if cls is not None else {}


def is_elementwise(kind: str) -> bool:
    """Whether units of `kind` are stepped elementwise (no owner needed: sharded over ranks)."""
    return kind in ELEMENTWISE_OPTIMIZERS
