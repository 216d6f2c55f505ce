"""The help text of `quill simulate`: what it does, its modes, the trace format and how it
counts, kept apart from the command's code."""

DESCRIPTION = """\
Run a workload through quill's engine core (the same scheduler, batching and preemption as
`quill serve`) in virtual time: every step takes what the cost model predicts for it on the
given hardware. Reports what a serving benchmark client reports. Defaults: SmolLM2-135M on
H100-SXM, 1000 requests all at t=0 with 256-token prompts and 128-token replies,
--max-num-batched-tokens 8192 (quill serve uses 512 on a CPU: pass it to compare), and a KV
pool of what is left of 90% of the device memory after the weights (--kv-cache-memory: bytes
per device), at most max-num-seqs sequences of full context."""

EPILOG = """\
modes:
  (default)           one run; with --replicas N, N replicas share the arrivals
  --capacity          highest rate one replica sustains with p99 TTFT and p99 ITL within --slo
  --disaggregate P:D  P prefill + D decode replicas against P+D colocated ones, side by side

trace format (--trace): JSONL, one request per line, e.g.
  {"arrival_time": 0.25, "prompt_tokens": 512, "output_tokens": 64}
  {"arrival_time": 0.5, "prompt_tokens": 900, "output_tokens": 32, "prefix_id": "sys-a",
   "prefix_tokens": 400}
  arrival_time is in seconds. prefix_id and prefix_tokens (optional, together) say that the
  prompt starts with the first prefix_tokens tokens (1 to prompt_tokens) of a text shared by
  every request of that prefix_id; the rest of each prompt is its own. With prefix caching on
  (the default, as in `quill serve`), a request computes only what is not cached yet.

prefix caching: --prefix-tokens N gives synthetic request i the prefix i mod --num-prefixes
(default 1) of min(N, its prompt) tokens. Only full blocks (--block-size) are shared, and at
least the prompt's last token is computed. Results show the share of tokens looked up that
were found cached (--no-enable-prefix-caching to compare).

speculative decoding: --speculative-config (as quill serve's) runs the engine's own drafts,
verification and switch; since simulated text has no words, each decode asked for drafts gets
some with chance --spec-proposal-rate, --spec-draft-length of them on average, each holding
with chance --spec-acceptance when the ones before it held. A server's spec_decode counters
over a workload give all three (quill.sim.speculation.SpecChances.measured).

goodput counts requests served in full whose TTFT, mean inter-token latency (their time per
output token) and end-to-end latency are within the SLO given. ITL percentiles are over every
inter-token gap of every request, as vLLM's benchmark client reports them.

capacity: each trial simulates --num-requests requests at one rate (same seed, so only the pace
changes), first all at once, then doubling or halving to bracket the answer, then bisecting
until the passing and failing rates are within --capacity-tolerance. --target-rate assumes the
traffic splits evenly over independent replicas, and checks the answer with a simulation of
that many replicas behind the router.

disaggregation: a request is prefilled (its first token) on a prefill replica, then its
prompt's KV cache (the model's KV bytes per token x prompt tokens) crosses the interconnect:
each prefill replica sends one transfer at a time, first come first served, at the hardware's
interconnect bandwidth per device. A decode replica then produces the rest. TTFT is the
prefill replica's; the transfer shows in the first inter-token gap. Both sides route to the
replica holding the least unfinished work (or round robin)."""
