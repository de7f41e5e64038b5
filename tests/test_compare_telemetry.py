"""`orthoptim compare`'s second figure (issue 43): the update/weight RMS ratio per parameter
class that `orthoptim train` logs in metrics.jsonl's `telemetry` rows, kept in summary.json,
drawn in telemetry.png (one panel per class, one line per optimizer in loss.png's colours)
and tabled in report.md. Built from planted runs (tests/models/compare.py) whose metrics.jsonl
files a stand-in for `launch` writes, so compare reads them as it reads real runs."""

from __future__ import annotations

import json
from pathlib import Path

from matplotlib.figure import Figure

from models.compare import opts, pair, planted
from orthoptim.cli import main
from orthoptim.train import compare, compare_telemetry
from orthoptim.train.compare import report, summarize

PNG = b"\x89PNG\r\n\x1a\n"
EVERY = 2  # the planted runs log telemetry at every second step (the loop's step % log_every)


def adamw_ratio(cls: str, step: int) -> float:
    return {"attn_qkv": 1e-3 * step, "mlp": 2e-3 * step, "elementwise": 5e-4 + 1e-4 * step}[cls]


def muon_ratio(cls: str, step: int) -> float:
    return {"attn_qkv": 0.04 / step, "mlp": 0.03 / step, "elementwise": 4e-4 * step}[cls]


def with_telemetry(result: dict, ratio, classes=("mlp", "attn_qkv", "elementwise")) -> dict:
    """`result` whose rows at steps ≥ 1 divisible by EVERY carry the loop's telemetry, each
    class's ratio `ratio(cls, step)` (update_rms = ratio · weight_rms); the others carry none."""
    for row in result["metrics"]:
        step = row["step"]
        if step == 0 or step % EVERY:
            continue
        cls_rows = {}
        for cls in classes:
            weight = 0.5 + 0.01 * step
            r = ratio(cls, step)
            cls_rows[cls] = dict(update_rms=r * weight, weight_rms=weight, ratio=r, lr=0.01,
                                 momentum_rms=None, ns_residual=None, tensors=3)  # fmt: skip
        row["telemetry"] = dict(
            classes=cls_rows,
            opt_time_s=dict(max=0.011, mean=0.01),
            comm_bytes=dict(max=3e6, mean=3e6),
            ranks=2,
        )
    return result


def run_planted(
    monkeypatch, out: Path, results: dict[str, dict], **kw
) -> tuple[dict, dict[str, Figure]]:
    """`run_compare` over `results` (by optimizer) in place of training: the stand-in `launch`
    writes each run's planted rows to its metrics.jsonl, which compare reads back. Returns
    summary.json and the figures compare saved (by file name), as drawn."""

    def launch(args, nproc):
        folder = Path(args.out)
        folder.mkdir(parents=True, exist_ok=True)
        planted_run = results[args.optimizer]
        rows = "".join(json.dumps(r) + "\n" for r in planted_run["metrics"])
        (folder / "metrics.jsonl").write_text(rows)
        return {k: v for k, v in planted_run.items() if k != "metrics"}

    figures: dict[str, Figure] = {}
    savefig = Figure.savefig

    def keep(fig, path, *a, **k):
        figures[Path(path).name] = fig
        return savefig(fig, path, *a, **k)

    monkeypatch.setattr(compare, "launch", launch)
    monkeypatch.setattr(Figure, "savefig", keep)
    monkeypatch.setattr(compare.devices, "visible_gpus", lambda: 0)
    compare.run_compare(opts(out=str(out), progress=False, **kw))
    return json.loads((out / "summary.json").read_text()), figures


def expected_series(ratio, classes=("mlp", "attn_qkv", "elementwise"), steps=10):
    return {c: [[s, ratio(c, s)] for s in range(EVERY, steps + 1, EVERY)] for c in classes}


def late_mean(ratio, cls: str) -> float:
    """The mean ratio over the last half of the planted 10 steps: the logged steps 6, 8, 10."""
    return sum(ratio(cls, s) for s in (6, 8, 10)) / 3


def line_colours(ax) -> dict[str, str]:
    from matplotlib.colors import to_hex

    lines = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
    return {line.get_label(): to_hex(line.get_color()) for line in lines}


def test_compare_keeps_draws_and_tables_the_telemetry(monkeypatch, tmp_path):
    """Runs whose metrics.jsonl carry telemetry every second step: summary.json holds each
    class's (step, ratio) series exactly; telemetry.png is a PNG with one log-scale panel per
    class and one line per optimizer in loss.png's colour; the report shows the figure, says
    how to read it, and tables each class's mean ratio over the last half of the steps."""
    results = pair()
    with_telemetry(results["adamw"], adamw_ratio)
    with_telemetry(results["muon"], muon_ratio)
    out = tmp_path / "cmp"
    summary, figures = run_planted(monkeypatch, out, results)

    assert summary["runs"]["adamw"]["telemetry"] == expected_series(adamw_ratio)
    assert summary["runs"]["muon"]["telemetry"] == expected_series(muon_ratio)

    png = (out / "telemetry.png").read_bytes()
    assert png[:8] == PNG and png[-8:-4] == b"IEND"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out / "telemetry.png").shape
    assert width > 500 and height > 200
    # One panel per class in the loop's class order, a log y-axis, each optimizer's line in the
    # colour its loss.png line has.
    loss = line_colours(figures["loss.png"].axes[0])
    assert set(loss) == {"adamw (lr 0.003)", "muon (lr 0.05)"}
    assert loss["adamw (lr 0.003)"] != loss["muon (lr 0.05)"]
    panels = [ax for ax in figures["telemetry.png"].axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == ["attn_qkv", "mlp", "elementwise"]
    for ax in panels:
        assert ax.get_yscale() == "log"
        assert line_colours(ax) == loss
        muon = next(line for line in ax.get_lines() if line.get_label().startswith("muon"))
        assert list(muon.get_xdata()) == [2, 4, 6, 8, 10]
        assert list(muon.get_ydata()) == [muon_ratio(ax.get_title(), s) for s in (2, 4, 6, 8, 10)]

    text = (out / "report.md").read_text()
    assert "## Update size per parameter class" in text
    assert "![update/weight RMS per class](telemetry.png)" in text
    assert (
        "Each point is, at a step where the run logged telemetry, the RMS of the update the "
        "optimizer applied to that class over the RMS of the class's weights"
    ) in text
    assert "Muon's hidden matrices move at a rate set by its LR and the LR scale" in text
    assert "at a rate set by AdamW's LR." in text
    assert "the logged steps among 6–10" in text
    assert "| class | AdamW | Muon |" in text
    for cls in ("attn_qkv", "mlp", "elementwise"):
        row = f"| {cls} | {late_mean(adamw_ratio, cls):.3g} | {late_mean(muon_ratio, cls):.3g} |"
        assert row in text
    assert "| mlp | 0.016 | 0.00392 |" in text  # by hand: 2e-3·8; 0.03·(1/6 + 1/8 + 1/10)/3
    assert "No run logged optimizer telemetry" not in text


def test_runs_without_telemetry_draw_nothing_and_say_so(monkeypatch, tmp_path):
    """Runs from before the loop logged telemetry: no series, no telemetry.png (a previous
    compare's in the same folder removed), and the report says so in one sentence."""
    out = tmp_path / "old"
    out.mkdir()
    (out / "telemetry.png").write_bytes(PNG + b"a previous compare's figure")
    summary, figures = run_planted(monkeypatch, out, pair())
    assert all(run["telemetry"] == {} for run in summary["runs"].values())
    assert not (out / "telemetry.png").exists() and set(figures) == {"loss.png"}
    assert (out / "loss.png").read_bytes()[:8] == PNG
    text = (out / "report.md").read_text()
    assert (
        "No run logged optimizer telemetry (no row of any run's `metrics.jsonl` carries "
        "`telemetry`), so `telemetry.png` was not drawn."
    ) in text
    assert "telemetry.png)" not in text and "| class |" not in text


def test_a_run_without_telemetry_beside_one_with(tmp_path):
    """Only Muon's run logged telemetry, and its router class only in the first half: the
    table has Muon's column alone, n/a where the last half logged nothing, and the report says
    AdamW has no line; the figure draws Muon's lines only."""
    results = pair()
    with_telemetry(results["muon"], muon_ratio, classes=("mlp",))
    for row in results["muon"]["metrics"]:
        if "telemetry" in row and row["step"] <= 4:
            row["telemetry"]["classes"]["router"] = dict(row["telemetry"]["classes"]["mlp"])
    summary = summarize(opts(), results, {})
    assert summary["runs"]["adamw"]["telemetry"] == {}
    assert summary["runs"]["muon"]["telemetry"]["router"] == [
        [2, muon_ratio("mlp", 2)],
        [4, muon_ratio("mlp", 4)],
    ]
    text = report(summary)
    assert "| class | Muon |" in text
    assert f"| mlp | {late_mean(muon_ratio, 'mlp'):.3g} |" in text
    assert "| router | n/a |" in text
    assert "AdamW logged no telemetry, so it has no line and no column." in text
    assert compare_telemetry.plot_telemetry(summary, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:8] == PNG


def test_each_optimizer_keeps_its_colour_when_only_the_later_ones_logged(tmp_path):
    """Colours follow the runs' order in summary.json, the same in both figures, whichever
    runs logged telemetry."""
    results = dict(pair(), normuon=planted("normuon", 0.05, 0.1, 0.01, {5: 3.4, 10: 3.3}))
    with_telemetry(results["normuon"], muon_ratio)
    summary = summarize(opts(optimizers=("adamw", "muon", "normuon")), results, {})
    assert compare_telemetry.colours(summary) == {"adamw": "C0", "muon": "C1", "normuon": "C2"}


def test_end_to_end_compare_draws_the_telemetry_of_real_runs(tmp_path):
    """A real 2-optimizer compare: each run logs the telemetry at its evaluation steps, the
    summary keeps each run's series as its metrics.jsonl has them, and the report draws
    and tables them."""
    from orthoptim.train.runfolder import read_metrics

    out = tmp_path / "e2e"
    argv = ["compare", "--optimizers", "adamw,muon", "--nproc", "1", "--steps", "2",
            "--batch", "2", "--eval-every", "2", "--segments", "1", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    text = (out / "report.md").read_text()
    for name in ("adamw", "muon"):
        rows = read_metrics(out / name / "metrics.jsonl")
        assert [r["step"] for r in rows if "telemetry" in r] == [2]  # --log-every = --eval-every
        assert summary["runs"][name]["telemetry"] == compare_telemetry.telemetry_series(rows)
    assert (out / "telemetry.png").read_bytes()[:8] == PNG
    assert "![update/weight RMS per class](telemetry.png)" in text
    assert "| class | AdamW | Muon |" in text
    for name in ("adamw", "muon"):
        series = summary["runs"][name]["telemetry"]
        assert series and all(v > 0 for points in series.values() for _, v in points)


def test_a_compare_says_its_routing_once_per_run_and_names_every_file(tmp_path, capsys):
    """A real compare in two segments (the second resumes each run): each run's routing
    table is printed once, at its start, no "resuming from" line, and the last line names
    telemetry.png too."""
    out = tmp_path / "cmp"
    argv = ["compare", "--optimizers", "adamw,muon", "--nproc", "1", "--steps", "2",
            "--batch", "2", "--eval-every", "2", "--segments", "2", "--out", str(out),
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    stdout, stderr = capsys.readouterr()
    assert stdout.count("routing of ") == 2, stdout
    assert "resuming from" not in stderr, stderr
    last = stdout.strip().splitlines()[-1]
    assert last == f"wrote {out}/report.md, loss.png, telemetry.png, summary.json", last


def test_four_optimizers_are_told_apart_by_line_style_and_marker(monkeypatch, tmp_path):
    """In a four-optimizer loss.png no two lines share a colour, a line style or a marker, so
    Muon's line is not hidden under NorMuon's where their curves meet."""
    results = dict(
        pair(),
        normuon=planted("normuon", 0.05, 0.1, 0.01, {5: 3.4, 10: 3.3}),
        adamuon=planted("adamuon", 0.02, 0.1, 0.01, {5: 3.4, 10: 3.3}),
    )
    summary = summarize(opts(optimizers=tuple(results)), results, {})
    figures: dict[str, Figure] = {}
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, *a, **k: figures.update(loss=fig))
    compare.plot(summary, tmp_path / "loss.png")
    lines = [ln for ln in figures["loss"].axes[0].get_lines() if ln.get_label()[0] != "_"]
    assert len(lines) == 4
    for get in ("get_color", "get_linestyle", "get_marker"):
        assert len({getattr(line, get)() for line in lines}) == 4, get
