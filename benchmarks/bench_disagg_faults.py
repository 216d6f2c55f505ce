"""Disaggregation under faults: a seeded run of injections, each checked for hangs, wrong
tokens and leaked blocks on both sides.

A prefill engine runs in a process of its own (its KV address open); a decode engine runs here
and continues every request from the prefill engine's lease, as `quill serve --role decode`
does. Each injection draws one fault (seeded):

- none: a plain transfer (prompts of 16, 32 and 48 tokens, exact multiples of the block, and 43);
- kill_prefill: the prefill process is SIGKILLed a random 0-60 ms into the decode engine's
  fetch of a long prompt (before, during or after the transfer); it is started again after;
- lease_expired: the lease ends (0.3 s) before the decode engine asks;
- never_asks: a lease no decode engine fetches (as when the decode instance dies): it must end;
- abort_before / abort_during / abort_after: the decode request is aborted before its fetch
  starts, right after the step that starts it (the fetch in flight: the decode engine must
  hold the blocks until it ends), or once the request decodes;
- fail_mode: the decode engine's failure flag alternates between recompute and fail.

Checked after each: the decode engine finished within the transfer timeout + 10 s (no hang);
a request that finished by length has exactly the tokens the decode engine computes for the
whole request alone (no wrong-token success); a request that failed did so only where a fetch
could fail and the flag says fail; both pools are back to idle (no leak), the prefill pool once
its lease could have ended (the decode pool once the engine has nothing left, fetches of
aborted requests included). Usage:

    .venv/bin/python benchmarks/bench_disagg_faults.py [--injections 200] [--seed 0]
        [--json docs/results/bench_disagg_faults.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import threading
import time
from collections import Counter

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.contract.plan import RemoteKV  # noqa: E402
from quill.distributed.group import free_port  # noqa: E402

OPTIONS = dict(dtype="float32", kv_cache_dtype="float32", quantization="none")
TIMEOUT_S = 3.0  # the decode engine's transfer timeout
PROMPTS = {
    "16": list(range(2000, 2016)),
    "32": list(range(3000, 3032)),
    "43": list(range(4000, 4043)),
    "48": list(range(5000, 5048)),
    "long": [(7 * i) % 30000 + 100 for i in range(700)],  # ~32 MB of fp32 KV to move
}
FAULTS = ["none", "kill_prefill", "lease_expired", "never_asks", "abort_before", "abort_during",
          "abort_after"]  # fmt: skip
_FETCH_FAULTS = ("kill_prefill", "lease_expired")  # a fetch can fail in these
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _prefill_main(model, port, conn) -> None:
    """The prefill engine: runs ('prefill', id, prompt, lease_s) and ('state',) commands."""
    llm = LLM(model, kv_cache_memory=96 << 20, kv_transfer_port=port, **OPTIONS)
    engine = llm.engine
    first = SamplingParams(max_tokens=1, temperature=0)
    conn.send("ready")
    while True:
        if conn.poll(0.01):
            command = conn.recv()
            if command[0] == "prefill":
                _, rid, prompt, lease_s = command
                engine.add_request(prompt, first, rid, kv_lease_s=lease_s)
                out = None
                while out is None:
                    out = next((o for o in engine.step() if o.request_id == rid), None)
                conn.send(vars(out.kv_transfer) if out.kv_transfer else None)
            elif command[0] == "state":
                kv = engine.scheduler.kv
                conn.send((len(kv.leases), kv.pool.num_free_blocks, kv.num_blocks))
        engine.step()  # frees fetched and expired leases


class Prefill:
    def __init__(self, model: str) -> None:
        self.model = model
        self.start()

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.port = free_port()
        self.proc = context.Process(
            target=_prefill_main, args=(self.model, self.port, child), daemon=True
        )
        self.proc.start()
        assert self.conn.recv() == "ready"

    def prefill(self, rid: str, prompt: list[int], lease_s: float) -> RemoteKV:
        self.conn.send(("prefill", rid, prompt, lease_s))
        return RemoteKV(**self.conn.recv())

    def state(self) -> tuple[int, int, int]:
        self.conn.send(("state",))
        return self.conn.recv()

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            leases, free, total = self.state()
            if leases == 0 and free == total:
                return True
            time.sleep(0.05)
        return False

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)


def _run(decode: LLM, rid: str, deadline_s: float):
    """Step until `rid` ends; (its output, seconds) or (None, seconds) past the deadline."""
    start = time.monotonic()
    while decode.engine.has_unfinished_requests():
        for out in decode.engine.step():
            if out.request_id == rid and out.finished:
                return out, time.monotonic() - start
        if time.monotonic() - start > deadline_s:
            return None, time.monotonic() - start
    return None, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--injections", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.model is None:
        from quill.model.default_model import default_gguf_path

        args.model = str(default_gguf_path())
    rng = random.Random(args.seed)
    prefill = Prefill(args.model)
    decodes = {
        mode: LLM(args.model, kv_cache_memory=96 << 20, kv_transfer_timeout=TIMEOUT_S,
                  kv_transfer_failure=mode, **OPTIONS)
        for mode in ("recompute", "fail")
    }  # fmt: skip
    reference = {
        name: decodes["recompute"].generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        for name, p in PROMPTS.items()
    }
    counts, problems, outcomes = Counter(), [], Counter()
    worst_s = 0.0
    in_flight = 0  # abort_during injections whose fetch was still running at the abort
    for i in range(args.injections):
        fault = rng.choice(FAULTS)
        mode = rng.choice(["recompute", "fail"])
        decode = decodes[mode]
        # A long prompt where the fault is to strike while its KV is on the way.
        long = fault in ("kill_prefill", "abort_during")
        name = "long" if long else rng.choice(["16", "32", "43", "48"])
        prompt = PROMPTS[name]
        rid = f"i{i}"
        # Short leases where the lease is to end (and must be waited out).
        lease_s = {"lease_expired": 0.3, "never_asks": 1.0, "abort_before": 1.0}.get(fault, 30.0)
        remote = prefill.prefill(rid, prompt, lease_s)
        counts[fault] += 1
        if fault == "never_asks":
            ok = prefill.wait_idle(lease_s + 5)
            outcomes[(fault, "lease ended")] += 1
            if not ok:
                problems.append((i, fault, "prefill lease leaked"))
            print(f"{i:4d} {fault:14s} -> lease ended: {ok}", flush=True)
            continue
        if fault == "lease_expired":
            time.sleep(lease_s + 0.2)
            prefill.wait_idle(5)
        decode.engine.add_request(prompt, GREEDY, rid, remote_kv=remote)
        killer = None
        if fault == "kill_prefill":
            killer = threading.Timer(rng.uniform(0.0, 0.06), prefill.kill)
            killer.start()
        if fault == "abort_before":
            decode.engine.abort_request(rid)
        if fault == "abort_during":
            decode.engine.step()  # starts the fetch (and waits 50 ms for it: not enough)
            in_flight += rid in decode.engine.scheduler.fetching
            decode.engine.abort_request(rid)
        if fault == "abort_after":
            while not any(o.request_id == rid for o in decode.engine.step()):
                pass  # until it decodes a token (or ends)
            decode.engine.abort_request(rid)
        out, seconds = _run(decode, rid, TIMEOUT_S + 10)
        drain_start = time.monotonic()  # an aborted request's fetch may still be running
        while decode.engine.has_unfinished_requests():
            decode.engine.step()
            if time.monotonic() - drain_start > TIMEOUT_S + 10:
                problems.append((i, fault, "a fetch never ended"))
                break
        worst_s = max(worst_s, seconds)
        if killer is not None:
            killer.join()
        reason = None if out is None else out.outputs[0].finish_reason
        outcomes[(fault, reason or "hang")] += 1
        if out is None:
            problems.append((i, fault, f"hang ({seconds:.1f} s)"))
        elif reason == "length" and out.outputs[0].token_ids != reference[name]:
            problems.append((i, fault, "wrong tokens"))
        elif reason == "error" and not (mode == "fail" and fault in _FETCH_FAULTS):
            problems.append((i, fault, f"failed: {out.error}"))
        elif reason == "abort" and not fault.startswith("abort"):
            problems.append((i, fault, "aborted unasked"))
        kv = decode.engine.scheduler.kv
        if kv.pool.num_free_blocks != kv.num_blocks:
            problems.append((i, fault, "decode blocks leaked"))
        if fault == "kill_prefill":
            prefill.start()
        elif not prefill.wait_idle(lease_s + 5 if fault == "abort_before" else 5):
            problems.append((i, fault, "prefill blocks leaked"))
        print(f"{i:4d} {fault:14s} {mode:9s} {name:5s} -> {reason} ({seconds * 1e3:.0f} ms)",
              flush=True)  # fmt: skip
    prefill.kill()
    result = {
        "machine": machine_info(torch.get_num_threads()),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "injections": args.injections,
        "seed": args.seed,
        "faults": dict(counts),
        "outcomes": {f"{f}: {r}": n for (f, r), n in sorted(outcomes.items())},
        "problems": [f"#{i} {f}: {p}" for i, f, p in problems],
        "hangs": sum(1 for p in problems if p[2].startswith("hang")),
        "wrong_tokens": sum(1 for p in problems if p[2] == "wrong tokens"),
        "leaks": sum(1 for p in problems if "leaked" in p[2]),
        "slowest_s": round(worst_s, 3),
        "abort_during_in_flight": in_flight,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
