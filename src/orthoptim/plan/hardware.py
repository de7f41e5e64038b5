"""Accelerator descriptions for the planner: throughput, memory and link bandwidths.

Shipped as JSON next to this module (`h100`, `h200`, `gb300`); `load_hardware(path)` reads a
custom file of the same keys, such as one `orthoptim bench calibrate` measured. The shipped
figures are datasheet dense rates; `matmul_efficiency` is the fraction of peak a large
Newton-Schulz matmul reaches, `model_mfu` the model's own utilisation. Optional keys hold
what a measurement adds (`memory_gb_per_s`, `matmul_tflops` per dtype and shape class,
`collectives` per kind and group size), and `sources` says where each figure comes from.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args

MatmulDtype = Literal["bf16", "fp32"]
# square: n×n·n×n; gram: X·Xᵀ of a wide X (Newton-Schulz's products); small: a small square;
# linear: a transformer's linear layers, forward and backward (tokens × in · in × out and the
# two gradient products), on the calibration transformer's shapes
MatmulShape = Literal["square", "gram", "small", "linear"]
CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
# the keys of one `collectives` entry: bytes each rank sends per second, fixed cost per call
LINK_KEYS = ("gb_per_s", "latency_us")
# fields that name or describe the hardware rather than give a figure
TEXT_FIELDS = ("name", "description", "sources")
# the keys a hardware file may leave out (the figures a measurement adds, and the text)
OPTIONAL_FIELDS = (
    "description", "memory_gb_per_s", "matmul_tflops", "collectives", "sources",
    "activation_gb_per_s", "optimizer_gb_per_s", "optimizer_us_per_tensor", "comm_overlap",
    "tp_us_per_linear",
)  # fmt: skip
# the keys of `optimizer_us_per_tensor`: a Muon matrix, an elementwise (AdamW) tensor, a Muon
# matrix split by tensor parallelism (a DTensor)
TensorKind = Literal["matrix", "elementwise", "matrix_tp"]

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
    """One accelerator and its interconnect (bandwidths per GPU, per direction).

    The optional tables hold measured figures (`orthoptim bench calibrate`) and take
    precedence where present: `matmul_tflops[dtype][shape]` in TFLOP/s,
    `collectives[kind][group size]` as {"gb_per_s": bytes each rank sends per second ÷ 1e9,
    "latency_us": one call's fixed cost}; `activation_gb_per_s`, the saved-activation bytes
    (`plan.work`) a forward and backward gets through per second beside its matmuls;
    `optimizer_gb_per_s`, the bytes the optimizer step's elementwise part is counted to move
    (`plan.steptime.step_traffic`) per second, and `optimizer_us_per_tensor[kind]`, its fixed
    cost per tensor of each `TensorKind`; `comm_overlap`, the fraction of a collective that
    runs hidden beside compute (1 when not given: a GPU's copy engines and links; on a CPU
    the cores do both); `tp_us_per_linear`, the fixed cost of a tensor-parallel linear
    layer's forward and backward (its dispatch, its one all-reduce's latency);
    `sources[field]` says where a figure comes from
    ("datasheet: ...", "measured <date>: ...", "assumed: ...").
    """

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
    memory_gb_per_s: float | None = None
    matmul_tflops: dict[str, dict[str, float]] = field(default_factory=dict, hash=False)
    collectives: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict, hash=False)
    activation_gb_per_s: float | None = None
    optimizer_gb_per_s: float | None = None
    comm_overlap: float | None = None
    tp_us_per_linear: float | None = None
    optimizer_us_per_tensor: dict[str, float] = field(default_factory=dict, hash=False)
    sources: dict[str, str] = field(default_factory=dict, hash=False)

    def matmul_flops_per_s(self, dtype_bytes: int, shape: MatmulShape | None = None) -> float:
        """Sustained matmul rate for Newton-Schulz in a 2-byte (bf16) or 4-byte dtype: the
        measured rate of `shape` (default its Gram product) where `matmul_tflops` has it,
        else the dense peak × `matmul_efficiency`."""
        dtype = "bf16" if dtype_bytes <= 2 else "fp32"
        measured = self.matmul_tflops.get(dtype, {}).get(shape or "gram")
        if measured is not None:
            return measured * 1e12
        peak = self.bf16_tflops if dtype_bytes <= 2 else self.fp32_tflops
        return peak * 1e12 * self.matmul_efficiency

    def link(self, group_span: int) -> tuple[float, float]:
        """(bytes/s, latency s) of a collective over `group_span` consecutive GPUs."""
        if group_span <= self.nvlink_domain:
            return self.intra_node_gb_per_s * 1e9, self.intra_node_latency_us * 1e-6
        return self.inter_node_gb_per_s * 1e9, self.inter_node_latency_us * 1e-6

    def collective(self, kind: CollectiveKind, group_size: int) -> tuple[float, float]:
        """(bytes each rank sends per s, latency s) of one `kind` over `group_size` ranks: the
        measured entry of `collectives` for that size, else `link(group_size)`."""
        entry = self.collectives.get(kind, {}).get(str(group_size))
        if entry is None:
            return self.link(group_size)
        return entry["gb_per_s"] * 1e9, entry["latency_us"] * 1e-6

    def memory_bytes_per_s(self) -> float | None:
        """Elementwise memory bandwidth (bytes read + written per s); None when not given."""
        return None if self.memory_gb_per_s is None else self.memory_gb_per_s * 1e9

    def optimizer_bytes_per_s(self) -> float | None:
        """The optimizer step's elementwise rate (counted bytes per s): the measured
        `optimizer_gb_per_s`, else the memory bandwidth; None when neither is given."""
        if self.optimizer_gb_per_s is not None:
            return self.optimizer_gb_per_s * 1e9
        return self.memory_bytes_per_s()

    def to_json(self) -> str:
        """The JSON text `load_hardware` reads back (optional keys left out when unset)."""
        raw = {k: v for k, v in asdict(self).items() if v not in (None, {}, "")}
        raw = {"name": raw.pop("name"), "description": raw.pop("description", ""), **raw}
        return json.dumps(raw, indent=2) + "\n"


def shipped_hardware() -> list[str]:
    """Names of the shipped hardware descriptions."""
    folder = resources.files("orthoptim.plan") / "hardware"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A shipped description (`h100`, `h200`, `gb300`) or a JSON file with the `Hardware`
    fields; a bad key or value is a ValueError naming the key and what it takes."""
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
    required = [f.name for f in fields(Hardware) if f.name not in OPTIONAL_FIELDS]
    missing = sorted(k for k in required if k not in raw)
    if unknown or missing:
        raise ValueError(
            f"{origin}: unknown key(s) {unknown}, missing key(s) {missing}; "
            f"a hardware file has the keys {sorted(known)}"
        )
    for key in required:
        if key not in TEXT_FIELDS and not _positive(raw[key]):
            raise ValueError(f"{origin}: {key!r} must be a positive number, got {raw[key]!r}")
    _check_optional(raw, origin)
    return Hardware(**raw)


def _positive(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _table(value: Any, where: str, origin: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """`value` (the file's key `where`) checked to be an object whose keys are among
    `allowed` (any, when empty)."""
    if not isinstance(value, dict):
        raise ValueError(f"{origin}: {where!r} must be a JSON object, got {value!r}")
    bad = sorted(k for k in value if allowed and k not in allowed)
    if bad:
        raise ValueError(f"{origin}: {where!r} has unknown key(s) {bad}; it takes {list(allowed)}")
    return value


def _check_optional(raw: dict[str, Any], origin: str) -> None:
    """Validate the optional keys, naming the first bad one by its path in the file."""
    for key in ("description", "name"):
        if not isinstance(raw.get(key, ""), str):
            raise ValueError(f"{origin}: {key!r} must be a string, got {raw[key]!r}")
    for key in ("memory_gb_per_s", "activation_gb_per_s", "optimizer_gb_per_s", "tp_us_per_linear"):
        gbs = raw.get(key)
        if gbs is not None and not _positive(gbs):
            raise ValueError(
                f"{origin}: {key!r} must be a positive number (or left out), got {gbs!r}"
            )
    overlap = raw.get("comm_overlap")
    fraction = _positive(overlap) or (overlap == 0 and not isinstance(overlap, bool))
    if overlap is not None and not (fraction and overlap <= 1):
        raise ValueError(
            f"{origin}: 'comm_overlap' must be a fraction from 0 to 1 (or left out), got "
            f"{overlap!r}"
        )
    per_tensor = raw.get("optimizer_us_per_tensor", {})
    for kind, v in _table(
        per_tensor, "optimizer_us_per_tensor", origin, get_args(TensorKind)
    ).items():
        if not _positive(v):
            raise ValueError(
                f"{origin}: 'optimizer_us_per_tensor.{kind}' must be a positive number of "
                f"microseconds, got {v!r}"
            )
    rates = _table(raw.get("matmul_tflops", {}), "matmul_tflops", origin, get_args(MatmulDtype))
    for dtype, by_shape in rates.items():
        where = f"matmul_tflops.{dtype}"
        for shape, v in _table(by_shape, where, origin, get_args(MatmulShape)).items():
            if not _positive(v):
                raise ValueError(
                    f"{origin}: '{where}.{shape}' must be a positive number of TFLOP/s, got {v!r}"
                )
    kinds = _table(raw.get("collectives", {}), "collectives", origin, get_args(CollectiveKind))
    for kind, sizes in kinds.items():
        for size, entry in _table(sizes, f"collectives.{kind}", origin, ()).items():
            where = f"collectives.{kind}.{size}"
            if not size.isdigit() or int(size) < 2:
                raise ValueError(f"{origin}: {where!r}: a group size is a whole number >= 2")
            if not isinstance(entry, dict) or sorted(entry) != sorted(LINK_KEYS):
                raise ValueError(
                    f"{origin}: {where!r} must be an object with keys {list(LINK_KEYS)}"
                )
            for k in LINK_KEYS:
                if not _positive(entry[k]):
                    raise ValueError(
                        f"{origin}: '{where}.{k}' must be a positive number, got {entry[k]!r}"
                    )
    figures = [f.name for f in fields(Hardware) if f.name not in TEXT_FIELDS]
    for key, text in _table(raw.get("sources", {}), "sources", origin, tuple(figures)).items():
        if not (isinstance(text, str) and text.strip()):
            raise ValueError(
                f"{origin}: 'sources.{key}' must say where the figure comes from, e.g. "
                f'"datasheet: ..." or "measured <date>: ...", got {text!r}'
            )


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
