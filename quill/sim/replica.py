"""One simulated replica: the real EngineCore and Scheduler, run by an executor that only prices.

Nothing about scheduling is re-implemented here. `SimExecutor` receives the core's step plans,
advances a virtual clock by the cost model's price of each and hands back a token for every
sequence that samples, so the core's decisions, preemptions and timestamps are the engine's
own. A replica owns its clock; the event loops in `quill.sim.cluster` keep several in step.
Prompts are made of token ids that share blocks exactly where the workload's prompts share a
prefix (`PromptTokens`), so the scheduler's prefix cache hits where a real server's would.
"""

from __future__ import annotations

import math
from collections import deque

from quill.contract.plan import StepPlan, StepResult
from quill.contract.sampling_params import SamplingParams
from quill.cost.step import CostModel
from quill.engine.admission import StepTimer
from quill.engine.clock import VirtualClock
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request, RequestTimes
from quill.engine.scheduler import Scheduler
from quill.engine.spec_switch import SpeculationSwitch
from quill.sim.config import SimConfig
from quill.sim.fast_forward import fast_forward
from quill.sim.jitter import StepJitters, kind_of
from quill.sim.metrics import MetricsSink
from quill.sim.speculation import SimDrafts
from quill.sim.workload import WorkItem

SAMPLED_TOKEN = 0  # any valid id: requests ignore EOS and have no stop tokens


def made_up_block_hash(parent: bytes | int, token_ids) -> int:
    """The simulator's block hash (KVCacheManager's `block_hasher`), a quarter of SHA-256's
    cost: its prompts are made up, so no user's cached state is at stake, and 64 bits keep
    blocks apart (a collision among a million requests' 24 million blocks is about 1e-5
    likely). `parent` is a chain's root (b"": the simulator salts no request) or the block
    before's hash. Python hashes ints without a per-process salt, so a run repeats exactly;
    it hashes -1 as -2, so PromptTokens never makes -1."""
    return hash((parent or 0, tuple(token_ids)))


class PromptTokens:
    """Makes a work item's prompt token ids, so that the prefix cache hits exactly where the
    workload says prompts share and nowhere else.

    A prompt's first `prefix_tokens` tokens are one value per prefix_id (1, 2, ... in order of
    first use) and the rest a value of the request's own (-2, -3, ...: -1 would hash as -2
    does in `made_up_block_hash`); a prompt without a prefix_id is all its own value. Block
    hashes chain over every earlier token, so two prompts have equal blocks only within their
    shared prefix. No value is SAMPLED_TOKEN: replies only match where the prompts before them
    are equal. One instance serves every replica of a run, so the values mean the same on all
    of them (a request moves from a prefill replica to a decode one with its token ids). Costs
    a list multiplication per request.
    """

    def __init__(self) -> None:
        self.prefixes: dict[str | int, int] = {}
        self.last_own = -1

    def __call__(self, item: WorkItem) -> list[int]:
        self.last_own -= 1
        n = item.prompt_tokens
        if item.prefix_id is None:
            return [self.last_own] * n
        shared = self.prefix_value(item.prefix_id)
        k = min(item.prefix_tokens, n)
        return [shared] * k + [self.last_own] * (n - k)

    def prefix_value(self, prefix_id: str | int) -> int:
        """The token value of a prefix's tokens (made on first use)."""
        shared = self.prefixes.get(prefix_id)
        if shared is None:
            shared = self.prefixes[prefix_id] = len(self.prefixes) + 1
        return shared


class SimExecutor:
    """Runs a plan in virtual time: the clock moves by the plan's predicted price.

    KV fetches run beside the steps, as the engine's fetcher thread does them: one after
    another, each needing `CostModel.kv_fetch_seconds` of the link, and reported in the result
    of the first step that ends after it; a plan of fetches alone moves the clock to the next
    fetch's end. With `shares_cores` a fetch and a step running at once share the cores, each
    at half speed (processor sharing). `fetches` keeps (request id, when it started, seconds)
    of each that ended, for the event loop to collect.
    """

    reads_block_tables = False  # the engine core hands it its tables uncopied

    def __init__(
        self,
        cost: CostModel,
        clock: VirtualClock,
        shares_cores: bool = False,
        jitter=None,
        gap: tuple[float, float] = (0.0, 0.0),
        drafts: SimDrafts | None = None,
    ) -> None:
        self.cost = cost
        self.drafts = drafts  # the verdict on each sequence's drafts (speculation on)
        self.clock = clock
        self.shares_cores = shares_cores
        self.jitter = jitter  # quill/sim/jitter.StepJitters, or None
        # The host's time after a step, before the next can start (SimConfig.step_gap).
        self.gap_base, self.gap_per_seq = gap
        self.num_steps = 0
        self.num_polls = 0  # plans of fetches alone
        self.num_fast_steps = 0  # of num_steps, run by fast_forward
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.fetches: list[tuple[str, float, float]] = []
        # Fetches not yet ended, in order: [request id, bytes, link seconds left, started at]
        # (started: when it reached the head of the line; None before).
        self._queue: deque[list] = deque()

    @property
    def has_fetches(self) -> bool:
        return bool(self._queue)

    def execute(self, plan: StepPlan) -> StepResult:
        for fetch in plan.kv_fetches:
            tokens = fetch.source.num_tokens_to_fetch
            bytes_ = int(tokens * self.cost.model.kv_bytes_per_token)
            self._queue.append([fetch.request_id, bytes_, self.cost.kv_fetch_seconds(tokens), None])
        if plan.seqs:
            shape = self.cost.model.shape_of(plan)
            seconds = self.cost.price(shape).predicted_s
            if self.jitter is not None:
                seconds *= self.jitter.draw(kind_of(shape), self.clock.t)
            seconds += self.gap_base + self.gap_per_seq * len(plan.seqs)
            self.num_steps += 1
            self.busy_s += seconds
            self.prefill_tokens += shape.num_prefill_tokens
            self.decode_tokens += shape.num_decode_tokens
            sampled = [s.request_id for s in plan.seqs if s.samples]
            result = StepResult(dict.fromkeys(sampled, [SAMPLED_TOKEN]))
            if self.drafts is not None:  # a sequence with drafts keeps those that held
                for s in plan.seqs:
                    if s.samples and s.draft_token_ids:
                        kept = 1 + self.drafts.verify(len(s.draft_token_ids))
                        result.sampled[s.request_id] = [SAMPLED_TOKEN] * kept
        else:
            self.num_polls += 1
            seconds = 0.0
            result = StepResult({})
        self._run(seconds, result)
        return result

    def _run(self, work: float, result: StepResult) -> None:
        """Move the clock through `work` seconds of step (none: until the next fetch ends),
        the fetches progressing beside it; those that end go into `result`."""
        t = self.clock.t
        queue = self._queue
        stepping = work > 0
        while queue:
            head = queue[0]
            if head[3] is None:
                head[3] = t
            shared = 0.5 if self.shares_cores and stepping else 1.0
            step_dt = work / shared if stepping else math.inf
            fetch_dt = head[2] / shared
            dt = min(step_dt, fetch_dt)
            t += dt
            head[2] -= dt * shared
            if stepping:
                work -= dt * shared
            if dt == fetch_dt:  # the fetch ended (no later than the step)
                queue.popleft()
                request_id, bytes_, _, started = head
                result.kv_fetched[request_id] = (bytes_, t - started)
                self.fetches.append((request_id, started, t - started))
                if not stepping:
                    break
            if stepping and dt == step_dt:
                work = 0.0
                break
        self.clock.t = t + (work if stepping else 0.0)


class Replica:
    """An EngineCore on its own virtual clock, with a backlog of arrived requests.

    Requests wait in the backlog as cheap WorkItems and become engine Requests only when the
    scheduler could take them: the core is topped up to `max_num_seqs` waiting requests before
    each step. The scheduler admits at most `max_num_seqs` requests a step, from the front of
    its waiting queue, so anything further back could not have been scheduled anyway; the
    decisions are the same as adding every request on arrival, without holding 100,000 of them.
    `output_cap` limits replies (1 on a prefill replica: it produces only the first token).
    `tokens` names prompts' tokens; the replicas of one run share it.
    """

    def __init__(
        self,
        config: SimConfig,
        sink: MetricsSink,
        name: str = "replica 0",
        output_cap: int | None = None,
        record: bool = False,
        tokens: PromptTokens | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.sink = sink
        self.output_cap = output_cap
        self.clock = VirtualClock()
        jitter = None
        if config.step_jitter is not None or config.step_jitter_by_kind:
            jitter = StepJitters(
                config.step_jitter,
                config.step_jitter_by_kind,
                f"{config.seed}:{name}",
                config.step_memory,
            )
        spec = config.speculative
        drafts = None
        if spec is not None:
            drafts = SimDrafts(config.spec_chances, f"{config.seed}:{name}:drafts", SAMPLED_TOKEN)
        self.executor = SimExecutor(
            config.cost, self.clock, config.fetch_shares_cores, jitter, config.step_gap, drafts
        )
        self.tokens = PromptTokens() if tokens is None else tokens
        kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.cost.model.kv_groups.group_windows,
            made_up_block_hash,
        )
        # As `quill serve` builds it: the switch, when on, prices steps by the cost model and
        # corrects that by the (virtual) times the steps took.
        switch = None
        if spec is not None and spec.by_cost:
            switch = SpeculationSwitch(
                spec.num_speculative_tokens, StepTimer.from_cost_model(config.cost)
            )
        scheduler = Scheduler(
            kv,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            config.max_model_len,
            speculative=spec,
            spec_switch=switch,
        )
        if drafts is not None:
            scheduler.proposer = drafts.propose
        listeners = [switch] if switch is not None else []
        self.core = EngineCore(scheduler, self.executor, self.clock, listeners)
        self.backlog: deque[WorkItem | Request] = deque()
        # Fast-forwarded steps' KV-cache events, each with its step's end (the router takes
        # them: quill/sim/routing.py).
        self.fast_events: list[tuple[float, list]] = []
        self.outstanding = 0  # prompt + output tokens of the requests it holds (for routing)
        self._params: dict[int, SamplingParams] = {}
        # For tests: per step [(request_id, start, num_tokens)], and for every arrival the
        # number of steps run before it, so that a real engine can replay the same sequence.
        self.record = record
        self.step_log: list[list[tuple[str, int, int]]] = []

        self.add_log: list[tuple[int, str]] = []

    @property
    def busy(self) -> bool:
        return bool(self.backlog) or self.core.has_unfinished_requests()

    def submit(self, work: WorkItem | Request, now: float) -> None:
        """A request reaches this replica at `now`; an idle replica's clock jumps to it."""
        if self.clock.t < now:
            self.clock.t = now
        self.backlog.append(work)
        if self.record:
            self.add_log.append((self.executor.num_steps, work.request_id))

    def params(self, max_tokens: int) -> SamplingParams:
        # Shared between requests: the engine never changes a request's parameters.
        params = self._params.get(max_tokens)
        if params is None:
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
            self._params[max_tokens] = params
        return params

    def make_request(self, item: WorkItem) -> Request:
        out = item.output_tokens
        if self.output_cap is not None and out > self.output_cap:
            out = self.output_cap
        return Request(
            item.request_id,
            self.tokens(item),
            self.params(out),
            item.arrival_time,
            out,
            times=RequestTimes(item.arrival_time, itl_counts=self.sink.itl.counts),
        )

    def _admit(self) -> None:
        scheduler = self.core.scheduler
        room = scheduler.max_num_seqs - len(scheduler.waiting)
        backlog = self.backlog
        while room > 0 and backlog:
            work = backlog.popleft()
            request = work if type(work) is Request else self.make_request(work)
            self.core.add_request(request)
            room -= 1

    def step(self, until: float = math.inf) -> list[Request]:
        """One engine step at this replica's clock, or as many steady decode steps as start
        before `until` (the next event that could change them; quill/sim/fast_forward.py);
        returns the requests that ended."""
        if self.backlog:
            self._admit()
        if self.config.fast_forward:
            ended = fast_forward(self, until, SAMPLED_TOKEN)
            if ended is not None:
                return ended
        ex = self.executor
        before, polls = ex.num_steps, ex.num_polls
        out = self.core.step()
        if ex.num_steps == before:
            if not out.finished and ex.num_polls == polls:
                raise RuntimeError(f"{self.name}: the scheduler can schedule nothing")
        elif self.record:
            plan = self.core.last_plan
            self.step_log.append([(s.request_id, s.start, s.num_tokens) for s in plan.seqs])
        return out.finished

    def stats(self, duration: float) -> dict:
        ex = self.executor
        kv = self.core.scheduler.kv.stats
        return {
            "name": self.name,
            "steps": ex.num_steps,
            "fast_forwarded_steps": ex.num_fast_steps,
            "busy_s": ex.busy_s,
            "busy_fraction": ex.busy_s / duration if duration > 0 else None,
            "prefill_tokens": ex.prefill_tokens,
            "decode_tokens": ex.decode_tokens,
            "mean_tokens_per_step": (
                (ex.prefill_tokens + ex.decode_tokens) / ex.num_steps if ex.num_steps else None
            ),
            "preemptions": self.core.scheduler.num_preemptions,
            # Tokens looked up in the prefix cache at each admission (again after a preemption;
            # a request moved in with its KV counts as a miss), and of them found cached.
            "prefix_cache_queries": kv.queries,
            "prefix_cache_hits": kv.hits,
            **self._spec_stats(),
        }

    def _spec_stats(self) -> dict:
        """Speculation's counters, as a server's spec_decode metrics count them."""
        scheduler = self.core.scheduler
        if scheduler.speculative is None:
            return {}
        spec = scheduler.spec_stats
        return {
            "spec_decode_num_drafts": spec.num_drafts,
            "spec_decode_num_draft_tokens": spec.num_draft_tokens,
            "spec_decode_num_accepted_tokens": spec.num_accepted_tokens,
            "spec_decode_num_eligible": spec.num_eligible,
            "spec_decode_num_proposed": spec.num_proposed,
        }
