"""Budgets per key or tenant and UTC day or month (``service.budgets``).

A budget counts one unit of what finished requests used in its window (the UTC day, or
the UTC calendar month): prompt plus output tokens; requests that reached a model,
whatever they used (routes where no tokens apply: images, forwarded routes); seconds of
audio transcribed (rounded up per request); characters said by speech models; or
seconds of model loading the requests caused (counted in milliseconds). A request is
checked at admission against the budgets of what it can spend: once a window's count has
reached its limit, new requests of that key or tenant are refused with 429
``budget_exceeded`` and ``Retry-After`` set to the seconds left until the window
resets. Requests already running finish and are counted, so a budget can be overshot by
what was in flight when it ran out.

The counts live behind :class:`BudgetCounters`: :class:`LocalCounters` for one pool;
with a cluster, ``pool.cluster``'s shared counters (Redis ``INCRBY`` on one key per
window, expiring after it) so several pools enforce one budget. Either way the check
reads a local number and never waits on anything. Local counters start from the usage
database (:meth:`Budgets.restore`), so restarting a pool does not give its budgets back;
shared counters outlive a restart in Redis.

The clock is injectable (seconds since the epoch), so tests move time across a window
boundary instead of sleeping.
"""

from __future__ import annotations

import calendar
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal, Protocol

from pool.config import BudgetRule
from pool.errors import PoolError

Period = Literal["day", "month"]
Subject = Literal["key", "tenant"]
# What a budget counts (load seconds in milliseconds, so that counters stay integers).
Unit = Literal["tokens", "requests", "audio_seconds", "characters", "load_ms"]
UNITS: tuple[Unit, ...] = ("tokens", "requests", "audio_seconds", "characters", "load_ms")
# How a refusal names each unit, and the factor from the counter to what it shows.
_SHOWN: dict[Unit, tuple[str, str, float]] = {
    "tokens": ("tokens", "tokens", 1),
    "requests": ("requests", "requests", 1),
    "audio_seconds": ("audio_seconds", "seconds of audio", 1),
    "characters": ("characters", "characters", 1),
    "load_ms": ("load_seconds", "load seconds", 1000),
}


@dataclass(frozen=True, slots=True)
class Spent:
    """What a request (or a key or tenant in a window) used, in every budget unit."""

    tokens: int = 0
    requests: int = 0
    audio_seconds: int = 0
    characters: int = 0
    load_ms: int = 0

    def of(self, unit: Unit) -> int:
        return int(getattr(self, unit))


class BudgetCounters(Protocol):
    """Tokens spent per counter name (one per budget subject and window)."""

    def spent(self, counter: str, expires_at: float) -> int:
        """The count as this pool knows it now (never waits; shared counters keep the
        counters asked for up to date until ``expires_at``, the end of their window)."""
        ...

    def add(self, counter: str, tokens: int, expires_at: float) -> None:
        """Count ``tokens`` more; the counter may be forgotten after ``expires_at``."""
        ...


class LocalCounters:
    """Counters in this process only (a pool without a cluster)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._counts: dict[str, int] = {}
        self._expiries: dict[str, float] = {}

    def spent(self, counter: str, expires_at: float) -> int:
        return self._counts.get(counter, 0)

    def add(self, counter: str, tokens: int, expires_at: float) -> None:
        self._counts[counter] = self._counts.get(counter, 0) + tokens
        self._expiries[counter] = expires_at
        now = self._clock()
        # Past windows' counters go when a new one starts (few: rules x periods).
        for name, ends in list(self._expiries.items()):
            if ends <= now:
                del self._expiries[name], self._counts[name]


@dataclass(frozen=True, slots=True)
class Window:
    """One budget period as it stands at a moment: its id, start and end (UTC)."""

    period: Period
    id: str
    starts_at: float
    ends_at: float


def window(period: Period, now: float) -> Window:
    """The UTC day or calendar month that ``now`` (epoch seconds) falls in."""
    at = datetime.fromtimestamp(now, UTC)
    if period == "day":
        start = datetime(at.year, at.month, at.day, tzinfo=UTC)
        return Window(
            "day", start.strftime("%Y-%m-%d"), start.timestamp(), start.timestamp() + 86400.0
        )
    days = calendar.monthrange(at.year, at.month)[1]
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    return Window(
        "month", start.strftime("%Y-%m"), start.timestamp(), start.timestamp() + days * 86400.0
    )


@dataclass(frozen=True, slots=True)
class _Limit:
    subject: Subject
    name: str
    period: Period
    amount: int
    unit: Unit = "tokens"

    def counter(self, current: Window) -> str:
        # Token counters keep the name they had before other units existed (shared
        # counters in a cluster outlive an upgrade).
        base = f"{self.subject}:{self.name}:{self.period}:{current.id}"
        return base if self.unit == "tokens" else f"{base}:{self.unit}"


def _limits(rules: Iterable[BudgetRule]) -> list[_Limit]:
    limits: list[_Limit] = []
    for rule in rules:
        subject: Subject = "key" if rule.key is not None else "tenant"
        name = rule.key if rule.key is not None else rule.tenant
        assert name is not None  # BudgetRule names exactly one
        load_s = rule.load_seconds_per_day
        load_ms = None if load_s is None else max(1, round(load_s * 1000))
        for amount, period, unit in (
            (rule.tokens_per_day, "day", "tokens"),
            (rule.tokens_per_month, "month", "tokens"),
            (rule.requests_per_day, "day", "requests"),
            (rule.requests_per_month, "month", "requests"),
            (rule.audio_seconds_per_day, "day", "audio_seconds"),
            (rule.audio_seconds_per_month, "month", "audio_seconds"),
            (rule.characters_per_day, "day", "characters"),
            (rule.characters_per_month, "month", "characters"),
            (load_ms, "day", "load_ms"),
        ):
            if amount is not None:
                limits.append(_Limit(subject, name, period, amount, unit))  # type: ignore[arg-type]
    return limits


class Budgets:
    """The budget policy of one pool: :meth:`check` at admission, :meth:`charge` at finish.

    Args:
        rules: ``service.budgets``.
        counters: where counts live (default: this process only).
        clock: seconds since the epoch.
    """

    def __init__(
        self,
        rules: Iterable[BudgetRule],
        counters: BudgetCounters | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self.counters: BudgetCounters = counters or LocalCounters(clock)
        self._by_subject: dict[tuple[Subject, str], list[_Limit]] = {}
        for limit in _limits(rules):
            self._by_subject.setdefault((limit.subject, limit.name), []).append(limit)

    @property
    def enabled(self) -> bool:
        return bool(self._by_subject)

    def _applying(self, tenant: str, key: str | None) -> list[_Limit]:
        found = list(self._by_subject.get(("tenant", tenant), ()))
        if key is not None:
            found.extend(self._by_subject.get(("key", key), ()))
        return found

    def check(self, tenant: str, key: str | None, units: Iterable[Unit] = UNITS) -> None:
        """Refuse a new request whose key or tenant has spent a budget of one of
        ``units`` (what the request can spend: a speech request characters, not tokens).

        Raises:
            PoolError: ``budget_exceeded`` (429) with ``Retry-After`` (seconds until
                the spent window resets) and the ``budget`` that ran out.
        """
        if not self._by_subject:
            return
        wanted = set(units)
        limits = [limit for limit in self._applying(tenant, key) if limit.unit in wanted]
        if not limits:
            return
        now = self._clock()
        refusal: tuple[_Limit, Window, int] | None = None
        for limit in limits:
            current = window(limit.period, now)
            spent = self.counters.spent(limit.counter(current), current.ends_at)
            # Of several spent budgets, the one that resets last decides the wait.
            if spent >= limit.amount and (refusal is None or current.ends_at > refusal[1].ends_at):
                refusal = (limit, current, spent)
        if refusal is None:
            return
        limit, current, spent = refusal
        wait = max(1.0, math.ceil(current.ends_at - now))
        field, words, scale = _SHOWN[limit.unit]
        amount: float = limit.amount if scale == 1 else limit.amount / scale
        used: float = spent if scale == 1 else spent / scale
        raise PoolError(
            "budget_exceeded",
            f"{limit.subject} {limit.name!r} has spent its budget of {amount} {words}"
            f" per {limit.period} ({current.id}, UTC)",
            retry_after_s=wait,
            details={
                "budget": {
                    limit.subject: limit.name,
                    "period": limit.period,
                    "window": current.id,
                    f"limit_{field}": amount,
                    f"spent_{field}": used,
                    "resets_at": int(current.ends_at),
                }
            },
        )

    def current_windows(self) -> set[tuple[Subject, float]]:
        """Each budget's subject kind and the start of its current window: the spending
        :meth:`restore` needs."""
        now = self._clock()
        return {
            (subject, window(limit.period, now).starts_at)
            for (subject, _), limits in self._by_subject.items()
            for limit in limits
        }

    def restore(self, spent: Mapping[tuple[Subject, float], Mapping[str, Spent]]) -> None:
        """Count what was spent in the current windows before this pool started: for
        each of :meth:`current_windows`, what each key or tenant name used since then
        (from the usage database). Local counters only: shared ones were never lost."""
        if not isinstance(self.counters, LocalCounters):
            return
        now = self._clock()
        for (subject, name), limits in self._by_subject.items():
            for limit in limits:
                current = window(limit.period, now)
                used = spent.get((subject, current.starts_at), {}).get(name, Spent())
                amount = used.of(limit.unit)
                if amount > 0:
                    self.counters.add(limit.counter(current), amount, current.ends_at)

    def charge(self, tenant: str, key: str | None, used: Spent) -> None:
        """Count what a finished request (or a load it caused) used."""
        if not self._by_subject:
            return
        limits = self._applying(tenant, key)
        if not limits:
            return
        now = self._clock()
        for limit in limits:
            amount = used.of(limit.unit)
            if amount > 0:
                current = window(limit.period, now)
                self.counters.add(limit.counter(current), amount, current.ends_at)
