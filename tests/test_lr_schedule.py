"""`orthoptim train`'s learning-rate schedule as a run applies it: linear warmup, then cosine
decay that ends at `--min-lr-ratio` times the peak at the last step. The expected values are
written out here from the schedule's definition, not taken from `lr_multiplier`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from orthoptim.cli import main


def test_a_run_decays_to_min_lr_ratio_at_its_last_step(tmp_path: Path) -> None:
    ratio = 0.25
    data = tmp_path / "text.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 400)
    out = tmp_path / "run"
    argv = ["train", "--nproc", "1", "--config", "tiny", "--steps", "6", "--warmup", "2",
            "--batch", "2", "--eval-every", "6", "--eval-batches", "1", "--ckpt-every", "6",
            "--data", str(data), "--min-lr-ratio", str(ratio), "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["lr"] for r in rows if "lr" in r and r.get("step", 0) > 0}
    assert sorted(lrs) == list(range(1, 7)), rows
    peak = lrs[2]  # the end of the warmup
    assert lrs[1] == pytest.approx(peak / 2, rel=1e-12)
    for step in range(3, 7):  # 4 decay steps after the warmup: cos(π·k/4), k = 1..4
        cosine = 0.5 * (1 + math.cos(math.pi * (step - 2) / 4))
        assert lrs[step] == pytest.approx(peak * (ratio + (1 - ratio) * cosine), rel=1e-12, abs=0)
    assert lrs[6] == pytest.approx(ratio * peak, rel=1e-12, abs=0)
