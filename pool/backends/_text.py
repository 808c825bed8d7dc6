"""Text handling shared by the backends that decode tokens themselves."""

from __future__ import annotations


class StopScanner:
    """Holds back text that might be the start of a stop string.

    ``feed`` returns what is safe to send now and whether a stop string was reached
    (the stop string itself is never sent); ``hit`` is then the stop string reached.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._pending = ""
        self.hit: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        self._pending += text
        hits = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        if hits:
            at, self.hit = min(hits, key=lambda hit: hit[0])
            out, self._pending = self._pending[:at], ""
            return out, True
        hold = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._pending)), 0, -1):
                if self._pending.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        cut = len(self._pending) - hold
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
