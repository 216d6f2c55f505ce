"""The console screenshot in docs/ (README): `quill serve` as a user starts it (this machine's
saved calibration, a price per hour), a minute of mixed traffic (short chats and long prompts
beside them, so the step timeline shows decodes and prompt chunks), one playground reply, then
the whole page. Needs chromium (make browser). Usage:

    .venv/bin/python benchmarks/console_screenshot.py [--out docs/console.png] [--seconds 40]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_server import prompt_ids, run_clients, start_server  # noqa: E402


def _traffic(url: str, seconds: float) -> None:
    """A quiet stretch, then a busy one, then long prompts, round after round."""
    end = time.monotonic() + seconds
    round_ = 0
    while time.monotonic() < end:
        clients, length = [(1, 32), (8, 32), (4, 600)][round_ % 3]
        prompts = [prompt_ids(length, 500 * round_ + i) for i in range(clients)]
        asyncio.run(run_clients(url, clients, prompts, 48))
        round_ += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/console.png")
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    proc, url = start_server("shared", ["--price-per-hour", "0.10"])
    try:
        with sync_playwright() as p:
            flags = ["--no-sandbox"] if os.geteuid() == 0 else []
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=flags)
            page = browser.new_page(viewport={"width": 1280, "height": 900}, base_url=url)
            page.goto("/console")
            page.wait_for_selector("body[data-ready=true]")
            # Traffic from a thread of its own: Playwright's loop holds this one.
            traffic = threading.Thread(target=_traffic, args=(url, args.seconds))
            traffic.start()
            while traffic.is_alive():
                page.wait_for_timeout(500)
            page.fill("#prompt", "Explain in two sentences why a GPU is fast at matrix products.")
            page.fill("input[name=temperature]", "0")
            page.click("#send")
            page.wait_for_selector("#play-timings[data-done=true]", timeout=120_000)
            for section in ("#ttft", "#step-times", "#series-tokens", "#requests", "#figures"):
                page.locator(section).scroll_into_view_if_needed()
                time.sleep(1.0)  # a redraw of the section now in view
            page.screenshot(path=args.out, full_page=True)
            browser.close()
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
