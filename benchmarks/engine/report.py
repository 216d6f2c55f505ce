"""The engine benchmark's report: markdown tables with ratios quill/peer, and a roofline plot.

print_tables() pairs each peer with the quill variant of its precision class; plot() draws
output tokens/s against batch size under the rooflines the machine's measured rates set, and
beside it each product kernel's achieved GB/s and GFLOP/s against the probe and the GEMM.
"""

from __future__ import annotations

import math


def _pair(quill_cols, peer, row_value, higher_is_better: bool) -> tuple:
    """The quill column to hold against `peer`: same precision if any, else the best on the row."""
    same = [c for c in quill_cols if c.precision == peer.precision]
    candidates = [(c, row_value(c)) for c in (same[:1] or quill_cols)]
    candidates = [(c, v) for c, v in candidates if v]
    if not candidates:
        return None, None
    pick = max if higher_is_better else min
    return pick(candidates, key=lambda cv: cv[1])


def _seqs(n: int) -> str:
    return f"{n} seq" if n == 1 else f"{n} seqs"


def print_tables(results, columns, prompts, batches, long_batches, args) -> None:
    m = results["machine"]
    cols = results["columns"]
    quill_cols = [c for c in columns if c.kind == "quill"]
    peers = [c for c in columns if c.kind != "quill"]
    print(
        f"\n{m['cpu']} ({' '.join(m['cpu_flags'])}), {m['threads']} threads, torch {m['torch']}, "
        f"{m['date']}, {results['minutes']:.1f} min"
    )

    def table(title, rows, value, fmt, higher_is_better):
        names = [c.name for c in columns]
        ratio_names = [f"quill / {p.name}" for p in peers]
        print(f"\n{title}\n")
        print("| measure | " + " | ".join(names + ratio_names) + " |")
        print("|---" * (1 + len(names) + len(ratio_names)) + "|")
        for label, section, key in rows:
            cells = []
            for c in columns:
                v = value(cols[c.name].get(section, {}).get(key))
                cells.append(fmt(v, cols[c.name].get(section, {}).get(key)) if v else "-")
            for p in peers:
                pv = value(cols[p.name].get(section, {}).get(key))
                q, qv = _pair(
                    quill_cols,
                    p,
                    lambda c, s=section, k=key: value(cols[c.name].get(s, {}).get(k)),
                    higher_is_better,
                )
                if not pv or not qv:
                    cells.append("-")
                    continue
                tag = f" ({q.name.removeprefix('quill-')})" if len(quill_cols) > 1 else ""
                cells.append(f"{qv / pv:.2f}x{tag}")
            print(f"| {label} | " + " | ".join(cells) + " |")
        print(
            "\nratio > 1: quill faster"
            if higher_is_better
            else "\nratio < 1: quill faster (time ratio)"
        )

    def rate(m_):
        return m_ and (m_.get("tokens_per_s") or m_.get("decode_tokens_per_s"))

    def rate_fmt(v, m_):
        return f"{v:.0f} ({m_['step_ms']:.1f} ms)"

    decode_rows = [
        (f"{_seqs(b)}, {args.prompt_len}+{args.new_tokens} tokens", "decode", b) for b in batches
    ]
    if any("decode_only" in cols[c.name] for c in columns):
        # llama-bench's tg: one sequence, no prompt, decode only; the others alike.
        decode_rows.append(
            (f"1 seq, decode only (llama-bench -n {args.new_tokens})", "decode_only", 1)
        )
    decode_rows += [
        (f"{_seqs(b)} at {args.long_context} context, decode only", "long_decode", b)
        for b in long_batches
    ]
    table(
        "Output tokens/s (decode step ms); prompt prefill included in the short rows",
        decode_rows,
        rate,
        rate_fmt,
        True,
    )
    table(
        "Time to first token, seconds",
        [(f"prompt {n} tokens", "prefill", n) for n in prompts],
        lambda m_: m_ and m_.get("seconds"),
        lambda v, m_: f"{v:.3f}",
        False,
    )
    stream = results["rates"]["weight_stream_Bps"]
    probe = results["rates"].get("read_probe_Bps")
    probe_text = f"; read probe, all threads: {probe / 1e9:.1f} GB/s" if probe else ""
    print(
        f"\nKV read rate of quill's long-context decode (weight streaming: {stream / 1e9:.1f} GB/s"
        f"{probe_text})"
    )
    print("\n| column | seqs | context | step ms | KV MB/step | KV GB/s | KV+weights GB/s |")
    print("|---|---|---|---|---|---|---|")
    for c in quill_cols:
        for b in long_batches:
            d = cols[c.name].get("long_decode", {}).get(b)
            if d and "kv_read_Bps" in d:
                print(
                    f"| {c.name} | {b} | {d['context']:.0f} | {d['step_ms']:.1f} | "
                    f"{d['kv_bytes_per_step'] / 1e6:.1f} | {d['kv_read_Bps'] / 1e9:.2f} | "
                    f"{d['kv_plus_weights_Bps'] / 1e9:.2f} |"
                )


def plot(results, columns, batches, long_batches, args) -> None:
    """Left: output tokens/s against batch size under the rooflines (weights read at the
    probe's rate, arithmetic at the fastest product kernel's). Right: what each product kernel
    reaches on the head's shape, GB/s at one row and GFLOP/s at 256, beside the probe and the
    fp32 GEMM."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = results["columns"]
    rates = results["rates"]
    kernels = rates.get("kernels") or {}
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(13, 5.5), width_ratios=[3, 2])
    for c in columns:
        d = cols[c.name].get("decode", {})
        xs = [b for b in batches if b in d]
        if xs:
            line = ax.plot(xs, [d[b]["tokens_per_s"] for b in xs], marker="o", label=c.name)[0]
            ld = cols[c.name].get("long_decode", {})
            lx = [b for b in long_batches if b in ld]
            if lx:
                ax.plot(
                    lx,
                    [ld[b]["decode_tokens_per_s"] for b in lx],
                    marker="x",
                    linestyle=":",
                    color=line.get_color(),
                    label=f"{c.name}, ctx {args.long_context}, decode only",
                )
    grid = sorted({*batches, *long_batches}) or [1]
    lo, hi = math.log2(min(grid)), math.log2(max(grid)) + 0.5
    xs = [2 ** (lo + (hi - lo) * i / 200) for i in range(201)]
    params = rates["matmul_params_per_token"]
    # The arithmetic bound: the fastest product measured (bf16 or int8 GEMMs beat fp32's).
    peak = max([rates["gemm_fp32_flops"]] + [1e9 * k["GFLOPs_256_rows"] for k in kernels.values()])
    compute = peak / (2 * params)
    bandwidth = rates.get("read_probe_Bps") or rates["weight_stream_Bps"]
    source = "probe" if rates.get("read_probe_Bps") else "F.linear stream"
    # One roofline per precision class, with the smallest weight footprint of that class.
    weights: dict[str, int] = {}
    for c in columns:
        if c.weight_bytes:
            weights[c.precision] = min(weights.get(c.precision, c.weight_bytes), c.weight_bytes)
    for i, (precision, wbytes) in enumerate(sorted(weights.items(), key=lambda kv: -kv[1])):
        bound = [min(x * bandwidth / wbytes, compute) for x in xs]
        ax.plot(
            xs,
            bound,
            color="black",
            alpha=max(0.3, 1.0 - 0.25 * i),
            linestyle=["-", "--", "-.", ":"][i % 4],
            linewidth=1,
            label=f"roofline {precision} ({wbytes / 1e6:.0f} MB at {bandwidth / 1e9:.0f} GB/s)",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent sequences (batch)")
    ax.set_ylabel("output tokens/s")
    m = results["machine"]
    ax.set_title(
        f"{m['cpu']}, {m['threads']} threads: decode against the roofline\n"
        f"(weights at the {source}'s rate, arithmetic at {peak / 1e9:.0f} GFLOP/s, the fastest "
        "product measured)",
        fontsize=9,
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _plot_kernels(bars, rates)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


def _plot_kernels(ax, rates) -> None:
    kernels = rates.get("kernels") or {}
    names = list(kernels)
    ys = range(len(names))
    gbps = [kernels[n]["GBps_1_row"] for n in names]
    ax.barh([y + 0.2 for y in ys], gbps, height=0.4, color="tab:blue", label="GB/s, 1 row")
    probe = rates.get("read_probe_Bps")
    if probe:
        ax.axvline(probe / 1e9, color="tab:blue", linestyle="--", linewidth=1)
        ax.text(probe / 1e9, len(names) - 0.4, " read probe", color="tab:blue", fontsize=7)
    flops = ax.twiny()
    gflops = [kernels[n]["GFLOPs_256_rows"] for n in names]
    flops.barh([y - 0.2 for y in ys], gflops, height=0.4, color="tab:orange")
    gemm = rates["gemm_fp32_flops"] / 1e9
    flops.axvline(gemm, color="tab:orange", linestyle="--", linewidth=1)
    flops.text(gemm, -0.9, " fp32 GEMM", color="tab:orange", fontsize=7)
    flops.set_xlabel("GFLOP/s at 256 rows (orange)", fontsize=8)
    ax.set_xlabel("weight GB/s at 1 row (blue)", fontsize=8)
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.set_ylim(-1.2, len(names) - 0.2)
    ax.set_title("each product kernel on the output head's shape", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)
