"""Where a tensor-parallel step's time goes on this host: rank 0's time inside its all-reduces
against the step, and one rank on the per-op path against the fused native decoder stack.

Why: bench_tensor_parallel.py shows TP=2 costing more than the cost model's price (the one-rank
work plus 60 all-reduces at their isolated cost); this says which part is the excess. Same
model as there (SmolLM2-135M's shape, 6 + 6 heads of 96, dummy bf16 weights, not quantized).

    .venv/bin/python benchmarks/tp_breakdown.py
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import quill.model.llama as llama
from quill import LLM, SamplingParams
from quill.distributed.group import TensorParallel
from quill.model.default_model import default_model_dir

_waits: list[float] = []


def _timed_all_reduce(original):
    def all_reduce(self, x):
        start = time.perf_counter()
        out = original(self, x)
        _waits.append(time.perf_counter() - start)
        return out

    return all_reduce


def model_dir(directory: Path) -> Path:
    config = json.loads((default_model_dir() / "config.json").read_text())
    config.update(num_attention_heads=6, num_key_value_heads=6, head_dim=96)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def decode(llm: LLM, batch: int, steps: int = 24) -> tuple[float, float]:
    """(median decode step, median time inside all-reduces in it), milliseconds."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request([100 + i] * 32, params)
    durations, waits = [], []
    while engine.has_unfinished_requests():
        _waits.clear()
        _, stats = engine.step_with_stats()
        if stats is not None and stats.num_prefill_tokens == 0:
            durations.append(stats.duration)
            waits.append(sum(_waits))
    return 1000 * statistics.median(durations), 1000 * statistics.median(waits)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = str(model_dir(Path(tmp)))
        options = dict(
            load_format="dummy",
            tokenizer=str(default_model_dir()),
            kv_cache_memory=1 << 30,
            quantization="none",
        )
        with LLM(path, **options) as one:
            decode(one, 2, 4)
            for batch in (1, 64):
                print(f"TP=1, fused decoder stack, batch {batch}: {decode(one, batch)[0]:.1f} ms")
            fused = llama._native_layer_weights
            llama._native_layer_weights = lambda layer: None  # every layer on the op path
            model = one.engine.worker.runner.model
            for layer in model.layers:
                layer.__dict__.pop("_native_cache", None)
            model.__dict__.pop("_stack_cache", None)
            for batch in (1, 64):
                print(f"TP=1, per-op path, batch {batch}: {decode(one, batch)[0]:.1f} ms")
            llama._native_layer_weights = fused
        TensorParallel.all_reduce = _timed_all_reduce(TensorParallel.all_reduce)
        with LLM(path, tensor_parallel_size=2, **options) as two:
            decode(two, 2, 4)
            layers = two.engine.worker.runner.runner.model.config.num_layers
            for batch in (1, 64):
                step, waits = decode(two, batch)
                each = 1000 * waits / (2 * layers)
                print(
                    f"TP=2, batch {batch}: step {step:.1f} ms, rank 0 inside its all-reduces "
                    f"{waits:.1f} ms ({each:.0f} us each)"
                )


if __name__ == "__main__":
    main()
