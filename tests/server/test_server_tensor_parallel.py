"""`quill serve --tensor-parallel-size 3`: the same greedy text as one rank over the OpenAI API,
and a rank killed mid-stream ends the stream with an error, turns /health to 503 and stops the
server with a non-zero status, leaving no process behind."""

from __future__ import annotations

import httpx
import openai
import psutil
from server_helpers import still_running
from test_server_cli import KEY, ServeProcess, stream_and_kill

from quill.contract.sampling_params import SamplingParams

TP3 = ("--tensor-parallel-size", "3", "--dtype", "float32", "--kv-cache-dtype", "float32",
       "--quantization", "none", "--kv-cache-memory", "64MiB", "--port", "0",
       "--served-model-name", "smol", "--max-num-seqs", "4", "--no-access-log")  # fmt: skip
PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def test_tp3_serves_the_one_rank_text_and_a_killed_rank_stops_the_server(llm):
    want = [
        o.outputs[0].text
        for o in llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0), use_tqdm=False)
    ]
    served = ServeProcess(*TP3)
    try:
        url = served.ready()
        engine = served.engine()
        # Ranks 1 and 2, spawned (beside them, multiprocessing's resource tracker).
        engine_children = engine.children()
        ranks = [p for p in engine_children if "spawn_main" in " ".join(p.cmdline())]
        assert len(ranks) == 2, engine.children()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        resp = client.completions.create(model="smol", prompt=PROMPTS, max_tokens=32, temperature=0)
        assert [c.text for c in resp.choices] == want
        rank = ranks[-1]
        with httpx.Client(base_url=url, timeout=60) as c:
            events, ended = stream_and_kill(c, rank.kill)
            assert ended < 5
            assert events[-1] == "data: [DONE]"
            assert '"error"' in events[-2] and "tensor-parallel" in events[-2], events[-2]
            assert c.get("/health").status_code == 503
        assert served.proc.wait(timeout=30) == 1
        for proc in [engine, *engine_children]:
            try:
                proc.wait(10)
            except psutil.NoSuchProcess:
                pass
            assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    finally:
        served.kill()


def test_tp2_over_http_matches_one_rank(tmp_path, model_dir):
    """TP=2 needs heads that 2 divides (SmolLM2's 9 do not): a random 12 / 6-head Llama."""
    from quill import LLM
    from tests.conftest import write_random_checkpoint

    path = write_random_checkpoint(tmp_path, model_dir, "llama", 12, 6)
    prompts = [[11, 12, 13, 14], list(range(1000, 1040))]
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    options = dict(dtype="float32", kv_cache_dtype="float32", quantization="none")
    with LLM(path, kv_cache_memory=32 << 20, **options) as one:
        want = [o.outputs[0].text for o in one.generate(prompts, greedy, use_tqdm=False)]
    served = ServeProcess(path, *TP3[2:], "--tensor-parallel-size", "2")
    try:
        url = served.ready()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        for prompt, text in zip(prompts, want, strict=True):
            resp = client.completions.create(
                model="smol",
                prompt=prompt,
                max_tokens=32,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert resp.choices[0].text == text and resp.usage.completion_tokens == 32
        # SIGKILL of the server: its engine and the engine's other rank end too.
        family = psutil.Process(served.proc.pid).children(recursive=True)
        assert len(family) >= 2, family
        served.proc.kill()
        assert not still_running(family, timeout=5.0)
    finally:
        served.kill()
