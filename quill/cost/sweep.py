"""Real engine steps of chosen shapes, timed: what `quill cost calibrate` fits and what
`benchmarks/bench_cost.py` checks the cost model's predictions against.

Reaching a decode step of 64 sequences at 1,500 tokens of context honestly means prefilling
96,000 tokens first: minutes of CPU per shape. A step's time depends on its shape, not on the
values in the KV cache, so the prompts before a measured step are fast-forwarded: while they
are scheduled, the engine runs a stand-in executor that computes nothing and samples token 0.
The scheduler, block tables and KV pool stay the engine's own, and every measured step is a
real `engine.step()` through the real model runner, timed by the engine itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from quill.contract.plan import StepPlan, StepResult
from quill.contract.sampling_params import SamplingParams


@dataclass(frozen=True)
class Case:
    """Steps of one shape: `decodes` running sequences (prompts of `context` tokens) decoding
    one token each, plus `chunks` new prompt chunks of `chunk` tokens, each after
    `chunk_start` tokens of its prompt already computed (chunked prefill)."""

    decodes: int = 0
    context: int = 0
    chunks: int = 0
    chunk: int = 0
    chunk_start: int = 0
    steps: int = 3  # measured steps
    warmup: int = 1  # steps run first and thrown away (allocations, first-touch of buffers)

    def __post_init__(self) -> None:
        if self.decodes < 0 or self.chunks < 0 or self.steps < 1 or self.warmup < 0:
            raise ValueError(f"bad case {self}")
        if self.decodes and self.context < 1:
            raise ValueError(f"decodes need a context of at least one token: {self}")
        if self.chunks and self.chunk < 1:
            raise ValueError(f"chunks need at least one token: {self}")
        if not self.decodes and not self.chunks:
            raise ValueError("a case needs decodes or chunks")

    @property
    def kind(self) -> str:
        if not self.chunks:
            return "decode"
        return "mixed" if self.decodes else "prefill"

    @property
    def label(self) -> str:
        parts = [f"{self.decodes} dec @ {self.context}"] if self.decodes else []
        if self.chunks:
            at = f" @ {self.chunk_start}" if self.chunk_start else ""
            parts.append(f"{self.chunks} x {self.chunk}-tok chunk{at}")
        return " + ".join(parts)

    @property
    def decode_max_tokens(self) -> int:
        # Room for the fast-forwarded steps of chunked prefill as well as the measured ones.
        return 2 * (self.warmup + self.steps) + 4

    @property
    def kv_tokens(self) -> int:
        """KV tokens the case holds at its peak (the engine's pool must hold them)."""
        return self.decodes * (self.context + self.decode_max_tokens) + self.chunks * (
            self.chunk_start + self.chunk + 1
        )

    @property
    def step_tokens(self) -> int:
        return self.decodes + self.chunks * max(self.chunk, self.chunk_start)


@dataclass
class MeasuredStep:
    """One measured step: its composition as (start, num_tokens, samples, is_decode) per
    sequence (the `seqs` of quill.engine.record) and its wall time in seconds."""

    case: str
    kind: str
    duration: float
    seqs: list[tuple[int, int, bool, bool]]
    start: float | None = None  # when it began (a recorded step's clock), where known

    def to_dict(self) -> dict:
        return {
            "case": self.case,
            "kind": self.kind,
            "duration": self.duration,
            "seqs": [list(s) for s in self.seqs],
        }


class _FastForward:
    """A stand-in executor: the plan's sampling sequences all get token 0, nothing is computed.
    (The requests are greedy, so the real runner keeps no per-request sampler state to free.)"""

    def execute(self, plan: StepPlan) -> StepResult:
        return StepResult({s.request_id: [0] for s in plan.seqs if s.samples})


def plan_kind(plan: StepPlan) -> str:
    decodes = plan.num_decode_tokens
    if decodes == len(plan.seqs):
        return "decode"
    return "mixed" if decodes else "prefill"


class Sweep:
    """Runs cases on one engine (an LLMEngine) and returns the measured steps."""

    def __init__(self, engine, seed: int = 0) -> None:
        self.engine = engine
        self.real = engine.core.executor
        self.fake = _FastForward()
        self.rng = random.Random(seed)
        vocab = engine.model_config.vocab_size
        # Ordinary text ids: away from the special tokens at the start of most vocabularies.
        low = min(100, vocab - 1)
        self._token_range = (low, max(low, min(40000, vocab) - 1))
        self._counter = 0

    def _prompt(self, n: int) -> list[int]:
        lo, hi = self._token_range
        return [self.rng.randint(lo, hi) for _ in range(n)]

    def _add(self, n: int, max_tokens: int) -> str:
        self._counter += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        return self.engine.add_request(self._prompt(n), params, request_id=f"sweep-{self._counter}")

    def _step(self, real: bool, budget: int) -> tuple[StepPlan | None, float]:
        """(the plan that ran, its seconds), or (None, 0) when the step ran no pass."""
        engine = self.engine
        engine.core.executor = self.real if real else self.fake
        engine.set_token_budget(budget)
        _, stats = engine.step_with_stats()
        return (None, 0.0) if stats is None else (engine.last_plan, stats.duration)

    def run_case(self, case: Case, on_step: Callable[[], None] | None = None) -> list[MeasuredStep]:
        engine = self.engine
        scheduler = engine.scheduler
        base_budget = engine.token_budget
        if case.step_tokens > base_budget:
            raise ValueError(
                f"case {case.label} needs {case.step_tokens} tokens per step; the engine's "
                f"budget is {base_budget}"
            )
        ids: list[str] = []
        measured: list[MeasuredStep] = []
        try:
            if case.decodes:
                ids += [
                    self._add(case.context, case.decode_max_tokens) for _ in range(case.decodes)
                ]
                # Fast-forward the prompts (all at once: a fake step costs only scheduling),
                # done once nothing waits and no chunk was left partial.
                while True:
                    plan, _ = self._step(False, case.decodes * (case.context + 1))
                    if plan is None:
                        raise RuntimeError(f"case {case.label}: the engine scheduled nothing")
                    if not scheduler.num_waiting and all(s.samples for s in plan.seqs):
                        break
            for i in range(case.warmup + case.steps):
                if case.chunks:
                    prompt = case.chunk_start + case.chunk
                    ids += [self._add(prompt, 1) for _ in range(case.chunks)]
                    if case.chunk_start:
                        self._step(False, case.decodes + case.chunks * case.chunk_start)
                plan, duration = self._step(True, case.decodes + case.chunks * case.chunk)
                if plan is None:
                    raise RuntimeError(f"case {case.label}: the engine scheduled nothing")
                if i >= case.warmup:
                    seqs = [(s.start, len(s.token_ids), s.samples, s.is_decode) for s in plan.seqs]
                    measured.append(MeasuredStep(case.label, plan_kind(plan), duration, seqs))
                if on_step is not None:
                    on_step()
        finally:
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():  # aborts take effect in the next step
                self._step(False, base_budget)
            engine.core.executor = self.real
            engine.set_token_budget(base_budget)
        return measured

    def run(self, cases: Iterable[Case], desc: str = "steps", progress: bool = True):
        """Every case in turn, with a progress bar counting the real steps."""
        return self.run_tagged([("", c) for c in cases], desc, progress)[""]

    def run_tagged(
        self, tagged: list[tuple[str, Case]], desc: str = "steps", progress: bool = True
    ) -> dict[str, list[MeasuredStep]]:
        """Cases in the order given, their steps gathered by tag. Interleaving two sweeps
        (calibration and evaluation) makes the machine's drift between minutes hit both alike."""
        from tqdm import tqdm

        total = sum(c.warmup + c.steps for _, c in tagged)
        out: dict[str, list[MeasuredStep]] = {tag: [] for tag, _ in tagged}
        if tagged:  # the process's first real steps pay one-off costs (allocator, thread pool)
            first = tagged[0][1]
            self.run_case(replace(first, steps=1, warmup=1))
        with tqdm(total=total, desc=desc, unit="step", disable=not progress) as bar:
            for tag, case in tagged:
                bar.set_postfix_str(case.label)
                out[tag] += self.run_case(case, lambda: bar.update(1))
        return out


def engine_for(
    cases: Iterable[Case],
    model: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    load_format: str = "auto",
    tokenizer: str | None = None,
    block_size: int = 16,
    quantization: str = "none",
):
    """An LLMEngine whose token budget and KV pool hold every case (and no more).
    `quantization`: the weights' (none by default: the cost model prices them in `dtype`; a
    calibration for a server that quantizes is fitted with its quantization)."""
    from pathlib import Path

    import torch

    from quill.config import EngineConfig
    from quill.cost.model import ModelSpec
    from quill.engine.llm_engine import LLMEngine
    from quill.model.loader import resolve_device, resolve_dtype

    cases = list(cases)
    if model is None:
        from quill.model.default_model import default_model_dir

        model = str(default_model_dir())
    elem = torch.empty((), dtype=resolve_dtype(dtype, resolve_device(device))).element_size()
    spec = ModelSpec.from_path(Path(model), elem)
    blocks = max(-(-c.kv_tokens // block_size) + c.decodes + c.chunks for c in cases)
    config = EngineConfig(
        model=model,
        dtype=dtype,
        device=device,
        load_format=load_format,
        tokenizer=tokenizer,
        block_size=block_size,
        max_num_batched_tokens=max(c.step_tokens for c in cases),
        max_num_seqs=max(c.decodes + c.chunks for c in cases),
        kv_cache_memory=int((blocks + 4) * block_size * spec.kv_bytes_per_token),
        quantization=quantization,
        # Measuring needs no prices, and must not look for (and refit) a calibration itself.
        cost_accounting=False,
        predict_ttft=False,
    )
    return LLMEngine(config)
