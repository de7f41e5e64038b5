"""The telemetry part of `orthoptim compare`: each run's update/weight RMS per parameter
class over steps (from the `telemetry` rows of its metrics.jsonl), drawn as telemetry.png and
tabled in the report."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from orthoptim.optim.telemetry import CLASSES


def telemetry_series(rows: list[dict[str, Any]]) -> dict[str, list[list[float]]]:
    """Per parameter class, [step, update RMS / weight RMS] of each row that carries the loop's
    `telemetry` (the others do not), in the rows' order; empty for a run that logged none."""
    series: dict[str, list[list[float]]] = {}
    for r in rows:
        for cls, t in (r.get("telemetry") or {}).get("classes", {}).items():
            if t.get("ratio") is not None:
                series.setdefault(cls, []).append([int(r["step"]), float(t["ratio"])])
    return series


# Each run's line style and marker beside its colour: four optimizers whose curves nearly meet
# (Muon's and NorMuon's) stay apart where one line would hide the other.
LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "D", "v", "x")


def styles(summary: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Each run's colour, line style and marker (matplotlib's `color`, `linestyle`,
    `marker`), the same in loss.png and telemetry.png, none two runs share."""
    return {
        name: dict(color=f"C{i}", linestyle=LINESTYLES[i % 4], marker=MARKERS[i % 6])
        for i, name in enumerate(summary["runs"])
    }


def colours(summary: dict[str, Any]) -> dict[str, str]:
    """Each run's colour, the same in loss.png and telemetry.png (`styles`)."""
    return {name: style["color"] for name, style in styles(summary).items()}


def telemetry_classes(summary: dict[str, Any]) -> list[str]:
    """The parameter classes any run logged telemetry for (none: no run logged it), in
    the telemetry's order (`orthoptim.optim.telemetry.CLASSES`)."""
    found = {c for run in summary["runs"].values() for c in run.get("telemetry") or {}}
    known = [c for c in CLASSES if c in found]
    return known + sorted(found - set(known))


def plot_telemetry(summary: dict[str, Any], path: Path) -> bool:
    """telemetry.png: one panel per parameter class, its update RMS over weight RMS against the
    step on a log axis, one line per optimizer in loss.png's colours. Draws nothing and returns
    False when no run logged telemetry."""
    classes = telemetry_classes(summary)
    if not classes:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    cols = min(len(classes), 3)
    rows = math.ceil(len(classes) / cols)
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(4 * cols, 3 * rows),
        sharex=True,
        squeeze=False,
        constrained_layout=True,
    )
    palette = styles(summary)
    drawn = [n for n, run in summary["runs"].items() if run.get("telemetry")]
    for ax, cls in zip(axes.flat, classes):
        for name in drawn:
            # a log axis shows positive ratios only (an update of exactly zero is left out)
            points = [(s, v) for s, v in summary["runs"][name]["telemetry"].get(cls, []) if v > 0]
            if points:
                steps, ratios = zip(*points)
                label = f"{name} (lr {summary['runs'][name]['lr']:g})"
                ax.plot(steps, ratios, ms=3, label=label, **palette[name])
        ax.set_yscale("log")
        ax.set_title(cls)
        ax.grid(alpha=0.3, which="both")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("update RMS / weight RMS")
    for ax in list(axes.flat)[len(classes) :]:
        ax.set_visible(False)
    handles = [Line2D([], [], ms=3, **palette[n]) for n in drawn]
    labels = [f"{n} (lr {summary['runs'][n]['lr']:g})" for n in drawn]
    axes[0, 0].legend(handles, labels, fontsize="small")
    fig.suptitle(
        f"update/weight RMS per parameter class, {summary['config']} GPT, "
        f"{summary['tokens_per_step']} tokens/step"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def late_mean(series: list[list[float]], steps: int) -> float | None:
    """The mean ratio of `series`' points in the last half of a run of `steps` steps (step >
    steps / 2); None when it logged none there."""
    late = [v for s, v in series if s > steps / 2]
    return sum(late) / len(late) if late else None


def telemetry_section(summary: dict[str, Any], labels: dict[str, str]) -> str:
    """The report's telemetry part: the figure, how to read it, and per class and optimizer the
    mean ratio over the last half of the steps; one sentence when no run logged telemetry.
    `labels`: each run's name in the report, in the report's order."""
    classes = telemetry_classes(summary)
    if not classes:
        return (
            "No run logged optimizer telemetry (no row of any run's `metrics.jsonl` carries "
            "`telemetry`), so `telemetry.png` was not drawn."
        )
    names = [n for n in labels if summary["runs"][n].get("telemetry")]
    missing = [label for n, label in labels.items() if n not in names]
    steps = summary["steps"]
    lines = [
        "| class | " + " | ".join(labels[n] for n in names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for cls in classes:
        cells = []
        for n in names:
            mean = late_mean(summary["runs"][n]["telemetry"].get(cls, []), steps)
            cells.append(f"{mean:.3g}" if mean is not None else "n/a")
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    has = "it has" if len(missing) == 1 else "they have"
    absent = (
        f" {', '.join(missing)} logged no telemetry, so {has} no line and no column."
        if missing
        else ""
    )
    how = (
        "One panel per parameter class, one line per optimizer (the colours of `loss.png`), on "
        "a log axis. Each point is, at a step where the run logged telemetry, the RMS of the "
        "update the optimizer applied to that class over the RMS of the class's weights: how "
        "far the class moves in one step relative to its size. Muon's hidden matrices move at a "
        "rate set by its LR and the LR scale of their shape; AdamW's parameters, and those a "
        "matrix optimizer leaves to AdamW, at a rate set by AdamW's LR."
    )
    late = (
        f"Mean update/weight RMS over the last half of the run (the logged steps among "
        f"{steps // 2 + 1}–{steps}; n/a: none logged there):"
    )
    table_text = "\n".join(lines)
    return (
        f"![update/weight RMS per class](telemetry.png)\n\n{how}{absent}\n\n{late}\n\n{table_text}"
    )
