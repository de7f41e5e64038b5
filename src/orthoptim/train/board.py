"""`orthoptim train --tensorboard DIR`: every metrics row as TensorBoard scalars.

A row's numbers become scalars at its step, nested fields joined by "/" (the telemetry's
`telemetry/mlp/update_rms`, `telemetry/opt_time_s/max`); strings, flags and missing values
(None) are left out. torch's `SummaryWriter` writes the event files, rank 0 only.

The event files say what metrics.jsonl says: a run purges every step it writes again (a
resumed run the steps after its checkpoint, a fresh one every step), as TensorBoard's
readers honour `SummaryWriter(purge_step=...)`, and `--overwrite` removes the replaced run's
event files (`remove_events`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: the names of the event files `SummaryWriter` writes
EVENT_FILES = "events.out.tfevents.*"

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


def summary_writer(logdir: str | Path) -> type:
    """torch's `SummaryWriter`, or ValueError in one line naming --tensorboard `logdir` and
    the install it needs (`launch` asks before any rank starts)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ValueError(
            f"--tensorboard {logdir}: TensorBoard is not installed ({exc}); "
            "pip install 'orthoptim[tensorboard]' or leave --tensorboard out"
        ) from None
    return SummaryWriter


def remove_events(logdir: str | Path) -> list[Path]:
    """Remove the event files directly under `logdir` (a run `--overwrite` replaces);
    returns them."""
    removed = sorted(Path(logdir).glob(EVENT_FILES))
    for path in removed:
        path.unlink(missing_ok=True)
    return removed


class Board:
    """TensorBoard event files under `logdir`, one scalar per number of each row written, of
    a run that starts after step `start` (0: a fresh run): readers drop the steps after it
    that earlier files hold (every step, for a fresh run), which the run writes again."""

    def __init__(self, logdir: str | Path, start: int = 0) -> None:
        writer = summary_writer(logdir)
        self.writer = writer(log_dir=str(logdir), purge_step=start + 1 if start else 0)

    def write(self, row: dict[str, Any]) -> None:
        """Every number of `row` at its step."""
        step = int(row["step"])
        for tag, value in flat_scalars(row).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()
