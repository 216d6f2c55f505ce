"""The simulator's results as a person reads them: the figures a serving benchmark prints.

Layout only; every number comes from the result dicts that `--json` prints unchanged.
"""

from __future__ import annotations

import math

WIDTH = 64
DISTRIBUTIONS = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:,.{digits}f}"


def _percent(results: dict) -> float | None:
    rate = results.get("prefix_cache_hit_rate")
    return None if rate is None else rate * 100


def _row(label: str, value) -> str:
    return f"{label + ':':<44}{value:>20}"


def _settings(settings: dict) -> list[str]:
    s = settings["scheduler"]
    w = settings["workload"]
    lines = [
        f"Model       {s['model']} ({settings['dtype']}) on {s['hardware']}, tp {s['tp']}",
        f"Scheduler   max-num-seqs {s['max_num_seqs']}, max-num-batched-tokens "
        f"{s['max_num_batched_tokens']}, block-size {s['block_size']}, "
        f"max-model-len {s['max_model_len']}, prefix caching "
        f"{'on' if s.get('enable_prefix_caching') else 'off'}",
        f"KV pool     {s['kv_cache_tokens']:,} tokens ({s['num_kv_blocks']:,} blocks) per replica",
    ]
    if w.get("trace"):
        lines.append(f"Workload    trace {w['trace']} ({w['num_requests']:,} requests)")
    else:
        rate = w["request_rate"]
        if settings["mode"] == "capacity":
            pace = "per trial, at the rate searched" + (
                "" if w["burstiness"] == 1 else f" (burstiness {w['burstiness']:g})"
            )
        elif math.isinf(rate):
            pace = "all at t=0"
        elif w["burstiness"] == 1:
            pace = f"Poisson at {rate:g} req/s"
        else:
            pace = f"gamma (burstiness {w['burstiness']:g}) at {rate:g} req/s"
        lines.append(
            f"Workload    {w['num_requests']:,} requests {pace}, prompt {w['prompt_tokens']}, "
            f"output {w['output_tokens']} tokens, seed {w['seed']}"
        )
        if w.get("prefix_tokens"):
            count = w["num_prefixes"]
            lines.append(
                f"            prompts start with one of {count} shared prefix"
                f"{'es' if count > 1 else ''} of {w['prefix_tokens']} tokens (or all the prompt)"
            )
    if settings.get("slo"):
        slo = settings["slo"]
        parts = [f"{k[:-3]} <= {v:g} ms" for k, v in slo.items() if v is not None]
        lines.append(f"SLO         {', '.join(parts)}")
    return lines


def format_run(settings: dict, out: dict) -> str:
    r = out["results"]
    lines = _settings(settings)
    title = f" Simulated serving ({settings['replicas']} replica"
    title += "s) " if settings["replicas"] > 1 else ") "
    lines += ["", title.center(WIDTH, "=")]
    lines += [
        _row("Successful requests", _num(r["num_requests"] - r["num_truncated"])),
        _row("Duration (s)", _num(r["duration_s"], 3)),
        _row("Total input tokens", _num(r["prompt_tokens"])),
        _row("Total generated tokens", _num(r["output_tokens"])),
        _row("Request throughput (req/s)", _num(r["request_throughput"])),
        _row("Output token throughput (tok/s)", _num(r["output_throughput"])),
        _row("Total token throughput (tok/s)", _num(r["total_token_throughput"])),
    ]
    if r["goodput"] is not None:
        lines.append(_row("Goodput (req/s)", _num(r["goodput"])))
    if r.get("prefix_cache_hit_rate") is not None:
        lines.append(_row("Prefix cache hit rate", f"{r['prefix_cache_hit_rate']:.2%}"))
    lines += [
        _row("Preemptions", _num(r["num_preemptions"])),
        _row("Truncated requests (KV pool too small)", _num(r["num_truncated"])),
        "-" * WIDTH,
        f"{'(ms)':<14}" + "".join(f"{h:>10}" for h in ("mean", "p50", "p90", "p99", "max")),
    ]
    for label, key in DISTRIBUTIONS:
        d = r[key]
        cells = (d["mean"], d["p50"], d["p90"], d["p99"], d["max"])
        lines.append(f"{label:<14}" + "".join(f"{_num(c):>10}" for c in cells))
    lines.append("-" * WIDTH)
    lines += [_replica_line(x) for x in out["replicas"]]
    return "\n".join(lines)


def _replica_line(stats: dict) -> str:
    busy = stats["busy_fraction"]
    busy_text = "-" if busy is None else f"{busy:.0%}"
    line = (
        f"{stats['name']}: {stats['steps']:,} steps, busy {busy_text}, "
        f"{_num(stats['mean_tokens_per_step'], 1)} tokens/step, "
        f"{stats['preemptions']:,} preemptions"
    )
    if "spec_decode_num_drafts" in stats:  # speculation on
        drafted = stats["spec_decode_num_draft_tokens"]
        accepted = stats["spec_decode_num_accepted_tokens"]
        line += f", {accepted:,} of {drafted:,} drafts accepted"
    return line


def format_comparison(settings: dict, colocated: dict, disaggregated: dict) -> str:
    p, d = settings["disaggregate"]
    heads = (f"colocated x{p + d}", f"disagg {p}:{d}")
    lines = _settings(settings)
    lines += ["", f"{'':<30}{heads[0]:>17}{heads[1]:>17}"]

    def row(label: str, get, digits: int = 2) -> None:
        cells = [_num(get(x), digits) for x in (colocated, disaggregated)]
        lines.append(f"{label:<30}{cells[0]:>17}{cells[1]:>17}")

    row("Goodput (req/s)", lambda x: x["results"]["goodput"])
    row("Request throughput (req/s)", lambda x: x["results"]["request_throughput"])
    row("Output throughput (tok/s)", lambda x: x["results"]["output_throughput"])
    row("Duration (s)", lambda x: x["results"]["duration_s"], 3)
    for label, key in DISTRIBUTIONS:
        for q in ("p50", "p99"):
            row(f"{label} {q} (ms)", lambda x, key=key, q=q: x["results"][key][q])
    row("KV transfer mean (ms)", lambda x: x.get("kv_transfer_ms", {}).get("mean"), 3)
    row("KV transfer wait p99 (ms)", lambda x: x.get("kv_transfer_wait_ms", {}).get("p99"), 3)
    row("Preemptions", lambda x: x["results"]["num_preemptions"])
    row("Truncated requests", lambda x: x["results"]["num_truncated"])
    if colocated["results"].get("prefix_cache_hit_rate") is not None:
        row("Prefix cache hit rate (%)", lambda x: _percent(x["results"]))
    lines.append("")
    good_c = colocated["results"]["goodput"]
    good_d = disaggregated["results"]["goodput"]
    if good_c is None:
        lines.append("Give --slo to compare goodput.")
    elif good_d > good_c:
        lines.append(f"Disaggregation pays: {good_d:.2f} vs {good_c:.2f} good requests/s.")
    else:
        lines.append(f"Disaggregation does not pay: {good_d:.2f} vs {good_c:.2f} good requests/s.")
    lines.append("Replicas:")
    lines += ["  colocated " + _replica_line(x) for x in colocated["replicas"]]
    lines += ["  disagg    " + _replica_line(x) for x in disaggregated["replicas"]]
    return "\n".join(lines)


def format_capacity(settings: dict, found: dict, plan: dict | None) -> str:
    lines = _settings(settings)
    lines += ["", f"{'rate (req/s)':>14}{'TTFT p99':>12}{'ITL p99':>12}{'E2E p99':>12}  meets SLO"]
    for t in found["trials"]:
        lines.append(
            f"{_num(t['rate']):>14}{_num(t['ttft_p99_ms']):>12}{_num(t['itl_p99_ms']):>12}"
            f"{_num(t['e2e_p99_ms']):>12}  {'yes' if t['meets_slo'] else 'no'}"
        )
    rate = found["capacity_rate"]
    lines.append("")
    if rate == 0:
        lines.append("No rate meets the SLO: even a lone request misses it.")
    elif math.isinf(rate):
        lines.append("The SLO is met even when every request arrives at once.")
    else:
        lines.append(
            f"Capacity: {rate:,.2f} req/s per replica (p99 TTFT and ITL within the SLO; "
            f"{found['lowest_failing_rate']:,.2f} req/s fails; tolerance "
            f"{found['tolerance']:.0%})."
        )
    if plan is not None:
        check = plan["check"]["results"]
        verdict = "meets" if plan["check_meets_slo"] else "misses"
        lines.append(
            f"For {plan['target_rate']:,.2f} req/s: {plan['replicas']} replicas "
            f"({plan['replicas'] * settings['scheduler']['tp']} devices), assuming the traffic "
            f"splits evenly over independent replicas."
        )
        lines.append(
            f"Check, {plan['replicas']} replicas behind a {settings['router']} router: p99 TTFT "
            f"{_num(check['ttft_ms']['p99'])} ms, p99 ITL {_num(check['itl_ms']['p99'])} ms: "
            f"{verdict} the SLO."
        )
        if plan.get("cost_per_hour") is not None:
            lines.append(f"Hardware cost: ${plan['cost_per_hour']:,.2f} per hour.")
    return "\n".join(lines)
