"""Accelerator descriptions for the planner: throughput, memory and link bandwidths.

Shipped as JSON next to this module (`h200`, `gb300`); `load_hardware(path)` reads a custom
file of the same keys. Figures are datasheet dense rates; `matmul_efficiency` is the fraction
of peak a large Newton-Schulz matmul reaches, `model_mfu` the model's own utilisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

# Published Muon vs AdamW throughput on GB300 NVL72 (NVIDIA technical blog "Advancing
# Emerging Optimizers for Accelerated LLM Training with NVIDIA Megatron", Megatron Bridge
# 26.02, MXFP8). Muon's TFLOP/s count the Newton-Schulz matmuls: model + Muon.
PUBLISHED_GB300 = {
    "kimi-k2": {
        "layout": "PP4 DP64 EP64, 256 GB300",
        "adamw_tflops": 1051,
        "muon_tflops": 1080,
        "muon_model_tflops": 1029,
        "muon_ns_tflops": 51,
    },
    "qwen3-30b-a3b": {
        "layout": "DP8 EP8, 8 GB300",
        "adamw_tflops": 713,
        "muon_tflops": 721,
        "muon_model_tflops": 686,
        "muon_ns_tflops": 35,
    },
}


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its interconnect (bandwidths per GPU, per direction)."""

    name: str
    bf16_tflops: float
    fp32_tflops: float
    matmul_efficiency: float
    model_mfu: float
    memory_gb: float
    nvlink_domain: int
    intra_node_gb_per_s: float
    inter_node_gb_per_s: float
    intra_node_latency_us: float
    inter_node_latency_us: float
    description: str = ""

    def matmul_flops_per_s(self, dtype_bytes: int) -> float:
        """Sustained matmul rate for Newton-Schulz in a 2-byte (bf16) or 4-byte dtype."""
        peak = self.bf16_tflops if dtype_bytes <= 2 else self.fp32_tflops
        return peak * 1e12 * self.matmul_efficiency

    def link(self, group_span: int) -> tuple[float, float]:
        """(bytes/s, latency s) of a collective over `group_span` consecutive GPUs."""
        if group_span <= self.nvlink_domain:
            return self.intra_node_gb_per_s * 1e9, self.intra_node_latency_us * 1e-6
        return self.inter_node_gb_per_s * 1e9, self.inter_node_latency_us * 1e-6


def shipped_hardware() -> list[str]:
    """Names of the shipped hardware descriptions."""
    folder = resources.files("orthoptim.plan") / "hardware"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A shipped description (`h200`, `gb300`) or a JSON file with the `Hardware` fields."""
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"--hardware: no such file {str(path)!r}")
        text, origin = path.read_text(), str(path)
    else:
        names = shipped_hardware()
        if str(name_or_path) not in names:
            raise ValueError(
                f"--hardware: unknown hardware {str(name_or_path)!r}; shipped: "
                f"{', '.join(names)}, or pass a path to a .json file"
            )
        text = (resources.files("orthoptim.plan") / "hardware" / f"{name_or_path}.json").read_text()
        origin = f"shipped hardware {name_or_path!r}"
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{origin}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{origin}: expected a JSON object of hardware fields")
    known = {f.name for f in fields(Hardware)}
    unknown = sorted(set(raw) - known)
    missing = sorted(
        f.name for f in fields(Hardware) if f.name != "description" and f.name not in raw
    )
    if unknown or missing:
        raise ValueError(
            f"{origin}: unknown key(s) {unknown}, missing key(s) {missing}; "
            f"a hardware file has the keys {sorted(known)}"
        )
    hw = Hardware(**raw)
    for f in fields(Hardware):
        v = getattr(hw, f.name)
        if f.name not in ("name", "description") and not (isinstance(v, int | float) and v > 0):
            raise ValueError(f"{origin}: {f.name!r} must be a positive number, got {v!r}")
    return hw


def memory_verdict(peak: float, capacity: float, name: str, over: int = 0, ranks: int = 1) -> str:
    """Whether a rank's `peak` bytes fit `capacity` bytes of hardware `name`, as one line:
    "fits: yes — peak 97.3 GiB of 131.3 GiB (h200: 141 GB)", both sides in GiB and the
    hardware's own figure beside; when not, by how much, and `over` of the `ranks` ranks that
    do not fit when there are several."""
    head = f"peak {peak / 2**30:.1f} GiB of {capacity / 2**30:.1f} GiB"
    head += f" ({name}: {capacity / 1e9:.3g} GB)"
    if peak <= capacity:
        return f"fits: yes — {head}"
    some = f", {over} of {ranks} ranks over" if ranks > 1 else ""
    return f"fits: no — {head}, {peak / capacity:.2f}x{some}"
