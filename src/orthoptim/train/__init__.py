"""The main job: a byte-level GPT trained on the Python stdlib source with Muon or AdamW."""

from orthoptim.train.args import TrainArgs
from orthoptim.train.data import Corpus, DataError, load_corpus
from orthoptim.train.launcher import launch, run
from orthoptim.train.model import CONFIGS, GPT, GPTConfig

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
