"""Figures of a benchmark run: how TTFT and ITL are distributed, and every stream over time.

A table of percentiles hides the shape of a distribution (two humps, a long tail) and when
things happened (a stall that hit every stream at once); these show both. Drawn on matplotlib
Figure objects with the Agg canvas directly, so no pyplot state or display is involved.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from quill.bench.stream import StreamRecord


def _cdf(ax, values_ms: Sequence[float], label: str) -> None:
    x = sorted(values_ms)
    n = len(x)
    if n:
        ax.step(x, [(i + 1) / n for i in range(n)], where="post")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of samples")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.set_title(f"CDF of {label} ({n} samples)")


def write_plots(directory: str | Path, records: Sequence[StreamRecord]) -> list[Path]:
    """ttft_cdf.png, itl_cdf.png and timeline.png in `directory` (made if missing)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ok = [r for r in records if r.ok]
    paths = []

    def save(fig: Figure, name: str) -> None:
        FigureCanvasAgg(fig)
        path = directory / name
        fig.savefig(path, dpi=110, bbox_inches="tight")
        paths.append(path)

    fig = Figure(figsize=(6, 4))
    _cdf(fig.add_subplot(), [r.ttft * 1000 for r in ok], "TTFT")
    save(fig, "ttft_cdf.png")

    fig = Figure(figsize=(6, 4))
    _cdf(fig.add_subplot(), [gap * 1000 for r in ok for gap in r.itls], "ITL")
    save(fig, "itl_cdf.png")

    # One row per request: a line from sent to end (red when it failed), a tick per chunk.
    height = min(max(3.0, 0.12 * len(records)), 30.0)
    fig = Figure(figsize=(9, height))
    ax = fig.add_subplot()
    sent = [r for r in records if r.sent is not None and r.ended is not None]
    spans = [[(r.sent, r.index), (r.ended, r.index)] for r in sent]
    colors = ["tab:blue" if r.ok else "tab:red" for r in sent]
    ax.add_collection(LineCollection(spans, colors=colors, linewidths=1.0))
    ticks_x = [t for r in sent for t in r.chunk_times]
    ticks_y = [r.index for r in sent for _ in r.chunk_times]
    ax.scatter(ticks_x, ticks_y, marker="|", s=30, linewidths=0.8, color="black")
    ax.scatter([r.scheduled for r in records], [r.index for r in records], marker=".", s=6,
               color="tab:gray", label="scheduled")  # fmt: skip
    ax.autoscale()
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the start")
    ax.set_ylabel("request")
    ax.set_title("streams: sent to end, a tick per chunk (red: failed)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    save(fig, "timeline.png")
    return paths
