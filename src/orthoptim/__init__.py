"""orthoptim: matrix-aware optimizers (Muon and its variants, SOAP) at data-, tensor-, expert-
and pipeline-parallel scale."""

import atexit
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from orthoptim.lazy import lazy_exports

__version__ = "0.1.0"

# Each public name and the module that defines it, imported on first use (`lazy_exports`):
# `import orthoptim` imports no torch, so the `orthoptim` command's --help, --version and
# usage errors answer without it (`orthoptim.cli`).
_EXPORTS = {
    name: module
    for module, names in {
        "orthoptim.newton_schulz": "COEFFICIENT_SETS newton_schulz polar_factor",
        "orthoptim.optim": "SOAP AdaMuon HybridOptimizer Lion MatrixOptimizer Muon NorMuon "
        "PolarGrad Scion build_optimizer routing_table",
        "orthoptim.optim.base": "NonFiniteGradientError",
        "orthoptim.optim.guards": "ParameterSetError SteppedTwiceError",
        "orthoptim.optim.qk_clip": "QKClip",
        "orthoptim.optim.routing": "explain_routing",
        "orthoptim.parallel": "FSDPOptimizer LayerwiseDistributedOptimizer ParallelDims",
        "orthoptim.parallel.base": "StepRefusedError",
        "orthoptim.telemetry": "Telemetry",
    }.items()
    for name in names.split()
}

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


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


@atexit.register
def _end_at_exit() -> None:
    """Registered when orthoptim is imported (so it runs after the program's own exit
    handlers registered later): where the program used torch.distributed, end its process
    group while the interpreter still serves gloo's threads (`collectives.teardown`). A
    program that only asked for --help imported no torch and does nothing here."""
    if "torch.distributed" in sys.modules:
        from orthoptim.collectives import teardown

        teardown.end_at_exit()


class _Package(ModuleType):
    """The package's module: importing submodule `orthoptim.newton_schulz` binds the
    function of that name here, as the package exported it before it became lazy."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, ModuleType) and value.__name__ == _EXPORTS.get(name):
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if TYPE_CHECKING:
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
