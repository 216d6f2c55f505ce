"""`quill simulate`: the engine's own loop in virtual time, checked by hand, against the real
engine, and at its edges (bad flags, impossible hardware)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace

import pytest

from quill.cost.batch import BatchShape
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.step import CostModel
from quill.sim.capacity import meets
from quill.sim.cli import main
from quill.sim.cluster import run_colocated, run_disaggregated
from quill.sim.config import SimConfig, model_context_len
from quill.sim.metrics import SLO, Distribution
from quill.sim.workload import LengthSpec, WorkItem, read_trace, synthetic, write_trace
from tests.conftest import write_tiny_config

# A device with round numbers, so that prices are easy to follow.
TOY = HardwareSpec(
    name="toy",
    flops={"bfloat16": 1e13},
    memory_bandwidth=1e12,
    memory_capacity=80e9,
    interconnect_bandwidth=1e10,
    step_overhead_s=1e-4,
)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = main([*args, "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_simulator_imports_no_torch():
    code = (
        "import sys; import quill.sim, quill.sim.cli, quill.sim.cluster, quill.sim.capacity, "
        "quill.sim.report; from quill.sim.cli import main; "
        "assert main(['--num-requests', '5', '--no-progress', '--json']) == 0; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_same_seed_same_json(capsys):
    args = ["--json", "--num-requests", "300", "--request-rate", "400", "--burstiness", "0.5"]
    args += ["--prompt-tokens", "16:600", "--output-tokens", "1:80", "--seed", "7"]
    args += ["--kv-cache-memory", "40MiB", "--slo", "ttft=50,itl=5,e2e=400"]  # preempts
    first = run_cli(args, capsys)
    second = run_cli(args, capsys)
    assert first[0] == 0 and first[1] == second[1]
    out = json.loads(first[1])
    assert out["results"]["num_requests"] == 300
    assert out["results"]["num_preemptions"] > 0
    assert out["settings"]["workload"]["prompt_tokens"] == "16:600"


def test_replicas_share_the_arrivals(capsys):
    for router in ("round-robin", "least-work"):
        args = ["--replicas", "3", "--router", router, "--num-requests", "60", "--json"]
        code, text, _ = run_cli([*args, "--request-rate", "500"], capsys)
        out = json.loads(text)
        assert code == 0 and out["results"]["num_requests"] == 60
        decoded = [r["decode_tokens"] for r in out["replicas"]]
        assert len(decoded) == 3 and min(decoded) > 0
        assert sum(decoded) == 60 * (128 - 1)  # the first token of each comes with its prefill


def test_lone_request_costs_the_sum_of_its_steps():
    """Prompt 100 under a 64-token budget: two prefill chunks, then 4 decodes, each priced
    from a batch shape built here by hand."""
    model = ModelSpec.abstract(1e9, 2)
    config = SimConfig.create(model, TOY, max_num_batched_tokens=64, max_model_len=1024)
    item = WorkItem("0", 0.5, prompt_tokens=100, output_tokens=5)
    out = run_colocated(config, [item])["results"]

    cost = CostModel(model, TOY)
    chunks = [BatchShape.from_seqs([(0, 64, False, False)]), BatchShape.abstract([(36, 64)])]
    decodes = [BatchShape.decodes(1, context) for context in (100, 101, 102, 103)]
    prefill = [cost.price(s).predicted_s for s in chunks]
    decode = [cost.price(s).predicted_s for s in decodes]
    assert prefill[0] != prefill[1] != decode[0]  # the shapes really differ in price
    assert out["ttft_ms"]["mean"] == pytest.approx(sum(prefill) * 1000, rel=1e-12)
    assert out["e2e_ms"]["mean"] == pytest.approx((sum(prefill) + sum(decode)) * 1000, rel=1e-12)
    assert out["itl_ms"]["count"] == 4 and out["itl_ms"]["max"] == pytest.approx(max(decode) * 1000)
    assert out["duration_s"] == pytest.approx(sum(prefill) + sum(decode))


def test_disaggregated_request_pays_for_its_kv_transfer():
    model = ModelSpec.preset("SmolLM2-135M")
    config = SimConfig.create(model, TOY, max_num_batched_tokens=512, context_len=8192)
    out = run_disaggregated(config, [WorkItem("0", 0.0, 300, 4)], 1, 1)
    cost = CostModel(model, TOY)
    prefill = cost.price(BatchShape.abstract([(300, 0)])).predicted_s
    decode = [cost.price(BatchShape.decodes(1, c)).predicted_s for c in (300, 301, 302)]
    transfer = model.kv_bytes_per_token * 300 / TOY.interconnect_bandwidth
    assert transfer > decode[0]  # the link is slow enough to see
    r = out["results"]
    assert r["ttft_ms"]["mean"] == pytest.approx(prefill * 1000)
    assert out["kv_transfer_ms"]["mean"] == pytest.approx(transfer * 1000)
    assert r["itl_ms"]["max"] == pytest.approx((transfer + decode[0]) * 1000)  # first gap
    assert r["e2e_ms"]["mean"] == pytest.approx((prefill + transfer + sum(decode)) * 1000)


def test_fetches_run_beside_the_steps_and_skip_blocks_cached_on_the_decode_side():
    """The decode replica fetches a moved prompt's KV beside its steps (as the engine's fetcher
    thread does): the streams decoding there do not wait for it, the request decodes once its
    KV is in, and blocks the decode replica's own prefix cache holds are not fetched."""
    from quill.contract.plan import RemoteKV

    model = ModelSpec.preset("SmolLM2-135M")
    cost = CostModel(model, TOY)
    per_token = model.kv_bytes_per_token / TOY.interconnect_bandwidth
    remote = RemoteKV("h", 1, "p", list(range(7)), 100, 5, num_cached_blocks=4)
    assert remote.num_tokens_to_fetch == 42  # 100 tokens x 3 of 7 blocks
    assert cost.kv_fetch_seconds(42) == pytest.approx(42 * per_token)

    # Two prompts sharing 64 tokens (4 blocks), the second after the first is done: the
    # decode replica registered the first's fetched blocks, so it fetches 100 x 3 of 7 blocks.
    work = [WorkItem("0", 0.0, 100, 3, "sys", 64), WorkItem("1", 1.0, 100, 3, "sys", 64)]
    for caching, second in ((True, 42), (False, 100)):
        config = SimConfig.create(model, TOY, max_model_len=1024, enable_prefix_caching=caching)
        fetched = run_disaggregated(config, work, 1, 1)["kv_transfer_ms"]
        assert fetched["count"] == 2
        assert fetched["max"] == pytest.approx(100 * per_token * 1000)
        assert fetched["mean"] == pytest.approx((100 + second) / 2 * per_token * 1000)

    # A stream decoding on the decode replica while a long prompt's KV crosses a slow link.
    slow = replace(TOY, name="slow link", interconnect_bandwidth=1e8)
    config = SimConfig.create(model, slow, max_model_len=4096)
    work = [WorkItem("s", 0.0, 16, 3000), WorkItem("long", 0.05, 2000, 2)]
    out = run_disaggregated(config, work, 1, 1)
    transfer = model.kv_bytes_per_token * 2000 / 1e8
    step = CostModel(model, slow).price(BatchShape.decodes(2, 2001)).predicted_s
    assert out["kv_transfer_ms"]["max"] == pytest.approx(transfer * 1000)
    itl = out["results"]["itl_ms"]
    assert itl["p99"] < 2 * step * 1000  # the stream's gaps stay steps (3,000 of 3,001)
    # The newcomer's one gap: its KV's transfer and the steps around its end.
    assert transfer * 1000 < itl["max"] < (transfer + 3 * step) * 1000

    # The same with the fetch sharing the decode replica's cores with its steps: while both
    # run each goes at half speed, so the fetch takes twice as long, and the stream (decoding
    # throughout it) does the transfer's worth less work in that time: it ends that much later.
    shared = SimConfig.create(model, slow, max_model_len=4096, fetch_shares_cores=True)
    both = run_disaggregated(shared, work, 1, 1)
    assert both["kv_transfer_ms"]["max"] == pytest.approx(2 * transfer * 1000, rel=0.01)
    later = both["results"]["e2e_ms"]["max"] - out["results"]["e2e_ms"]["max"]
    assert later == pytest.approx(transfer * 1000, abs=2 * step * 1000)


def test_disaggregation_serves_everyone_and_reports_both(capsys):
    config = SimConfig.create(ModelSpec.preset("SmolLM2-135M"), TOY, context_len=8192)
    work = list(synthetic(200, 300, LengthSpec(16, 512), LengthSpec(1, 64), seed=3))
    out = run_disaggregated(config, work, 2, 1, SLO(ttft=0.5, itl=0.05))
    assert out["results"]["num_requests"] == 200 and out["results"]["num_truncated"] == 0
    assert out["results"]["output_tokens"] == sum(w.output_tokens for w in work)
    assert [r["name"] for r in out["replicas"]] == ["prefill 0", "prefill 1", "decode 0"]

    args = ["--disaggregate", "1:1", "--num-requests", "50", "--request-rate", "100"]
    code, text, _ = run_cli([*args, "--slo", "ttft=100,itl=10"], capsys)
    assert (
        code == 0 and "colocated x2" in text and "disagg 1:1" in text and "Disaggregation" in text
    )
    code, text, _ = run_cli([*args, "--json"], capsys)
    both = json.loads(text)
    assert both["colocated"]["results"]["num_requests"] == 50
    assert both["disaggregated"]["results"]["num_requests"] == 50
    assert both["disaggregated"]["kv_transfer_ms"]["count"] == 50


def test_simulator_schedules_like_the_real_engine(tmp_path, model_dir):
    """The same arrivals (two waves, a pool small enough to preempt, prompts sharing prefixes)
    give the same plans, prefix cache hits included."""
    from quill.config import EngineConfig
    from quill.contract.sampling_params import SamplingParams
    from quill.engine.llm_engine import LLMEngine
    from quill.sim.replica import PromptTokens

    write_tiny_config(tmp_path, model_dir)
    spec = ModelSpec.from_path(tmp_path, bytes_per_param=4)
    kv_bytes = 12 * 16 * spec.kv_bytes_per_token  # 12 blocks of 16 tokens
    limits = dict(max_num_seqs=4, max_num_batched_tokens=48)
    config = SimConfig.create(
        spec,
        HardwareSpec.preset("H100-SXM"),
        kv_cache_memory=int(kv_bytes),
        context_len=model_context_len(str(tmp_path), spec),
        **limits,
    )
    lengths = [(40, 30), (20, 50), (60, 8), (33, 40), (8, 70), (50, 20), (25, 25), (70, 5)]
    # Prefix "a" is two full blocks; "b" one block and a bit (request 6's whole prompt); request
    # 4's 8 shared tokens fill no block.
    prefixes = {0: ("a", 32), 2: ("a", 32), 4: ("a", 8), 5: ("a", 32), 7: ("a", 32)}
    prefixes.update({3: ("b", 25), 6: ("b", 25)})

    def item(i: int, t: float) -> WorkItem:
        return WorkItem(str(i), t, *lengths[i], *prefixes.get(i, (None, 0)))

    first = [item(i, 0.0) for i in range(5)]
    alone = run_colocated(config, first)["results"]["duration_s"]
    waves = (0.25, 0.25, 0.6)  # the second wave arrives a quarter of the way in, and later
    second = [item(i + 5, alone * f) for i, f in enumerate(waves)]
    sim = run_colocated(config, first + second, record=True)
    replica = sim["_replicas"][0]
    assert sim["results"]["num_preemptions"] > 0
    assert len({step for step, _ in replica.add_log}) >= 3  # arrivals in several waves
    sim_kv = replica.core.scheduler.kv.stats
    assert sim_kv.hits >= 4 * 16  # the second wave maps prefix "a" at least

    engine = LLMEngine(
        EngineConfig(
            model=str(tmp_path),
            tokenizer=str(model_dir),
            load_format="dummy",
            dtype="float32",
            kv_cache_dtype="float32",  # the spec's 4 bytes per element
            quantization="none",
            kv_cache_memory=int(kv_bytes),
            **limits,
        )
    )
    assert engine.scheduler.kv.num_blocks == config.num_blocks
    assert engine.max_model_len == config.max_model_len
    # The simulator's prompts, in the order it made them, as distinct valid token ids.
    items = {w.request_id: w for w in first + second}
    tokens, vocab = PromptTokens(), {}
    prompts = {
        rid: [vocab.setdefault(t, 100 + len(vocab)) for t in tokens(items[rid])]
        for _, rid in replica.add_log
    }
    assert len(vocab) == 2 + 6  # one per prefix, one per prompt not all prefix (not 4 and 6)
    arrivals = list(replica.add_log)
    plans = []
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] == len(plans):
            rid = arrivals.pop(0)[1]
            params = SamplingParams(max_tokens=items[rid].output_tokens, ignore_eos=True)
            engine.add_request(prompts[rid], params, request_id=rid)
        engine.step()
        plan = engine.last_plan
        plans.append([(s.request_id, s.start, s.num_tokens) for s in plan.seqs])
    assert plans == replica.step_log
    assert engine.scheduler.kv.stats == sim_kv


def test_a_cached_prefix_is_not_priced_again():
    """Two requests share a 64-token prefix (four blocks of 16); the second arrives after the
    first is done, so its prefill is a chunk of the other 36 tokens after 64 cached ones."""
    model = ModelSpec.abstract(1e9, 2)
    cost = CostModel(model, TOY)
    full = cost.price(BatchShape.abstract([(100, 0)])).predicted_s
    rest = cost.price(BatchShape.abstract([(100 - 64, 64)])).predicted_s
    assert rest < full
    work = [WorkItem("0", 0.0, 100, 3, "sys", 64), WorkItem("1", 1.0, 100, 3, "sys", 64)]
    for caching, second, hit_rate in ((True, rest, 64 / 200), (False, full, None)):
        config = SimConfig.create(model, TOY, max_model_len=1024, enable_prefix_caching=caching)
        for out in (run_colocated(config, work), run_disaggregated(config, work, 1, 1)):
            r = out["results"]
            assert r["ttft_ms"]["max"] == pytest.approx(full * 1000, rel=1e-12)
            assert r["ttft_ms"]["mean"] == pytest.approx((full + second) / 2 * 1000, rel=1e-12)
            assert r["prefix_cache_hit_rate"] == hit_rate
            first = out["replicas"][0]
            assert first["prefix_cache_hits"] == (64 if caching else 0)
    # A different prefix, or none, shares nothing.
    config = SimConfig.create(model, TOY, max_model_len=1024)
    for other in (WorkItem("1", 1.0, 100, 3, "other", 64), WorkItem("1", 1.0, 100, 3)):
        r = run_colocated(config, [work[0], other])["results"]
        assert r["ttft_ms"]["mean"] == pytest.approx(full * 1000, rel=1e-12)
        assert r["prefix_cache_hit_rate"] == 0


def test_prefix_flags_reach_the_cache(capsys):
    args = ["--num-requests", "40", "--request-rate", "100", "--prefix-tokens", "200"]
    args += ["--num-prefixes", "2"]
    code, text, _ = run_cli([*args, "--json"], capsys)
    out = json.loads(text)
    assert code == 0 and out["settings"]["scheduler"]["enable_prefix_caching"] is True
    # 256-token prompts: 12 blocks of each 200-token prefix are shared, once computed.
    assert out["results"]["prefix_cache_hit_rate"] == (40 - 2) * 192 / (40 * 256)
    code, text, _ = run_cli(args, capsys)
    assert "Prefix cache hit rate:" in text and "prefix caching on" in text
    code, text, _ = run_cli([*args, "--json", "--no-enable-prefix-caching"], capsys)
    out = json.loads(text)
    assert out["settings"]["scheduler"]["enable_prefix_caching"] is False
    assert out["results"]["prefix_cache_hit_rate"] is None


def test_arrivals_have_the_asked_mean_and_shape():
    for burstiness in (1.0, 0.25, 4.0):
        one = LengthSpec(1, 1)
        times = [w.arrival_time for w in synthetic(20_000, 50.0, one, one, burstiness, seed=1)]
        gaps = [b - a for a, b in zip(times, times[1:])]
        mean = sum(gaps) / len(gaps)
        cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2
        assert mean == pytest.approx(1 / 50, rel=0.05)
        assert cv2 == pytest.approx(1 / burstiness, rel=0.15)  # gamma: CV^2 = 1/shape
    assert {
        w.arrival_time for w in synthetic(10, math.inf, LengthSpec(1, 1), LengthSpec(1, 1))
    } == {0.0}


def test_lengths_and_traces(tmp_path):
    work = list(synthetic(2000, 10, LengthSpec.parse("5:9"), LengthSpec.parse("3"), seed=2))
    assert {w.prompt_tokens for w in work} == {5, 6, 7, 8, 9}
    assert {w.output_tokens for w in work} == {3}
    work[3].prefix_id, work[3].prefix_tokens = "system-a", 5
    work[4].prefix_id, work[4].prefix_tokens = 7, 1
    path = tmp_path / "trace.jsonl"
    write_trace(work, path)
    assert read_trace(path) == work
    assert read_trace(path, limit=10) == work[:10]
    shared = list(synthetic(6, 10, LengthSpec(9, 9), LengthSpec(3, 3), prefix_tokens=7))
    assert {(w.prefix_id, w.prefix_tokens) for w in shared} == {(0, 7)}
    shared = list(
        synthetic(
            90, 10, LengthSpec(5, 9), LengthSpec(3, 3), seed=2, prefix_tokens=7, num_prefixes=3
        )
    )
    assert [w.prefix_id for w in shared[:4]] == [0, 1, 2, 0]
    assert all(w.prefix_tokens == min(7, w.prompt_tokens) for w in shared)
    assert {w.prefix_tokens for w in shared} == {5, 6, 7}
    start = '{"arrival_time": 0, "prompt_tokens": 5, "output_tokens": 2'
    for bad, message in [
        (', "prefix_id": "a"}', "prefix_id needs prefix_tokens"),
        (', "prefix_tokens": 3}', "prefix_tokens needs a prefix_id"),
        (', "prefix_id": "a", "prefix_tokens": 0}', "prefix_tokens must be an integer in [1, "),
        (', "prefix_id": "a", "prefix_tokens": 6}', "prompt_tokens=5], got 6"),
        (', "prefix_id": "a", "prefix_tokens": 2.5}', "got 2.5"),
        (', "prefix_id": "a", "prefix_tokens": true}', "got True"),
        (', "prefix_id": [1], "prefix_tokens": 2}', "prefix_id must be a string"),
    ]:
        path.write_text(start + "}\n" + start + bad + "\n")
        with pytest.raises(ValueError, match="line 2") as e:
            read_trace(path)
        assert message in str(e.value)
    for bad in ("0", "9:5", "a:b", "-3", "4:"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad)


def test_distribution_percentiles_interpolate_like_numpy():
    d = Distribution()
    for v in (1.0, 2.0, 2.0, 3.0, 10.0):
        d.add(v)
    s = d.summary()
    assert (s["count"], s["mean"], s["p50"], s["max"]) == (5, 3.6, 2.0, 10.0)
    assert s["p90"] == pytest.approx(3 + 0.6 * 7)  # rank 3.6 between 3 and 10
    assert s["p99"] == pytest.approx(3 + 0.96 * 7)


def test_capacity_meets_the_slo_and_a_higher_rate_does_not(capsys):
    args = ["--capacity", "--slo", "ttft=200,itl=15", "--num-requests", "150", "--json"]
    args += ["--model", "Llama-3-8B", "--prompt-tokens", "512", "--output-tokens", "32"]
    args += ["--target-rate", "100"]
    code, text, _ = run_cli(args, capsys)
    assert code == 0
    out = json.loads(text)
    found = out["capacity"]
    rate, failing = found["capacity_rate"], found["lowest_failing_rate"]
    assert 0 < rate < failing <= rate * (1 + found["tolerance"])
    config = SimConfig.create(ModelSpec.preset("Llama-3-8B"), HardwareSpec.preset("H100-SXM"))
    slo = SLO.parse("ttft=200,itl=15")

    def at(r: float) -> dict:
        work = synthetic(150, r, LengthSpec(512, 512), LengthSpec(32, 32))
        return run_colocated(config, work, slo=slo)["results"]

    assert meets(slo, at(rate))
    assert not meets(slo, at(rate * 1.2))
    plan = out["replicas_for_target"]
    assert plan["replicas"] == math.ceil(100 / rate)
    assert plan["check"]["results"]["num_requests"] == 150 * plan["replicas"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prompt-tokens", "10:5"], "MIN <= MAX"),
        (["--output-tokens", "x"], "not a token count"),
        (["--hardware", "H900"], "unknown hardware 'H900'"),
        (["--model", "Llama-9"], "unknown model 'Llama-9'"),
        (["--model", "Llama-3-70B", "--hardware", "L40S"], "does not fit"),
        (["--slo", "ttft=abc"], "not a number"),
        (["--disaggregate", "2"], "P:D"),
        (["--capacity"], "--capacity needs --slo"),
        (["--prompt-tokens", "9000"], "context of 8192"),
        (["--tp", "4", "--model", "SmolLM2-135M"], "query heads do not divide"),
        (["--kv-cache-memory", "1KiB"], "holds no block"),
        (["--prefix-tokens", "0"], "--prefix-tokens must be at least 1"),
        (["--prefix-tokens", "9", "--num-prefixes", "0"], "--num-prefixes must be at least 1"),
        (["--num-prefixes", "2"], "--num-prefixes needs --prefix-tokens"),
    ],
)
def test_bad_settings_are_one_line_errors(args, message, capsys):
    code, _, err = run_cli(args, capsys)
    assert code == 2
    assert "Traceback" not in err and message in err.strip().splitlines()[-1]


def test_impossible_hardware_and_traces(tmp_path, capsys):
    spec = HardwareSpec.preset("H100-SXM").to_dict()
    for key in ("memory_bandwidth", "interconnect_bandwidth"):
        path = tmp_path / f"zero-{key}.json"
        path.write_text(json.dumps({**spec, key: 0}))
        code, _, err = run_cli(["--hardware", str(path)], capsys)
        assert code == 2 and f"{key} must be positive" in err
    no_link = tmp_path / "no-link.json"
    no_link.write_text(json.dumps({**spec, "interconnect_bandwidth": None}))
    code, _, err = run_cli(["--hardware", str(no_link), "--disaggregate", "1:1"], capsys)
    assert code == 2 and "interconnect bandwidth" in err

    trace = tmp_path / "trace.jsonl"
    good = '{"arrival_time": 0, "prompt_tokens": 5, "output_tokens": 2}\n'
    for line, message in [
        ("{not json\n", "line 2"),
        ('{"arrival_time": 1, "prompt_tokens": 0, "output_tokens": 2}\n', "prompt_tokens"),
        ('{"arrival_time": -1, "prompt_tokens": 3, "output_tokens": 2}\n', "arrival_time"),
        ('{"arrival_time": 1, "prompt_tokens": 9000, "output_tokens": 2}\n', "context"),
    ]:
        trace.write_text(good + line)
        code, _, err = run_cli(["--trace", str(trace)], capsys)
        assert code == 2 and "line 2" in err and message in err and "Traceback" not in err
    code, _, err = run_cli(["--trace", str(tmp_path / "missing.jsonl")], capsys)
    assert code == 2 and "missing.jsonl" in err


def test_quill_command_runs_simulate():
    proc = subprocess.run(
        [sys.executable, "-m", "quill.cli", "simulate", "--num-requests", "20", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Simulated serving" in proc.stdout and "TTFT" in proc.stdout
    proc = subprocess.run(
        [sys.executable, "-m", "quill.cli", "simulate", "--hardware", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "not a preset (A100-80GB-SXM, H100-SXM, H200, L40S) nor a JSON file"
    )


def test_windowed_layers_pool_blocks_of_their_groups_by_hand():
    """SmolLM2's 30 layers with 2 of 3 windowed to 64 keys: groups of 10 layers (2 windowed, 1
    global), so a pool block is 10 layers' keys for 16 tokens, 23040 / 3 * 16 = 122880 bytes
    in bf16. 100 of them hold a 1200-token request: 75 global blocks and each windowed group's
    chunk of 64 with 63 keys back, 9 blocks at most, 93 in all, where 225 would be needed
    without the release."""
    spec = replace(ModelSpec.preset("SmolLM2-135M"), layer_windows=(64, 64, 0) * 10)
    assert spec.kv_bytes_per_token == 23040
    config = SimConfig.create(
        spec, TOY, kv_cache_memory=100 * 122880, max_num_batched_tokens=64, max_model_len=2048
    )
    assert config.num_blocks == 100
    assert config.kv_tokens == 100 * 16 // 3
    assert config.check_request(1000, 200) is None
    assert "never fit" in config.check_request(1900, 100)  # 119 + 2 * 9 blocks
    sim = run_colocated(config, [WorkItem("a", 0.0, 1000, 200)])
    assert sim["results"]["num_preemptions"] == 0
    results = sim["results"]
    assert results["num_requests"] == 1 and results["num_truncated"] == 0
    assert results["output_tokens"] == 200
