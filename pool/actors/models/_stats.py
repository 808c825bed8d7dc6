"""Recent per-model figures: queue waits (average, p95) and the observed drain rate.

Both come from a bounded window of the latest requests, so they follow the current
load and cost O(window) memory per model whatever the traffic.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable


def percentile(values: Iterable[float], fraction: float) -> float:
    """The nearest-rank percentile of ``values`` (0 for none)."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


class RecentStats:
    def __init__(self, window: int) -> None:
        self._waits: deque[float] = deque(maxlen=window)
        self._completions: deque[float] = deque(maxlen=window)

    def record_wait(self, wait_ms: float) -> None:
        self._waits.append(wait_ms)

    def record_completion(self, at: float) -> None:
        self._completions.append(at)

    @property
    def waits_ms(self) -> list[float]:
        return list(self._waits)

    @property
    def avg_wait_ms(self) -> float:
        return sum(self._waits) / len(self._waits) if self._waits else 0.0

    @property
    def p95_wait_ms(self) -> float:
        return percentile(self._waits, 0.95)

    def drain_rate(self, now: float, horizon_s: float = 60.0) -> float:
        """Completions per second over the last ``horizon_s`` (0 when unknown)."""
        recent = [t for t in self._completions if now - t <= horizon_s]
        if len(recent) < 2:
            return 0.0
        span = max(now - recent[0], 1e-3)
        return len(recent) / span

    def retry_after_s(self, now: float) -> float:
        """How long a refused client should wait for the queue to free one place.

        The inverse of the observed completion rate; one second when nothing has
        completed recently, and never more than a minute.
        """
        rate = self.drain_rate(now)
        if rate <= 0:
            return 1.0
        return min(60.0, max(1.0, 1.0 / rate))
