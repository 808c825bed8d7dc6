"""The lease ledger: who holds how much memory on which GPU, shared through Redis.

Every GPU user of a machine (pools, training jobs, other services) takes a lease before
it allocates and holds it while it uses the memory. A lease names its holder, one or
more GPUs of one host with the MiB on each, a purpose, and expires unless renewed.
Taking one is a Lua script (``_scripts.ACQUIRE``): it checks each GPU's budget against
the live leases and the caller's NVML reading, and writes the lease only if every GPU
has room, so two holders can never both get the last room. The GPUs of a lease are
taken in index order (the seed's rule; inside one script it is also all or nothing).

Used by the pool (``PoolLeases``), the CLI (``llm-pool lease``) and any Python program::

    async with open_ledger("redis://127.0.0.1:6379") as ledger:
        async with hold_lease(ledger, holder="trainer", host="box1", gpus={0: 20_000}):
            ...  # the pool sees these 20 GB as taken while this block runs
"""

from __future__ import annotations

import json
import math
import secrets
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import trio

from pool.cluster._keys import Keys
from pool.cluster._redis import RedisUnavailable, call, open_redis
from pool.cluster._scripts import ACQUIRE, RELEASE, USAGE

if TYPE_CHECKING:
    import coredis

DEFAULT_TTL_S = 15.0


@dataclass(frozen=True, slots=True)
class Lease:
    """One lease as the ledger holds it."""

    id: str
    holder: str
    host: str
    # (GPU index, MiB) in index order.
    gpus: tuple[tuple[int, int], ...]
    purpose: str = ""
    ttl_s: float = DEFAULT_TTL_S
    # Milliseconds left before it expires, when read from the ledger.
    expires_in_ms: int | None = None
    acquired_ms: int | None = None

    @property
    def mib(self) -> int:
        return sum(mib for _, mib in self.gpus)

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "holder": self.holder,
            "host": self.host,
            "gpus": [{"index": i, "mib": m} for i, m in self.gpus],
            "purpose": self.purpose,
            "ttl_s": self.ttl_s,
            "expires_in_ms": self.expires_in_ms,
            "acquired_ms": self.acquired_ms,
        }


class LeaseRefused(Exception):
    """A GPU had no room for the lease; nothing was taken."""

    def __init__(self, gpu: int, reason: str, leased_mib: int, limit_mib: int, mib: int) -> None:
        self.gpu = gpu
        self.reason = reason
        self.leased_mib = leased_mib
        self.limit_mib = limit_mib
        if reason == "budget":
            message = (
                f"GPU {gpu}: {mib} MiB asked, {leased_mib} MiB leased by others,"
                f" budget {limit_mib} MiB"
            )
        else:
            message = f"GPU {gpu}: {mib} MiB asked, {limit_mib} MiB free by the GPU's reading"
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class Usage:
    """A live lease's share of one GPU."""

    gpu: int
    lease_id: str
    mib: int
    holder: str


def new_lease_id(holder: str) -> str:
    return f"{holder}/{secrets.token_hex(4)}"


def _ttl_ms(ttl_s: float) -> int:
    return max(1, math.ceil(ttl_s * 1000))


@dataclass
class LeaseLedger:
    """The ledger's commands on one Redis client. Every method may raise
    :class:`RedisUnavailable`."""

    client: coredis.Redis[str]
    keys: Keys = field(default_factory=Keys)
    ttl_s: float = DEFAULT_TTL_S

    def __post_init__(self) -> None:
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)
        self._usage = self.client.register_script(USAGE)

    async def acquire(
        self,
        *,
        holder: str,
        host: str,
        gpus: Mapping[int, int],
        purpose: str = "",
        ttl_s: float | None = None,
        lease_id: str | None = None,
        budgets: Mapping[int, int] | None = None,
        free: Mapping[int, int] | None = None,
        force: bool = False,
    ) -> Lease:
        """Take a lease of ``gpus`` (GPU index -> MiB) on ``host``, all or nothing.

        Args:
            budgets: MiB each GPU may lease out in all; a GPU not named here uses the
                budget stored for ``host`` (:meth:`set_budgets`), or has none.
            free: MiB free on each GPU by the caller's NVML reading, checked too.
            lease_id: take or resize this lease (its own old size does not count).
            force: write it whatever the budgets say (memory already in use that the
                ledger lost, e.g. after Redis restarted).

        Raises:
            LeaseRefused: some GPU has no room; nothing was taken.
        """
        if not gpus:
            raise ValueError("a lease needs at least one GPU")
        lease_id = lease_id or new_lease_id(holder)
        ttl_s = self.ttl_s if ttl_s is None else ttl_s
        order = sorted(gpus)  # the seed's rule: GPUs in index order
        keys = [self.keys.lease(lease_id), self.keys.budgets(host)]
        keys += [self.keys.gpu(host, index) for index in order]
        args: list[str | int] = [
            self.keys.lease_prefix,
            lease_id,
            holder,
            purpose,
            host,
            _ttl_ms(ttl_s),
            "1" if force else "0",
            self.keys.events,
        ]
        for index in order:
            budget = (budgets or {}).get(index, -1)
            args += [index, int(gpus[index]), int(budget), int((free or {}).get(index, -1))]
        reply: list[Any] = await call(self._acquire(keys=keys, args=args))
        if int(reply[0]) != 1:
            gpu, reason, leased, limit = int(reply[1]), str(reply[2]), int(reply[3]), int(reply[4])
            raise LeaseRefused(gpu, reason, leased, limit, int(gpus[gpu]))
        return Lease(
            id=lease_id,
            holder=holder,
            host=host,
            gpus=tuple((i, int(gpus[i])) for i in order),
            purpose=purpose,
            ttl_s=ttl_s,
            acquired_ms=int(reply[1]),
        )

    async def renew(self, lease: Lease) -> bool:
        """Push the lease's expiry ``ttl_s`` out again; False when it has already expired
        (or was released): the caller must take it anew."""
        key = self.keys.lease(lease.id)
        return bool(await call(self.client.pexpire(key, _ttl_ms(lease.ttl_s))))

    async def release(self, lease: Lease | str) -> bool:
        """Drop a lease (a :class:`Lease`, or an id: then it is read first). False when
        it was not there any more."""
        if isinstance(lease, str):
            found = await self.get(lease)
            if found is None:
                return False
            lease = found
        keys = [self.keys.lease(lease.id)] + [self.keys.gpu(lease.host, i) for i, _ in lease.gpus]
        args = [lease.id, self.keys.events, lease.host]
        return bool(await call(self._release(keys=keys, args=args)))

    async def get(self, lease_id: str) -> Lease | None:
        key = self.keys.lease(lease_id)
        fields = await call(self.client.hgetall(key))
        if not fields:
            return None
        return _lease_from(fields, await call(self.client.pttl(key)))

    async def list_leases(self, host: str | None = None) -> list[Lease]:
        """Every live lease (of ``host`` only, if given), by host, then id."""
        leases = []
        for key in await scan_keys(self.client, self.keys.lease_prefix + "*"):
            fields = await call(self.client.hgetall(key))
            if fields and (host is None or fields.get("host") == host):
                leases.append(_lease_from(fields, await call(self.client.pttl(key))))
        return sorted(leases, key=lambda lease: (lease.host, lease.id))

    async def usage(self, host: str, gpus: Iterable[int]) -> list[Usage]:
        """The live leases' shares of ``host``'s ``gpus``."""
        order = sorted(gpus)
        if not order:
            return []
        keys = [self.keys.gpu(host, i) for i in order]
        args = [self.keys.lease_prefix, *(str(i) for i in order)]
        flat: list[Any] = await call(self._usage(keys=keys, args=args))
        return [
            Usage(int(flat[i]), str(flat[i + 1]), int(flat[i + 2]), str(flat[i + 3]))
            for i in range(0, len(flat), 4)
        ]

    async def set_budgets(self, host: str, budgets: Mapping[int, int]) -> None:
        """Store the MiB each of ``host``'s GPUs may lease out (used by acquirers that
        name no budget, such as the CLI)."""
        if budgets:
            mapping = {str(i): str(m) for i, m in budgets.items()}
            await call(self.client.hset(self.keys.budgets(host), mapping))

    async def wait_for_change(self, timeout_s: float) -> None:
        """Return at the next lease or node event (or after ``timeout_s``)."""
        with trio.move_on_after(timeout_s):
            try:
                async with self.client.pubsub(channels=[self.keys.events]) as pubsub:
                    async for message in pubsub:
                        if message.get("type") == "message":
                            return
            # Leaving a subscription while cancelled can raise coredis's cleanup errors
            # beside the Cancelled (which go on); a failure just ends the wait.
            except* Exception:  # noqa: BLE001
                pass

    async def acquire_waiting(self, timeout_s: float, **kwargs: Any) -> Lease:
        """:meth:`acquire`, retried at every lease change until ``timeout_s`` has passed
        (the last refusal is raised then)."""
        deadline = trio.current_time() + timeout_s
        while True:
            try:
                return await self.acquire(**kwargs)
            except LeaseRefused:
                left = deadline - trio.current_time()
                if left <= 0:
                    raise
                # Expiries publish nothing: look again at least every second.
                await self.wait_for_change(min(left, 1.0))


async def scan_keys(client: coredis.Redis[str], pattern: str) -> list[str]:
    """Every key matching ``pattern`` (SCAN, so Redis never blocks on a big keyspace)."""

    async def collect() -> list[str]:
        return [key async for key in client.scan_iter(match=pattern, count=500)]

    return await call(collect())


def _lease_from(fields: Mapping[str, str], pttl: int) -> Lease:
    gpus = json.loads(fields.get("gpus") or "[]")
    return Lease(
        id=fields.get("id", ""),
        holder=fields.get("holder", ""),
        host=fields.get("host", ""),
        gpus=tuple((int(i), int(m)) for i, m in gpus),
        purpose=fields.get("purpose", ""),
        expires_in_ms=pttl if pttl >= 0 else None,
        acquired_ms=int(fields["acquired_ms"]) if fields.get("acquired_ms") else None,
    )


@asynccontextmanager
async def open_ledger(
    redis_url: str,
    *,
    prefix: str = "llm-pool",
    ttl_s: float = DEFAULT_TTL_S,
    timeout_s: float = 2.0,
) -> AsyncIterator[LeaseLedger]:
    """A :class:`LeaseLedger` on its own Redis connection, for the life of the block."""
    async with open_redis(redis_url, timeout_s=timeout_s) as client:
        yield LeaseLedger(client, Keys(prefix), ttl_s)


@asynccontextmanager
async def hold_lease(
    ledger: LeaseLedger,
    *,
    holder: str,
    host: str,
    gpus: Mapping[int, int],
    purpose: str = "",
    ttl_s: float | None = None,
    wait_s: float = 0.0,
) -> AsyncIterator[Lease]:
    """Take a lease (waiting up to ``wait_s`` for room), renew it every third of its
    time to live while the block runs, and release it on the way out.

    Raises:
        LeaseRefused: no room within ``wait_s``.
    """
    kwargs: dict[str, Any] = {
        "holder": holder,
        "host": host,
        "gpus": gpus,
        "purpose": purpose,
        "ttl_s": ttl_s,
    }
    lease = await ledger.acquire_waiting(wait_s, **kwargs)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_keep_renewed, ledger, lease)
            yield lease
            nursery.cancel_scope.cancel()
    finally:
        # Unreachable Redis: the lease expires on its own.
        with trio.CancelScope(shield=True), trio.move_on_after(5), suppress(RedisUnavailable):
            await ledger.release(lease)


async def _keep_renewed(ledger: LeaseLedger, lease: Lease) -> None:
    while True:
        await trio.sleep(lease.ttl_s / 3)
        try:
            if not await ledger.renew(lease):
                # Lost (Redis restarted, or a long outage): the memory is still in use.
                await ledger.acquire(
                    holder=lease.holder,
                    host=lease.host,
                    gpus=dict(lease.gpus),
                    purpose=lease.purpose,
                    ttl_s=lease.ttl_s,
                    lease_id=lease.id,
                    force=True,
                )
        except RedisUnavailable:
            continue
