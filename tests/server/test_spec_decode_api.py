"""Speculative decoding over HTTP (issue 24): `quill serve --speculative-config` answers the
`openai` client with what the offline engine without drafts writes, streamed or not, and shows
its drafts in each reply's `metrics`, in /metrics (vLLM's spec_decode counters) and in the
console's state."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import SERVER_ARGS, running_server
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import API_KEY

PASSAGE = (
    "Our office moves to 12 Harbour Street on Monday. Parking is behind the building, the "
    "entrance is on the left, and the lift goes to the fourth floor, where reception is."
)
CHAT = [{"role": "user", "content": f"Repeat this text exactly:\n{PASSAGE}"}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "by_cost": False}


@pytest.fixture(scope="module")
def spec_server():
    with running_server(SERVER_ARGS + ["--speculative-config", json.dumps(NGRAM)]) as srv:
        yield srv


def test_replies_match_the_plain_engine_and_count_their_drafts(spec_server, greedy):
    client = openai.OpenAI(base_url=f"{spec_server.base_url}/v1", api_key=API_KEY,
                           max_retries=0, timeout=120)  # fmt: skip
    model = spec_server.ctx.model_name
    expected = greedy([CHAT], 60, chat=True)[0]
    reply = client.chat.completions.create(model=model, messages=CHAT, max_tokens=60,
                                           temperature=0)  # fmt: skip
    assert reply.choices[0].message.content == expected
    metrics = reply.model_extra["metrics"]
    assert metrics["num_draft_tokens"] > 0 and 0 < metrics["num_accepted_tokens"]
    assert metrics["num_accepted_tokens"] <= metrics["num_draft_tokens"]
    stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=60,
                                            temperature=0, stream=True)  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected

    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=spec_server.base_url, headers=headers, timeout=60) as http:
        text = http.get("/metrics").text
        state = http.get("/console/state").json()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, s.labels.get("position"))] = s.value
    drafted = values[("quill:spec_decode_num_draft_tokens_total", None)]
    accepted = values[("quill:spec_decode_num_accepted_tokens_total", None)]
    assert drafted >= 2 * metrics["num_draft_tokens"] > 0  # both replies' drafts
    assert values[("quill:spec_decode_acceptance_rate", None)] == pytest.approx(accepted / drafted)
    per_position = [values.get(("quill:spec_decode_num_accepted_tokens_per_pos_total", str(i)), 0)
                    for i in range(4)]  # fmt: skip
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    assert values[("quill:spec_decode_drafts_allowed", None)] == 4
    # How often the proposer found drafts (what the simulator draws proposals with).
    eligible = values[("quill:spec_decode_num_eligible_total", None)]
    proposed = values[("quill:spec_decode_num_proposed_total", None)]
    assert eligible >= proposed >= values[("quill:spec_decode_num_drafts_total", None)] > 0
    spec = state["spec_decode"]
    assert spec["draft_tokens"] == drafted and spec["accepted_tokens"] == accepted


def test_a_bad_speculative_config_is_refused_at_start():
    for bad, why in (
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "draft_model", "model": "x"}', "not built"),
        ("{method: ngram}", "not valid JSON"),
    ):
        with pytest.raises(ValueError, match=why):
            with running_server(SERVER_ARGS + ["--speculative-config", bad]):
                pass
