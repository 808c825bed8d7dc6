"""Budget counters shared by the pools of a cluster, in Redis (docs/operations.md).

Each budget window is one Redis integer (``Keys.tokens_spent``): a pool adds what its
finished requests spent with ``INCRBY`` and sets the key to expire a day after its
window ends, so old windows clean themselves up. The admission check must never wait
on Redis, so it reads a local copy: a pool's own spending is added to the copy at once
and sent in the background; what the other pools spent arrives with the next refresh
(``engine.cluster.budget_refresh_s``). A budget can therefore be overshot by what the
cluster spends within one refresh, besides the requests in flight.

While Redis is unreachable the pool goes on enforcing budgets with what it knows and
keeps its unsent spending, which it sends once Redis answers again. Each piece of
spending is sent under a number (rising per sender, a node's boot) and added by a script
that adds a number once (``ADD_ONCE``): a piece whose reply was lost -- Redis stopped
with the command in its socket, and ran it after the sender gave up -- is sent again,
alone and under its own number, so it is never counted twice.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from typing import TYPE_CHECKING

import trio

from pool.cluster._keys import Keys
from pool.cluster._redis import RedisUnavailable, call
from pool.cluster._scripts import ADD_ONCE

if TYPE_CHECKING:
    import coredis

log = logging.getLogger("pool.cluster")

# Keep a window's key this long past its end (a late INCRBY never resurrects it forever).
_EXPIRY_GRACE_S = 86400


class SharedBudgetCounters:
    """:class:`pool.actors.BudgetCounters` on a Redis shared by every pool of the cluster.

    Run :meth:`run` in a nursery for as long as the pool serves.
    """

    def __init__(
        self, client: coredis.Redis[str], keys: Keys, refresh_s: float, *, sender: str
    ) -> None:
        self.client = client
        self.keys = keys
        self.refresh_s = refresh_s
        # Who adds (unique per boot: a restarted pool numbers its pieces afresh).
        self.sender = sender
        self._add_once = client.register_script(ADD_ONCE)
        self._numbers = itertools.count(1)
        self._known: dict[str, int] = {}
        # Spending not yet sent: counter -> (tokens, expires_at).
        self._unsent: dict[str, tuple[int, float]] = {}
        # Pieces sent whose reply has not come: counter -> (number, tokens, expires_at).
        # Each goes again as it was until Redis answers it; new spending waits in
        # _unsent meanwhile, so a number always stands for the same tokens.
        self._in_flight: dict[str, tuple[int, int, float]] = {}
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
        """Send what was not answered before, then what came since; stops (raising
        RedisUnavailable) at the first piece Redis does not answer."""
        for counter in list(self._in_flight):
            await self._send_piece(counter)
        for counter, (tokens, expires_at) in list(self._unsent.items()):
            del self._unsent[counter]
            self._in_flight[counter] = (next(self._numbers), tokens, expires_at)
            await self._send_piece(counter)

    async def _send_piece(self, counter: str) -> None:
        number, tokens, expires_at = self._in_flight[counter]
        keys = [self.keys.tokens_spent(counter), self.keys.tokens_applied(counter)]
        args = [self.sender, str(number), str(tokens), str(math.ceil(expires_at) + _EXPIRY_GRACE_S)]
        total = int(await call(self._add_once(keys=keys, args=args)))
        del self._in_flight[counter]
        # What the cluster counted, ours included (sent now or before).
        self._known[counter] = max(self._known.get(counter, 0), total)

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
