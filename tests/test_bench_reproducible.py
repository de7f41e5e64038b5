"""`orthoptim bench reproducible` end to end on a tiny GPT: its JSON has the ratios the issue
names, and bytes_ratio is the ratio of the bytes it counted (no timing is asserted)."""

from __future__ import annotations

import json

from orthoptim.cli import main

TINY = ["--layers", "1", "--width", "32", "--heads", "2", "--seq-len", "16", "--batch", "1"]


def test_bench_reproducible_writes_the_ratios_of_what_it_counted(tmp_path, capsys):
    path = tmp_path / "repro.json"
    argv = ["bench", "reproducible", "--nproc", "2", "--micro-batches", "4", *TINY]
    assert main([*argv, "--steps", "1", "--warmup", "0", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert isinstance(report["time_ratio"], float) and report["time_ratio"] > 0
    assert isinstance(report["bytes_ratio"], float)
    row = report["sizes"]["2"]
    assert row["accumulation"] == 2
    sent = {m: max(row[m]["sent_bytes_per_rank"]) for m in ("default", "reproducible")}
    assert sent["default"] > 0 and sent["reproducible"] > 0  # both modes did communicate
    assert report["bytes_ratio"] == row["bytes_ratio"] == sent["reproducible"] / sent["default"]
    busiest = {m: max(row[m]["step_s_per_rank"]) for m in ("default", "reproducible")}
    assert report["time_ratio"] == busiest["reproducible"] / busiest["default"]
    assert "bytes ratio" in capsys.readouterr().out
