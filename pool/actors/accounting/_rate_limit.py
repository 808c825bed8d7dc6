"""Per-tenant and per-key rate limits with GCRA (the generic cell rate algorithm).

GCRA keeps one number per tenant and limit, the theoretical arrival time (TAT), so a
check is O(1) and a tenant over its limit costs the others nothing: it is refused at
admission, before it reaches any queue. Requests are charged when admitted; tokens
(prompt plus output) when the request finishes, so a tenant that burned through its
token budget is refused until the budget has refilled.

A key's ``rate_limit_rpm`` (``service.auth.keys``) is one more request cell, kept by
the key's name: it allows the minute's requests at once, then refills evenly. A request
must conform to both its key's and its tenant's cells, and is charged to both only if
it does, so a refusal by one costs nothing in the other.

Times come from the Trio clock, so tests can drive the limiter with ``autojump_clock``.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import trio

from pool.config import TenancySettings, TenantLimits
from pool.errors import PoolError


@dataclass(slots=True)
class _Cell:
    """One GCRA limiter: ``interval`` seconds per unit, ``tolerance`` seconds of burst."""

    interval: float
    tolerance: float
    tat: float = 0.0

    def delay(self, now: float) -> float:
        """Seconds until one more unit conforms (0 if it conforms now)."""
        return max(0.0, max(self.tat, now) - self.tolerance - now)

    def charge(self, now: float, units: float) -> None:
        self.tat = max(self.tat, now) + units * self.interval

    def remaining(self, now: float) -> int:
        """Units that would still conform right now."""
        return max(0, math.floor((self.tolerance - (max(self.tat, now) - now)) / self.interval) + 1)

    def reset_after(self, now: float) -> float:
        """Seconds until the full burst is available again."""
        return max(0.0, self.tat - now)


@dataclass(slots=True)
class _TenantState:
    requests: _Cell | None
    tokens: _Cell | None
    limits: TenantLimits


@dataclass(slots=True)
class _KeyState:
    cell: _Cell
    per_minute: float


class RateLimiter:
    """Admission checks for every tenant and key of the pool."""

    def __init__(self, settings: TenancySettings) -> None:
        self._settings = settings
        self._states: OrderedDict[str, _TenantState] = OrderedDict()
        self._keys: OrderedDict[str, _KeyState] = OrderedDict()

    def limits_for(self, tenant: str) -> TenantLimits:
        return self._settings.tenants.get(tenant, self._settings.default)

    def _state(self, tenant: str) -> _TenantState:
        state = self._states.get(tenant)
        if state is None:
            limits = self.limits_for(tenant)
            requests = tokens = None
            if limits.requests_per_minute:
                interval = 60.0 / limits.requests_per_minute
                requests = _Cell(interval, interval * (limits.burst - 1))
            if limits.tokens_per_minute:
                # A token budget of one minute may be spent at once.
                interval = 60.0 / limits.tokens_per_minute
                tokens = _Cell(interval, 60.0 - interval)
            state = _TenantState(requests, tokens, limits)
            self._states[tenant] = state
            if len(self._states) > self._settings.max_tenants_tracked:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(tenant)
        return state

    def _key_cell(self, name: str, per_minute: float) -> _Cell:
        state = self._keys.get(name)
        if state is None or state.per_minute != per_minute:
            # A minute's requests at once (at least one), then one every 60/rpm seconds.
            # A key re-added under the same name with another limit starts afresh.
            interval = 60.0 / per_minute
            state = _KeyState(_Cell(interval, max(0.0, 60.0 - interval)), per_minute)
            self._keys[name] = state
            if len(self._keys) > self._settings.max_tenants_tracked:
                self._keys.popitem(last=False)
        else:
            self._keys.move_to_end(name)
        return state.cell

    def admit(self, tenant: str, key: tuple[str, float] | None = None) -> None:
        """Charge one request to ``tenant`` (and to ``key``) or refuse it.

        Args:
            key: the name and requests-per-minute limit of the key that sent it.

        Raises:
            PoolError: ``rate_limit_exceeded`` (429) with ``Retry-After`` and the
                ``limit``, ``remaining`` and ``resetAt`` (epoch seconds) fields, and
                ``key`` or ``tenant``: whose limit it is.
        """
        key_cell = None
        if key is not None:
            name, limit = key
            key_cell = self._key_cell(name, limit)
            now = trio.current_time()
            _refuse_if_spent(key_cell, now, limit, "key", name, "requests")
        self._admit_tenant(tenant)
        if key_cell is not None:
            key_cell.charge(trio.current_time(), 1)

    def _admit_tenant(self, tenant: str) -> None:
        state = self._state(tenant)
        if state.requests is None and state.tokens is None:
            return
        now = trio.current_time()
        for cell, unit, limit in (
            (state.requests, "requests", state.limits.requests_per_minute),
            (state.tokens, "tokens", state.limits.tokens_per_minute),
        ):
            if cell is None:
                continue
            _refuse_if_spent(cell, now, limit, "tenant", tenant, unit)
        if state.requests is not None:
            state.requests.charge(now, 1)

    def charge_tokens(self, tenant: str, tokens: int) -> None:
        state = self._state(tenant)
        if state.tokens is not None and tokens > 0:
            state.tokens.charge(trio.current_time(), tokens)

    def headers(self, tenant: str) -> dict[str, str]:
        """``X-RateLimit-*`` headers describing the request limit of ``tenant``."""
        state = self._states.get(tenant)
        if state is None:
            # Not charged yet (or forgotten): its whole burst is left. Read without
            # tracking it, so an answer that charged nothing (a 404) evicts no one.
            limits = self.limits_for(tenant)
            if not limits.requests_per_minute:
                return {}
            return {
                "X-RateLimit-Limit": f"{limits.requests_per_minute:g}",
                "X-RateLimit-Remaining": str(limits.burst),
                "X-RateLimit-Reset": str(math.ceil(time.time())),
            }
        if state.requests is None:
            return {}
        now = trio.current_time()
        return {
            "X-RateLimit-Limit": f"{state.limits.requests_per_minute:g}",
            "X-RateLimit-Remaining": str(state.requests.remaining(now)),
            "X-RateLimit-Reset": str(math.ceil(time.time() + state.requests.reset_after(now))),
        }


def _refuse_if_spent(
    cell: _Cell, now: float, limit: float | None, whose: str, name: str, unit: str
) -> None:
    """429 ``rate_limit_exceeded`` when ``cell`` admits nothing now, naming whose limit
    (``key`` or ``tenant``) it is."""
    wait = cell.delay(now)
    if wait > 0:
        raise PoolError(
            "rate_limit_exceeded",
            f"{whose} {name!r} exceeded {limit:g} {unit} per minute",
            retry_after_s=wait,
            details={
                # A whole count, as the spec's body has it (a rate from "/h" rounds).
                "limit": max(1, round(limit or 0)),
                "remaining": 0,
                "reset_at": math.ceil(time.time() + cell.reset_after(now)),
                whose: name,
            },
        )
