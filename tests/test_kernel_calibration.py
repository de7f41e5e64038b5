"""The CPU path choice of `kernels.calibration`: the faster path wins a race, the plain product
wins without one, decisions round-trip through the cache file keyed by machine and shape class,
and measuring stays off where asked (environment variable, distributed jobs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from orthoptim import kernels, ns_cost
from orthoptim.kernels import calibration, syrk_cpu
from orthoptim.kernels.calibration import Calibrator
from orthoptim.newton_schulz import newton_schulz
from orthoptim.ns_cost import PathName


@pytest.fixture
def measuring(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Measuring on, a fresh cache directory, a small leaf so small matrices split; returns
    the cache file."""
    monkeypatch.setenv(calibration.CALIBRATION_ENV, "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(syrk_cpu, "LEAF_ROWS", 16)
    monkeypatch.setattr(calibration, "MIN_ROWS", 8)
    return tmp_path / "orthoptim" / calibration.CACHE_NAME


class PlantedClock:
    """A clock that moves only by the planted time of each call made through `costing`, so a
    race decides on planted times whatever the machine's load."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def costing(self, fn: Callable[..., Any], *ms: float) -> Callable[..., Any]:
        """`fn` taking ms[i] milliseconds on this clock at its i-th call (the last one for
        every call after)."""
        count = 0

        def timed(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            self.now += ms[min(count, len(ms) - 1)] * 1e-3
            count += 1
            return fn(*args, **kwargs)

        return timed


def _refuse(X: torch.Tensor, paths: tuple[PathName, ...]) -> dict[str, float]:
    raise AssertionError("measured although it must not")


def _planted(ms: dict[str, float]):
    calls = []

    def racer(X: torch.Tensor, paths: tuple[PathName, ...]) -> dict[str, float]:
        calls.append((tuple(X.shape), paths))
        return {p: ms[p] for p in paths}

    racer.calls = calls  # type: ignore[attr-defined]
    return racer


def test_the_race_picks_the_faster_path_against_a_planted_slow_one(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real products, raced on a clock where a SYRK call takes 3 ms and a plain one 1 ms
    (the apply, common to both paths, takes none), then the other way round."""
    X = torch.randn(48, 60)  # n < 2m: the step form only, plain against blocked SYRK
    steps = calibration.RUN_STEPS  # a Gram and a polynomial per step, in either path
    cases = (
        ("syrk", "syrk_matmul", {"matmul": steps * 2 * 1.0, "cpu_syrk": steps * 2 * 3.0}),
        ("syrk_matmul", "syrk", {"matmul": steps * 2 * 3.0, "cpu_syrk": steps * 2 * 1.0}),
    )
    for i, (slow, fast, want) in enumerate(cases):
        clock = PlantedClock()
        with monkeypatch.context() as mp:
            mp.setattr(syrk_cpu, slow, clock.costing(getattr(syrk_cpu, slow), 3.0))
            mp.setattr(syrk_cpu, fast, clock.costing(getattr(syrk_cpu, fast), 1.0))
            # the second case remeasures: the file holds the first one's decision
            d = Calibrator(clock=clock).decide(X, remeasure=i > 0)
        assert (d.path, d.reason) == (min(want, key=want.__getitem__), "measured")
        assert d.ms == pytest.approx(want)
        assert d.seconds == pytest.approx(clock.now)  # the whole race, on the same clock


def test_the_paths_add_up_from_their_products() -> None:
    t = {"gram_matmul": 10.0, "poly_matmul": 3.0, "apply": 10.0, "sym_matmul": 3.0}
    t |= {"gram_syrk": 6.0, "poly_syrk": 2.0, "sym_syrk": 2.0}
    ms = calibration.path_times(t, ns_cost.PATHS)
    assert ms == {
        "matmul": 3 * (10 + 3 + 10),
        "cpu_syrk": 3 * (6 + 2 + 10),
        "gram_form": 10 + 3 * 3 + 6 * 3 + 10,
        "gram_form_syrk": 6 + 3 * 2 + 6 * 2 + 10,
    }
    assert calibration.winner(ms) == "gram_form_syrk"
    # another path must beat the plain product by MARGIN, else the plain product serves
    close = 1 - calibration.MARGIN / 2
    assert calibration.winner({"matmul": 100.0, "cpu_syrk": 100.0 * close}) == "matmul"
    assert calibration.winner({"matmul": 100.0, "cpu_syrk": 90.0}) == "cpu_syrk"
    leaf = syrk_cpu.LEAF_ROWS
    assert calibration.eligible(torch.float32, leaf + 1, 2 * leaf + 2) == ns_cost.PATHS
    assert calibration.eligible(torch.float64, leaf, 4 * leaf) == ("matmul", "gram_form")
    assert calibration.eligible(torch.float32, leaf + 1, leaf + 1) == ("matmul", "cpu_syrk")
    assert calibration.eligible(torch.bfloat16, 512, 2048) == ("matmul",)
    assert calibration.eligible(torch.float32, 4, 4096) == ("matmul",)


def test_a_measured_decision_drives_newton_schulz(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels.forget()
    planted = _planted({"matmul": 9.0, "cpu_syrk": 8.0, "gram_form": 7.0, "gram_form_syrk": 1.0})
    monkeypatch.setattr(calibration, "CALIBRATOR", Calibrator(planted))
    seen: list[str] = []
    real = kernels.syrk_for
    monkeypatch.setattr(
        kernels, "syrk_for", lambda Z: seen.append(kernels.path_for(Z).path) or real(Z)
    )
    G = torch.randn(40, 100)
    got = newton_schulz(G)
    assert seen == ["gram_form_syrk"] and len(planted.calls) == 1
    with kernels.force_matmul():
        plain = newton_schulz(G)
    assert kernels.gram_form_pays(G) and kernels.backend_for(G) == "cpu_syrk"
    assert (got - plain).abs().max().item() < 1e-4
    assert [d.path for d in kernels.decisions()] == ["gram_form_syrk"]
    assert (
        "gram_form_syrk (measured: 3 steps gram_form_syrk 1.0 ms"
        in kernels.decisions()[0].describe()
    )


def test_the_cache_file_round_trips_keyed_by_machine_and_class(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ms = {"matmul": 5.0, "cpu_syrk": 2.0, "gram_form": 4.0, "gram_form_syrk": 3.0}
    first = Calibrator(_planted(ms))
    d = first.decide(torch.randn(40, 60))
    assert (d.path, d.reason) == ("cpu_syrk", "measured")
    assert calibration.cache_path() == measuring and measuring.is_file()
    assert [p.name for p in measuring.parent.iterdir()] == [measuring.name]  # no temporary left
    doc = json.loads(measuring.read_text())
    assert doc["format"] == calibration.CACHE_FORMAT
    ((key, entry),) = doc["entries"].items()
    threads = torch.get_num_threads()
    assert key == d.key == calibration.class_key(torch.float32, 1, 40, 60, threads)
    assert calibration.cpu_model() in key and torch.__version__ in key
    assert f"{threads} threads" in key and "float32" in key and "single" in key
    assert entry["path"] == "cpu_syrk" and entry["ms"] == {"matmul": 5.0, "cpu_syrk": 2.0}

    # a new process: the file decides, nothing is measured, for any shape of the class
    fresh = Calibrator(_refuse)
    for shape in ((40, 60), (42, 62), (44, 56)):
        d = fresh.decide(torch.randn(*shape))
        assert (d.path, d.reason) == ("cpu_syrk", "cached"), shape
    # another class, dtype, batch kind, thread count, CPU model or torch version is measured
    again = _planted(ms)
    other = Calibrator(again)
    other.decide(torch.randn(80, 60))  # rows an octave up
    other.decide(torch.randn(40, 60, dtype=torch.float64))
    other.decide(torch.randn(2, 40, 60))
    with monkeypatch.context() as mp:
        mp.setattr(torch, "get_num_threads", lambda: threads + 1)
        other.decide(torch.randn(40, 60))
    with monkeypatch.context() as mp:
        mp.setattr(calibration, "cpu_model", lambda: "Planted CPU 9000")
        Calibrator(again).decide(torch.randn(40, 60))
    with monkeypatch.context() as mp:
        mp.setattr(torch, "__version__", "9.9.9")
        Calibrator(again).decide(torch.randn(40, 60))
    assert len(again.calls) == 6
    assert len(json.loads(measuring.read_text())["entries"]) == 7  # merged, none lost
    # remeasuring replaces the cached entry
    d = Calibrator(_planted({**ms, "matmul": 1.0})).decide(torch.randn(80, 60), remeasure=True)
    assert (d.path, d.reason) == ("matmul", "measured")


def test_an_unreadable_cache_is_ignored_with_a_warning(measuring: Path) -> None:
    measuring.parent.mkdir(parents=True)
    measuring.write_text("{not json")
    with pytest.warns(RuntimeWarning, match="kernels-cpu.json"):
        d = Calibrator(_planted({"matmul": 1.0, "cpu_syrk": 2.0})).decide(torch.randn(40, 60))
    assert (d.path, d.reason) == ("matmul", "measured")
    assert json.loads(measuring.read_text())["entries"]  # rewritten whole


def test_the_environment_variable_turns_measuring_off(
    measuring: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(calibration.CALIBRATION_ENV, "0")
    d = Calibrator(_refuse).decide(torch.randn(40, 60))
    assert (d.path, d.reason) == ("matmul", "default")
    assert not measuring.exists()
    # the cache file, written before, still decides
    key = calibration.class_key(torch.float32, 1, 40, 60, torch.get_num_threads())
    calibration.write_cache(measuring, {key: {"path": "cpu_syrk", "ms": {}}})
    d = Calibrator(_refuse).decide(torch.randn(40, 60))
    assert (d.path, d.reason) == ("cpu_syrk", "cached")
    # a cached path the shape cannot take is not used (the Gram form on a square matrix)
    sq = calibration.class_key(torch.float32, 1, 40, 40, torch.get_num_threads())
    calibration.write_cache(measuring, {sq: {"path": "gram_form", "ms": {}}})
    assert Calibrator(_refuse).decide(torch.randn(40, 40)).path == "matmul"


def test_no_measuring_inside_a_distributed_job(
    measuring: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")  # torchrun's ranks, before their group exists
    assert not calibration.measuring_enabled()
    assert Calibrator(_refuse).decide(torch.randn(40, 60)).reason == "default"
    monkeypatch.delenv("WORLD_SIZE")
    assert calibration.measuring_enabled()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        assert not calibration.measuring_enabled()
        assert Calibrator(_refuse).decide(torch.randn(40, 60)).reason == "default"
    finally:
        dist.destroy_process_group()


def test_small_and_half_precision_matrices_are_not_raced(measuring: Path) -> None:
    cal = Calibrator(_refuse)
    assert cal.decide(torch.randn(4, 600)).reason == "not raced"
    assert cal.decide(torch.randn(40, 60, dtype=torch.bfloat16)).reason == "not raced"
    with kernels.force_matmul():
        assert kernels.path_for(torch.randn(40, 60)).reason == "forced"


def _planted_products(
    monkeypatch: pytest.MonkeyPatch, ms: dict[str, tuple[float, ...]]
) -> tuple[PlantedClock, dict[str, int]]:
    """The race's products replaced by ones taking `ms[name]` milliseconds on the returned
    clock (per call, as `PlantedClock.costing`), each call counted."""
    clock = PlantedClock()
    calls = dict.fromkeys(ms, 0)

    def product(name: str) -> Callable[[], None]:
        def run() -> None:
            calls[name] += 1

        return clock.costing(run, *ms[name])

    monkeypatch.setattr(calibration, "_products", lambda X, paths: {n: product(n) for n in ms})
    return clock, calls


def test_the_race_stops_timing_a_path_that_cannot_win(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first round a path over PRUNE times the best is timed no further; the close
    ones are repeated REPEATS times while the budget lasts, each product's fastest call
    counting."""
    monkeypatch.setattr(calibration, "PRUNE", 1.5)
    planted = {"gram_matmul": (2,), "poly_matmul": (1,), "apply": (2,), "sym_matmul": (1, 0.6)}
    planted |= {"gram_syrk": (40,), "poly_syrk": (1,)}
    clock, calls = _planted_products(monkeypatch, planted)
    ms = calibration.race(torch.zeros(4, 8), ("matmul", "cpu_syrk", "gram_form"), clock=clock)
    # after the first calls gram_form 2 + 3·1 + 6·1 + 2 = 13 is best; matmul 3·(2 + 1 + 2) = 15
    # is within PRUNE = 1.5 of it, cpu_syrk 3·(40 + 1 + 2) = 129 is not; the repeats bring
    # gram_form down to 2 + 3·1 + 6·0.6 + 2 = 10.6
    assert ms == pytest.approx({"matmul": 15.0, "cpu_syrk": 129.0, "gram_form": 10.6})
    assert calls["gram_syrk"] == calls["poly_syrk"] == 1
    assert calls["gram_matmul"] == calls["sym_matmul"] == 1 + calibration.REPEATS
    assert calibration.winner(ms) == "gram_form"


def test_the_race_repeats_only_while_the_budget_lasts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Products of 50 ms, two paths alike (neither pruned): the first round takes 250 ms and
    each repeat 250 ms more, so two of five repeats fit in a budget of 0.9 s and a third would
    end past it."""
    monkeypatch.setattr(calibration, "BUDGET_S", 0.9)
    monkeypatch.setattr(calibration, "REPEATS", 5)
    names = ("gram_matmul", "poly_matmul", "apply", "gram_syrk", "poly_syrk")
    clock, calls = _planted_products(monkeypatch, dict.fromkeys(names, (50.0,)))
    ms = calibration.race(torch.zeros(4, 8), ("matmul", "cpu_syrk"), clock=clock)
    assert calls == dict.fromkeys(names, 3)
    assert clock.now == pytest.approx(0.75)
    assert ms == pytest.approx({"matmul": 450.0, "cpu_syrk": 450.0})
