"""The console page in a real browser: Debian's chromium driven by Playwright, against the
suite's server (API key set, a priced hardware spec). Everything asserted is read from the
page's DOM and compared with what the openai client or the offline engine says; a screenshot of
the loaded console is written as an artefact (build/test-artifacts/console.png).

Skipped, with the reason, where the Python package or the browser is missing (`make test`
installs both when it can; see the Makefile's `browser`).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from server_helpers import API_KEY

playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (requirements.txt has it)"
)
CHROMIUM = os.environ.get("QUILL_CHROMIUM") or shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip(
        "no chromium on PATH: `make browser` installs Debian's (apt-get install chromium), "
        "or set QUILL_CHROMIUM",
        allow_module_level=True,
    )

ARTIFACTS = Path(os.environ.get("QUILL_TEST_ARTIFACTS", "build/test-artifacts"))
TIMEOUT_MS = 60_000  # a guard against hangs, not a speed check


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        # Chromium's sandbox cannot start as root (CI runs so); the page is our own.
        args = ["--no-sandbox"] if os.geteuid() == 0 else []
        b = p.chromium.launch(executable_path=CHROMIUM, args=args)
        yield b
        b.close()


@pytest.fixture
def signed_in(browser, base_url):
    """A fresh browser context signed in through the page's own sign-in; a page in it, with
    every console message and page error kept."""
    context = browser.new_context(viewport={"width": 1280, "height": 900}, base_url=base_url)
    page = context.new_page()
    page.problems = []
    page.on("console", lambda m: page.problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: page.problems.append(f"page error: {e}"))
    page.set_default_timeout(TIMEOUT_MS)
    response = page.goto("/console")
    assert response.status == 401  # the sign-in page
    page.problems.clear()  # the browser reports that 401 itself
    page.fill("#api-key", API_KEY)
    page.click("button[type=submit]")
    page.wait_for_selector("body[data-ready=true]")
    yield page
    context.close()


def _number(text: str) -> float:
    return float(text.replace(",", "").split()[0])


def test_the_page_refuses_without_the_key(browser, base_url):
    context = browser.new_context(base_url=base_url)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    try:
        for path in ("/", "/console"):
            response = page.goto(path)
            assert response.status == 401
            assert page.locator("#api-key").is_visible()
            assert page.locator("#running").count() == 0  # no console without the key
        assert page.request.get("/console/state").status == 401
        page.fill("#api-key", "not-the-key")
        page.click("button[type=submit]")
        page.wait_for_function("document.getElementById('error').textContent.length > 0")
        assert "Incorrect API key" in page.inner_text("#error")
        assert page.request.get("/console/state").status == 401
        cookies = context.cookies()
        assert all(c["value"] != API_KEY for c in cookies)  # never the key itself
    finally:
        context.close()


def test_the_console_shows_the_requests(signed_in, client, http, model_name):
    page = signed_in
    before = http.get("/console/state").json()["finished_requests"]
    usages = []
    for i, n in enumerate((4, 9, 6)):
        r = client.completions.create(
            model=model_name, prompt=f"List {i + 2} colours:", max_tokens=n, temperature=0
        )
        usages.append(r.usage)
    page.wait_for_function(
        f"Number(document.getElementById('finished').textContent.replace(/,/g, '')) >= {before + 3}"
    )
    assert _number(page.inner_text("#finished")) == before + 3
    assert _number(page.inner_text("#running")) == 0
    # Charts and tables are drawn when their section comes into view.
    page.locator("#requests").scroll_into_view_if_needed()
    page.wait_for_function("document.querySelectorAll('#requests tbody tr').length >= 3")
    # The last requests, newest first: the token counts the client was told.
    rows = page.locator("#requests tbody tr")
    for row, usage in zip(range(3), reversed(usages), strict=True):
        cells = rows.nth(row).locator("td").all_inner_texts()
        assert _number(cells[3]) == usage.prompt_tokens
        assert _number(cells[5]) == usage.completion_tokens
        assert cells[11].startswith("$")  # the hardware spec has a price
    # TTFT and ITL apart: TTFT counts requests, ITL counts gaps (n - 1 a request at least).
    page.locator("#ttft").scroll_into_view_if_needed()
    page.wait_for_function("document.querySelectorAll('#itl rect[data-count]').length == 15")
    ttft_count = _number(page.inner_text("#ttft [data-q=count]"))
    itl_count = _number(page.inner_text("#itl [data-q=count]"))
    assert ttft_count >= 3 and itl_count >= sum(u.completion_tokens - 1 for u in usages)
    for figure, total in (("#ttft", ttft_count), ("#itl", itl_count)):
        bars = page.locator(f"{figure} rect[data-count]")
        assert bars.count() == 15
        assert sum(int(c) for c in bars.evaluate_all("bs => bs.map(b => b.dataset.count)")) == total
        assert page.inner_text(f"{figure} [data-q=p50]") not in ("", "–")
    # The step timeline: decode and prompt tokens, and the priced lines beside the bars.
    page.locator("#step-times").scroll_into_view_if_needed()
    page.wait_for_function("document.querySelectorAll('#step-tokens g[data-step]').length > 0")
    steps = page.locator("#step-tokens g[data-step]")
    assert steps.count() > 0
    decodes = steps.evaluate_all("gs => gs.map(g => Number(g.dataset.decode))")
    prefills = steps.evaluate_all("gs => gs.map(g => Number(g.dataset.prefill))")
    assert max(decodes) > 0 and max(prefills) > 0
    for line in ("price", "floor-arith", "floor-move"):
        assert page.locator(f"#step-times .{line}").count() > 0
    assert "bound by movement" in page.inner_text("#step-summary")
    assert re.match(r"\$\S+ · \$\S+", page.inner_text("#usd-per-mtok"))
    page.locator("#series-tokens").scroll_into_view_if_needed()
    page.wait_for_function("document.querySelectorAll('#series-tokens rect[data-tokens]').length")
    # The page keeps updating on its own.
    seen = int(page.get_attribute("body", "data-updates"))
    page.wait_for_function(f"Number(document.body.dataset.updates) > {seen + 1}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "console.png"), full_page=True)
    assert page.problems == []


def _reply_watch(page) -> None:
    """Count the reply's changes: more than one means it streamed in."""
    page.evaluate(
        """() => { window.replyChanges = 0;
        new MutationObserver(() => window.replyChanges++).observe(
            document.getElementById('reply'), {childList: true, characterData: true,
            subtree: true}); }"""
    )


def test_the_playground_streams_a_completion_and_a_chat(signed_in, greedy):
    page = signed_in
    prompt = "The three primary colours are"
    page.check("input[name=endpoint][value=completion]")
    page.fill("#prompt", prompt)
    page.fill("input[name=max_tokens]", "16")
    page.fill("input[name=temperature]", "0")
    _reply_watch(page)
    page.click("#send")
    page.wait_for_selector("#play-timings[data-done=true]")
    assert page.inner_text("#play-error") == ""
    assert page.inner_text("#reply") == greedy([prompt], 16)[0]
    assert page.evaluate("window.replyChanges") > 1
    timings = dict(
        row.split("\t", 1) for row in page.inner_text("#play-timings").splitlines() if "\t" in row
    )
    assert _number(timings["output tokens"]) == 16
    assert timings["TTFT (server)"] != "–" and timings["cost"].startswith("$")

    # Keyboard only: the chat endpoint, sent with Ctrl+Enter from the prompt.
    page.evaluate("document.getElementById('play-timings').dataset.done = ''")
    question = "Name one colour."
    page.check("input[name=endpoint][value=chat]")
    page.focus("#prompt")
    page.keyboard.press("Control+A")
    page.keyboard.type(question)
    _reply_watch(page)
    page.keyboard.press("Control+Enter")
    page.wait_for_selector("#play-timings[data-done=true]")
    assert page.inner_text("#play-error") == ""
    expected = greedy([[{"role": "user", "content": question}]], 16, chat=True)[0]
    assert page.inner_text("#reply") == expected
    assert page.evaluate("window.replyChanges") > 1
    # The form survives a reload (it is kept in this browser).
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.input_value("#prompt") == question
    assert page.input_value("input[name=max_tokens]") == "16"
    assert page.problems == []


def test_a_refused_playground_request_shows_the_servers_error(signed_in):
    page = signed_in
    page.check("input[name=endpoint][value=completion]")
    page.fill("#prompt", "Hello")
    page.fill("input[name=temperature]", "7")  # outside 0..2: a 400 from the API
    page.evaluate("document.getElementById('prompt').form.noValidate = true")
    page.click("#send")
    page.wait_for_selector("#play-timings[data-done=true]")
    assert "temperature" in page.inner_text("#play-error")
    page.problems.clear()  # the 400 itself is logged by the browser


def test_narrow_window_has_no_sideways_scroll_and_figures_load(signed_in):
    page = signed_in
    page.set_viewport_size({"width": 360, "height": 800})
    page.wait_for_function("Number(document.body.dataset.updates) > 1")
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0
    figures = sorted(p.name for p in Path("docs/figures/experiments").glob("*.png"))
    page.wait_for_function(f"document.querySelectorAll('#figures img').length == {len(figures)}")
    shown = page.locator("#figures img").evaluate_all("is => is.map(i => i.src.split('/').pop())")
    assert sorted(shown) == figures
    for img in page.locator("#figures img").all():
        img.scroll_into_view_if_needed()
        page.wait_for_function("i => i.complete && i.naturalWidth > 0", arg=img.element_handle())
    assert page.problems == []
