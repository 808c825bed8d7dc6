"""The node registry: each pool's record in Redis, renewed while it lives, and the
records of its peers.

A node writes ``P:node:ID`` (JSON) with an expiry of ``node_ttl_s`` every
``heartbeat_s``, so a node that dies drops out of every view within ``node_ttl_s``. At
each change of its models it rewrites the record at once and publishes a ``node`` event
on ``P:events``; peers read the record when they hear the event, so they see a change
in about one round trip, not a heartbeat later. ``P:epoch:ID`` counts the node's boots
(``INCR`` at its first contact), so peers can tell a restarted node from the old one.

One id, one live node: every write of the record goes through a script that refuses
it while the record belongs to another boot (``boot``, new at every start). Before it
first writes, a node that finds another boot's record waits for that record to be
renewed (``beat`` grows with each write): renewed, the id belongs to a live node and
this one refuses to join (:class:`NodeIdInUse`); gone, or not renewed within two of its
heartbeats, it is the record of a dead node and this one takes it over.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import trio

from pool.cluster._keys import Keys
from pool.cluster._ledger import scan_keys
from pool.cluster._redis import RedisUnavailable, call
from pool.errors import ConfigError

if TYPE_CHECKING:
    import coredis

    from pool.actors import Pool

log = logging.getLogger("pool.cluster")

# Changes closer together than this go out as one record write and one event.
COALESCE_S = 0.02

# A record that names no boot (written by hand, or by an older pool).
_NO_BOOT = "-"
# An id check that found Redis unreachable is tried once more after this pause.
_CHECK_TRIES = 2
_CHECK_RETRY_S = 0.2

# Write a node's record unless it belongs to another boot (a live node under the same
# id), or to the stale boot this node decided to take over.
# KEYS[1] the record; ARGV[1] this boot; ARGV[2] the record (JSON); ARGV[3] ttl ms;
# ARGV[4] the boot of a dead node's record this node may replace ('' none).
# Returns nil when written, else the record in the way.
WRITE_RECORD = """
local raw = redis.call('GET', KEYS[1])
if raw then
  local ok, record = pcall(cjson.decode, raw)
  local boot = '-'
  if ok and type(record) == 'table' and type(record['boot']) == 'string' then
    boot = record['boot']
  end
  if boot ~= ARGV[1] and (ARGV[4] == '' or boot ~= ARGV[4]) then return raw end
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
return false
"""

# Delete a node's record if it is still this boot's. KEYS[1] the record; ARGV[1] the boot.
DELETE_RECORD = """
local raw = redis.call('GET', KEYS[1])
if not raw then return 0 end
local ok, record = pcall(cjson.decode, raw)
if ok and type(record) == 'table' and record['boot'] == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class NodeIdInUse(ConfigError):
    """Another live node is registered under this node's id."""

    def __init__(self, node_id: str, record: Mapping[str, Any]) -> None:
        self.node_id = node_id
        self.other = dict(record)
        super().__init__(
            [
                f"engine.cluster: node id {node_id!r} is already used by another live node"
                f" (at {record.get('url') or 'an unknown address'}, epoch"
                f" {record.get('epoch')}, boot {record.get('boot') or _NO_BOOT}); this pool"
                " does not join the cluster under it. Give each pool its own id:"
                " engine.cluster.node_id, service.runner_id, or a port of its own."
            ]
        )


def describe(pool: Pool) -> dict[str, Any]:
    """What peers need to know of ``pool``: its GPUs, and its models' states, load and
    recent prompts (at most ``engine.cluster.affinity_keys`` keys each)."""
    engine = pool.settings.engine
    caps = engine.gpu_budget_mib or []
    models = []
    for snap in pool.snapshots():
        models.append(
            {
                "name": snap.name,
                "state": snap.state,
                "replicas": snap.loaded_replicas,
                "slots": snap.loaded_replicas * snap.effective_target_inflight,
                "in_flight": snap.running,
                "queue_depth": snap.queue_depth,
                "on_demand": snap.definition.on_demand,
                "vram_mib": snap.vram.mib,
                # The cluster's prefix affinity (docs/cluster.md, "Routing").
                "prefixes": [key.hex() for key in pool.model(snap.name).recent_prompts()],
            }
        )
    gpus = [
        {
            "index": g.index,
            "name": g.name,
            "used_mib": g.used_mib,
            "total_mib": g.total_mib,
            # As the VRAM gate's ceiling (docs/vram.md): total less the reserve, capped.
            "budget_mib": min(
                g.total_mib - (0 if g.virtual else engine.gpu_reserve_mib),
                caps[g.index] if g.index < len(caps) else g.total_mib,
            ),
            "virtual": g.virtual,
        }
        for g in pool.gpu_view().gpus
    ]
    return {"gpus": gpus, "models": models}


class NodeRegistry:
    """One node's registration and its view of the peers."""

    def __init__(
        self,
        client: coredis.Redis[str],
        keys: Keys,
        *,
        node_id: str,
        boot: str,
        gpu_host: str,
        heartbeat_s: float,
        node_ttl_s: float,
    ) -> None:
        self.client = client
        self.keys = keys
        self.node_id = node_id
        self.boot = boot
        self.gpu_host = gpu_host
        self.heartbeat_s = heartbeat_s
        self.node_ttl_s = node_ttl_s
        self.epoch: int | None = None
        self.url: str | None = None
        self.started_at = time.time()
        # Live peers by node id (this node not included), as their records say.
        self.peers: dict[str, dict[str, Any]] = {}
        self.online = False
        self.error: str | None = "not registered yet"
        self._describe: Callable[[], Mapping[str, Any]] | None = None
        self._attached = trio.Event()
        self._poked = trio.Event()
        self._peers_changed = trio.Event()
        self._last_event: str | None = None
        self._running = trio.CancelScope()
        self._write = client.register_script(WRITE_RECORD)
        self._delete = client.register_script(DELETE_RECORD)
        # Writes of this boot's record so far: peers waiting on the id see it renewed.
        self._beats = 0
        # The boot of a dead node's record under this id that the first write replaces.
        self._stale_boot: str | None = None
        # Why this node refused to join (another live node holds its id), once it did.
        self.refused: NodeIdInUse | None = None
        self._written = False
        # Back from an outage of Redis longer than the records' expiry, the views read
        # may lack peers that are alive but have not written theirs again yet: the view
        # from before the outage, and until when it stands in for them.
        self._before_outage: dict[str, dict[str, Any]] = {}
        self._before_outage_until = 0.0

    def attach(self, describe: Callable[[], Mapping[str, Any]], url: str) -> None:
        """Start registering: ``describe()`` gives the record's pool part, ``url`` is
        where peers reach this node."""
        self._describe = describe
        self.url = url
        self._attached.set()
        self._poked.set()

    async def join(self, describe: Callable[[], Mapping[str, Any]], url: str) -> None:
        """Write the record now, then keep it (as :meth:`attach`).

        Raises:
            NodeIdInUse: another live node holds this node's id (Redis unreachable: the
                record is written, and the id checked, once it answers).
        """
        self._describe = describe
        self.url = url
        try:
            await self._write_checked()
        except NodeIdInUse as exc:
            self._refuse(exc)
            raise
        self.attach(describe, url)

    async def check_id(self) -> None:
        """Make sure no other live node holds this node's id, before this one joins.

        Another boot's record is watched for up to two of its heartbeats: renewed, the
        id is a live node's; gone or not renewed, a dead node's, which the first write
        replaces. Redis unreachable: the check is tried once more (a connection cut short
        once, as a loaded host's handshake can be, must not skip it), then nothing is
        checked now (the first write checks).

        Raises:
            NodeIdInUse: another live node holds the id.
        """
        for attempt in range(_CHECK_TRIES):
            try:
                await self._check_id_once()
                return
            except RedisUnavailable as exc:
                if attempt + 1 == _CHECK_TRIES:
                    # At the start, and in the first write's own check: either way
                    # the next write of the record (its script) refuses a live id.
                    log.warning(
                        "cluster: node %s: Redis unreachable (%s): the id is not checked"
                        " now; the next write of the record checks it",
                        self.node_id,
                        exc,
                    )
                    return
                await trio.sleep(_CHECK_RETRY_S)

    async def _check_id_once(self) -> None:
        """:meth:`check_id`, one try.

        Raises:
            NodeIdInUse: another live node holds the id.
            RedisUnavailable: a call failed.
        """
        key = self.keys.node(self.node_id)
        first = _parse(await call(self.client.get(key)))
        if first is None or first.get("boot") == self.boot:
            return
        their_heartbeat = _positive(first.get("heartbeat_s"), self.heartbeat_s)
        deadline = trio.current_time() + 2 * their_heartbeat
        poll_s = min(max(their_heartbeat / 20, 0.01), 0.25)
        while trio.current_time() < deadline:
            await trio.sleep(poll_s)
            now = _parse(await call(self.client.get(key)))
            if now is None:
                return  # left or expired: the id is free
            if (now.get("boot"), now.get("beat")) != (first.get("boot"), first.get("beat")):
                raise NodeIdInUse(self.node_id, now)
        self._stale_boot = str(first.get("boot") or _NO_BOOT)
        log.warning(
            "cluster: node %s: the record of boot %s (at %s) was not renewed for %.1f s;"
            " its node is gone, this one takes the id over",
            self.node_id,
            self._stale_boot,
            first.get("url"),
            2 * their_heartbeat,
        )

    def poke(self) -> None:
        self._poked.set()

    async def wait_peers_changed(self) -> None:
        await self._peers_changed.wait()

    def record(self) -> dict[str, Any]:
        pool_part = dict(self._describe()) if self._describe is not None else {}
        return {
            "node": self.node_id,
            "epoch": self.epoch,
            "boot": self.boot,
            "beat": self._beats,
            "heartbeat_s": self.heartbeat_s,
            "url": self.url,
            "gpu_host": self.gpu_host,
            "started_at": self.started_at,
            **pool_part,
        }

    # -- background --------------------------------------------------------------------
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        with self._running:
            await self._attached.wait()
            await self._beat()

    async def _beat(self) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._follow_events)
            next_beat = trio.current_time()
            try:
                while True:
                    with trio.move_on_at(next_beat):
                        await self._poked.wait()
                        await trio.sleep(COALESCE_S)
                    beat = trio.current_time() >= next_beat
                    self._poked = trio.Event()
                    await self._write_checked()
                    if beat:
                        await self._refresh_peers()
                        next_beat = trio.current_time() + self.heartbeat_s
            except NodeIdInUse as exc:
                # Taken over while Redis was out of reach (or this node was too slow to
                # renew): two nodes never share an id, so this one stops registering.
                self._refuse(exc)
                nursery.cancel_scope.cancel()

    async def leave(self) -> None:
        """Remove the record and say so (a graceful stop; a crash just lets it expire)."""
        # No heartbeat may write the record again after it is deleted.
        self._running.cancel()
        if self.epoch is None or self.refused is not None:
            return
        try:
            # Only this boot's record: another node may have taken the id over.
            if await call(self._delete(keys=[self.keys.node(self.node_id)], args=[self.boot])):
                await self._send({"kind": "node", "op": "leave", "node": self.node_id})
        except RedisUnavailable:
            pass

    # -- helpers -------------------------------------------------------------------------
    async def _write_checked(self) -> None:
        """:meth:`_publish`; a first write refused is checked as a start checks the id.

        Raises:
            NodeIdInUse: the record under this id belongs to another live boot.
        """
        try:
            await self._publish(announce=True)
        except NodeIdInUse:
            if self._written:
                raise
            # Never written yet (Redis was out of reach at the start, or another node
            # wrote since the check): the record in the way may be a dead node's.
            await self.check_id()
            await self._publish(announce=True)

    async def _publish(self, *, announce: bool) -> None:
        """Write the record (and announce a change).

        Raises:
            NodeIdInUse: the record under this id belongs to another live boot.
        """
        try:
            if self.epoch is None:
                self.epoch = int(await call(self.client.incr(self.keys.epoch(self.node_id))))
            self._beats += 1
            record = self.record()
            ttl_ms = max(1, int(self.node_ttl_s * 1000))
            in_the_way: Any = await call(
                self._write(
                    keys=[self.keys.node(self.node_id)],
                    args=[self.boot, json.dumps(record), ttl_ms, self._stale_boot or ""],
                )
            )
            if in_the_way is not None:
                raise NodeIdInUse(self.node_id, _parse(in_the_way) or {})
            self._stale_boot = None
            self._written = True
            # Peers re-read the record on an event; one is sent when something other
            # than the GPU readings changed.
            fingerprint = json.dumps(record.get("models")) + str(record.get("epoch"))
            if announce and fingerprint != self._last_event:
                await self._send(
                    {"kind": "node", "op": "update", "node": self.node_id, "epoch": self.epoch}
                )
                self._last_event = fingerprint
            self._set_online(True, None)
        except RedisUnavailable as exc:
            self._set_online(False, f"Redis unreachable: {exc}")
            self._last_event = None  # announce again once back

    async def _send(self, event: Mapping[str, Any]) -> None:
        await call(self.client.publish(self.keys.events, json.dumps(event)))

    async def _refresh_peers(self) -> None:
        """Every live record (expired ones are gone from Redis by themselves)."""
        try:
            keys = await scan_keys(self.client, self.keys.node_prefix + "*")
            values = await call(self.client.mget(keys)) if keys else []
        except RedisUnavailable as exc:
            self._set_online(False, f"Redis unreachable: {exc}")
            return
        peers = {}
        for raw in values:
            record = _parse(raw)
            if record is not None and record.get("node") != self.node_id:
                peers[str(record["node"])] = record
        if trio.current_time() < self._before_outage_until:
            # Back from an outage, the peers known before it stay in the view for one
            # expiry: their records may have expired while Redis was away, to be written
            # again within their heartbeat (and their events missed while this node
            # resubscribes); dropping them now would answer 404 for their models
            # meanwhile. One that is gone drops out within that expiry, as a node that
            # dies does.
            peers = {**self._before_outage, **peers}
        self._set_peers(peers)

    async def _read_peer(self, node_id: str) -> None:
        try:
            raw = await call(self.client.get(self.keys.node(node_id)))
        except RedisUnavailable:
            return
        peers = dict(self.peers)
        record = _parse(raw)
        if record is None:
            peers.pop(node_id, None)
        else:
            peers[node_id] = record
        self._set_peers(peers)

    def _set_peers(self, peers: dict[str, dict[str, Any]]) -> None:
        if peers != self.peers:
            self.peers = peers
            self._peers_changed.set()
            self._peers_changed = trio.Event()

    async def _follow_events(self) -> None:
        while True:
            try:
                async with self.client.pubsub(channels=[self.keys.events]) as sub:
                    async for message in sub:
                        if message.get("type") != "message":
                            continue
                        event = _parse(message.get("data"))
                        if event is None or event.get("kind") != "node":
                            continue
                        node_id = str(event.get("node"))
                        if node_id == self.node_id:
                            continue
                        if event.get("op") == "leave":
                            self._set_peers({k: v for k, v in self.peers.items() if k != node_id})
                        else:
                            await self._read_peer(node_id)
            # except*: leaving a subscription while cancelled can raise a group of
            # Cancelled and coredis's own cleanup errors; the Cancelled go on.
            except* Exception as exc:  # noqa: BLE001 - any failure: resubscribe later
                log.debug("cluster: node events: %s", exc)
            await trio.sleep(self.heartbeat_s)

    def _refuse(self, exc: NodeIdInUse) -> None:
        """Leave the cluster's view for good: another live node has this node's id."""
        log.error("cluster: %s", exc.problems[0])
        self.refused = exc
        self.online = False
        self.error = exc.problems[0]
        self._set_peers({})

    def _set_online(self, online: bool, error: str | None) -> None:
        if online and not self.online:
            log.info("cluster: node %s registered (epoch %s)", self.node_id, self.epoch)
            if self.peers:  # back from an outage, with a view from before it
                self._before_outage = dict(self.peers)
                self._before_outage_until = trio.current_time() + self.node_ttl_s
        elif not online and self.online:
            log.warning("cluster: node %s cannot reach Redis: %s", self.node_id, error)
        self.online = online
        self.error = error


def _positive(value: object, default: float) -> float:
    return float(value) if isinstance(value, int | float) and value > 0 else default


def _parse(raw: object) -> dict[str, Any] | None:
    if not isinstance(raw, str):
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) and "node" in value else None
