"""``GET /v1/admin/events``: the admin state pushed as Server-Sent Events.

One long response replaces polling: the dashboard and ``llm-pool events`` hold it open
and get a ``state`` event whenever what they show changes. A state change of any model
(load, unload, failure, going idle) is pushed at once; counters that move without one
(queue depth, in flight, pull progress, GPU readings) are looked at once a second. A
busy pool still sends at most a few events a second, and an unchanged one sends only a
keep-alive comment now and then. Each residency decision made while the stream is open
(a placement, eviction, wait, refusal...: ``GET /v1/admin/decisions``) follows as a
``decision`` event of its own, oldest first.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator

import trio

from pool.actors import Pool
from pool.http._common import dumps
from pool.http.admin._render import admin_state

STATE_EVENT = "state"


DECISION_EVENT = "decision"


# Counters that move without a state change are re-read this often.
_TICK_S = 1.0


# However busy the pool, state events are at least this far apart.
_MIN_GAP_S = 0.25


# An unchanged pool still writes something this often: a client (or a proxy) sees the
# stream is alive, and the server notices a client that has gone.
_KEEPALIVE_S = 15.0


def _event(name: str, payload: bytes) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


async def state_events(pool: Pool) -> AsyncIterator[bytes]:
    """The stream: the state at once, then each change; it ends when the pool shuts down
    (an open stream must not hold up a graceful shutdown)."""
    yield b"retry: 2000\n\n"  # for EventSource clients: reconnect after 2 s
    sent: bytes | None = None
    sent_at = -math.inf
    latest = pool.decisions(limit=1)
    decided = latest[0].seq if latest else 0
    while True:
        payload = dumps(admin_state(pool))
        now = trio.current_time()
        if payload != sent:
            yield _event(STATE_EVENT, payload)
            sent, sent_at = payload, now
        elif now - sent_at >= _KEEPALIVE_S:
            yield b": keep-alive\n\n"
            sent_at = now
        for decision in reversed([d for d in pool.decisions() if d.seq > decided]):
            yield _event(DECISION_EVENT, dumps(decision.as_json()))
            decided = decision.seq
        if pool.shutting_down:
            return
        with trio.move_on_after(_TICK_S):
            await pool.wait_change()
        # A burst of changes (many short requests) becomes one event per gap.
        await trio.sleep_until(max(trio.current_time(), sent_at + _MIN_GAP_S))
