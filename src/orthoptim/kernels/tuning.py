"""Which implementation serves a symmetric product on CUDA, per shape: measured, not guessed.

A *choice* is either `MATMUL` (torch's general product) or a `SyrkConfig` (tiles, warps,
stages and launch order of the Triton SYRK). Choices come from, in order:

1. a measured table for this GPU model: `orthoptim bench syrk --tune --write FILE` times
   every candidate (the plain product among them) side by side on a grid of shapes and
   writes the winners with all their timings. Tables are read from the package's
   `kernels/tables/*.json` and from the files named in `ORTHOPTIM_SYRK_TABLE`
   (os.pathsep-separated); a shape takes the winner of the nearest measured shape (log
   scale) of the same dtype, batch kind and epilogue, so every rank on the same GPU model
   decides alike;
2. with `ORTHOPTIM_SYRK_TUNE=1`, timing the candidates on first sight of a shape in this
   process (`triton_syrk.tune`). Each rank times for itself, so ranks may decide
   differently: use it to explore, and a table to train;
3. otherwise torch's product: a GPU model no table covers takes the one candidate that never
   loses to itself. The one exception is the model the row threshold `FALLBACK_MIN_ROWS`
   was measured on (`FALLBACK_DEVICES`, in bfloat16): `default_config` from that many rows.

This module does not import triton: tables and choices are plain data.
"""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

TABLE_ENV = "ORTHOPTIM_SYRK_TABLE"
TUNE_ENV = "ORTHOPTIM_SYRK_TUNE"
TABLE_DIR = Path(__file__).with_name("tables")
TABLE_FORMAT = 1
MATMUL = "matmul"
# Without a table: the Triton SYRK only on FALLBACK_DEVICES, in FALLBACK_DTYPE and from this many
# rows; every other GPU model takes torch's product until measured. Measured on one H200 (bf16,
# triton 3.6, the 128×128×64 tile of `default_config`): Gram of 2048² 0.033 ms against
# torch X@Xᵀ 0.027 (slower), 4096² 0.124 against 0.177 (faster); see docs/benchmarks.md.
FALLBACK_MIN_ROWS = 4096
FALLBACK_DTYPE = torch.bfloat16
FALLBACK_DEVICES = ("NVIDIA H200",)


@dataclass(frozen=True)
class SyrkConfig:
    """Tiles and launch order of one Triton SYRK launch.

    block_n is block_m or 2·block_m (a super-tile of block_n rows holds block_n/block_m
    program tiles). group: super-tile rows per band of the launch order (1: row-major).
    persistent: `programs_per_sm` programs per SM walk all the tiles, else one per tile.
    """

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    group: int = 1
    persistent: bool = False
    programs_per_sm: int = 1

    @property
    def name(self) -> str:
        """A short label: m×n×k, warps/stages, group, p(ersistent)."""
        tail = f"g{self.group}" + ("p" if self.persistent else "")
        return f"{self.block_m}x{self.block_n}x{self.block_k}_w{self.warps}s{self.stages}_{tail}"

    def smem_bytes(self, element_size: int) -> int:
        """Shared memory of the pipelined operand tiles."""
        return (self.block_m + self.block_n) * self.block_k * element_size * self.stages


Choice = str | SyrkConfig

# Candidates the tuner times, by input width in bytes. 16-bit: the tensor-core shapes Hopper
# favours (128×128 and 128×256 with 8 warps, 64-wide for small matrices); float32: TF32.
CANDIDATES: dict[int, tuple[SyrkConfig, ...]] = {
    2: (
        SyrkConfig(128, 128, 64, 8, 3),
        SyrkConfig(128, 128, 64, 8, 4, group=8, persistent=True),
        SyrkConfig(128, 256, 64, 8, 3, group=8, persistent=True),
        SyrkConfig(128, 256, 64, 8, 3),
        SyrkConfig(128, 128, 128, 8, 3, group=8, persistent=True),
        SyrkConfig(64, 128, 64, 4, 4, group=8),
        SyrkConfig(64, 64, 64, 4, 4),
    ),
    4: (
        SyrkConfig(64, 64, 32, 4, 3),
        SyrkConfig(128, 128, 32, 8, 3, group=8, persistent=True),
        SyrkConfig(64, 128, 32, 4, 3, group=8),
    ),
}
# Hopper's 228 KiB per SM, less room for barriers.
SMEM_LIMIT = 224 * 1024


def default_config(dtype: torch.dtype) -> SyrkConfig:
    """The config used without a table or tuning: the first candidate for the dtype's width."""
    return CANDIDATES[4 if dtype == torch.float32 else 2][0]


def candidates(m: int, dtype: torch.dtype) -> list[SyrkConfig]:
    """The configs worth timing for an m-row SYRK in `dtype`: within shared memory, and with
    super-tiles no wider than twice m rounded up to a power of two (at least 64)."""
    width = 4 if dtype == torch.float32 else 2
    cap = 2 * max(64, 1 << max(0, m - 1).bit_length())
    return [c for c in CANDIDATES[width] if c.smem_bytes(width) <= SMEM_LIMIT and c.block_n <= cap]


def choice_to_json(choice: Choice) -> Any:
    """A choice as a table stores it: "matmul" or the config's fields."""
    return choice if isinstance(choice, str) else asdict(choice)


def choice_from_json(data: Any) -> Choice:
    """A table's choice: "matmul" or the fields of a SyrkConfig (unknown fields refused)."""
    if data == MATMUL:
        return MATMUL
    if not isinstance(data, dict):
        raise ValueError(f"a SYRK table choice must be {MATMUL!r} or a config object, got {data!r}")
    try:
        return SyrkConfig(**data)
    except TypeError as exc:
        raise ValueError(f"a SYRK table choice has fields {sorted(data)}: {exc}") from exc


@dataclass(frozen=True)
class Entry:
    """One measured shape of a table and its winner."""

    dtype: str
    batch: int
    m: int
    n: int
    has_c: bool
    choice: Choice

    def distance(self, batch: int, m: int, n: int) -> float:
        """How far a shape is from this one: the sum of the log ratios of its sizes."""
        return (
            abs(math.log(self.m / m))
            + abs(math.log(self.n / n))
            + abs(math.log(self.batch / batch))
        )


def read_table(path: str | os.PathLike[str]) -> tuple[str, list[Entry]]:
    """(GPU name, entries) of a table file; a clear error naming the file when malformed."""
    try:
        data = json.loads(Path(path).read_text())
        if data.get("format") != TABLE_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {TABLE_FORMAT}")
        entries = [
            Entry(
                str(e["dtype"]),
                int(e["batch"]),
                int(e["m"]),
                int(e["n"]),
                bool(e["has_c"]),
                choice_from_json(e["choice"]),
            )
            for e in data["entries"]
        ]
        for e in entries:
            if min(e.batch, e.m, e.n) < 1:
                raise ValueError(f"entry {e} has a size below 1")
        return str(data["device"]), entries
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"SYRK table {os.fspath(path)!r} is unreadable ({type(exc).__name__}: {exc}); "
            f"rewrite it with `orthoptim bench syrk --tune --write FILE` or remove it from "
            f"{TABLE_ENV}"
        ) from exc


def write_table(
    path: str | os.PathLike[str], device: str, rows: Iterable[dict[str, Any]], **about: Any
) -> None:
    """Write a table: `rows` are dicts with dtype, batch, m, n, has_c, choice (a Choice) and
    the timings behind it (kept for the reader, ignored by the lookup)."""
    entries = [{**r, "choice": choice_to_json(r["choice"])} for r in rows]
    doc = {"format": TABLE_FORMAT, "device": device, **about, "entries": entries}
    Path(path).write_text(json.dumps(doc, indent=1, default=str) + "\n")


def table_paths() -> list[Path]:
    """The packaged tables, then those named in ORTHOPTIM_SYRK_TABLE (later ones win)."""
    packaged = sorted(TABLE_DIR.glob("*.json")) if TABLE_DIR.is_dir() else []
    named = [Path(p) for p in os.environ.get(TABLE_ENV, "").split(os.pathsep) if p.strip()]
    for p in named:
        if not p.is_file():
            raise ValueError(f"{TABLE_ENV} names {os.fspath(p)!r}, which is not a file")
    return packaged + named


@functools.cache
def _entries_for(device_name: str, paths: tuple[Path, ...]) -> tuple[Entry, ...]:
    found: list[Entry] = []
    for p in paths:
        name, entries = read_table(p)
        if name == device_name:
            found = [e for e in found if not any(_same_key(e, n) for n in entries)] + entries
    return tuple(found)


def _same_key(a: Entry, b: Entry) -> bool:
    return (a.dtype, a.batch, a.m, a.n, a.has_c) == (b.dtype, b.batch, b.m, b.n, b.has_c)


def lookup(
    entries: Sequence[Entry], dtype: torch.dtype, batch: int, m: int, n: int, has_c: bool
) -> Choice | None:
    """The winner of the nearest measured shape with the same dtype, epilogue and batch kind
    (one matrix or a stack), or None when the table has none."""
    name = str(dtype).removeprefix("torch.")
    pool = [
        e for e in entries if e.dtype == name and e.has_c == has_c and (e.batch > 1) == (batch > 1)
    ]
    if not pool:
        return None
    return min(pool, key=lambda e: e.distance(batch, m, n)).choice


Timer = Callable[[Callable[[], object]], float]


def cuda_timer(fn: Callable[[], object], repeats: int = 15, sample_ms: float = 0.5) -> float:
    """Median milliseconds per call of `fn` on the current CUDA stream, after one warm call.
    Each sample times enough back-to-back calls between two events to last `sample_ms`, so
    microsecond kernels are not measured against the event resolution."""

    def sample(calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls

    fn()
    calls = 1
    while calls < 1024 and sample(calls) * calls < sample_ms:
        calls *= 4
    return statistics.median(sample(calls) for _ in range(repeats))


def wall_timer(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median wall milliseconds of `fn` (CPU tensors, e.g. under the Triton interpreter)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_name(device: torch.device) -> str:
    """The name tables are keyed by: the GPU model ("NVIDIA H200"), else the device type."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


_decided: dict[tuple[Any, ...], Choice] = {}


Tuner = Callable[[Tensor, Tensor | None], tuple[Choice, dict[str, float]]]


def tuning_requested() -> bool:
    """Whether ORTHOPTIM_SYRK_TUNE asks to time the candidates of an unmeasured shape."""
    return os.environ.get(TUNE_ENV, "").strip().lower() in ("1", "true", "yes")


def choose(X: Tensor, has_c: bool, tuner: Tuner | None = None) -> Choice:
    """The implementation for beta·C + alpha·X·Xᵀ on X ([..., m, n]; the dispatch asks for
    CUDA tensors only); decided once per (device, dtype, batch, m, n, epilogue) here.
    `tuner` (`triton_syrk.tune`) times the candidates of a shape no table covers when
    ORTHOPTIM_SYRK_TUNE is set."""
    m, n = X.shape[-2], X.shape[-1]
    batch = math.prod(X.shape[:-2])
    key = _key(X, has_c)
    found = _decided.get(key)
    if found is not None:
        return found
    if min(batch, m, n) == 0:
        return MATMUL  # nothing to compute
    device = device_name(X.device)
    entries = _entries_for(device, tuple(table_paths()))
    choice = lookup(entries, X.dtype, batch, m, n, has_c)
    if choice is None and tuner is not None and tuning_requested():
        X3 = X.reshape(-1, m, n)
        C3 = torch.zeros(X3.shape[0], m, m, dtype=X.dtype, device=X.device) if has_c else None
        choice, _ = tuner(X3, C3)
    if choice is None:
        measured = (
            device in FALLBACK_DEVICES and X.dtype == FALLBACK_DTYPE and m >= FALLBACK_MIN_ROWS
        )
        choice = default_config(X.dtype) if measured else MATMUL
    _decided[key] = choice
    return choice


def _key(X: Tensor, has_c: bool) -> tuple[Any, ...]:
    return (X.device, X.dtype, math.prod(X.shape[:-2]), X.shape[-2], X.shape[-1], has_c)


def refuse(X: Tensor, has_c: bool, config: SyrkConfig, error: Exception) -> None:
    """Serve this shape with torch's product from now on, saying once why: `config` failed
    on it (a config this triton or GPU cannot build), so results go on, slower."""
    _decided[_key(X, has_c)] = MATMUL
    warnings.warn(
        f"orthoptim: the Triton SYRK {config.name} failed on {tuple(X.shape)} "
        f"{str(X.dtype).removeprefix('torch.')} ({type(error).__name__}: {error}); torch's "
        f"product serves this shape instead. Re-measure with `orthoptim bench syrk --tune`, "
        f"or set ORTHOPTIM_KERNELS=matmul.",
        RuntimeWarning,
        stacklevel=3,
    )


def forget() -> None:
    """Drop every decision and cached table (after changing ORTHOPTIM_SYRK_TABLE)."""
    _decided.clear()
    _entries_for.cache_clear()
