"""Issue 10 over HTTP: cached prompt tokens in usage (read with the openai client), the prefix
cache's counters, TTFT admission's 503 and its metrics, and the new fields' bad values."""

from __future__ import annotations

import pytest
from server_helpers import sample
from test_server_errors import check_error

from tests.conftest import long_prompt

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def test_usage_reports_cached_prompt_tokens(client, model_name, scrape):
    prompt = long_prompt(60)  # several full blocks
    params = dict(model=model_name, prompt=prompt, max_tokens=2, temperature=0)
    salt = {"cache_salt": "usage-test"}  # nothing earlier tests left can match
    before = scrape()
    first = client.completions.create(**params, extra_body=salt)
    second = client.completions.create(**params, extra_body=salt)
    after = scrape()
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    assert second.model_extra["metrics"]["num_cached_tokens"] == (n - 1) // 16 * 16
    assert second.choices[0].text == first.choices[0].text

    def rise(name: str) -> float:
        return sample(after, name) - sample(before, name)

    assert rise("quill:prefix_cache_queries_total") == 2 * n
    assert rise("quill:prefix_cache_hits_total") == (n - 1) // 16 * 16


def test_streamed_chat_usage_reports_cached_tokens(client, model_name):
    messages = [{"role": "system", "content": long_prompt(50)}, {"role": "user", "content": "Hi"}]
    kwargs = dict(
        model=model_name,
        messages=messages,
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": "stream-test"},
    )
    usages = []
    for _ in range(2):
        chunks = list(client.chat.completions.create(**kwargs))
        usages.append(chunks[-1].usage)
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens == (usages[1].prompt_tokens - 1) // 16 * 16


def test_a_request_predicted_to_start_late_is_refused_at_once(http, scrape):
    ok = http.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2, "ttft_slo_ms": 1e7})
    assert ok.status_code == 200, ok.text
    predicted = ok.json()["metrics"]["predicted_time_to_first_token"]
    assert predicted is not None and predicted > 0
    before = scrape()
    r = http.post(
        COMPLETIONS, json={"prompt": long_prompt(200), "max_tokens": 2, "ttft_slo_ms": 1e-3}
    )
    error = check_error(r, 503)
    assert error["code"] == "overloaded"
    assert "predicted time to first token" in error["message"]
    assert int(r.headers["Retry-After"]) >= 1
    after = scrape()
    assert (
        sample(after, "quill:num_requests_refused_slo_total")
        - sample(before, "quill:num_requests_refused_slo_total")
        == 1
    )
    assert sample(after, "quill:num_requests_running") == 0  # nothing of it was queued


@pytest.mark.parametrize(
    "field, value",
    [
        ("priority", "1"),  # not an integer
        ("priority", 1.5),
        ("priority", 1),  # an integer, but the server runs first come, first served
        ("ttft_slo_ms", -5),
        ("ttft_slo_ms", 0),
        ("cache_salt", ""),
    ],
)
def test_bad_scheduling_values_name_the_field(http, field, value):
    for path, base in (
        (COMPLETIONS, {"prompt": "Hi"}),
        (CHAT, {"messages": [{"role": "user", "content": "Hi"}]}),
    ):
        r = http.post(path, json={**base, "max_tokens": 1, field: value})
        check_error(r, 400, field)


@pytest.fixture(scope="module")
def priority_server():
    """A second server, one sequence at a time, under the priority policy."""
    from conftest import SERVER_ARGS, running_server

    args = SERVER_ARGS + ["--scheduling-policy", "priority", "--max-num-seqs", "1"]
    with running_server(args) as srv:
        yield srv


def test_priority_over_http_serves_the_most_important_waiting_request_first(priority_server):
    import threading

    import httpx
    from server_helpers import API_KEY, engine_call, wait_until

    headers = {"Authorization": f"Bearer {API_KEY}"}
    results: dict[str, dict] = {}

    def send(name: str, priority: int, max_tokens: int) -> None:
        body = {"prompt": f"Request {name}:", "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "priority": priority}  # fmt: skip
        with httpx.Client(base_url=priority_server.base_url, headers=headers, timeout=120) as c:
            r = c.post(COMPLETIONS, json=body)
        assert r.status_code == 200, r.text
        results[name] = r.json()["metrics"]

    def state():
        return engine_call(priority_server, "state")

    busy = threading.Thread(target=send, args=("busy", 5, 40))
    busy.start()  # holds the one sequence slot for 40 tokens
    wait_until(lambda: state()["num_running"] == 1)
    late = [
        threading.Thread(target=send, args=("less", 3, 2)),
        threading.Thread(target=send, args=("more", 0, 2)),  # arrives later, matters more
    ]
    late[0].start()
    wait_until(lambda: state()["num_unscheduled"] >= 1)
    late[1].start()
    wait_until(lambda: state()["num_unscheduled"] >= 2)
    assert state()["num_running"] == 1  # both wait behind "busy"
    for t in [busy, *late]:
        t.join(120)

    queue = {name: results[name]["queue_time"] for name in ("less", "more")}
    ttft = {name: results[name]["time_to_first_token"] for name in ("less", "more")}
    # "more" arrived after "less" yet waited less (under fcfs it would wait for "less" too).
    assert queue["more"] < queue["less"] and ttft["more"] < ttft["less"]
