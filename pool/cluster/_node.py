"""One pool's membership of the cluster: its Redis connection, its leases, its name.

``serve`` opens it before the pool (the VRAM gate needs the ledger from the first
load on) when ``engine.cluster.redis_url`` is set.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from pool.cluster._budgets import SharedBudgetCounters
from pool.cluster._keys import Keys
from pool.cluster._ledger import LeaseLedger
from pool.cluster._pool_leases import PoolLeases
from pool.cluster._redis import missing_client_reason, open_redis
from pool.cluster._registry import NodeRegistry, describe
from pool.cluster._routing import ClusterRouter
from pool.config import Settings
from pool.errors import ConfigError

if TYPE_CHECKING:
    from pool.actors import LedgerBinding, Pool

log = logging.getLogger("pool.cluster")


def node_name(settings: Settings, port: int | None = None) -> str:
    """``engine.cluster.node_id``, else ``service.runner_id`` (or the host name) and the
    port served: ``port`` where given (``serve`` passes the port it bound, so a
    ``--port`` on the command line and a port picked at bind time count), else
    ``service.port``. With no port known, the process id stands in for it."""
    cluster = settings.engine.cluster
    if cluster.node_id:
        return cluster.node_id
    base = settings.service.runner_id or socket.gethostname()
    port = settings.service.port if port is None else port
    return f"{base}:{port}" if port else f"{base}-{os.getpid()}"


class ClusterNode:
    """What one pool keeps in the cluster: its leases and its registration.

    It is the pool's :class:`pool.actors.SharedLedger` (pass it to ``open_pool``): the
    lease calls go to :class:`PoolLeases`, and every change of the pool also refreshes
    the node's record.
    """

    def __init__(self, settings: Settings, ledger: LeaseLedger, *, port: int | None = None) -> None:
        cluster = settings.engine.cluster
        self.settings = settings
        self.keys = ledger.keys
        self.client = ledger.client
        self.node_id = node_name(settings, port)
        self.gpu_host = cluster.gpu_host or socket.gethostname()
        # Unique per boot: a restarted node never takes its old leases for its own, and
        # its record tells it from another live node under the same id.
        self.boot = secrets.token_hex(3)
        self.holder = f"{self.node_id}#{self.boot}"
        self.leases = PoolLeases(
            ledger, holder=self.holder, host=self.gpu_host, renew_s=cluster.lease_renew_s
        )
        self.registry = NodeRegistry(
            ledger.client,
            ledger.keys,
            node_id=self.node_id,
            boot=self.boot,
            gpu_host=self.gpu_host,
            heartbeat_s=cluster.heartbeat_s,
            node_ttl_s=cluster.node_ttl_s,
        )
        self.router = ClusterRouter(self)
        # Budgets count in Redis so every pool of the cluster enforces the same ones.
        self.budget_counters = SharedBudgetCounters(
            ledger.client, ledger.keys, cluster.budget_refresh_s, sender=self.holder
        )
        self._changed = trio.Event()

    def attach(self, pool: Pool, url: str) -> None:
        """Register ``pool``, reachable at ``url`` (or ``engine.cluster.advertise_url``),
        in the background."""
        self.router.attach(pool)
        self.registry.attach(
            lambda: describe(pool), self.settings.engine.cluster.advertise_url or url
        )

    async def join(self, pool: Pool, url: str) -> None:
        """Register ``pool`` as :meth:`attach` does, writing its record before returning.

        Raises:
            NodeIdInUse: another live node is registered under this node's id.
        """
        self.router.attach(pool)
        await self.registry.join(
            lambda: describe(pool), self.settings.engine.cluster.advertise_url or url
        )

    @property
    def online(self) -> bool:
        """Whether Redis answered the last call of either part."""
        return self.leases.online and (self.registry.online or self.registry.url is None)

    @property
    def error(self) -> str | None:
        return self.leases.error or (self.registry.error if self.registry.url else None)

    def status(self) -> dict[str, Any]:
        """The node's cluster state, for /health and the capabilities."""
        # A node refused its id is out of the cluster while Redis answers it well.
        reachable = self.online or (self.registry.refused is not None and self.leases.online)
        return {
            "node_id": self.node_id,
            "epoch": self.registry.epoch,
            "gpu_host": self.gpu_host,
            "redis": "ok" if reachable else "unreachable",
            "error": None if self.online else self.error,
            "peers": sorted(self.registry.peers),
        }

    # -- the pool's SharedLedger -------------------------------------------------------
    def bind(self, pool: LedgerBinding) -> None:
        self.leases.bind(pool)

    def others_mib(self) -> Mapping[int, int]:
        return self.leases.others_mib()

    async def claim(
        self, model: str, mib_per_gpu: Mapping[int, int], free: Mapping[int, int]
    ) -> str | None:
        return await self.leases.claim(model, mib_per_gpu, free)

    def poke(self) -> None:
        self.leases.poke()
        self.registry.poke()
        self._changed.set()

    async def settle_load_locks(self) -> None:
        """Let the load locks of this node's finished loads go (see ClusterRouter)."""
        while True:
            await self._changed.wait()
            self._changed = trio.Event()
            await self.router.settle_locks()


@asynccontextmanager
async def open_cluster(
    settings: Settings, *, port: int | None = None
) -> AsyncIterator[ClusterNode | None]:
    """The node for ``settings`` (None when ``engine.cluster.redis_url`` is unset).

    Redis need not be up: the node reports itself offline and joins when it answers.
    Leaving the block releases the pool's leases (they would expire anyway).

    Args:
        port: the port the pool serves on, for the default node id (see
            :func:`node_name`).

    Raises:
        ConfigError: the cluster is configured but its client is not installed.
        NodeIdInUse: another live node is registered under this node's id.
    """
    cluster = settings.engine.cluster
    if not cluster.redis_url:
        yield None
        return
    reason = missing_client_reason()
    if reason is not None:
        raise ConfigError([f"engine.cluster.redis_url is set but {reason}"])
    async with open_redis(cluster.redis_url, timeout_s=cluster.redis_timeout_s) as client:
        ledger = LeaseLedger(client, Keys(cluster.key_prefix), cluster.lease_ttl_s)
        node = ClusterNode(settings, ledger, port=port)
        # Before the pool opens: a node refused its id loads nothing and leases nothing.
        await node.registry.check_id()
        async with trio.open_nursery() as nursery:
            await nursery.start(node.leases.run)
            await nursery.start(node.registry.run)
            await nursery.start(node.budget_counters.run)
            nursery.start_soon(node.settle_load_locks)
            try:
                yield node
            finally:
                # Stop renewing first: nothing may write a record or lease back after it
                # is removed.
                nursery.cancel_scope.cancel()
                with trio.CancelScope(shield=True), trio.move_on_after(cluster.redis_timeout_s):
                    await node.registry.leave()
                    await node.leases.release_all()
                    await node.router.aclose()
