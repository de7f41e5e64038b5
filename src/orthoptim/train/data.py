"""The training text: the Python standard library's source by default, or the user's own.

The default corpus is every `*.py` file under `sysconfig.get_paths()["stdlib"]` (outside
site-packages): real text that ships with every Python, so training needs no download.
Files are listed in sorted order and split into train and validation *by file* with a fixed
seed, so the two splits never share a file. A single file (`--data FILE`) cannot be split by
file: its last `val_fraction` of bytes is the validation split.

Batches are a pure function of (seed, step, rank): a resumed run sees exactly the batches an
uninterrupted one would, with no sampler state to checkpoint.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from orthoptim.train.model import CONFIGS

SPLIT_SEED = 20240601
VAL_FRACTION = 0.02
# Bytes other than these in a file's head mark it as binary (text has tab/newline/CR/FF/ESC).
_TEXT_CONTROL = {7, 8, 9, 10, 11, 12, 13, 27}
_BINARY_SNIFF = 8192


class DataError(ValueError):
    """The corpus cannot be used: the message names the file or folder and the fix."""


@dataclass
class Corpus:
    """Train and validation byte streams, and where they came from."""

    train: Tensor  # uint8, 1-D
    val: Tensor  # uint8, 1-D
    source: str
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"{self.source}: {len(self.train_files)} train files ({self.train.numel():,} bytes), "
            f"{len(self.val_files)} validation files ({self.val.numel():,} bytes)"
        )


def stdlib_root() -> Path:
    """Where this interpreter's standard library source lives."""
    return Path(sysconfig.get_paths()["stdlib"])


def _walk(root: Path, suffix: str | None) -> list[Path]:
    """Regular files under root, sorted by relative path; skips hidden entries, caches, and
    site-packages (third-party code is not the standard library)."""
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d
            for d in dirnames
            if not d.startswith(".") and d not in ("__pycache__", "site-packages")
        ]
        for name in filenames:
            if name.startswith(".") or (suffix and not name.endswith(suffix)):
                continue
            path = Path(dirpath, name)
            if path.is_file():
                files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def is_binary(head: bytes) -> bool:
    """True for data that is not text: a NUL byte, or > 10 % control bytes in the head."""
    if b"\0" in head:
        return True
    if not head:
        return False
    control = sum(1 for b in head if b < 32 and b not in _TEXT_CONTROL)
    return control > 0.1 * len(head)


def read_text(path: Path) -> bytes:
    """The bytes of a text file; a binary file is a DataError naming it."""
    data = path.read_bytes()
    if is_binary(data[:_BINARY_SNIFF]):
        raise DataError(
            f"--data: {path} looks binary (NUL or control bytes), not text; "
            "pass text files only (remove it from the folder or point --data elsewhere)"
        )
    return data


def split_files(files: list[str], val_fraction: float, seed: int) -> tuple[list[str], list[str]]:
    """Deterministic split of a sorted file list: a seeded shuffle picks the validation files.

    At least one file goes to each side; both lists come back in sorted order.
    """
    if len(files) < 2:
        raise ValueError(f"split_files needs at least 2 files, got {len(files)}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n_val = min(len(files) - 1, max(1, round(val_fraction * len(files))))
    order = np.random.default_rng(seed).permutation(len(files))
    val_idx = set(order[:n_val].tolist())
    train = [f for i, f in enumerate(files) if i not in val_idx]
    val = [f for i, f in enumerate(files) if i in val_idx]
    return train, val


def _concat(chunks: list[bytes]) -> Tensor:
    data = b"".join(chunks)
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def load_corpus(
    data: str | os.PathLike[str] | None = None,
    val_fraction: float = VAL_FRACTION,
    seed: int = SPLIT_SEED,
    min_bytes: int = 2,
) -> Corpus:
    """Load the corpus: the stdlib source (data=None), a text file, or a folder of text files.

    Each split must hold at least `min_bytes` bytes (the loop passes seq_len + 1); a file
    that is empty (given on its own) or binary, an empty folder, a path that is neither a
    regular file nor a folder (a device, a FIFO), or a split too short to cut one training
    window is a DataError that says what to change.
    """
    if data is None:
        root = stdlib_root()
        paths = _walk(root, ".py")
        source = f"Python {sys.version_info[0]}.{sys.version_info[1]} stdlib ({root})"
        if len(paths) < 2:
            raise DataError(
                f"found {len(paths)} .py files under the stdlib folder {root}; "
                "pass --data PATH with your own text"
            )
    else:
        root = Path(data).expanduser()
        if not root.exists():
            raise DataError(f"--data: {root} does not exist; pass a text file or a folder")
        if root.is_file():
            paths = [root]
        elif not root.is_dir():
            raise DataError(
                f"--data: {root} is neither a regular file nor a folder (a device, FIFO or "
                "socket); pass a text file or a folder of them"
            )
        else:
            paths = _walk(root, None)
            if not paths:
                raise DataError(f"--data: the folder {root} holds no files")
        source = str(root)

    if len(paths) == 1:
        path = paths[0]
        text = read_text(path)
        if not text:
            raise DataError(f"--data: {path} is empty; pass a file with text in it")
        cut = max(0, len(text) - max(min_bytes, round(val_fraction * len(text))))
        train, val = _concat([text[:cut]]), _concat([text[cut:]])
        corpus = Corpus(train, val, source, [str(path)], [str(path)])
    else:
        names = [p.relative_to(root).as_posix() for p in paths]
        train_names, val_names = split_files(names, val_fraction, seed)
        train = _concat([read_text(root / n) for n in train_names])
        val = _concat([read_text(root / n) for n in val_names])
        corpus = Corpus(train, val, source, train_names, val_names)

    for split, t in (("train", corpus.train), ("validation", corpus.val)):
        if t.numel() < min_bytes:
            shortest = min(c.seq_len for c in CONFIGS.values())
            name = next(n for n, c in CONFIGS.items() if c.seq_len == shortest)
            shorter = f", or pass --config {name} ({shortest}-byte context)"
            raise DataError(
                f"--data: the {split} split of {source} has {t.numel()} bytes, fewer than the "
                f"{min_bytes} one training window needs; add text"
                + (shorter if shortest + 1 < min_bytes else "")
            )
    return corpus


def _windows(
    data: Tensor, rng: np.random.Generator, batch: int, seq_len: int
) -> tuple[Tensor, Tensor]:
    starts = rng.integers(0, data.numel() - seq_len, size=batch)
    idx = torch.from_numpy(starts)[:, None] + torch.arange(seq_len + 1)
    windows = data[idx].long()
    return windows[:, :-1], windows[:, 1:]


def get_batch(
    data: Tensor, batch: int, seq_len: int, seed: int, step: int, rank: int
) -> tuple[Tensor, Tensor]:
    """`batch` random windows of `data` for (seed, step, rank): inputs and next-byte targets."""
    return _windows(data, np.random.default_rng([seed, 1, step, rank]), batch, seq_len)


def val_batches(
    data: Tensor, n_batches: int, batch: int, seq_len: int, seed: int
) -> list[tuple[Tensor, Tensor]]:
    """A fixed set of validation batches, the same at every evaluation and on every rank."""
    rng = np.random.default_rng([seed, 2])
    return [_windows(data, rng, batch, seq_len) for _ in range(n_batches)]
