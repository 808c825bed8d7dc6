"""What the admin API reads from a query string: times, choices, flags, limits."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from pool.errors import PoolError


def parse_time(value: str, name: str) -> float:
    """An instant given as RFC 3339 (``2026-11-26T00:00:00Z``) or as seconds since the
    epoch; ``invalid_request`` otherwise. An RFC 3339 time without an offset is UTC."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds):
            return seconds
        raise PoolError("invalid_request", f"{name} must be a finite number of seconds")
    try:
        # fromisoformat reads RFC 3339 (a trailing Z included, from Python 3.11 on).
        at = datetime.fromisoformat(text)
    except ValueError:
        raise PoolError(
            "invalid_request",
            f"{name} must be an RFC 3339 time (2026-11-26T00:00:00Z) or seconds since the"
            f" epoch (got {value!r})",
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.timestamp()


def choice(name: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is None or value == "":
        return None
    if value not in allowed:
        raise PoolError(
            "invalid_request", f"{name} must be one of {', '.join(allowed)} (got {value!r})"
        )
    return value


def flag(value: str | None, name: str) -> bool:
    """A boolean query parameter: absent, ``false`` or ``0`` is off; ``true`` or ``1`` on."""
    if value is None or value.lower() in ("false", "0", ""):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise PoolError("invalid_request", f"{name} must be true or false (got {value!r})")


def positive_limit(value: str | None) -> int | None:
    """``?limit=``: absent, or a positive integer."""
    if value is None:
        return None
    if not (value.isdigit() and int(value) > 0):
        raise PoolError("invalid_request", "limit must be a positive integer")
    return int(value)
