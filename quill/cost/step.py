"""The price of one step: a roofline floor from peak rates, and the time to expect.

A pass costs arithmetic (FLOPs) and movement (bytes between memory and the chip); whichever
takes longer at the device's peak sets the floor. The simulator calls `price` once per step,
so everything that does not depend on the batch is worked out once, in the constructor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quill.cost.batch import BatchShape
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec


@dataclass(slots=True)
class StepCost:
    """One step on one device of the replica (with tp > 1 the others do the same at once).

    FLOPs and bytes are per device; times are seconds. `roofline_s` is the floor at peak
    rates, max(arithmetic_s, movement_s) + communication_s (all-reduces are not overlapped);
    `predicted_s` is the time to expect (calibrated when the hardware carries coefficients).
    """

    linear_flops: float
    attention_flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    activation_bytes: float
    comm_bytes: float
    arithmetic_s: float
    movement_s: float
    communication_s: float
    roofline_s: float
    predicted_s: float
    bound: str
    # FLOPs weighted by how slowly the hardware runs products of this many rows (see
    # HardwareSpec.matmul_rates): what the calibrated model charges for; = linear_flops without.
    linear_flops_effective: float = 0.0

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    @property
    def bytes_moved(self) -> float:
        """Bytes between memory and the chip (interconnect traffic is `comm_bytes`)."""
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.activation_bytes

    @property
    def ops_per_byte(self) -> float:
        moved = self.bytes_moved
        return self.flops / moved if moved else 0.0


class CostModel:
    """Prices steps of `model` on `hardware`, split over `tp` tensor-parallel devices.

    Per device, weights, FLOPs and KV bytes divide by tp. Each layer then all-reduces its
    attention output and its MLP output (num_tokens * hidden activations each); a ring
    all-reduce sends 2*(tp-1)/tp of that payload from every device over the interconnect.

    When the hardware carries a measured all-reduce for tp ranks on one host (`host_allreduce`,
    from `quill cost calibrate`), the tp ranks run on that one host instead: they share its
    cores and memory, so a rank's 1/tp of the work at 1/tp of the rates takes what the whole
    pass takes on one rank, and each all-reduce costs its measured latency + bytes/bandwidth.
    """

    def __init__(self, model: ModelSpec, hardware: HardwareSpec, tp: int = 1) -> None:
        model.check_tensor_parallel(tp)
        host = hardware.allreduce_on_host(tp) if tp > 1 else None
        if tp > 1 and host is None and hardware.interconnect_bandwidth is None:
            raise ValueError(
                f"tp={tp} needs the interconnect bandwidth of {hardware.name}, or a measured "
                f"all-reduce of {tp} ranks on it (`quill cost calibrate`), which it lacks"
            )
        self.model = model
        self.hardware = hardware
        self.tp = tp
        self.shares_host = host is not None
        split = 1 if self.shares_host else tp  # what a device's share of the work is
        self.peak_flops = hardware.flops_for(model.dtype)
        act = model.activation_bytes_per_element
        per_token, per_sampled = model.activation_elements_per_token(split)
        if model.is_abstract:
            self._linear_per_token = 2 * model.num_params / split
            self._linear_per_sampled = 0
        else:
            self._linear_per_token = 2 * model.linear_params / split
            self._linear_per_sampled = 2 * model.hidden_size * model.vocab_size / split
        self._attention_per_pair = model.attention_flops(1) / split
        # Past the KV head count each rank keeps one KV head (replicated), not 1/tp of them.
        kv_split = split if model.is_abstract else min(split, model.num_kv_heads)
        self._kv_per_token = model.kv_bytes_per_token / kv_split
        self._act_per_token = act * per_token
        self._act_per_sampled = act * per_sampled
        self._split = split
        self.weight_bytes = model.weight_bytes / split  # all of them (a sparse MLP: its experts)
        self._comm_fixed_s = 0.0  # per pass, whatever its size
        if tp > 1:
            payload = 2 * model.num_layers * model.hidden_size * act  # per token, per pass
            if host is not None:
                latency, bandwidth = host
                self._comm_per_token = payload  # measured against the payload itself
                self._inv_interconnect = 1.0 / bandwidth
                self._comm_fixed_s = 2 * model.num_layers * latency
            else:
                self._comm_per_token = payload * 2 * (tp - 1) / tp
                self._inv_interconnect = 1.0 / hardware.interconnect_bandwidth
        else:
            self._comm_per_token = 0
            self._inv_interconnect = 0.0
        link = hardware.interconnect_bandwidth
        self._inv_link = 1.0 / link if link else None  # per device: each fetches its KV share
        self._inv_flops = 1.0 / self.peak_flops
        self._inv_bandwidth = 1.0 / hardware.memory_bandwidth
        self._overhead = hardware.step_overhead_s
        self._coef = hardware.coefficients
        self._slowdown = None
        if hardware.matmul_rates is not None and not model.is_abstract:
            self._slowdown = _slowdown_tables(hardware.matmul_rates)
        # KV traffic past the calibration's knee (per layer, so per pass x num_layers) costs more.
        coef = self._coef or {}
        self._kv_knee = coef.get("kv_knee_bytes_per_layer", 0.0) * (model.num_layers or 0)
        self._s_over_knee = coef.get("s_per_kv_byte_over_knee", 0.0)

    @property
    def ridge_ops_per_byte(self) -> float:
        """Ops per byte above which a pass is arithmetic-bound on this device."""
        return self.peak_flops / self.hardware.memory_bandwidth

    def price(self, batch) -> StepCost:
        """The cost of one step: a BatchShape, or an engine plan (see BatchShape.from_plan)."""
        if type(batch) is not BatchShape:
            batch = self.model.shape_of(batch)
        n = batch.num_tokens
        if n == 0:  # nothing runs, nothing is read
            return StepCost(0, 0, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, "movement", 0.0)
        sampled = batch.num_sampled
        linear = self._linear_per_token * n + self._linear_per_sampled * sampled
        slow = self._slowdown
        if slow is None:
            linear_effective = linear
        else:
            layers, lm_head = slow
            linear_effective = self._linear_per_token * n * layers[min(n, len(layers) - 1)]
            linear_effective += (
                self._linear_per_sampled * sampled * lm_head[min(sampled, len(lm_head) - 1)]
            )
        attention = self._attention_per_pair * batch.attention_pairs
        kv_read = self._kv_per_token * batch.kv_tokens_read
        kv_write = self._kv_per_token * batch.kv_tokens_written
        act = self._act_per_token * n + self._act_per_sampled * batch.num_sampled
        comm = self._comm_per_token * n
        arithmetic_s = (linear + attention) * self._inv_flops
        weights = self.weight_bytes
        if self.model.num_experts:  # the experts its tokens chose
            weights = self.model.weight_bytes_for(n) / self._split
        movement_s = (weights + kv_read + kv_write + act) * self._inv_bandwidth
        communication_s = comm * self._inv_interconnect + self._comm_fixed_s
        if arithmetic_s > movement_s:
            roofline_s, bound = arithmetic_s + communication_s, "arithmetic"
        else:
            roofline_s, bound = movement_s + communication_s, "movement"
        c = self._coef
        if c is None:
            predicted_s = roofline_s + self._overhead
        else:
            predicted_s = (
                c["overhead_s"]
                + c["per_seq_s"] * batch.num_seqs
                + c["s_per_weight_byte"] * weights
                + c["s_per_linear_flop"] * linear_effective
                + c["s_per_attention_flop"] * attention
                + c["s_per_kv_byte"] * (kv_read + kv_write)
                + self._s_over_knee * max(0.0, kv_read + kv_write - self._kv_knee)
                + communication_s
            )
        return StepCost(
            linear,
            attention,
            weights,
            kv_read,
            kv_write,
            act,
            comm,
            arithmetic_s,
            movement_s,
            communication_s,
            roofline_s,
            predicted_s,
            bound,
            linear_effective,
        )

    def kv_fetch_seconds(self, num_tokens: int) -> float:
        """Moving `num_tokens` tokens' KV cache from a prefill replica over the interconnect
        (each device its share, at once). Not part of any step: the fetch runs beside them."""
        if self._inv_link is None:
            raise ValueError(f"a KV fetch needs the interconnect bandwidth of {self.hardware.name}")
        return self._kv_per_token * num_tokens * self._inv_link

    # -- memory ----------------------------------------------------------------------------
    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> float:
        """Tokens of KV cache one replica holds in `memory_fraction` of its devices' memory
        after the weights. `math.inf` when nothing limits it (an abstract model, whose KV is
        not modelled, or hardware of unknown memory)."""
        if not 0 < memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
        capacity = self.hardware.memory_capacity
        stored = self.model.stored_bytes / (1 if self.shares_host else self.tp)
        room = capacity * memory_fraction - stored
        if room <= 0:
            raise ValueError(
                f"model of {stored / 1e9:.4g} GB per device does not fit in "
                f"{capacity * memory_fraction / 1e9:.4g} GB ({memory_fraction:.0%} of "
                f"{self.hardware.name}'s {capacity / 1e9:.4g} GB)"
            )
        if self._kv_per_token == 0 or math.isinf(room):
            return math.inf
        return int(room // self._kv_per_token)

    def max_batch(
        self, context_len: int, memory_fraction: float = 0.9, limit: int | None = None
    ) -> int | float:
        """Sequences of `context_len` tokens whose KV fits at once (at most `limit`)."""
        if context_len < 1:
            raise ValueError(f"context_len must be >= 1, got {context_len}")
        capacity = self.kv_capacity_tokens(memory_fraction)
        fits = math.inf if math.isinf(capacity) else capacity // context_len
        return fits if limit is None else min(fits, limit)


def _slowdown_tables(rates: dict) -> tuple[list[float], list[float]]:
    """Per row count 0..max measured, how many times slower than the layers' best rate a
    product of that many rows runs (interpolated in log2(rows); held flat past the ends)."""
    best = max(r for _, r in rates["layers"])

    def table(curve: list[list[float]]) -> list[float]:
        top = int(curve[-1][0])
        out = [1.0]  # row 0: nothing to multiply (the factor is never used with 0 FLOPs)
        for rows in range(1, top + 1):
            out.append(best / _interpolate(curve, rows))
        return out

    layers = table(rates["layers"])
    return layers, table(rates.get("lm_head", rates["layers"]))


def _interpolate(curve: list[list[float]], rows: int) -> float:
    if rows <= curve[0][0]:
        return curve[0][1]
    for (t0, r0), (t1, r1) in zip(curve, curve[1:]):
        if rows <= t1:
            f = (math.log2(rows) - math.log2(t0)) / (math.log2(t1) - math.log2(t0))
            return r0 + f * (r1 - r0)
    return curve[-1][1]
