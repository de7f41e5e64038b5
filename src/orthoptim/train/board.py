"""`orthoptim train --tensorboard DIR`: every metrics row as TensorBoard scalars.

A row's numbers become scalars at its step, nested fields joined by "/" (the telemetry's
`telemetry/mlp/update_rms`, `telemetry/opt_time_s/max`); strings, flags and missing values
(None) are left out. torch's `SummaryWriter` writes the event files, rank 0 only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: row fields that are not figures over steps
SKIPPED = frozenset({"step", "cold"})


def flat_scalars(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The numbers of `row`, nested dicts flattened to "a/b/c" tags (`SKIPPED` left out)."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if not prefix and key in SKIPPED:
            continue
        tag = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_scalars(value, tag + "/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[tag] = float(value)
    return out


class Board:
    """TensorBoard event files under `logdir`, one scalar per number of each row written."""

    def __init__(self, logdir: str | Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError(
                f"--tensorboard {logdir}: TensorBoard is not installed ({exc}); "
                "pip install 'orthoptim[tensorboard]' or leave --tensorboard out"
            ) from None
        self.writer = SummaryWriter(log_dir=str(logdir))

    def write(self, row: dict[str, Any]) -> None:
        """Every number of `row` at its step."""
        step = int(row["step"])
        for tag, value in flat_scalars(row).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
