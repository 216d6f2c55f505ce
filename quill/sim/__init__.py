"""The serving simulator: the engine's own scheduling loop, timed by the cost model.

Questions like "how many replicas for 50 requests/s within a 200 ms TTFT" or "does splitting
prefill from decode pay for this traffic" need the engine's real batching and preemption, but
not its model or its GPU. This package drives `quill.engine.core.EngineCore` unchanged with an
executor that advances virtual time by each step's predicted price. It never imports torch.

Modules: `workload` (arrivals and lengths), `config` (a replica's settings), `replica` (one
engine core on a virtual clock), `cluster` (event loops over replicas, colocated or split),
`metrics` (what a benchmark client reports), `capacity` (rate search), `report` and `cli`.
"""
