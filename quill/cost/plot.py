"""The roofline picture: where each priced row sits against what the device can attain.

Kept apart from the table so matplotlib is imported only when someone asks for a plot.
"""

from __future__ import annotations

from pathlib import Path

from quill.cost.step import CostModel
from quill.cost.table import Row


def plot_roofline(cm: CostModel, rows: list[Row], path: str | Path) -> None:
    """Attainable FLOP/s against ops/byte (log-log), the ridge marked, each row at its
    ops/byte and the FLOP/s its predicted time achieves (on the roof when it runs at peak)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    peak, bandwidth, ridge = cm.peak_flops, cm.hardware.memory_bandwidth, cm.ridge_ops_per_byte
    points = [(r.ops_per_byte, r.flops / r.time_s, r) for r in rows if r.time_s and r.bytes]
    xs = [p[0] for p in points] or [ridge]
    lo, hi = min(min(xs), ridge) / 4, max(max(xs), ridge) * 4
    x = np.logspace(np.log10(lo), np.log10(hi), 256)

    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.loglog(x, np.minimum(peak, bandwidth * x), color="black", lw=2, label="roofline")
    ax.axvline(ridge, color="gray", ls="--", lw=1)
    ax.annotate(
        f"ridge {ridge:.4g} FLOP/B",
        (ridge, peak),
        textcoords="offset points",
        xytext=(6, -14),
        fontsize=8,
        color="gray",
    )
    colors = {"prefill": "tab:blue", "decode": "tab:orange"}
    seen = set()
    offsets = [(4, 3), (4, -10), (4, 10), (4, -17)]  # staggered so neighbours stay legible
    for i, (ops, achieved, r) in enumerate(points):
        label = r.phase if r.phase not in seen else None
        seen.add(r.phase)
        ax.scatter([ops], [achieved], color=colors.get(r.phase, "tab:green"), s=24, label=label)
        ax.annotate(
            f"l={r.prompt_tokens} o={r.output_tokens} B={r.batch}",
            (ops, achieved),
            textcoords="offset points",
            xytext=offsets[i % len(offsets)],
            fontsize=7,
        )
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("FLOP/s per device")
    ax.set_title(f"{cm.model.name} on {cm.hardware.name} x{cm.tp} ({cm.model.dtype})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=120)
    plt.close(fig)
