"""The main job: a byte-level GPT trained on the Python stdlib source with Muon or AdamW.

Its public names are imported on first use (`orthoptim.lazy`): `orthoptim train --help`
imports no torch."""

from typing import TYPE_CHECKING

from orthoptim.lazy import lazy_exports

_EXPORTS = {
    "TrainArgs": "orthoptim.train.args",
    "Corpus": "orthoptim.train.data",
    "DataError": "orthoptim.train.data",
    "load_corpus": "orthoptim.train.data",
    "launch": "orthoptim.train.launcher",
    "run": "orthoptim.train.launcher",
    "CONFIGS": "orthoptim.train.model",
    "GPT": "orthoptim.train.model",
    "GPTConfig": "orthoptim.train.model",
}

__all__ = [
    "CONFIGS",
    "GPT",
    "Corpus",
    "DataError",
    "GPTConfig",
    "TrainArgs",
    "launch",
    "load_corpus",
    "run",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from orthoptim.train.args import TrainArgs
    from orthoptim.train.data import Corpus, DataError, load_corpus
    from orthoptim.train.launcher import launch, run
    from orthoptim.train.model import CONFIGS, GPT, GPTConfig
