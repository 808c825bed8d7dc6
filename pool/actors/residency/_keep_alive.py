"""Ollama-style keep-alive durations (the eviction policy lives in ``_vram.py``).

``keep_alive`` is how long an on-demand model stays loaded after its last request:
seconds as a number, or a Go-style duration string (``"5m"``, ``"1h30m"``, ``"250ms"``);
any negative value keeps it loaded forever, ``0`` unloads right after the request.
"""

from __future__ import annotations

import math
import re

from pool.errors import PoolError

_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_MAX_SECONDS = 10 * 365 * 24 * 3600.0


def parse_keep_alive(value: float | int | str | None) -> float | None:
    """Seconds to keep a model after its last request; ``None`` means forever.

    Raises:
        PoolError: ``invalid_request`` for a string that is not a duration.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise PoolError("invalid_request", "keep_alive must be a number or a duration string")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise PoolError(
                    "invalid_request",
                    f"keep_alive {value!r} is not a duration (examples: 300, '5m', '1h30m', -1)",
                ) from None
            seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    if math.isnan(seconds):
        raise PoolError("invalid_request", "keep_alive must be a number")
    if seconds < 0 or seconds > _MAX_SECONDS:
        return None
    return seconds
