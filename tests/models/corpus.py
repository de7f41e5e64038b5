"""A small text corpus for training runs in tests: loading the stdlib source costs seconds."""

import random
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "def", "return", "(x)", "self", "=", "\n"]


def write_corpus(folder: Path, words: int = 6000) -> str:
    """`words` seeded words of WORDS written to FOLDER/text.txt; its path, as --data takes it."""
    rng = random.Random(0)
    path = folder / "text.txt"
    path.write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
    return str(path)
