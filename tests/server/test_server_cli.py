"""`quill serve` as a real process: ready line, flags, QUILL_API_KEY, clean stop on signals."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest

KEY = "env-key"


class ServeProcess:
    """`python -m quill.cli serve ...` with its output read line by line in a thread."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "quill.cli", "serve", *flags]
        env = {**os.environ, "QUILL_API_KEY": KEY}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} in output:\n{''.join(self.log)}") from None
            self.log.append(line)
            if m := re.search(pattern, line):
                return m

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_starts_and_stops_cleanly(sig):
    served = ServeProcess(
        "--dtype", "float32", "--kv-cache-memory", "64MiB", "--port", "0",
        "--served-model-name", "smol", "--max-num-seqs", "4", "--no-access-log",
    )  # fmt: skip
    try:
        url = served.wait_for(r"(http://127\.0\.0\.1:\d+) ").group(1)
        served.wait_for(r"ready")
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/v1/models").status_code == 401  # the key came from QUILL_API_KEY
            assert [m["id"] for m in c.get("/v1/models", headers=auth).json()["data"]] == ["smol"]
            body = {
                "model": "smol",
                "messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": 1000,
                "ignore_eos": True,
                "stream": True,
            }
            events = []
            with c.stream("POST", "/v1/chat/completions", json=body, headers=auth) as r:
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        events.append(line)
                    if len(events) == 3:
                        served.proc.send_signal(sig)  # mid-stream
            # The stream ended by itself: aborted, then [DONE].
            assert events[-1] == "data: [DONE]"
            assert '"finish_reason":"abort"' in events[-2]
        assert served.proc.wait(timeout=60) == 0
    finally:
        served.kill()
