"""When each request of a benchmark leaves: a renewal process of gamma inter-arrival times.

Separate from the sending so that the pattern itself can be checked (its mean, its spread)
without a server, and so that one seed gives one pattern. A gamma distribution of shape k and
mean 1/rate has coefficient of variation 1/sqrt(k): k = 1 is a Poisson process (exponential
gaps), k < 1 sends bursts with lulls between them, k > 1 spaces requests more evenly.
"""

from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent: the first at 0, then gaps
    drawn from a gamma distribution of shape `burstiness` and mean 1/`rate`. An infinite rate
    sends every request at 0."""
    if n < 0:
        raise ValueError(f"the number of requests must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"the request rate must be positive (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be positive and finite, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"quill-bench:{seed}:arrivals")
    # Shape k, scale 1/(k * rate): mean k * scale = 1/rate whatever the shape.
    scale = 1.0 / (burstiness * rate)
    offsets, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets
