"""Token budgets per key or tenant and UTC day or month (``service.budgets``), and
budgets of load seconds per UTC day (``load_seconds_per_day``).

A budget counts the prompt plus output tokens of finished requests in its window (the
UTC day, or the UTC calendar month). A request is checked at admission: once a window's
count has reached its limit, new requests of that key or tenant are refused with 429
``budget_exceeded`` and ``Retry-After`` set to the seconds left until the window
resets. Requests already running finish and are counted, so a budget can be overshot by
what was in flight when it ran out.

The counts live behind :class:`BudgetCounters`: :class:`LocalCounters` for one pool;
with a cluster, ``pool.cluster``'s shared counters (Redis ``INCRBY`` on one key per
window, expiring after it) so several pools enforce one budget. Either way the check
reads a local number and never waits on anything. Local counters start from the usage
database (:meth:`Budgets.restore`), so restarting a pool does not give its budgets back;
shared counters outlive a restart in Redis.

A load-seconds budget counts the seconds of model loading the key's or tenant's
requests caused (each load a request started), in milliseconds on counters of their
own, and refuses the same way once spent: a tenant that keeps swapping models in stops
at its budget while the others go on.

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
# What a limit counts: prompt plus output tokens, or milliseconds of loading caused.
Unit = Literal["tokens", "load_ms"]


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
    tokens: int  # the limit, in ``unit``
    unit: Unit = "tokens"

    def counter(self, current: Window) -> str:
        # Token counters keep their names (shared counters outlive a pool's upgrade).
        kind = "" if self.unit == "tokens" else f"{self.unit}:"
        return f"{self.subject}:{self.name}:{kind}{self.period}:{current.id}"

    def describe(self) -> str:
        if self.unit == "load_ms":
            return f"budget of {self.tokens / 1000:g} load seconds per {self.period}"
        return f"budget of {self.tokens} tokens per {self.period}"


def _limits(rules: Iterable[BudgetRule]) -> list[_Limit]:
    limits: list[_Limit] = []
    for rule in rules:
        subject: Subject = "key" if rule.key is not None else "tenant"
        name = rule.key if rule.key is not None else rule.tenant
        assert name is not None  # BudgetRule names exactly one
        if rule.tokens_per_day is not None:
            limits.append(_Limit(subject, name, "day", rule.tokens_per_day))
        if rule.tokens_per_month is not None:
            limits.append(_Limit(subject, name, "month", rule.tokens_per_month))
        if rule.load_seconds_per_day is not None:
            ms = max(1, round(rule.load_seconds_per_day * 1000))
            limits.append(_Limit(subject, name, "day", ms, "load_ms"))
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

    def check(self, tenant: str, key: str | None) -> None:
        """Refuse a new request whose key or tenant has spent a budget.

        Raises:
            PoolError: ``budget_exceeded`` (429) with ``Retry-After`` (seconds until
                the spent window resets) and the ``budget`` that ran out.
        """
        if not self._by_subject:
            return
        limits = self._applying(tenant, key)
        if not limits:
            return
        now = self._clock()
        refusal: tuple[_Limit, Window, int] | None = None
        for limit in limits:
            current = window(limit.period, now)
            spent = self.counters.spent(limit.counter(current), current.ends_at)
            # Of several spent budgets, the one that resets last decides the wait.
            if spent >= limit.tokens and (refusal is None or current.ends_at > refusal[1].ends_at):
                refusal = (limit, current, spent)
        if refusal is None:
            return
        limit, current, spent = refusal
        wait = max(1.0, math.ceil(current.ends_at - now))
        if limit.unit == "load_ms":
            numbers: dict[str, float | int] = {
                "limit_load_seconds": limit.tokens / 1000,
                "spent_load_seconds": spent / 1000,
            }
        else:
            numbers = {"limit_tokens": limit.tokens, "spent_tokens": spent}
        raise PoolError(
            "budget_exceeded",
            f"{limit.subject} {limit.name!r} has spent its {limit.describe()} ({current.id}, UTC)",
            retry_after_s=wait,
            details={
                "budget": {
                    limit.subject: limit.name,
                    "period": limit.period,
                    "window": current.id,
                    **numbers,
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

    def restore(
        self,
        spent: Mapping[tuple[Subject, float], Mapping[str, int]],
        loaded_ms: Mapping[tuple[Subject, float], Mapping[str, int]] | None = None,
    ) -> None:
        """Count what was spent in the current windows before this pool started: for
        each of :meth:`current_windows`, the tokens (``spent``) and the milliseconds of
        loading caused (``loaded_ms``) per key or tenant name since then (from the usage
        database). Local counters only: shared ones were never lost."""
        if not isinstance(self.counters, LocalCounters):
            return
        now = self._clock()
        for (subject, name), limits in self._by_subject.items():
            for limit in limits:
                current = window(limit.period, now)
                source = spent if limit.unit == "tokens" else (loaded_ms or {})
                tokens = source.get((subject, current.starts_at), {}).get(name, 0)
                if tokens > 0:
                    self.counters.add(limit.counter(current), tokens, current.ends_at)

    def charge(self, tenant: str, key: str | None, tokens: int) -> None:
        """Count a finished request's prompt plus output ``tokens``."""
        if tokens <= 0 or not self._by_subject:
            return
        limits = self._applying(tenant, key)
        if not limits:
            return
        now = self._clock()
        for limit in limits:
            if limit.unit != "tokens":
                continue
            current = window(limit.period, now)
            self.counters.add(limit.counter(current), tokens, current.ends_at)

    def charge_load(self, tenant: str, key: str | None, seconds: float) -> None:
        """Count ``seconds`` of model loading that a request of ``tenant`` (and ``key``)
        caused against their load-seconds budgets."""
        ms = round(seconds * 1000)
        if ms <= 0 or not self._by_subject:
            return
        now = self._clock()
        for limit in self._applying(tenant, key):
            if limit.unit == "load_ms":
                current = window(limit.period, now)
                self.counters.add(limit.counter(current), ms, current.ends_at)
