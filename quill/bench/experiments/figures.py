"""One PNG per experiment, drawn from its raw numbers (matplotlib, no display needed).

Measurements are always dots and predictions lines, in every figure, so a reader learns the
code once: solid for the calibrated cost model or the simulator, dotted for the roofline floor.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

MEASURED, PREDICTED, FLOOR = "o", "-", ":"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    _pyplot().close(fig)


def plot_reading(result: dict, path: Path) -> None:
    plt = _pyplot()
    rows = result["rows"]
    x = [r["tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for phase, color, label in (
        ("read", "tab:blue", "read (prefill)"),
        ("write", "tab:orange", "write (decode)"),
    ):
        ax.plot(
            x,
            [r[phase]["measured_s"] for r in rows],
            MEASURED,
            color=color,
            label=f"{label}: measured",
        )
        ax.plot(
            x,
            [r[phase]["time_s"] for r in rows],
            PREDICTED,
            color=color,
            label=f"{label}: predicted",
        )
        ax.plot(
            x,
            [r[phase]["roofline_s"] for r in rows],
            FLOOR,
            color=color,
            label=f"{label}: roofline floor",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens L (prompt read, or reply written)")
    ax.set_ylabel("seconds")
    ax.set_title("Reading L tokens (1 pass) against writing L tokens (L passes), batch 1")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _caps(ax, result: dict) -> None:
    marks = [
        (result.get("arithmetic_from_batch"), "gray", "--", "roofline: arithmetic-bound from here"),
        (result.get("engine_max_batch"), "tab:red", "-", "KV pool + max_num_seqs cap"),
        (result.get("cost_model_max_batch"), "tab:red", ":", "cost model's memory cap"),
    ]
    for value, color, style, label in marks:
        if value:
            ax.axvline(value, color=color, ls=style, lw=1, label=f"{label} ({value:,})")


def plot_batching(result: dict, path: Path) -> None:
    plt = _pyplot()
    rows, curve = result["rows"], result["curve"]
    xb, cb = [r["batch"] for r in rows], [c["batch"] for c in curve]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5))
    left.plot(xb, [r["measured_s"] for r in rows], MEASURED, color="tab:orange", label="measured")
    left.plot(
        cb,
        [c["predicted_s"] for c in curve],
        PREDICTED,
        color="tab:orange",
        label="predicted (calibrated)",
    )
    left.plot(cb, [c["roofline_s"] for c in curve], FLOOR, color="black", label="roofline floor")
    left.set_ylabel("decode step, seconds")
    right.plot(xb, [r["tokens_per_s"] for r in rows], MEASURED, color="tab:green", label="measured")
    right.plot(
        cb,
        [c["batch"] / c["predicted_s"] for c in curve],
        PREDICTED,
        color="tab:green",
        label="predicted (calibrated)",
    )
    right.plot(
        cb,
        [c["batch"] / c["roofline_s"] for c in curve],
        FLOOR,
        color="black",
        label="roofline ceiling",
    )
    right.set_ylabel("output tokens per second")
    for ax in (left, right):
        _caps(ax, result)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"sequences decoding together (context {result['context']})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_cost(result: dict, path: Path) -> None:
    plt = _pyplot()
    loads = result["loads"]
    names = [f"{d['load']}\n(batch {d['batch']})" for d in loads]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.5))
    width = 0.38
    pos = range(len(loads))
    ax = axes[0]
    ax.bar(
        [p - width / 2 for p in pos],
        [d["measured"]["usd_per_million"] for d in loads],
        width,
        label="measured",
    )
    ax.bar(
        [p + width / 2 for p in pos],
        [d["predicted"]["usd_per_million"] for d in loads],
        width,
        label="predicted",
        alpha=0.6,
    )
    ax.set_ylabel(f"\\$ per million output tokens at \\${result['price_per_hour']:g}/h")
    ax.set_yscale("log")
    ax = axes[1]
    shared = [d["split"]["shared_s"] / d["batch"] * 1e3 for d in loads]
    own = [d["split"]["own_s"] / d["batch"] * 1e3 for d in loads]
    ax.bar(pos, shared, 0.6, label="shared: fixed cost + weights")
    ax.bar(pos, own, 0.6, bottom=shared, label="own: FLOPs, KV, per sequence")
    ax.set_ylabel("predicted ms per output token")
    ax = axes[2]
    weights = [d["split"]["weight_bytes"] / d["batch"] / 1e6 for d in loads]
    kv = [d["split"]["kv_bytes"] / d["batch"] / 1e6 for d in loads]
    ax.bar(pos, weights, 0.6, label="weights")
    ax.bar(pos, kv, 0.6, bottom=weights, label="KV cache")
    ax.set_ylabel("MB moved per output token (cost model)")
    for ax in axes:
        ax.set_xticks(list(pos), names)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    _save(fig, path)


def plot_interference(result: dict, path: Path) -> None:
    plt = _pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, len(runs), figsize=(12, 4.8), sharey=True)
    for ax, (name, run) in zip(axes, runs.items()):
        for side, style, alpha in (("measured", "-", 0.35), ("simulated", "--", 0.9)):
            timeline = run[side]
            streams = [k for k in timeline["token_times"] if k.startswith("stream-")]
            for i, rid in enumerate(streams if side == "measured" else streams[:1]):
                t = timeline["token_times"][rid]
                gaps = [b - a for a, b in zip(t, t[1:])]
                label = f"{side}" + (" (each stream)" if side == "measured" else " (every stream)")
                ax.plot(
                    t[1:],
                    [g * 1e3 for g in gaps],
                    style,
                    marker=".",
                    ms=3,
                    lw=1,
                    color="tab:blue" if side == "measured" else "black",
                    alpha=alpha,
                    label=label if i == 0 else None,
                )
            first = timeline["token_times"].get("long-prompt")
            if first:
                ax.axvline(
                    first[0],
                    color="tab:red",
                    ls=style,
                    lw=1,
                    label=f"newcomer's first token ({side})",
                )
        ax.axvline(0, color="gray", lw=1, label="prompt arrives")
        ax.set_title(f"{'one pass' if name == 'one_pass' else 'chunks'} (budget {run['budget']})")
        ax.set_xlabel("seconds since the long prompt arrived")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("inter-token gap, ms")
    _save(fig, path)


def plot_split(result: dict, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 4.8))
    for name, color in (("colocated", "tab:orange"), ("split", "tab:blue")):
        timeline = result["measured"][name]["timeline"]
        label = {"colocated": "(a) 2 colocated", "split": "(b) 1 prefill + 1 decode"}[name]
        ax.plot(
            [t for t, _ in timeline],
            [g * 1e3 for _, g in timeline],
            ".",
            ms=3,
            color=color,
            alpha=0.5,
            label=f"{label}: every stream's gaps",
        )
        p99 = result["simulated"][name]["all_itl_p99_s"]
        ax.axhline(p99 * 1e3, color=color, ls="--", lw=1, label=f"{label}: simulated ITL p99")
    first = min(w[1] for w in result["workload"] if not w[0].startswith("s"))
    for w in result["workload"]:
        if not w[0].startswith("s"):
            ax.axvline(w[1] - first, color="gray", lw=1)
    ax.set_xlabel("seconds since the first long prompt arrived (gray: each arrival)")
    ax.set_ylabel("inter-token gap, ms")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_load(result: dict, path: Path) -> None:
    plt = _pyplot()
    runs = result["runs"]
    rates = [r["rate"] for r in runs]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, metric, title in (
        (axes[0], "ttft", "time to first token"),
        (axes[1], "itl", "inter-token latency"),
    ):
        for q, color in (("p50", "tab:blue"), ("p99", "tab:orange")):
            key = f"{metric}_{q}_s"
            ax.plot(
                rates, [r["server"][key] for r in runs], MEASURED, color=color, label=f"server {q}"
            )
            ax.plot(
                rates,
                [r["simulated"][key] for r in runs],
                PREDICTED,
                marker="x",
                color=color,
                label=f"simulated {q}",
            )
            ax.plot(
                rates,
                [r["simulated_calibration"][key] for r in runs],
                "--",
                color=color,
                alpha=0.5,
                label=f"simulated {q}, calibration unrefitted",
            )
        ax.axvline(
            result["saturation_rate"], color="gray", ls="--", lw=1, label="simulated saturation"
        )
        ax.set_title(title)
        ax.set_xlabel("requests per second")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)


def plot_routing(result: dict, path: Path) -> None:
    from quill.bench.experiments.routing import measured_medians

    plt = _pyplot()
    real, sim = measured_medians(result), result["simulated"]
    names = list(real)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    x = range(len(names))
    for offset, key, color in ((-0.2, "ttft_p50_s", "tab:blue"), (0.2, "ttft_p90_s", "tab:orange")):
        axes[0].bar([i + offset for i in x], [real[n][key] for n in names], 0.4, color=color,
                    label=f"measured {key[5:8]}")  # fmt: skip
        axes[0].plot([i + offset for i in x], [sim[n][key] for n in names], "kx",
                     label=f"simulated {key[5:8]}")  # fmt: skip
    axes[0].set_ylabel("seconds")
    axes[0].set_title("time to first token")
    axes[1].bar(x, [real[n]["output_tokens_per_s"] for n in names], 0.5, color="tab:green",
                label="measured")  # fmt: skip
    axes[1].plot(x, [sim[n]["output_tokens_per_s"] for n in names], "kx", label="simulated")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_title("throughput")
    for ax in axes:
        ax.set_xticks(list(x), names)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)


PLOTS: dict[str, Callable[[dict, Path], None]] = {
    "reading": plot_reading,
    "batching": plot_batching,
    "cost": plot_cost,
    "interference": plot_interference,
    "split": plot_split,
    "load": plot_load,
    "routing": plot_routing,
}
