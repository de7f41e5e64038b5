"""Which path serves Newton-Schulz on a CPU matrix: measured on the machine it runs on.

A *path* is how the symmetric products of one Newton-Schulz iteration are computed:

- "matmul": the plain iteration, every product a general one (X·Xᵀ, A·A, B·X);
- "cpu_syrk": the plain iteration, X·Xᵀ and b·A + c·A·A by the blocked SYRK (`syrk_cpu`);
- "gram_form": the iteration on the m×m Gram matrix (`newton_schulz_gram_form`), general
  products; "gram_form_syrk": the same with the blocked SYRK and one-triangle products.

Without a measurement the path is "matmul": it never loses to itself. The first time a *shape
class* is met, the products each path is made of are raced side by side on the matrix itself
(a first call, then round-robin repeats while the budget `BUDGET_S` lasts, at most `REPEATS`,
of the products of the paths still within `PRUNE` of the best; minimum time per product) and
the path whose run of `RUN_STEPS` steps adds up fastest wins; a path other than "matmul" has
to win by `MARGIN`. A shape class is (CPU model, torch
version, thread count, dtype, one matrix or a stack, rows and columns rounded to the nearest
half octave): the first shape met speaks for its class.

Decisions are kept in memory and in a JSON file, `cache_path()`
(`$XDG_CACHE_HOME/orthoptim/kernels-cpu.json`, default `~/.cache/orthoptim/`), written
atomically (a temporary file renamed over it), so later processes take the cached winner
without measuring. `orthoptim bench syrk --tune` measures a list of shapes afresh and fills
the file.

Measuring is off with `ORTHOPTIM_KERNEL_CALIBRATION=0`, and inside a distributed job (a
`torch.distributed` group is initialised, or WORLD_SIZE > 1): ranks timing for themselves
could decide differently, and the layering keeps process groups out of this package. There
the cache file decides (all ranks on a machine read the same file: fill it before the job
with `orthoptim bench syrk --tune`, on every machine of the job), else the plain product.
No collective is added for this: a rank-consistent race (rank 0 measures and broadcasts)
would have to live in `orthoptim.collectives`, which this package does not import. Under
`torch.compile` nothing is measured either (`kernels.path_for` takes the plain product).
"""

from __future__ import annotations

import datetime
import functools
import json
import math
import os
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor

from orthoptim.fileio import atomic_write_json
from orthoptim.kernels import syrk_cpu
from orthoptim.ns_cost import (
    GRAM_FORM_ASPECT,
    GRAM_FORM_RESTART,
    GRAM_PATHS,
    SYRK_PATHS,
    PathName,
)

CALIBRATION_ENV = "ORTHOPTIM_KERNEL_CALIBRATION"
CACHE_NAME = "kernels-cpu.json"
CACHE_FORMAT = 1
Reason = Literal["measured", "cached", "default", "forced", "not raced"]
# Seconds of racing per shape class, first calls included: no repeat is begun that would end
# past it (every product is called once, so a shape whose products take longer overruns).
BUDGET_S = 0.9
# A path whose time is more than this many times the best path's after a round is raced no
# further.
PRUNE = 1.5
# At most this many round-robin repeats after the first calls.
REPEATS = 5
# A path other than the plain product wins only by this fraction (timing noise on a shared
# machine is a few per cent).
MARGIN = 0.03
# The steps a path is compared over: one restart run of the Gram form
# (`ns_cost.GRAM_FORM_RESTART`).
RUN_STEPS = GRAM_FORM_RESTART
# Fewer rows than this: the plain product, unraced (products of microseconds, where a race
# would cost more than any path could save).
MIN_ROWS = 64
_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Decision:
    """The path serving a shape class and why: measured here, read from the cache file, the
    default (plain product), forced, or not raced (a size or dtype no other path serves).
    `ms`: each path's modelled time of RUN_STEPS steps (measured or cached)."""

    path: PathName
    reason: Reason
    key: str = ""
    shape: tuple[int, int, int] = (0, 0, 0)
    dtype: str = ""
    ms: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def describe(self) -> str:
        """One line: shape, dtype, path, why, and the timings behind it."""
        b, m, n = self.shape
        shape = f"{m}x{n}" if b == 1 else f"{b}x{m}x{n}"
        line = f"{shape} {self.dtype}: {self.path} ({self.reason}"
        if self.ms:
            times = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(self.ms.items(), key=_by_ms))
            line += f": {RUN_STEPS} steps {times}"
        if self.seconds:
            line += f"; raced in {self.seconds:.2f} s"
        return line + ")"


def _by_ms(item: tuple[str, float]) -> float:
    return item[1]


def measuring_enabled() -> bool:
    """Whether this process may race paths: not turned off by ORTHOPTIM_KERNEL_CALIBRATION and
    not a rank of a distributed job (where only the cache file decides)."""
    if os.environ.get(CALIBRATION_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return not _distributed()


def _distributed() -> bool:
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return True
    except ValueError:
        pass
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def cache_path() -> Path:
    """The decisions file: $XDG_CACHE_HOME/orthoptim/kernels-cpu.json (~/.cache by default)."""
    root = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".cache"
    )
    return Path(root) / "orthoptim" / CACHE_NAME


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _half_octave(x: int) -> int:
    return round(2 * math.log2(max(1, x)))


def class_key(dtype: torch.dtype, batch: int, m: int, n: int, threads: int) -> str:
    """The cache key of a shape class: CPU model, torch version, threads, dtype, single or
    stacked, rows and columns rounded to the nearest half octave (shown as that size)."""
    sizes = "x".join(f"{2 ** (_half_octave(v) / 2):.0f}" for v in (m, n))
    kind = "stack" if batch > 1 else "single"
    dt = str(dtype).removeprefix("torch.")
    return f"{cpu_model()}|torch {torch.__version__}|{threads} threads|{dt}|{kind}|{sizes}"


def eligible(dtype: torch.dtype, m: int, n: int) -> tuple[PathName, ...]:
    """The paths worth racing for an m×n matrix: the blocked SYRK only where it splits (more
    rows than `syrk_cpu.LEAF_ROWS`), the Gram form only for float32/float64 with n >= 2m."""
    if dtype not in _DTYPES or m < MIN_ROWS:
        return ("matmul",)
    found: list[PathName] = ["matmul"]
    split = m > syrk_cpu.LEAF_ROWS
    if split:
        found.append("cpu_syrk")
    if n >= GRAM_FORM_ASPECT * m:
        found.append("gram_form")
        if split:
            found.append("gram_form_syrk")
    return tuple(found)


# The quintic's first-step coefficients: any finite ones time the same.
_A, _B, _C = 3.4445, -4.7750, 2.0315


def _products(X: Tensor, paths: tuple[PathName, ...]) -> dict[str, Callable[[], Tensor]]:
    """The products the paths are made of, on X (its m×m Gram stands in for A)."""
    A = syrk_cpu.syrk_matmul(X)
    A = A / A.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(1e-30)
    calls: dict[str, Callable[[], Tensor]] = {
        "gram_matmul": lambda: syrk_cpu.syrk_matmul(X),
        "poly_matmul": lambda: syrk_cpu.syrk_matmul(A, A, _B, _C),
        "apply": lambda: syrk_cpu.product(A, X.mT, X, _A, 1.0),
    }
    if any(p in SYRK_PATHS for p in paths):
        calls["gram_syrk"] = lambda: syrk_cpu.syrk(X)
        calls["poly_syrk"] = lambda: syrk_cpu.syrk(A, A, _B, _C)
    if "gram_form" in paths:
        calls["sym_matmul"] = lambda: torch.matmul(A, A)
    if "gram_form_syrk" in paths:
        calls["sym_syrk"] = lambda: syrk_cpu.sym_matmul(A, A)
    return calls


def _needs(path: PathName) -> tuple[str, ...]:
    """The products `path_times` adds up for `path`."""
    impl = "syrk" if path in SYRK_PATHS else "matmul"
    sym = ("sym_syrk" if impl == "syrk" else "sym_matmul",) if path in GRAM_PATHS else ()
    return (f"gram_{impl}", f"poly_{impl}", "apply", *sym)


def path_times(t: dict[str, float], paths: tuple[PathName, ...]) -> dict[str, float]:
    """Each path's time for RUN_STEPS steps from its products' times `t`: the step form takes
    a Gram, a polynomial and an apply per step; the Gram form one Gram, a polynomial per step,
    2·(steps − 1) + (steps − 1) one-triangle products and one apply per run."""
    r = RUN_STEPS
    out: dict[str, float] = {}
    for p in paths:
        gram, poly, apply, *sym = (t[name] for name in _needs(p))
        if p in GRAM_PATHS:
            out[p] = gram + r * poly + 3 * (r - 1) * sym[0] + apply
        else:
            out[p] = r * (gram + poly + apply)
    return out


Racer = Callable[[Tensor, tuple[PathName, ...]], dict[str, float]]
# Seconds from an arbitrary origin, as `time.perf_counter` reads them.
Clock = Callable[[], float]


def race(
    X: Tensor, paths: tuple[PathName, ...], clock: Clock = time.perf_counter
) -> dict[str, float]:
    """Milliseconds per path (RUN_STEPS steps) on X, from its products timed side by side by
    `clock`: the first call of each is a sample too, then round-robin repeats (min time per
    product) while BUDGET_S lasts, of the products of the paths still within PRUNE of the best
    (a path's time only falls with more samples, so one that far behind cannot win)."""
    calls = _products(X, paths)
    start = clock()
    best: dict[str, float] = {}
    for name, fn in calls.items():
        t0 = clock()
        fn()
        best[name] = (clock() - t0) * 1e3
    for _ in range(REPEATS):
        ms = path_times(best, paths)
        live = [p for p in paths if ms[p] <= PRUNE * min(ms.values())]
        names = {n for p in live for n in _needs(p)}
        cost = sum(best[n] for n in names) * 1e-3
        if len(live) == 1 or clock() + cost - start > BUDGET_S:
            break
        for name in (n for n in calls if n in names):
            t0 = clock()
            calls[name]()
            best[name] = min(best[name], (clock() - t0) * 1e3)
    return path_times(best, paths)


def winner(ms: dict[str, float]) -> PathName:
    """The fastest path of `ms`; another than "matmul" only when faster by MARGIN."""
    best = min(ms, key=ms.__getitem__)
    if best != "matmul" and "matmul" in ms and ms[best] > (1 - MARGIN) * ms["matmul"]:
        best = "matmul"
    return best  # type: ignore[return-value]


class Calibrator:
    """Decisions per shape class: in memory, from the cache file, or raced (see the module).
    `racer` times the paths of a class (default: `race` timed by `clock`); `clock` also times
    the whole race (`Decision.seconds`)."""

    def __init__(self, racer: Racer | None = None, clock: Clock = time.perf_counter) -> None:
        self.clock = clock
        self.racer: Racer = racer or functools.partial(race, clock=clock)
        self._exact: dict[tuple[Any, ...], Decision] = {}
        self._classes: dict[str, Decision] = {}
        self._file: dict[str, dict[str, Any]] | None = None
        self._warned = False

    def forget(self) -> None:
        """Drop every decision and the file's contents read (they are read again on demand)."""
        self._exact.clear()
        self._classes.clear()
        self._file = None

    def decisions(self) -> list[Decision]:
        """Every class decided in this process, in the order first met."""
        return list(self._classes.values())

    def decide(self, X: Tensor, remeasure: bool = False) -> Decision:
        """The path for Newton-Schulz on X ([..., m, n], CPU), decided once per shape class.
        `remeasure` races even a class decided or cached, whatever `measuring_enabled` says
        (an explicit request: `orthoptim bench syrk --tune`), and rewrites its cache entry."""
        m, n = X.shape[-2], X.shape[-1]
        batch = math.prod(X.shape[:-2])
        threads = torch.get_num_threads()
        exact = (X.dtype, batch, m, n, threads)
        if not remeasure and exact in self._exact:
            return self._exact[exact]
        key = class_key(X.dtype, batch, m, n, threads)
        decision = None if remeasure else self._classes.get(key)
        if decision is None:
            decision = self._decide_class(X, key, (batch, m, n), remeasure)
            self._classes[key] = decision
        self._exact[exact] = decision
        return decision

    def _decide_class(
        self, X: Tensor, key: str, shape: tuple[int, int, int], remeasure: bool
    ) -> Decision:
        dtype = str(X.dtype).removeprefix("torch.")
        paths = eligible(X.dtype, shape[1], shape[2])
        if len(paths) == 1:
            return Decision("matmul", "not raced", key, shape, dtype)
        cached = None if remeasure else self._read().get(key)
        if cached is not None and cached.get("path") in paths:
            return Decision(cached["path"], "cached", key, shape, dtype, dict(cached.get("ms", {})))
        if not remeasure and not measuring_enabled():
            return Decision("matmul", "default", key, shape, dtype)
        start = self.clock()
        with torch.no_grad():
            ms = self.racer(X.detach(), paths)
        seconds = self.clock() - start
        decision = Decision(winner(ms), "measured", key, shape, dtype, ms, seconds)
        self._store(decision)
        return decision

    def _read(self) -> dict[str, dict[str, Any]]:
        if self._file is None:
            self._file = read_cache(cache_path())
        return self._file

    def _store(self, d: Decision) -> None:
        entry = {
            "path": d.path,
            "ms": d.ms,
            "shape": list(d.shape),
            "measured": datetime.date.today().isoformat(),
        }
        path = cache_path()
        try:
            entries = read_cache(path)  # another process may have added classes meanwhile
            entries[d.key] = entry
            write_cache(path, entries)
        except OSError as exc:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"orthoptim: cannot write the kernel decisions to {path} ({exc}); they are "
                    f"kept for this process only. Set XDG_CACHE_HOME to a writable directory, "
                    f"or {CALIBRATION_ENV}=0 to stop measuring.",
                    RuntimeWarning,
                    stacklevel=4,
                )
        self._read()[d.key] = entry


def read_cache(path: Path) -> dict[str, dict[str, Any]]:
    """The entries of a decisions file; {} when it is missing, and (with one warning) when it
    is unreadable: it is a cache, measuring again is the remedy."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        warnings.warn(
            f"orthoptim: ignoring the kernel decisions file {path} ({exc}); delete it or "
            "rewrite it with `orthoptim bench syrk --tune`",
            RuntimeWarning,
            stacklevel=2,
        )
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT:
        return {}
    entries = data.get("entries")
    return (
        {k: v for k, v in entries.items() if isinstance(v, dict)}
        if isinstance(entries, dict)
        else {}
    )


def write_cache(path: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Write the decisions file atomically (`fileio.atomic_write_json`: a temporary file in its
    directory, flushed and renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"format": CACHE_FORMAT, "entries": entries}
    atomic_write_json(doc, path, indent=1, sort_keys=True)


CALIBRATOR = Calibrator()
