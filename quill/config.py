"""Engine configuration: one dataclass that every part reads."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path

from quill.contract.kv_format import parse_kv_cache_dtype


def cache_dir() -> Path:
    """Where quill keeps what it made once: converted models, compiled code, calibrations."""
    return Path(os.environ.get("QUILL_CACHE", Path.home() / ".cache" / "quill"))


QUANTIZATIONS = ("none", "int8", "int4", "auto")
# auto: 16-bit, as the model's dtype when that is 16-bit, else bf16 where the CPU has bf16
# arithmetic and fp16 (F16C) where it does not.


SPECULATIVE_METHODS = ("ngram",)
_SPECULATIVE_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "by_cost",
}
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's n when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding's settings: vLLM's `speculative_config` dict, validated with errors
    that name the key (quill/engine/speculative.py proposes, spec_switch.py decides)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # quill's own key: speculate only where the cost model says it pays (false: whenever the
    # proposer finds drafts, as vLLM does).
    by_cost: bool = True

    @classmethod
    def parse(cls, value: dict | str) -> SpeculativeConfig:
        """The dict, or its JSON text (the command line's --speculative-config)."""
        return cls.from_dict(_json_value(value, "speculative_config"))

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        """vLLM's dict (plus quill's `by_cost`); one lookup bound given stands for both, neither
        means 5."""
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a JSON object")
        method = d.get("method")
        if method in ("draft_model", "eagle", "eagle3", "medusa", "mtp"):
            raise ValueError(
                f"speculative_config.method {method!r} is not built: quill proposes by n-gram "
                "lookup only. A draft model needs a smaller model of the target's tokenizer, "
                "and no two of the models quill loads share one (SmolLM2-135M: 49,152 tokens; "
                "Gemma 3 270M: 262,144)"
            )
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {method!r}"
            )
        unknown = sorted(set(d) - _SPECULATIVE_KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        k = _positive(d, "num_speculative_tokens", None)
        high = d.get("prompt_lookup_max")
        low = _positive(d, "prompt_lookup_min", high if high is not None else DEFAULT_PROMPT_LOOKUP)
        high = _positive(d, "prompt_lookup_max", low)
        if high < low:
            raise ValueError(
                f"speculative_config.prompt_lookup_max ({high}) is below prompt_lookup_min ({low})"
            )
        by_cost = d.get("by_cost", True)
        if not isinstance(by_cost, bool):
            raise ValueError(f"speculative_config.by_cost must be true or false, got {by_cost!r}")
        return cls(method, k, low, high, by_cost)


def _json_value(value, name: str):
    """`value`, or the value its JSON text says (a flag's text)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} is not valid JSON: {e}") from None


def _positive(d: dict, key: str, default: int | None) -> int:
    value = d.get(key, default)
    if value is None:
        raise ValueError(f"speculative_config.{key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{key} must be a positive integer, got {value!r}")
    return value


_KV_EVENTS_DEFAULTS = {  # vLLM's KVEventsConfig, key by key
    "enable_kv_cache_events": False,
    "publisher": "null",
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}


@dataclass(frozen=True)
class KVEventsConfig:
    """Where the engine publishes its KV-cache events (quill/engine/kv_events.py): vLLM's
    `--kv-events-config` JSON. `endpoint` is bound (a ZeroMQ PUB socket; `tcp://*:PORT`), as
    is `replay_endpoint` (a ROUTER socket that resends the last `buffer_steps` batches from a
    sequence number a subscriber asks for); `data_parallel_rank` offsets both ports."""

    enable_kv_cache_events: bool
    publisher: str
    endpoint: str
    replay_endpoint: str | None
    buffer_steps: int
    hwm: int
    max_queue_size: int
    topic: str

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def parse(cls, value: dict | str) -> KVEventsConfig:
        """The dict, or its JSON text (the command line's --kv-events-config)."""
        value = _json_value(value, "kv_events_config")
        if not isinstance(value, dict):
            raise ValueError("kv_events_config must be a JSON object")
        unknown = sorted(set(value) - set(_KV_EVENTS_DEFAULTS))
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)}")
        d = {**_KV_EVENTS_DEFAULTS, **value}
        if d["enable_kv_cache_events"] and "publisher" not in value:
            d["publisher"] = "zmq"  # vLLM's default once events are on
        if d["publisher"] not in ("null", "zmq"):
            raise ValueError(
                f"kv_events_config.publisher must be zmq or null, got {d['publisher']!r}"
            )
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if isinstance(d[key], bool) or not isinstance(d[key], int) or d[key] < 1:
                raise ValueError(f"kv_events_config.{key} must be a positive integer")
        for key in ("endpoint", "replay_endpoint", "topic"):
            if d[key] is not None and not isinstance(d[key], str):
                raise ValueError(f"kv_events_config.{key} must be a string")
        if not isinstance(d["enable_kv_cache_events"], bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        return cls(**d)

    def for_rank(self, rank: int) -> KVEventsConfig:
        """The endpoints of data-parallel rank `rank` (ports offset by it, as vLLM does)."""
        return replace(
            self,
            endpoint=_offset_port(self.endpoint, rank),
            replay_endpoint=_offset_port(self.replay_endpoint, rank),
        )


def _offset_port(endpoint: str | None, rank: int) -> str | None:
    if endpoint is None or not rank or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}"


class SchedulingPolicy(StrEnum):
    """The order requests are served in (quill/engine/request_queue.py)."""

    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # lower `priority` first (vLLM's --scheduling-policy priority)


TASKS = ("auto", "generate", "embed", "score")


def resolve_task(task: str, encoder: bool, classifier: bool = False) -> str:
    """What `auto` means for a model: for an encoder, score with a classification head (a
    cross-encoder), else embed; generate otherwise. An encoder cannot generate."""
    if encoder:
        return "score" if classifier else "embed"
    return "generate" if task == "auto" else task


@dataclass
class EngineConfig:
    """Options of one engine instance; `LLM(**options)` and `quill serve` fill it."""

    model: str | None = None
    # What the model is served for: generate, embed, or score (a decoder reranker's yes / no);
    # auto: embed for an encoder, generate otherwise (embeddings are served either way).
    task: str = "auto"
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    load_format: str = "auto"  # auto | safetensors | gguf | dummy
    max_num_batched_tokens: int | None = None  # token budget per step; 512 on CPU
    max_num_seqs: int = 256
    max_model_len: int | None = None  # default: the model's context length
    kv_cache_memory: int | None = None  # bytes for the KV pool; default from free memory
    block_size: int = 16
    # auto | float32 | bfloat16 | float16 | int8, or K,V apart (quill/contract/kv_format.py)
    kv_cache_dtype: str = "auto"
    compile: bool = False  # torch.compile with bucketed batch sizes (slow start, faster steps)
    # Weight-only quantization: none | int8 | int4 | auto (auto measures here at start-up and
    # keeps an int8 copy for the batch sizes where it is faster than the float weights).
    quantization: str | None = "auto"
    seed: int = 0
    tokenizer: str | None = None
    record_steps: str | None = None  # JSONL file: every step's plan composition and wall time
    # The cost model's hardware: a preset or a `quill cost calibrate` file; default: this
    # machine's calibration when one was saved, else FLOPs and bytes only (no times, no $).
    hardware: str | None = None
    # That saved calibration, when stale (quill/cost/freshness.py): refit | refuse | as-is;
    # None: $QUILL_CALIBRATION, else refit.
    calibration: str | None = None
    price_per_hour: float | None = None  # USD, to put a price on every request
    enable_prefix_caching: bool = True  # reuse the KV of full blocks of earlier prompts
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS  # a string is taken too
    priority_aging: float = 10.0  # seconds of waiting worth one priority level (inf: none)
    # Refuse a request at once when its predicted time to first token exceeds this (seconds).
    max_ttft_slo: float | None = None
    # The step observers; each costs nothing when off. TTFT prediction gives every request its
    # predicted time to first token (and is what max_ttft_slo and per-request SLOs refuse by);
    # cost accounting charges every request its FLOPs, bytes and dollars and prices each step.
    predict_ttft: bool = True
    cost_accounting: bool = True
    # Ranks that each hold a slice of every layer (quill/distributed); 1: the whole model here.
    tensor_parallel_size: int = 1
    # Seconds a tensor-parallel collective may wait for a rank before the engine gives up on it
    # (a rank that dies is seen at once; this bounds one that hangs). Above any CPU step.
    distributed_timeout: float = 60.0
    # Hosts the ranks spread over, this host's index (0: the engine's, with rank 0), and where
    # rank 0 listens for the others (a free local port when all ranks are on this host).
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # Disaggregation (quill/disagg): a prefill instance's KV address, where decode instances
    # pair and fetch leased prompt KV (port None: no link); seconds a transfer may take; what a
    # decode instance does when a fetch fails: compute the prompt itself, or fail the request.
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int | None = None
    kv_transfer_timeout: float = 30.0
    kv_transfer_failure: str = "recompute"
    # Speculative decoding: vLLM's speculative_config dict, or its JSON text (quill/engine/
    # speculative.py), e.g. {"method": "ngram", "num_speculative_tokens": 4}; None: off.
    speculative_config: dict | str | None = None
    # KV-cache events for prefix-aware routers: vLLM's kv_events_config dict or JSON text
    # (KVEventsConfig); None: none published.
    kv_events_config: dict | str | None = None
    data_parallel_rank: int = 0  # this replica's index among data-parallel ones (events)

    @property
    def kv_events(self) -> KVEventsConfig | None:
        if self.kv_events_config is None:
            return None
        events = KVEventsConfig.parse(self.kv_events_config)
        return events.for_rank(self.data_parallel_rank) if events.enabled else None

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.price_per_hour is not None and not self.price_per_hour > 0:
            raise ValueError(f"price_per_hour must be positive, got {self.price_per_hour}")
        if self.scheduling_policy not in tuple(SchedulingPolicy):
            raise ValueError(
                f"unknown scheduling_policy {self.scheduling_policy!r} (fcfs | priority)"
            )
        self.scheduling_policy = SchedulingPolicy(self.scheduling_policy)
        if not self.priority_aging > 0:
            raise ValueError(f"priority_aging must be positive (or inf), got {self.priority_aging}")
        if self.max_ttft_slo is not None and not (
            self.max_ttft_slo > 0 and math.isfinite(self.max_ttft_slo)
        ):
            raise ValueError(f"max_ttft_slo must be positive seconds, got {self.max_ttft_slo}")
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}"
            )
        if not self.distributed_timeout > 0:
            raise ValueError(
                f"distributed_timeout must be positive seconds, got {self.distributed_timeout}"
            )
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"node_rank must be in [0, nnodes), got {self.node_rank} of {self.nnodes}"
            )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} does not divide among "
                f"{self.nnodes} nodes"
            )
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("several nodes need master_port (rank 0's, the same on every node)")
        if self.tensor_parallel_size > 1 and self.compile:
            raise ValueError("compile is not supported with tensor_parallel_size > 1")
        if self.max_ttft_slo is not None and not self.predict_ttft:
            raise ValueError("max_ttft_slo refuses by predicted TTFT: it needs predict_ttft on")
        if self.kv_transfer_failure not in ("recompute", "fail"):
            raise ValueError(
                f"unknown kv_transfer_failure {self.kv_transfer_failure!r} (recompute | fail)"
            )
        self.speculative  # noqa: B018 - parsed now, so a bad dict fails here
        self.kv_events  # noqa: B018 - as is this one
        if not self.kv_transfer_timeout > 0:
            raise ValueError(
                f"kv_transfer_timeout must be positive seconds, got {self.kv_transfer_timeout}"
            )
        if self.quantization is None:
            self.quantization = "none"
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"unknown quantization {self.quantization!r} (none | int8 | int4 | auto)"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise ValueError(f"unknown dtype {self.dtype!r}")
        key, value = parse_kv_cache_dtype(self.kv_cache_dtype)
        self.kv_cache_dtype = key if key == value else f"{key},{value}"
