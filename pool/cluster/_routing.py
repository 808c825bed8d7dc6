"""Routing: a request for a model this node does not have loaded goes to a peer that does.

The choice, from the node registry's records (docs/cluster.md, "Routing"):

1. Loaded here: served here.
2. Loaded on peers: the one with the fewest requests in flight and queued.
3. Loaded nowhere: one node loads it for the cluster. The candidates are this node and
   the peers that have the model configured on demand; the one with the most room on a
   GPU (room for the model first) and the fewest requests wins. The load lock
   ``P:loadlock:MODEL`` (a Lua script: taken when free or when its holder is no longer
   a live node; expiry ``load_lock_ttl_s``) makes that one node for the whole cluster;
   requests elsewhere go to the holder and wait in its queue while it loads.

The relay is the ``openai_remote`` backend's runtime pointed at the peer's
``/v1/chat/completions``, with the relay header, so the peer serves it itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pool.actors import RELAY_HEADER
from pool.backends.openai_remote import OpenAIRemoteModel, OpenAIRemoteRuntime
from pool.cluster._redis import RedisUnavailable, call

if TYPE_CHECKING:
    from pool.actors import ModelActor, Pool
    from pool.backends import GenerationRequest, GenerationStats, TokenSink
    from pool.cluster._node import ClusterNode

log = logging.getLogger("pool.cluster")

# Take the load lock of a model: free, already ours, or held by a node not in ARGV[3..].
# KEYS[1] the lock; ARGV[1] this node; ARGV[2] ttl ms; ARGV[3..] the live nodes.
# Returns the holder after the call.
TAKE_LOAD_LOCK = """
local holder = redis.call('GET', KEYS[1])
if holder then
  for i = 3, #ARGV do
    if ARGV[i] == holder then return holder end
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return ARGV[1]
"""

# Shorten the load lock to ARGV[2] ms if ARGV[1] holds it (its load is over).
SHORTEN_LOAD_LOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class PeerRoute:
    """One peer's streaming API for one model."""

    def __init__(self, node: str, url: str, model: str, timeout_s: float) -> None:
        self.node = node
        definition = OpenAIRemoteModel(
            backend="openai_remote",
            remote_base_url=url.rstrip("/") + "/v1",
            remote_model=model,
            remote_timeout_s=timeout_s,
        )
        self.runtime = _RelayRuntime(definition)

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        return await self.runtime.generate(request, sink)

    async def close(self) -> None:
        await self.runtime.close()


class _RelayRuntime(OpenAIRemoteRuntime):
    """The remote runtime, marking its requests as relayed."""

    def __init__(self, definition: OpenAIRemoteModel) -> None:
        super().__init__(definition, api_key=None)
        self._headers = {RELAY_HEADER: "1"}


def _load(record: Mapping[str, Any]) -> int:
    return sum(int(m.get("in_flight", 0)) + int(m.get("queue_depth", 0)) for m in record["models"])


def _room(record: Mapping[str, Any]) -> int:
    gpus = record.get("gpus") or []
    return max(((g.get("budget_mib") or g["total_mib"]) - g["used_mib"] for g in gpus), default=0)


class ClusterRouter:
    """The pool's :class:`pool.actors.Router` for one :class:`ClusterNode`."""

    def __init__(self, node: ClusterNode, relay_timeout_s: float = 600.0) -> None:
        self.node = node
        self.relay_timeout_s = relay_timeout_s
        self._routes: dict[tuple[str, str, str], PeerRoute] = {}
        self._take = node.client.register_script(TAKE_LOAD_LOCK)
        self._shorten = node.client.register_script(SHORTEN_LOAD_LOCK)
        # Models whose load lock this node took, until their load is over.
        self._locks: set[str] = set()
        self._pool: Pool | None = None

    def attach(self, pool: Pool) -> None:
        self._pool = pool

    async def settle_locks(self) -> None:
        """Once a load this node does for the cluster is over (loaded or failed), its
        lock lives two more heartbeats, so every peer has read the new record by then,
        and then expires: the next load of the model may happen anywhere."""
        if self._pool is None:
            return
        grace_ms = int(2 * self.node.settings.engine.cluster.heartbeat_s * 1000)
        for model in list(self._locks):
            actor = self._pool.models.get(model)
            if actor is not None and actor.state not in ("loaded", "failed"):
                continue
            try:
                await call(
                    self._shorten(
                        keys=[self.node.keys.load_lock(model)], args=[self.node_id, grace_ms]
                    )
                )
            except RedisUnavailable:
                return
            self._locks.discard(model)

    async def route(self, model: str, local: ModelActor | None) -> PeerRoute | None:
        if local is not None and local.state in ("loaded", "loading"):
            return None
        peers = self.node.registry.peers
        loaded = [
            (_model_load(m), node_id, record)
            for node_id, record in peers.items()
            for m in record.get("models", ())
            if m["name"] == model and m["state"] == "loaded" and record.get("url")
        ]
        if loaded:
            _, node_id, record = min(loaded, key=lambda c: (c[0], c[1]))
            return self._route(node_id, record["url"], model)
        if not self.node.online:
            return None  # no cluster view to trust: serve (or refuse) locally
        loader = await self._pick_loader(model, local)
        if loader is None or loader == self.node.node_id:
            return None
        return self._route(loader, peers[loader]["url"], model)

    async def _pick_loader(self, model: str, local: ModelActor | None) -> str | None:
        """The node that loads ``model`` for the cluster (the lock's holder)."""
        peers = self.node.registry.peers
        candidates: list[tuple[bool, int, int, str]] = []
        if local is not None and local.definition.on_demand:
            record = self.node.registry.record()
            need = local.vram_estimate().mib or 0
            room = _room(record) if record.get("gpus") else 0
            candidates.append((room >= need, -_load(record), room, self.node.node_id))
        for node_id, record in peers.items():
            for m in record.get("models", ()):
                if m["name"] == model and m.get("on_demand") and record.get("url"):
                    room = _room(record)
                    fits = room >= (m.get("vram_mib") or 0)
                    candidates.append((fits, -_load(record), room, node_id))
        if not candidates:
            return None
        best = max(candidates)[3]
        live = [self.node.node_id, *peers]
        try:
            ttl_ms = int(self.node.settings.engine.cluster.load_lock_ttl_s * 1000)
            holder: Any = await call(
                self._take(keys=[self.node.keys.load_lock(model)], args=[best, ttl_ms, *live])
            )
        except RedisUnavailable:
            return None
        if str(holder) == self.node.node_id:
            self._locks.add(model)
        return str(holder)

    @property
    def node_id(self) -> str:
        return self.node.node_id

    def peer_models(self) -> list[dict[str, Any]]:
        return [
            {"node": node_id, **m}
            for node_id, record in sorted(self.node.registry.peers.items())
            for m in record.get("models", ())
        ]

    def _route(self, node_id: str, url: str, model: str) -> PeerRoute:
        key = (node_id, url, model)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = PeerRoute(node_id, url, model, self.relay_timeout_s)
        return route

    async def aclose(self) -> None:
        for route in self._routes.values():
            await route.close()
        self._routes.clear()


def _model_load(model: Mapping[str, Any]) -> int:
    return int(model.get("in_flight", 0)) + int(model.get("queue_depth", 0))
