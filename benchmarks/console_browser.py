"""Hold the console open in headless chromium while a benchmark runs (bench_server.py
--console): the "open" side of console open against closed.

Run as a child process: `console_browser.py URL [--api-key KEY]`. It opens URL/console (signing
in first when a key is given), prints one JSON line once the page has drawn its first state
(`ready_s`: from navigation to the first draw, read from the page's own performance marks),
then keeps the page open until its stdin closes, and prints a last JSON line: how many times
the page redrew and over how many seconds. A process of its own, so that Playwright's event
loop never meets the benchmark's asyncio one; the browser shares the machine with the server,
as a console opened on the server's own host would.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

from playwright.sync_api import sync_playwright


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("url")
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    chromium = os.environ.get("QUILL_CHROMIUM") or shutil.which("chromium")
    if chromium is None:
        raise SystemExit("no chromium on PATH (make browser installs it)")
    with sync_playwright() as p:
        flags = ["--no-sandbox"] if os.geteuid() == 0 else []
        browser = p.chromium.launch(executable_path=chromium, args=flags)
        page = browser.new_page(viewport={"width": 1280, "height": 900}, base_url=args.url)
        if args.api_key:
            page.request.post("/console/login", data={"api_key": args.api_key})
        page.goto("/console")
        page.wait_for_selector("body[data-ready=true]", timeout=60_000)
        ready_s = page.evaluate("performance.getEntriesByName('console-ready')[0].startTime / 1000")
        first = int(page.get_attribute("body", "data-updates"))
        start = time.perf_counter()
        print(json.dumps({"ready_s": ready_s}), flush=True)
        sys.stdin.read()  # the benchmark closes it when its round ends
        updates = int(page.get_attribute("body", "data-updates")) - first
        print(json.dumps({"updates": updates, "seconds": time.perf_counter() - start}), flush=True)
        browser.close()


if __name__ == "__main__":
    main()
