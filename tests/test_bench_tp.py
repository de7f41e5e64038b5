"""`orthoptim bench tp`'s side-by-side table: every variant on every case, interleaved, each
ratio a paired median against the fastest right variant; Emerging-Optimizers when it imports,
a one-line refusal when it does not. No timing is asserted: only the table's arithmetic."""

from __future__ import annotations

import json
import subprocess
import sys

from orthoptim.bench.tp import OURS, import_eo, paired_ratios


def test_paired_ratios_divide_round_by_round():
    times = {"a": [1.0, 4.0, 2.0], "b": [2.0, 4.0, 6.0], "wrong": [0.1, 0.1, 0.1]}
    best, ratios = paired_ratios(times, right={"a", "b"})
    assert best == "a"  # "wrong" is faster but not a right variant: never the reference
    assert ratios == {"a": 1.0, "b": 2.0, "wrong": 0.05}
    # paired, not a ratio of medians: per round 3, 10/9, 3 (median 3); the medians' ratio is
    # 10/9
    times = {"a": [1.0, 9.0, 10.0], "b": [3.0, 10.0, 30.0]}
    assert paired_ratios(times, {"a", "b"}) == ("a", {"a": 1.0, "b": 3.0})


def _eo_imports() -> bool:
    try:
        import_eo()
    except SystemExit:
        return False
    return True


def test_side_by_side_runs_every_variant_on_every_case(tmp_path):
    out = tmp_path / "tp.json"
    eo = _eo_imports()
    cmd = [sys.executable, "-m", "orthoptim", "bench", "tp", "--nproc", "2", "--cases", "up,kv"]
    cmd += ["--shrink", "16", "--repeats", "2", "--steps", "3", "--json", str(out)]
    if eo:
        cmd += ["--against", "eo"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    variants = [label for label, _, _ in OURS] + ["auto/calibrated"]
    variants += ["eo/distributed", "eo/duplicated"] if eo else []
    assert {(r["case"], r["variant"]) for r in rows} == {
        (c, v) for c in ("up", "kv") for v in variants
    }
    for case in ("up", "kv"):
        mine = [r for r in rows if r["case"] == case]
        (fastest,) = {r["fastest"] for r in mine}
        (ref,) = [r for r in mine if r["variant"] == fastest]
        assert ref["right"] and ref["ratio_to_fastest"] == 1.0
        # every orthoptim mode that claims the full result returns it
        assert all(r["right"] for r in mine if not r["variant"].startswith("eo/")), mine
        for picked in mine[0]["auto_chose"].values():
            assert picked.split("/")[0] in ("duplicated", "distributed", "gram")
    assert "auto chose" in run.stdout and "fastest (ms)" in run.stdout


def test_against_eo_is_refused_in_one_line_without_it():
    # the module made unimportable, as where it is not installed (CI)
    code = (
        "import sys; sys.modules['emerging_optimizers'] = None; "
        "from orthoptim.cli import main; sys.exit(main(['bench', 'tp', '--against', 'eo']))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "--against eo" in run.stderr and "install emerging-optimizers" in run.stderr
    assert "Traceback" not in run.stderr
