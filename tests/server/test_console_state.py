"""The console's JSON and its door: GET /console/state (counts that match what the openai client
was told, TTFT and ITL kept apart, steps priced, rates and dollars by hand), the figures it
links (only what the listing shows), and the sign-in cookie the guard takes for the key."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from server_helpers import API_KEY

from quill.contract.messages import StepPrice, StepStats
from quill.server.console.routes import COOKIE, cookie_token
from quill.server.console.state import BUCKETS, ConsoleState, distribution


def test_percentiles_and_histogram_by_hand():
    # 0.5 ms, the 1 ms edge itself (counts up to and including it), 3 ms, 40 s (above all).
    d = distribution([0.0005, 0.001, 0.003, 40.0])
    assert d["histogram"] == [2, 0, 1] + [0] * 11 + [1] and d["count"] == 4
    # Linear between closest ranks: p50 of 4 sorted values is halfway from the 2nd to the 3rd.
    assert d["p50"] == pytest.approx(0.002)
    assert d["p90"] == pytest.approx(0.003 + 0.7 * (40.0 - 0.003))
    rng = np.random.default_rng(3)
    values = rng.exponential(0.05, 101)
    expected, _ = np.histogram(values, bins=[0.0, *BUCKETS, np.inf])
    # numpy's bins are closed on the left, ours on the right: no value sits on an edge here.
    assert distribution(values)["histogram"] == expected.tolist()
    assert distribution([])["p50"] is None and distribution([])["histogram"] == [0] * 15


def test_the_state_counts_the_requests_the_client_made(client, http, model_name, base_url):
    before = http.get("/console/state").json()
    usages = []
    for i, n in enumerate((3, 7, 12)):
        r = client.completions.create(
            model=model_name, prompt=f"Count to {i}:", max_tokens=n, temperature=0
        )
        usages.append(r.usage)
    state = http.get("/console/state").json()
    assert state["finished_requests"] == before["finished_requests"] + 3
    newest = state["requests"][:3][::-1]  # newest first
    for row, usage in zip(newest, usages, strict=True):
        assert row["prompt_tokens"] == usage.prompt_tokens
        assert row["output_tokens"] == usage.completion_tokens
        assert row["ttft_s"] > 0 and row["finished_at"] <= 0
        assert row["flops"] > 0 and row["cost_usd"] > 0  # the hardware file has a price
    assert state["ttft"]["count"] >= 3
    # ITL: one gap per token after each reply's first (n - 1 each), in the last minute.
    assert state["itl"]["count"] >= (3 - 1) + (7 - 1) + (12 - 1)
    assert state["running"] == 0 and state["waiting"] == 0
    assert state["output_tokens_per_s"] > 0
    priced = [s for s in state["steps"] if s["predicted_s"] is not None]
    assert priced and all(s["measured_s"] > 0 for s in priced)
    assert any(s["prefill_tokens"] for s in priced) and any(s["decode_tokens"] for s in priced)
    assert httpx.get(f"{base_url}/console/state").status_code == 401


def _stats(prefill: int, decode: int, duration: float, price=None) -> StepStats:
    return StepStats(prefill, decode, 1, 1, 0, 0.25, 0, duration, price=price)


def test_rates_dollars_and_series_by_hand():
    state = ConsoleState(started=100.0)
    price = StepPrice(0.4, 0.5, 0.8, 0.1, 0.7, 0.1, 0.4, 0.005)
    state.on_step(_stats(10, 0, 0.5, price), 102.0, [], 1, [])  # a prompt and its first token
    state.on_step(_stats(0, 2, 0.1), 103.0, [1.0], 2, [])
    state.on_step(_stats(0, 1, 0.05), 107.0, [4.0], 1, [])
    snap = state.snapshot(115.0, price_per_hour=36.0)  # $0.01 a second
    # The minute, as much of it as the server has lived (15 s): 4 tokens.
    assert snap["output_tokens_per_s"] == pytest.approx(4 / 15)
    assert snap["usd_per_million_tokens"] == pytest.approx(0.01 * 15 / 4 * 1e6)
    # The last 10 s (from 105): the one token at 107.
    assert snap["output_tokens_per_s_now"] == pytest.approx(1 / 10)
    assert snap["usd_per_million_tokens_now"] == pytest.approx(0.01 * 10 / 1 * 1e6)
    # Series: [100, 105) made 3 tokens in 0.6 busy seconds, [105, 110) one in 0.05.
    first, second = snap["series"]
    assert (first["at"], first["output_tokens"], first["steps"]) == (-15.0, 3, 2)
    assert first["busy_fraction"] == pytest.approx(0.6 / 5)
    assert first["usd_per_million_tokens"] == pytest.approx(0.01 * 5 / 3 * 1e6)
    assert (second["at"], second["output_tokens_per_s"]) == (-10.0, pytest.approx(1 / 5))
    step = snap["steps"][0]
    assert step["at"] == -13.0 and step["prefill_tokens"] == 10 and step["step"] == 1
    assert [s["step"] for s in snap["steps"]] == [1, 2, 3]
    assert (step["arithmetic_s"], step["movement_s"], step["cost_usd"]) == (0.1, 0.4, 0.005)
    assert snap["steps"][1]["predicted_s"] is None  # an unpriced step
    assert snap["itl"]["count"] == 2 and snap["itl"]["p50"] == pytest.approx(2.5)
    # A minute on, the samples are gone; no tokens, no price per token.
    later = state.snapshot(170.0, price_per_hour=36.0)
    assert later["itl"]["count"] == 0 and later["output_tokens_per_s"] == 0
    assert later["usd_per_million_tokens"] is None
    assert state.snapshot(115.0)["usd_per_million_tokens"] is None  # no price set


def test_signing_in_sets_a_cookie_that_stands_for_the_key(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as c:
        wrong = c.post("/console/login", json={"api_key": "nope"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert c.post("/console/login", json={"key": API_KEY}).status_code == 400
        assert c.get("/console/state").status_code == 401
        ok = c.post("/console/login", json={"api_key": API_KEY})
        assert ok.status_code == 200
        header = ok.headers["set-cookie"].lower()
        assert "httponly" in header and "samesite=strict" in header
        assert c.cookies[COOKIE] == cookie_token(API_KEY) != API_KEY
        assert c.get("/console/state").status_code == 200
        assert c.get("/v1/models").status_code == 200  # the playground's requests too
        page = c.get("/console")
        assert page.status_code == 200 and 'id="playground"' in page.text
        c.post("/console/logout")
        assert COOKIE not in c.cookies
        assert c.get("/console/state").status_code == 401
        signin = c.get("/")
        assert signin.status_code == 401 and 'id="api-key"' in signin.text


def test_figures_and_files_only_from_the_listing(http):
    listing = http.get("/console/figures").json()
    on_disk = sorted(p.name for p in Path("docs/figures/experiments").glob("*.png"))
    assert listing["directories"] == ["docs/figures/experiments"]
    assert sorted(f["name"] for f in listing["figures"]) == on_disk
    first = listing["figures"][0]
    r = http.get(first["url"])
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.content == (Path(first["directory"]) / first["name"]).read_bytes()
    for bad in (
        "/console/figures/0/..%2F..%2F..%2Fpyproject.toml",
        "/console/figures/0/../../README.md",
        "/console/figures/7/batching.png",
        "/console/static/routes.py",
        "/console/static/..%2Froutes.py",
    ):
        assert http.get(bad).status_code == 404, bad
    js = http.get("/console/static/console.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]


async def _call(app, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
    await app(scope, receive, send)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body


def test_the_guard_lets_the_cookie_or_the_header_in_and_pages_get_the_sign_in():
    import asyncio

    from starlette.responses import PlainTextResponse

    from quill.server.guard import RequestGuard

    inner = PlainTextResponse("inside")
    guarded = RequestGuard(inner, "k", 1 << 20, 5.0, pages=lambda: b"<p>sign in</p>")
    no_pages = RequestGuard(inner, "k", 1 << 20, 5.0)
    open_server = RequestGuard(inner, None, 1 << 20, 5.0, pages=lambda: b"<p>sign in</p>")
    cookie = [(b"cookie", f"other=1; {COOKIE}={cookie_token('k')}".encode())]
    cases = [
        (guarded, "/", [], (401, b"<p>sign in</p>")),
        (guarded, "/console/state", [], 401),
        (guarded, "/", cookie, (200, b"inside")),
        (guarded, "/v1/models", cookie, (200, b"inside")),
        (guarded, "/v1/models", [(b"authorization", b"Bearer k")], (200, b"inside")),
        (guarded, "/console/state", [(b"cookie", f"{COOKIE}=k".encode())], 401),  # not the key
        (guarded, "/console/state", [(b"cookie", b"\x7f;;=bad")], 401),
        (guarded, "/console/login", [], (200, b"inside")),  # it checks the key itself
        (no_pages, "/", [], 401),  # --no-console: a JSON refusal like any path
        (open_server, "/", [], (200, b"inside")),
    ]
    for app, path, headers, expected in cases:
        status, body = asyncio.run(_call(app, path, headers))
        if isinstance(expected, tuple):
            assert (status, body) == expected, (path, headers)
        else:
            assert status == expected and b"invalid_api_key" in body, (path, headers)
