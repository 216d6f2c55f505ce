"""Requests priced by the cost model, as rows a person reads at a glance.

`quill cost` answers "what does serving l-token prompts with o-token replies cost, alone and
in batches of B": one prefill row and one decode row per (l, o, B), and, given a price, the
dollars per million tokens on a quiet system against a busy one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from quill.cost.batch import BatchShape
from quill.cost.step import CostModel

# The busiest batch the cost table considers, however much memory is left for KV cache.
MAX_BUSY_BATCH = 1024


@dataclass
class Row:
    """One phase of B identical requests. Figures are sums over the phase's passes, per device;
    `tokens` is per sequence (the prompt for prefill, the reply for decode)."""

    phase: str
    prompt_tokens: int
    output_tokens: int
    tokens: int
    batch: int
    passes: int
    flops: float
    bytes: float
    comm_bytes: float
    arithmetic_s: float
    movement_s: float
    communication_s: float
    roofline_s: float
    time_s: float
    bound: str
    fits: bool

    @property
    def ops_per_byte(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.tokens / self.time_s if self.time_s else math.inf

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ops_per_byte"] = self.ops_per_byte
        d["tokens_per_s"] = self.tokens_per_s
        # The wait before the first token, and the pace of the following ones.
        d["ttft_s"] = self.time_s if self.phase == "prefill" else None
        d["itl_s"] = self.time_s / self.passes if self.phase == "decode" else None
        return d


def _row(phase: str, prompt: int, output: int, tokens: int, batch: int, costs, fits: bool) -> Row:
    row = Row(phase, prompt, output, tokens, batch, 0, 0, 0, 0, 0, 0, 0, 0, 0, "", fits)
    for c in costs:
        row.passes += 1
        row.flops += c.flops
        row.bytes += c.bytes_moved
        row.comm_bytes += c.comm_bytes
        row.arithmetic_s += c.arithmetic_s
        row.movement_s += c.movement_s
        row.communication_s += c.communication_s
        row.roofline_s += c.roofline_s
        row.time_s += c.predicted_s
    row.bound = "arithmetic" if row.arithmetic_s > row.movement_s else "movement"
    return row


def price_prefill(cm: CostModel, prompt: int, batch: int, output: int = 0) -> Row:
    """B prompts of `prompt` tokens in one pass."""
    fits = batch * prompt <= cm.kv_capacity_tokens()
    cost = cm.price(BatchShape.prefills(batch, prompt))
    return _row("prefill", prompt, output, prompt, batch, [cost], fits)


def price_decode(cm: CostModel, prompt: int, output: int, batch: int) -> Row:
    """`output` passes of B decodes, the context growing from `prompt` to prompt+output-1.

    Each reply token is priced as one pass through the model (the engine samples the first
    reply token at the end of the prefill pass; a reply of o tokens then needs o-1 more passes,
    the o-th here stands for the pass that would feed the last token back)."""
    fits = batch * (prompt + output) <= cm.kv_capacity_tokens()
    costs = (cm.price(BatchShape.decodes(batch, prompt + k)) for k in range(output))
    return _row("decode", prompt, output, output, batch, costs, fits)


def build_rows(
    cm: CostModel, prompts: list[int], outputs: list[int], batches: list[int]
) -> list[Row]:
    rows = []
    for prompt in prompts:
        for output in outputs:
            for batch in batches:
                rows.append(price_prefill(cm, prompt, batch, output))
                rows.append(price_decode(cm, prompt, output, batch))
    return rows


def busy_batch(cm: CostModel, prompt: int, output: int) -> int:
    """The largest batch whose KV cache fits at full length, at most MAX_BUSY_BATCH (and 1
    when not even one sequence fits)."""
    return max(1, int(cm.max_batch(prompt + output, limit=MAX_BUSY_BATCH)))


def price_costs(
    cm: CostModel, prompts: list[int], outputs: list[int], price_per_hour: float
) -> list[dict]:
    """Dollars per million prompt and reply tokens, quiet (batch 1) against busy (the largest
    batch memory holds). `price_per_hour` is per device; a replica is tp devices."""
    usd_per_s = price_per_hour * cm.tp / 3600
    out = []
    for prompt in prompts:
        for output in outputs:
            for load, batch in (("quiet", 1), ("busy", busy_batch(cm, prompt, output))):
                pre = price_prefill(cm, prompt, batch, output)
                dec = price_decode(cm, prompt, output, batch)
                out.append(
                    {
                        "prompt_tokens": prompt,
                        "output_tokens": output,
                        "load": load,
                        "batch": batch,
                        "fits": dec.fits,
                        "usd_per_hour": usd_per_s * 3600,
                        "usd_per_million_prompt_tokens": usd_per_s
                        * pre.time_s
                        / (batch * prompt)
                        * 1e6,
                        "usd_per_million_output_tokens": usd_per_s
                        * dec.time_s
                        / (batch * output)
                        * 1e6,
                        "ttft_s": pre.time_s,
                        "itl_s": dec.time_s / dec.passes,
                    }
                )
    return out


# -- text ----------------------------------------------------------------------------------
def sig(x: float, digits: int = 4) -> str:
    """`digits` significant digits in plain decimal notation (scientific only when extreme)."""
    if x is None:
        return "-"
    if x == 0:
        return "0"
    if not math.isfinite(x):
        return str(x)
    exponent = math.floor(math.log10(abs(x)))
    if exponent >= 12 or exponent < -6:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{max(0, digits - 1 - exponent)}f}"


def _grid(headers: list[str], lines: list[list[str]], left: int) -> str:
    """Columns padded to their widest cell; the first `left` columns left-aligned."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]

    def fmt(cells: list[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([fmt(headers), *(fmt(line) for line in lines)])


def format_header(cm: CostModel) -> str:
    m, hw = cm.model, cm.hardware
    model = (
        f"model     {m.name}: {m.num_params:,} params x {m.bytes_per_param:g} B "
        f"({m.dtype}); {sig(cm.weight_bytes / 1e9)} GB of weights read per pass per device"
    )
    if not m.is_abstract:
        model += f"; KV {sig(m.kv_bytes_per_token)} B per token"
    memory = "unknown" if math.isinf(hw.memory_capacity) else f"{sig(hw.memory_capacity / 1e9)} GB"
    device = (
        f"hardware  {hw.name} x{cm.tp}: {sig(cm.peak_flops / 1e12)} TFLOP/s {m.dtype}, "
        f"{sig(hw.memory_bandwidth / 1e12)} TB/s, {memory}; ridge "
        f"{sig(cm.ridge_ops_per_byte)} FLOP/B"
    )
    lines = [model, device]
    capacity = cm.kv_capacity_tokens()
    if not math.isinf(capacity):
        lines.append(f"KV cache  room for {capacity:,} tokens (90% of memory, after the weights)")
    if hw.coefficients is not None:
        lines.append("time      calibrated (additive model fitted on the machine)")
    elif hw.step_overhead_s:
        lines.append(f"time      roofline + {sig(hw.step_overhead_s * 1e3)} ms per step")
    return "\n".join(lines)


def format_rows(rows: list[Row]) -> str:
    headers = ["prompt", "reply", "phase", "tokens", "batch", "passes", "arithmetic ms"]
    headers += ["movement ms", "bound", "time ms", "TTFT ms", "ITL ms", "ops/B", "tok/s"]
    lines = []
    for r in rows:
        d = r.as_dict()
        lines.append(
            [
                str(r.prompt_tokens),
                str(r.output_tokens),
                r.phase + ("" if r.fits else "*"),
                str(r.tokens),
                str(r.batch),
                str(r.passes),
                sig(r.arithmetic_s * 1e3),
                sig(r.movement_s * 1e3),
                r.bound,
                sig(r.time_s * 1e3),
                sig(d["ttft_s"] and d["ttft_s"] * 1e3),
                sig(d["itl_s"] and d["itl_s"] * 1e3),
                sig(r.ops_per_byte),
                sig(r.tokens_per_s),
            ]
        )
    text = _grid(headers, lines, left=3)
    text += (
        "\ntokens are per sequence; times are sums over the passes; decode passes run at "
        "contexts prompt .. prompt+reply-1"
    )
    if not all(r.fits for r in rows):
        text += "\n* the KV cache of this batch does not fit in memory"
    return text


def format_costs(costs: list[dict]) -> str:
    headers = ["prompt", "reply", "load", "batch", "$/M prompt tokens", "$/M reply tokens"]
    headers += ["TTFT ms", "ITL ms"]
    lines = [
        [
            str(c["prompt_tokens"]),
            str(c["output_tokens"]),
            c["load"] + ("" if c["fits"] else "*"),
            str(c["batch"]),
            sig(c["usd_per_million_prompt_tokens"]),
            sig(c["usd_per_million_output_tokens"]),
            sig(c["ttft_s"] * 1e3),
            sig(c["itl_s"] * 1e3),
        ]
        for c in costs
    ]
    text = _grid(headers, lines, left=3)
    usd = costs[0]["usd_per_hour"] if costs else 0
    text += (
        f"\nat ${sig(usd)} per replica-hour; quiet: one request at a time; busy: the largest "
        f"batch whose KV cache fits (at most {MAX_BUSY_BATCH})"
    )
    if not all(c["fits"] for c in costs):
        text += "\n* not even one sequence of this length fits in memory"
    return text
