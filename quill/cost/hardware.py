"""What a device can do: peak arithmetic, memory bandwidth and capacity, and its price.

The cost model prices a pass against these rates, so they live in one validated place, with
the datasheet presets a person compares against and a JSON form that `quill cost calibrate`
extends with coefficients fitted on the real machine.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16", "int8")
_DTYPE_ALIASES = {
    "fp32": "float32",
    "f32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "f16": "float16",
    "half": "float16",
    "i8": "int8",
}

# The coefficients the additive (calibrated) model needs, each in seconds per unit.
CALIBRATION_KEYS = (
    "overhead_s",
    "per_seq_s",
    "s_per_weight_byte",
    "s_per_linear_flop",
    "s_per_attention_flop",
    "s_per_kv_byte",
)
# Optional (written by `quill cost calibrate` when it pays): past this many KV bytes per layer
# (read + written) every further KV byte also costs s_per_kv_byte_over_knee.
OPTIONAL_CALIBRATION_KEYS = ("kv_knee_bytes_per_layer", "s_per_kv_byte_over_knee")


def canonical_dtype(name: str) -> str:
    """'bf16' and 'BFloat16' both mean 'bfloat16'."""
    lower = str(name).strip().lower()
    return _DTYPE_ALIASES.get(lower, lower)


def _check_rate(name: str, value, allow_inf: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if number <= 0:
        raise ValueError(f"{name} must be positive, got {value!r}")
    return number


@dataclass
class HardwareSpec:
    """One device. Rates are peak (dense) figures: FLOP/s per dtype, bytes/s, bytes.

    `memory_capacity` may be `math.inf` for abstract hardware whose memory is not modelled.
    `interconnect_bandwidth` is what one device sends per second to its tensor-parallel peers.
    `calibration` holds measured coefficients (see CALIBRATION_KEYS); when present the cost
    model predicts times with them instead of the roofline plus `step_overhead_s`.
    """

    name: str
    flops: dict[str, float]
    memory_bandwidth: float
    memory_capacity: float
    interconnect_bandwidth: float | None = None
    step_overhead_s: float = 0.0
    price_per_hour: float | None = None
    calibration: dict | None = None
    notes: str = ""
    # Achieved matrix-multiply FLOP/s by rows per product, measured by `quill cost calibrate`:
    # {"layers": [[tokens, FLOP/s], ...], "lm_head": [...]}. A CPU's GEMM runs 2-8 rows barely
    # faster than one, so a single rate cannot price both a batch of 4 and a 512-token chunk.
    matmul_rates: dict | None = None
    # All-reduces among N tensor-parallel ranks on this one host, measured by `quill cost
    # calibrate`: {"N": {"latency_s": s, "bandwidth": bytes/s, ...}}. With an entry for its
    # size, the cost model runs the ranks on this host, sharing its cores and memory.
    host_allreduce: dict | None = None
    # Set by __post_init__: the calibration's coefficients only, extra keys dropped.
    coefficients: dict[str, float] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"hardware name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.flops, dict) or not self.flops:
            raise ValueError("flops must map at least one dtype to its peak FLOP/s")
        flops = {}
        for dtype, rate in self.flops.items():
            canonical = canonical_dtype(dtype)
            if canonical not in DTYPES:
                raise ValueError(f"flops has unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
            flops[canonical] = _check_rate(f"flops[{canonical!r}]", rate)
        self.flops = flops
        self.memory_bandwidth = _check_rate("memory_bandwidth", self.memory_bandwidth)
        self.memory_capacity = _check_rate("memory_capacity", self.memory_capacity, True)
        if self.interconnect_bandwidth is not None:
            self.interconnect_bandwidth = _check_rate(
                "interconnect_bandwidth", self.interconnect_bandwidth
            )
        overhead = float(self.step_overhead_s)
        if not math.isfinite(overhead) or overhead < 0:
            raise ValueError(f"step_overhead_s must be >= 0 and finite, got {overhead!r}")
        self.step_overhead_s = overhead
        if self.price_per_hour is not None:
            self.price_per_hour = _check_rate("price_per_hour", self.price_per_hour)
        if self.calibration is not None:
            self.coefficients = _check_calibration(self.calibration)
        if self.matmul_rates is not None:
            self.matmul_rates = _check_matmul_rates(self.matmul_rates)
        if self.host_allreduce is not None:
            self.host_allreduce = _check_host_allreduce(self.host_allreduce)

    def allreduce_on_host(self, tp: int) -> tuple[float, float] | None:
        """(latency s, bandwidth bytes/s) of an all-reduce among `tp` ranks on this host, if
        measured."""
        entry = (self.host_allreduce or {}).get(str(tp))
        return None if entry is None else (entry["latency_s"], entry["bandwidth"])

    def flops_for(self, dtype: str) -> float:
        """Peak FLOP/s for arithmetic in `dtype`."""
        canonical = canonical_dtype(dtype)
        if canonical not in self.flops:
            raise ValueError(
                f"{self.name} has no peak FLOP/s for {dtype!r}; "
                f"it lists {', '.join(sorted(self.flops))}"
            )
        return self.flops[canonical]

    @property
    def ridge_ops_per_byte(self) -> dict[str, float]:
        """Per dtype, the ops/byte above which a pass is arithmetic-bound."""
        return {d: f / self.memory_bandwidth for d, f in self.flops.items()}

    # -- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("coefficients")
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, d: dict) -> HardwareSpec:
        if not isinstance(d, dict):
            raise ValueError(f"a hardware spec is a JSON object, got {type(d).__name__}")
        known = {"name", "flops", "memory_bandwidth", "memory_capacity", "interconnect_bandwidth"}
        known |= {"step_overhead_s", "price_per_hour", "calibration", "notes", "matmul_rates"}
        known |= {"host_allreduce"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown hardware spec keys {unknown}; known: {sorted(known)}")
        missing = [
            k for k in ("name", "flops", "memory_bandwidth", "memory_capacity") if k not in d
        ]
        if missing:
            raise ValueError(f"hardware spec is missing {', '.join(missing)}")
        return cls(**d)

    @classmethod
    def load(cls, path: str | Path) -> HardwareSpec:
        try:
            d = json.loads(Path(path).read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
        return cls.from_dict(d)

    @classmethod
    def preset(cls, name: str) -> HardwareSpec:
        key = _PRESET_ALIASES.get(_normalize(name))
        if key is None:
            raise ValueError(f"unknown hardware preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls.from_dict(json.loads(json.dumps(PRESETS[key])))  # a private copy

    @classmethod
    def resolve(cls, name_or_path: str | Path) -> HardwareSpec:
        """A preset name (any case) or the path of a JSON spec."""
        text = str(name_or_path)
        if _normalize(text) in _PRESET_ALIASES:
            return cls.preset(text)
        path = Path(text)
        if path.is_file():
            return cls.load(path)
        if text.endswith(".json"):
            raise ValueError(f"hardware file {text!r} does not exist")
        raise ValueError(
            f"unknown hardware {text!r}: not a preset ({', '.join(PRESETS)}) nor a JSON file"
        )


def _check_host_allreduce(table: dict) -> dict:
    if not isinstance(table, dict):
        raise ValueError(f"host_allreduce must be an object, got {type(table).__name__}")
    out = {}
    for size, entry in table.items():
        if not str(size).isdigit() or int(size) < 2:
            raise ValueError(f"host_allreduce keys are rank counts of 2 or more, got {size!r}")
        if not isinstance(entry, dict) or "latency_s" not in entry or "bandwidth" not in entry:
            raise ValueError(f"host_allreduce[{size!r}] needs latency_s and bandwidth")
        latency = float(entry["latency_s"])
        if not math.isfinite(latency) or latency < 0:
            raise ValueError(f"host_allreduce[{size!r}].latency_s must be >= 0, got {latency!r}")
        bandwidth = _check_rate(f"host_allreduce[{size!r}].bandwidth", entry["bandwidth"])
        out[str(int(size))] = {**entry, "latency_s": latency, "bandwidth": bandwidth}
    return out


def _check_calibration(calibration: dict) -> dict[str, float]:
    if not isinstance(calibration, dict):
        raise ValueError(f"calibration must be an object, got {type(calibration).__name__}")
    missing = [k for k in CALIBRATION_KEYS if k not in calibration]
    if missing:
        raise ValueError(f"calibration is missing {', '.join(missing)}")
    coefficients = {}
    optional = [k for k in OPTIONAL_CALIBRATION_KEYS if k in calibration]
    for key in (*CALIBRATION_KEYS, *optional):  # any other key is informational and ignored
        try:
            value = float(calibration[key])
        except (TypeError, ValueError):
            raise ValueError(f"calibration {key} must be a number") from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"calibration {key} must be >= 0 and finite, got {value!r}")
        coefficients[key] = value
    return coefficients


def _check_matmul_rates(rates: dict) -> dict[str, list[list[float]]]:
    if not isinstance(rates, dict) or "layers" not in rates:
        raise ValueError('matmul_rates must be {"layers": [[tokens, FLOP/s], ...], ...}')
    out = {}
    for name, curve in rates.items():
        try:
            points = sorted((int(t), float(r)) for t, r in curve)
        except (TypeError, ValueError):
            raise ValueError(f"matmul_rates[{name!r}] must be [[tokens, FLOP/s], ...]") from None
        if not points or any(t < 1 or not (r > 0 and math.isfinite(r)) for t, r in points):
            raise ValueError(f"matmul_rates[{name!r}] needs tokens >= 1 and positive rates")
        out[name] = [[t, r] for t, r in points]
    return out


def _normalize(name: str) -> str:
    return str(name).strip().lower().replace("_", "-").replace(" ", "-")


# Datasheet peaks, dense (the sparsity figures NVIDIA headlines are twice these). GB and GB/s
# are decimal; the parts hold slightly more than the round figure, so capacity is conservative.
PRESETS: dict[str, dict] = {
    # NVIDIA A100 Tensor Core GPU datasheet, "A100 80GB SXM" column; NVLink 3: 600 GB/s.
    "A100-80GB-SXM": {
        "name": "A100-80GB-SXM",
        "flops": {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12, "int8": 624e12},
        "memory_bandwidth": 2.039e12,
        "memory_capacity": 80e9,
        "interconnect_bandwidth": 600e9,
        "notes": "A100 datasheet, 80GB SXM; fp32 is non-tensor-core (TF32 tensor: 156 TFLOP/s)",
    },
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column; NVLink 4: 900 GB/s.
    "H100-SXM": {
        "name": "H100-SXM",
        "flops": {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12, "int8": 1979e12},
        "memory_bandwidth": 3.35e12,
        "memory_capacity": 80e9,
        "interconnect_bandwidth": 900e9,
        "notes": "H100 datasheet, SXM5; NVLink figure is the total of both directions",
    },
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): H100 SXM compute, HBM3e 141 GB at 4.8 TB/s.
    "H200": {
        "name": "H200",
        "flops": {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12, "int8": 1979e12},
        "memory_bandwidth": 4.8e12,
        "memory_capacity": 141e9,
        "interconnect_bandwidth": 900e9,
        "notes": "H200 datasheet, SXM; NVLink figure is the total of both directions",
    },
    # NVIDIA L40S datasheet; no NVLink, peers talk over PCIe Gen4 x16 (64 GB/s).
    "L40S": {
        "name": "L40S",
        "flops": {"float32": 91.6e12, "bfloat16": 362e12, "float16": 362e12, "int8": 733e12},
        "memory_bandwidth": 864e9,
        "memory_capacity": 48e9,
        "interconnect_bandwidth": 64e9,
        "notes": "L40S datasheet; GDDR6; interconnect is PCIe Gen4 x16",
    },
}

_PRESET_ALIASES = {_normalize(k): k for k in PRESETS}
_PRESET_ALIASES.update(
    {"a100": "A100-80GB-SXM", "a100-80gb": "A100-80GB-SXM", "h100": "H100-SXM", "h200-sxm": "H200"}
)
