"""Routing: a request for a model this node does not have loaded goes to a peer that does.

The choice, from the node registry's records (docs/cluster.md, "Routing"):

1. Prefix affinity: among the nodes that have the model loaded (this one included),
   the one whose recent prompts hold the longest part of the request's prompt in its
   cache scope, when that is more than half of it and the node would not queue the
   request past ``engine.cluster.affinity_max_queue``; then the least loaded of equals,
   this node first.
2. Loaded here: served here.
3. Loaded on peers: the one with the fewest requests in flight and queued.
4. Loaded nowhere: one node loads it for the cluster. The candidates are this node and
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
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from pool.actors import AFFINITY_MIN_SHARE, RELAY_HEADER, longest_held
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
    """The remote runtime, marking its requests as relayed and sending their cache
    scope: the peer serves a request in its tenant's own scope (its prefix cache, its
    recent prompts), never in one shared by every relayed request."""

    def __init__(self, definition: OpenAIRemoteModel) -> None:
        super().__init__(definition, api_key=None)

    def headers(self, request: GenerationRequest) -> dict[str, str]:
        cache = request.cache
        headers = {RELAY_HEADER: "1", "X-Tenant-ID": _header_safe(cache.tenant)}
        if cache.tag is not None:
            headers["X-Cache-Tag"] = _header_safe(cache.tag)
        if not cache.enabled:
            headers["X-Cache-Mode"] = "none"
        return headers


def _header_safe(value: str) -> str:
    """``value`` as a header value, one to one: as it is when it is plain text (as every
    value that came in a header is), else percent-encoded (then with a ``%``, which the
    plain values have none of), so two tenants never become one on the peer."""
    if "%" not in value and value.isprintable() and value.isascii():
        return value
    return quote(value, safe="")


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
            state = self._pool.model_state(model)
            if state is not None and state not in ("loaded", "failed"):
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

    async def route(
        self,
        model: str,
        local: ModelActor | None,
        prefix_keys: Callable[[], tuple[bytes, ...]] | None = None,
    ) -> PeerRoute | None:
        here = local is not None and local.state in ("loaded", "loading")
        peers = self.node.registry.peers
        loaded = [
            (node_id, record, m)
            for node_id, record in peers.items()
            for m in record.get("models", ())
            if m["name"] == model and m["state"] == "loaded" and record.get("url")
        ]
        if prefix_keys is not None and any(m.get("prefixes") for _, _, m in loaded):
            holder = self._prefix_holder(prefix_keys(), local, loaded)
            if holder is not None:
                return (
                    None
                    if holder == self.node_id
                    else self._route(holder, peers[holder]["url"], model)
                )
        if here:
            return None
        if loaded:
            node_id, record, _ = min(loaded, key=lambda c: (_model_load(c[2]), c[0]))
            return self._route(node_id, record["url"], model)
        if not self.node.online:
            return None  # no cluster view to trust: serve (or refuse) locally
        loader = await self._pick_loader(model, local)
        if loader is None or loader == self.node.node_id:
            return None
        return self._route(loader, peers[loader]["url"], model)

    def _prefix_holder(
        self,
        keys: tuple[bytes, ...],
        local: ModelActor | None,
        loaded: list[tuple[str, dict[str, Any], dict[str, Any]]],
    ) -> str | None:
        """The node whose cache holds most of the prompt of ``keys`` (rule 1), or None
        when no node that could start it soon holds more than half of it."""
        bound = self.node.settings.engine.cluster.affinity_max_queue
        # (blocks held, this node first, least loaded first, node id)
        candidates: list[tuple[int, bool, int, str]] = []
        if local is not None and local.state == "loaded":
            scheduler = local.scheduler
            if scheduler.next_position <= bound:
                load = scheduler.running + scheduler.queue_depth
                candidates.append((scheduler.prefix_held(keys), True, -load, self.node_id))
        wanted = [key.hex() for key in keys]
        for node_id, _, m in loaded:
            prefixes = m.get("prefixes")
            if prefixes and _next_position(m) <= bound:
                held = longest_held(wanted, set(prefixes))
                candidates.append((held, False, -_model_load(m), node_id))
        if not candidates:
            return None
        held, _, _, node_id = max(candidates, key=lambda c: c[:3])
        return node_id if held > len(keys) * AFFINITY_MIN_SHARE else None

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

    def prompts_changed(self) -> None:
        # The record is rewritten within the registry's coalescing delay (20 ms).
        self.node.registry.poke()

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


def _next_position(model: Mapping[str, Any]) -> int:
    """The place a request sent now would take in a peer's queue for ``model`` (as
    :attr:`pool.actors.Scheduler.next_position`), by its record: 0 with a free slot."""
    queued = int(model.get("queue_depth", 0))
    # A record without "slots" (an older pool) counts as having no free slot.
    if queued == 0 and int(model.get("in_flight", 0)) < int(model.get("slots", 0)):
        return 0
    return queued + 1
