"""The pool's leases in the shared ledger: claimed before each load, renewed while the
model holds memory, released when it no longer does, re-asserted after Redis lost them.

The pool calls :meth:`PoolLeases.claim` from its VRAM gate and :meth:`PoolLeases.poke`
on every change; :meth:`PoolLeases.run` does the rest in the background. While Redis
cannot be reached the pool goes by its own gate alone (``online`` False, ``error``
says why) and puts its leases back when Redis answers again.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Mapping

import trio

from pool.actors import LedgerBinding
from pool.cluster._ledger import Lease, LeaseLedger, LeaseRefused
from pool.cluster._redis import RedisUnavailable

log = logging.getLogger("pool.cluster")


class PoolLeases:
    """The pool's :class:`pool.actors.SharedLedger` on a :class:`LeaseLedger`."""

    def __init__(self, ledger: LeaseLedger, *, holder: str, host: str, renew_s: float) -> None:
        self.ledger = ledger
        self.holder = holder
        self.host = host
        self.renew_s = renew_s
        self.online = False
        self.error: str | None = "not connected yet"
        self._pool: LedgerBinding | None = None
        self._bound = trio.Event()
        self._poked = trio.Event()
        self._others: dict[int, int] = {}
        self._held: dict[str, Lease] = {}
        self._serial = itertools.count(1)
        self._budgets_stored: dict[int, int] | None = None
        # Set when Redis answers after an outage (the node's registry listens too).
        self.reconnected = trio.Event()

    # -- the SharedLedger protocol --------------------------------------------------------
    def bind(self, pool: LedgerBinding) -> None:
        self._pool = pool
        self._bound.set()

    def others_mib(self) -> Mapping[int, int]:
        return self._others

    def poke(self) -> None:
        self._poked.set()

    async def claim(
        self, model: str, mib_per_gpu: Mapping[int, int], free: Mapping[int, int]
    ) -> str | None:
        budgets = self._pool.budgets() if self._pool is not None else {}
        try:
            lease = await self.ledger.acquire(
                holder=self.holder,
                host=self.host,
                gpus=mib_per_gpu,
                purpose=f"model {model}",
                lease_id=self._lease_id(model),
                budgets={i: budgets[i] for i in mib_per_gpu if i in budgets},
                free=free,
            )
        except LeaseRefused as exc:
            await self._refresh_others()
            return str(exc)
        except RedisUnavailable as exc:
            self._went_offline(exc)
            return None  # the local gate alone decides; the lease is put back later
        self._came_online()
        log.debug("cluster: %s took lease %s %s", self.holder, lease.id, lease.gpus)
        old = self._held.get(model)
        self._held[model] = lease
        if old is not None:
            self._poked.set()  # not expected; the next sync drops what is not wanted
        return None

    # -- the background work --------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Renew, release, re-assert and follow other holders, until cancelled."""
        task_status.started()
        await self._bound.wait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_events)
            while True:
                await self.sync()
                with trio.move_on_after(self.renew_s):
                    await self._poked.wait()
                self._poked = trio.Event()

    async def sync(self) -> None:
        """Bring the ledger in line with what the pool holds, once."""
        if self._pool is None:
            return
        try:
            await self._store_budgets()
            wanted = {
                model: {i: mib for i, mib in gpus.items() if mib > 0}
                for model, gpus in self._pool.holdings().items()
            }
            for model, old in list(self._held.items()):
                if model not in wanted:
                    log.debug("cluster: %s releases lease %s", self.holder, old.id)
                    await self.ledger.release(old)
                    if self._held.get(model) is old:
                        del self._held[model]
            for model, gpus in wanted.items():
                lease = self._held.get(model)
                # A lease never shrinks below what its claim was granted: a measured
                # footprint can come out low (an unload of the pool's that overlapped the
                # load), and shrinking would hand memory still in use to other holders.
                size = dict(lease.gpus) if lease is not None else {}
                for index, mib in gpus.items():
                    size[index] = max(size.get(index, 0), mib)
                if not size:
                    continue
                if lease is None or dict(lease.gpus) != size or not await self.ledger.renew(lease):
                    # Lost (expired during an outage, Redis restarted), never taken (the
                    # claim found Redis down), or measured larger: the memory is in use
                    # either way, so the lease is written whatever the budget.
                    log.debug("cluster: %s re-asserts %s as %s", self.holder, lease, size)
                    self._held[model] = await self.ledger.acquire(
                        holder=self.holder,
                        host=self.host,
                        gpus=size,
                        purpose=f"model {model}",
                        lease_id=lease.id if lease is not None else self._lease_id(model),
                        force=True,
                    )
            await self._refresh_others()
        except RedisUnavailable as exc:
            self._went_offline(exc)

    async def release_all(self) -> None:
        """Drop every lease of this pool (at shutdown)."""
        for model, lease in list(self._held.items()):
            try:
                await self.ledger.release(lease)
            except RedisUnavailable:
                return  # they expire on their own
            self._held.pop(model, None)

    def held(self) -> dict[str, Lease]:
        return dict(self._held)

    # -- helpers ---------------------------------------------------------------------------
    def _lease_id(self, model: str) -> str:
        return f"{self.holder}/{model}/{next(self._serial)}"

    async def _store_budgets(self) -> None:
        assert self._pool is not None
        budgets = dict(self._pool.budgets())
        if budgets != self._budgets_stored:
            await self.ledger.set_budgets(self.host, budgets)
            self._budgets_stored = budgets

    async def _refresh_others(self) -> None:
        if self._pool is None:
            return
        try:
            usage = await self.ledger.usage(self.host, self._pool.budgets())
        except RedisUnavailable as exc:
            self._went_offline(exc)
            return
        self._came_online()
        others: dict[int, int] = {}
        for share in usage:
            if share.holder != self.holder:
                others[share.gpu] = others.get(share.gpu, 0) + share.mib
        if others != self._others:
            self._others = others
            self._pool.changed()

    async def _follow_events(self) -> None:
        """Other holders' lease changes on this host, at once (expiries show up at the
        next renewal round: Redis publishes nothing for them without keyspace events)."""
        while True:
            try:
                async with self.ledger.client.pubsub(channels=[self.ledger.keys.events]) as sub:
                    async for message in sub:
                        if message.get("type") == "message" and self._concerns_us(
                            str(message.get("data", ""))
                        ):
                            await self._refresh_others()
            # except*: leaving a subscription while cancelled can raise a group of
            # Cancelled and coredis's own cleanup errors; the Cancelled go on.
            except* Exception as exc:  # noqa: BLE001 - any failure: resubscribe later
                log.debug("cluster: lease events: %s", exc)
            await trio.sleep(self.renew_s)

    def _concerns_us(self, data: str) -> bool:
        try:
            event = json.loads(data)
        except ValueError:
            return False
        return (
            isinstance(event, dict)
            and event.get("kind") == "lease"
            and event.get("host") == self.host
            and not str(event.get("id", "")).startswith(self.holder + "/")
        )

    def _went_offline(self, exc: Exception) -> None:
        if self.online or self.error is None or self.error.startswith("not connected"):
            log.warning("cluster: Redis unreachable, the pool goes by its own gate: %s", exc)
        self.online = False
        self.error = f"Redis unreachable: {exc}"

    def _came_online(self) -> None:
        if not self.online:
            log.info("cluster: Redis reachable, leases shared")
            self.online = True
            self.error = None
            self._poked.set()  # put back what the outage lost
            self.reconnected.set()
            self.reconnected = trio.Event()
