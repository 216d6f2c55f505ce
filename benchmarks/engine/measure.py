"""Alternating rounds: every column measured in turn, round after round, its best kept.

The machine drifts (20% between minutes), so no column gets all the good or all the bad
minutes; one column failing is reported and the others' numbers are kept.
"""

from __future__ import annotations

import sys


def _merge_best(old: dict | None, new: dict) -> dict:
    """Best of two measurements: the smaller times, the larger rates."""
    if old is None:
        return dict(new)
    out = dict(new)
    for key, value in new.items():
        if key not in old or not isinstance(value, int | float):
            continue
        if "per_s" in key or key.endswith("Bps"):
            out[key] = max(old[key], value)
        elif key.endswith(("_ms", "seconds")):
            out[key] = min(old[key], value)
    return out


def measure(columns, results, section: str, key, rounds: int, fn_name: str, *args) -> None:
    """Alternates the columns `rounds` times on one measurement; keeps each column's best."""
    for _ in range(rounds):
        for col in columns:
            fn = getattr(col, fn_name, None)
            if fn is None:
                continue
            try:
                value = fn(*args)
            except Exception as e:  # one peer failing must not lose the others' numbers
                print(f"  {col.name} {section} {key}: failed: {e}", file=sys.stderr, flush=True)
                continue
            store = results["columns"][col.name].setdefault(section, {})
            store[key] = _merge_best(store.get(key), value)
    summary = ", ".join(
        f"{c.name} {_cell(results['columns'][c.name].get(section, {}).get(key), section)}"
        for c in columns
        if hasattr(c, fn_name)
    )
    print(f"{section} {key}: {summary}", flush=True)


def _cell(m: dict | None, section: str) -> str:
    if not m:
        return "-"
    if section == "prefill":
        return f"{m['seconds']:.3f} s"
    rate = m.get("tokens_per_s", m.get("decode_tokens_per_s"))
    return f"{rate:.0f} ({m['step_ms']:.1f} ms)"
