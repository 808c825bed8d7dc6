"""Budget counters shared by the pools of a cluster, in Redis (docs/operations.md).

Each budget window is one Redis integer (``Keys.tokens_spent``): a pool adds what its
finished requests spent with ``INCRBY`` and sets the key to expire a day after its
window ends, so old windows clean themselves up. The admission check must never wait
on Redis, so it reads a local copy: a pool's own spending is added to the copy at once
and sent in the background; what the other pools spent arrives with the next refresh
(``engine.cluster.budget_refresh_s``). A budget can therefore be overshot by what the
cluster spends within one refresh, besides the requests in flight.

While Redis is unreachable the pool goes on enforcing budgets with what it knows and
keeps its unsent spending, which it sends once Redis answers again.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

import trio

from pool.cluster._keys import Keys
from pool.cluster._redis import RedisUnavailable, call

if TYPE_CHECKING:
    import coredis

log = logging.getLogger("pool.cluster")

# Keep a window's key this long past its end (a late INCRBY never resurrects it forever).
_EXPIRY_GRACE_S = 86400


class SharedBudgetCounters:
    """:class:`pool.actors.BudgetCounters` on a Redis shared by every pool of the cluster.

    Run :meth:`run` in a nursery for as long as the pool serves.
    """

    def __init__(self, client: coredis.Redis[str], keys: Keys, refresh_s: float) -> None:
        self.client = client
        self.keys = keys
        self.refresh_s = refresh_s
        self._known: dict[str, int] = {}
        # Spending not yet sent: counter -> (tokens, expires_at).
        self._unsent: dict[str, tuple[int, float]] = {}
        # Counters the budgets check, with the end of their window: each refresh reads
        # these, and forgets those whose window has ended.
        self._watched: dict[str, float] = {}
        self._wake = trio.Event()
        self.online = True

    # -- BudgetCounters ----------------------------------------------------------------
    def spent(self, counter: str, expires_at: float) -> int:
        if counter not in self._watched:
            self._watched[counter] = expires_at
            self._wake.set()  # read it now rather than after a whole refresh period
        return self._known.get(counter, 0)

    def add(self, counter: str, tokens: int, expires_at: float) -> None:
        self._known[counter] = self._known.get(counter, 0) + tokens
        before, _ = self._unsent.get(counter, (0, expires_at))
        self._unsent[counter] = (before + tokens, expires_at)
        self._watched[counter] = expires_at
        self._wake.set()

    # -- the background task --------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            with trio.move_on_after(self.refresh_s):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                await self._send()
                await self._refresh()
            except RedisUnavailable as exc:
                if self.online:
                    log.warning("budget counters: Redis unreachable, counting locally: %s", exc)
                self.online = False
                continue
            if not self.online:
                log.info("budget counters: Redis answers again")
            self.online = True

    async def _send(self) -> None:
        unsent, self._unsent = self._unsent, {}
        try:
            for counter, (tokens, expires_at) in list(unsent.items()):
                key = self.keys.tokens_spent(counter)
                total = int(await call(self.client.incrby(key, tokens)))
                await call(self.client.expireat(key, math.ceil(expires_at) + _EXPIRY_GRACE_S))
                # What the cluster counted, ours included (sent now or before).
                self._known[counter] = max(self._known.get(counter, 0), total)
                del unsent[counter]
        finally:
            # Whatever was not sent goes back, merged with what came meanwhile.
            for counter, (tokens, expires_at) in unsent.items():
                later, _ = self._unsent.get(counter, (0, expires_at))
                self._unsent[counter] = (tokens + later, expires_at)

    async def _refresh(self) -> None:
        now = time.time()
        for counter in [c for c, ends in self._watched.items() if ends <= now]:
            del self._watched[counter]
            self._known.pop(counter, None)
        watched = list(self._watched)
        if not watched:
            return
        values = await call(self.client.mget([self.keys.tokens_spent(c) for c in watched]))
        for counter, value in zip(watched, values, strict=True):
            if value is not None:
                # Never below what this pool counted itself (some of it may be unsent).
                self._known[counter] = max(self._known.get(counter, 0), int(value))
