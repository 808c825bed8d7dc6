"""The names of every Redis key and channel the cluster uses (docs/cluster.md lists them).

All start with ``engine.cluster.key_prefix`` so several clusters can share one Redis.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "llm-pool"

    @property
    def events(self) -> str:
        """The pub/sub channel of lease and node changes."""
        return f"{self.prefix}:events"

    @property
    def lease_prefix(self) -> str:
        return f"{self.prefix}:lease:"

    def lease(self, lease_id: str) -> str:
        """One lease: a hash that expires unless its holder renews it."""
        return f"{self.lease_prefix}{lease_id}"

    def gpu(self, host: str, index: int) -> str:
        """One GPU's index of leases: lease id -> MiB (entries of expired leases are
        dropped by the next acquire on that GPU)."""
        return f"{self.prefix}:gpu:{host}:{index}"

    def budgets(self, host: str) -> str:
        """MiB each GPU of ``host`` may lease out: GPU index -> MiB (pools write it)."""
        return f"{self.prefix}:budget:{host}"

    @property
    def node_prefix(self) -> str:
        return f"{self.prefix}:node:"

    def node(self, node_id: str) -> str:
        """A node's registration: JSON that expires unless the node renews it."""
        return f"{self.node_prefix}{node_id}"

    def epoch(self, node_id: str) -> str:
        """A node's boot counter (INCR at every start)."""
        return f"{self.prefix}:epoch:{node_id}"

    def tokens_spent(self, counter: str) -> str:
        """Tokens one budget window has counted, cluster-wide (INCRBY; expires after
        the window): ``counter`` is ``key|tenant:<name>:day|month:<window>``."""
        return f"{self.prefix}:tokens:{counter}"

    def tokens_applied(self, counter: str) -> str:
        """Per sender, the number of the last piece of spending added to
        :meth:`tokens_spent` (a hash, expiring with it): a piece sent again after its
        reply was lost is not added twice."""
        return f"{self.prefix}:tokens-applied:{counter}"

    def load_lock(self, model: str) -> str:
        """Held (with expiry) by the one node that loads ``model`` for the cluster."""
        return f"{self.prefix}:loadlock:{model}"
