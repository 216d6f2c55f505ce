"""Clocks: wall time for the real engine, virtual time for the simulator; metrics read either."""

from __future__ import annotations

import time


class WallClock:
    """Monotonic seconds."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Seconds that pass only when told to (the simulator advances it by each step's cost)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds
