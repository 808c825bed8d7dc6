"""One pool's membership of the cluster: its Redis connection, its leases, its name.

``serve`` opens it before the pool (the VRAM gate needs the ledger from the first
load on) when ``engine.cluster.redis_url`` is set.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from pool.cluster._keys import Keys
from pool.cluster._ledger import LeaseLedger
from pool.cluster._pool_leases import PoolLeases
from pool.cluster._redis import missing_client_reason, open_redis
from pool.config import Settings
from pool.errors import ConfigError

log = logging.getLogger("pool.cluster")


def node_name(settings: Settings) -> str:
    """``engine.cluster.node_id``, else ``service.runner_id``, else host name and port
    (the process id where the port is picked at bind time)."""
    cluster = settings.engine.cluster
    if cluster.node_id:
        return cluster.node_id
    base = settings.service.runner_id or socket.gethostname()
    port = settings.service.port
    return f"{base}:{port}" if port else f"{base}-{os.getpid()}"


class ClusterNode:
    """What one pool keeps in the cluster."""

    def __init__(self, settings: Settings, ledger: LeaseLedger) -> None:
        cluster = settings.engine.cluster
        self.settings = settings
        self.keys = ledger.keys
        self.client = ledger.client
        self.node_id = node_name(settings)
        self.gpu_host = cluster.gpu_host or socket.gethostname()
        # Unique per boot: a restarted node never takes its old leases for its own.
        self.holder = f"{self.node_id}#{secrets.token_hex(3)}"
        self.leases = PoolLeases(
            ledger, holder=self.holder, host=self.gpu_host, renew_s=cluster.lease_renew_s
        )

    @property
    def online(self) -> bool:
        return self.leases.online

    @property
    def error(self) -> str | None:
        return self.leases.error


@asynccontextmanager
async def open_cluster(settings: Settings) -> AsyncIterator[ClusterNode | None]:
    """The node for ``settings`` (None when ``engine.cluster.redis_url`` is unset).

    Redis need not be up: the node reports itself offline and joins when it answers.
    Leaving the block releases the pool's leases (they would expire anyway).

    Raises:
        ConfigError: the cluster is configured but its client is not installed.
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
        node = ClusterNode(settings, ledger)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.leases.run)
            try:
                yield node
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(cluster.redis_timeout_s):
                    await node.leases.release_all()
                nursery.cancel_scope.cancel()
