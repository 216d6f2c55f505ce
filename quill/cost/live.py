"""What each step of a running engine cost, and each request's share of it.

The engine core tells this accountant about every step it ran (plan, start, end). It prices
the plan, sets the price beside the measured time (how close the engine came to the roofline,
and what fraction of the hardware's FLOP/s and bandwidth it used), and charges every request in
the step its share: its own FLOPs, its own KV traffic and activations, and an even share of the
weights the batch read together — the one thing batching divides. With a price per hour, the
step's seconds become dollars, split by whatever bound the step (bytes when movement-bound,
FLOPs when arithmetic-bound). Torch-free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quill.config import cache_dir
from quill.cost.batch import logits_rows
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.step import CostModel, StepCost


@dataclass(slots=True)
class RequestCost:
    """One request's accumulated share of the steps it took part in."""

    flops: float = 0.0
    bytes_moved: float = 0.0
    cost_usd: float | None = None


@dataclass(slots=True)
class PricedStep:
    """One step, priced and measured."""

    cost: StepCost
    measured_s: float

    @property
    def roofline_efficiency(self) -> float:
        """The achieved fraction of the roofline bound: 1 means the step ran at the floor."""
        return self.cost.roofline_s / self.measured_s if self.measured_s > 0 else 0.0


class CostAccountant:
    """A step listener for EngineCore; `charges` holds per-request shares until taken."""

    def __init__(
        self,
        model: ModelSpec,
        cost_model: CostModel | None = None,
        price_per_hour: float | None = None,
    ) -> None:
        # Without a hardware spec, FLOPs and bytes (the model's alone) are still charged, and
        # with a price, dollars (the measured seconds, split by bytes); only the roofline's
        # times and efficiency need one.
        self.model = model
        self.cost_model = cost_model
        hardware = cost_model.hardware if cost_model else None
        if price_per_hour is None and hardware is not None:
            price_per_hour = hardware.price_per_hour
        self.price_per_second = (price_per_hour or 0.0) / 3600
        self.charges: dict[str, RequestCost] = {}
        self.last: PricedStep | None = None

    @property
    def has_price(self) -> bool:
        return self.price_per_second > 0

    def on_step(self, plan, start: float, end: float) -> None:
        measured = end - start
        model = self.model
        cost = None
        if self.cost_model is not None:
            cost = self.cost_model.price(model.shape_of(plan))
            self.last = PricedStep(cost, measured)
        num_tokens = sum(len(s.token_ids) for s in plan.seqs)
        weight_share = model.weight_bytes_for(num_tokens) / max(len(plan.seqs), 1)
        shares = []
        for s in plan.seqs:
            n = len(s.token_ids)
            sampled = logits_rows(s)  # its rows of logits: sampled, drafted and scored ones
            one = model.shape_of_seqs([(s.start, n, sampled, n == 1)])
            flops = model.linear_flops(n, sampled) + model.attention_flops(one.attention_pairs)
            moved = (
                weight_share
                + model.kv_bytes_per_token * (one.kv_tokens_read + n)  # read the context, write n
                + model.activation_bytes(n, sampled)
            )
            shares.append((s.request_id, flops, moved))
        step_usd = measured * self.price_per_second
        by_bytes = cost is None or cost.bound == "movement"
        total = sum(m if by_bytes else f for _, f, m in shares) or 1.0
        for request_id, flops, moved in shares:
            charge = self.charges.get(request_id)
            if charge is None:
                charge = self.charges[request_id] = RequestCost()
            charge.flops += flops
            charge.bytes_moved += moved
            if self.has_price:
                part = (moved if by_bytes else flops) / total
                charge.cost_usd = (charge.cost_usd or 0.0) + step_usd * part

    def take(self, request_id: str) -> RequestCost | None:
        """A finished request's charges (and forget them)."""
        return self.charges.pop(request_id, None)

    def peek(self, request_id: str) -> RequestCost | None:
        return self.charges.get(request_id)

    def utilization(self, step: PricedStep) -> tuple[float, float]:
        """(model FLOPs utilization, model bandwidth utilization) of one measured step."""
        if step.measured_s <= 0 or self.cost_model is None:
            return 0.0, 0.0
        peak, bandwidth = self.cost_model.peak_flops, self.cost_model.hardware.memory_bandwidth
        mfu = step.cost.flops / (step.measured_s * peak)
        mbu = step.cost.bytes_moved / (step.measured_s * bandwidth)
        return mfu, mbu


def find_calibration(dtype: str, directory: Path | None = None) -> HardwareSpec | None:
    """The newest `quill cost calibrate` file saved on this machine for `dtype`, if any."""
    path = find_calibration_file(dtype, directory)
    return HardwareSpec.load(path) if path else None


def find_calibration_file(dtype: str, directory: Path | None = None) -> Path | None:
    """The path of what `find_calibration` loads (whatever its key: quill/cost/freshness.py
    picks by key)."""
    found = saved_calibrations(dtype, directory)
    return max(found)[1] if found else None


def saved_calibrations(dtype: str, directory: Path | None = None) -> list[tuple]:
    """(modified time, path, its calibration) of each hardware file saved on this machine
    with a `dtype` rate."""
    directory = directory or cache_dir() / "hardware"
    found = []
    for path in directory.glob("*.json"):
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        calibration = spec.get("calibration") or {}
        if calibration.get("dtype", dtype) == dtype and spec.get("flops", {}).get(dtype):
            found.append((path.stat().st_mtime, path, calibration))
    return found
