"""Recording steps: each plan's composition and its measured time, one JSON line per step.

The cost model is only worth having if its prices match the steps the engine really runs; the
record is what they are checked against (`benchmarks/bench_cost.py`), and what a person reads to
see where a server's time went. Token ids are left out: the shape of a step, not its text,
sets its cost.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from quill.contract.plan import StepPlan


def step_record(plan: StepPlan, start: float, end: float) -> dict:
    """A step as plain data: per sequence [start, num_tokens, samples, is_decode]."""
    return {
        "step": plan.step_id,
        "start": start,
        "duration": end - start,
        "num_seqs": len(plan.seqs),
        "num_tokens": plan.num_tokens,
        "num_decode_tokens": plan.num_decode_tokens,
        "seqs": [[s.start, len(s.token_ids), s.samples, s.is_decode] for s in plan.seqs],
    }


class StepRecorder:
    """Appends one line per step to a JSONL file (line-buffered, so a crash loses little)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        self._lock = threading.Lock()

    def on_step(self, plan: StepPlan, start: float, end: float) -> None:
        line = json.dumps(step_record(plan, start, end), separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    def close(self) -> None:
        self._file.close()


def read_steps(path: str | Path) -> list[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
