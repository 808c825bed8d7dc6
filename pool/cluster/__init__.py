"""Several pools as one, and a GPU lease ledger shared with other GPU users, on Redis.

Turned on by ``engine.cluster.redis_url`` (docs/cluster.md). Needs the ``cluster``
extra (the coredis client); the pool runs without it when the setting is unset.
"""

from pool.cluster._budgets import SharedBudgetCounters
from pool.cluster._keys import Keys
from pool.cluster._ledger import (
    Lease,
    LeaseLedger,
    LeaseRefused,
    Usage,
    hold_lease,
    new_lease_id,
    open_ledger,
)
from pool.cluster._node import ClusterNode, node_name, open_cluster
from pool.cluster._pool_leases import PoolLeases
from pool.cluster._redis import RedisUnavailable, missing_client_reason, open_redis
from pool.cluster._registry import NodeIdInUse
from pool.cluster._routing import ClusterRouter, PeerRoute

__all__ = [
    "ClusterNode",
    "ClusterRouter",
    "Keys",
    "Lease",
    "LeaseLedger",
    "LeaseRefused",
    "NodeIdInUse",
    "PeerRoute",
    "PoolLeases",
    "RedisUnavailable",
    "SharedBudgetCounters",
    "Usage",
    "hold_lease",
    "missing_client_reason",
    "new_lease_id",
    "node_name",
    "open_cluster",
    "open_ledger",
    "open_redis",
]
