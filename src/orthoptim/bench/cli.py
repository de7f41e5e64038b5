"""`orthoptim bench`: one subcommand holding every benchmark.

Each benchmark is a module `orthoptim.bench.<name>` exposing `add_parser(bench_subparsers)`;
the parser it adds sets `func(args) -> int`. Add a benchmark by appending its module here.
"""

from __future__ import annotations

import argparse
import importlib

# Modules that contribute sub-benchmarks, in the order `orthoptim bench --help` lists them.
BENCH_MODULES = (
    "orthoptim.bench.ns",
    "orthoptim.bench.step",
    "orthoptim.bench.compile",
    "orthoptim.bench.syrk",
    "orthoptim.bench.dist",
    "orthoptim.bench.tp",
    "orthoptim.bench.build",
    "orthoptim.bench.telemetry",
    "orthoptim.bench.reproducible",
    "orthoptim.bench.calibrate",
    "orthoptim.bench.plan",
)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `orthoptim bench` and every sub-benchmark in BENCH_MODULES."""
    parser = subparsers.add_parser(
        "bench", help="benchmarks, measured side by side and reported as ratios"
    )
    bench_subparsers = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    for module_name in BENCH_MODULES:
        importlib.import_module(module_name).add_parser(bench_subparsers)

    def _no_benchmark(args: argparse.Namespace) -> int:
        parser.print_help()
        return 2

    parser.set_defaults(func=_no_benchmark)
