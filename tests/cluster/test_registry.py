"""The node registry: records with expiry, events on change, boots counted, deaths seen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from pool import Pool, open_pool
from pool.cluster import ClusterNode, open_cluster, open_ledger

from ..actors.helpers import ask
from .conftest import RedisServer
from .test_pool_leases import HOST, cluster_settings, on_demand


@asynccontextmanager
async def registered(
    redis_url: str, node: str, **cluster: Any
) -> AsyncIterator[tuple[Pool, ClusterNode]]:
    settings = cluster_settings(
        redis_url, {"a": on_demand(2000), "b": on_demand(2000)}, node, cluster=cluster
    )
    async with open_cluster(settings) as member:
        assert member is not None
        async with open_pool(settings, ledger=member) as pool:
            member.attach(pool, f"http://{node}.invalid:8011")
            yield pool, member


# A change reaches the peers by an event at once; ten times what that takes on a loaded
# machine, and far inside a heartbeat, so that what is seen in time came by the event.
EVENT_WITHIN_S = 20.0
HEARTBEAT_S = 300.0


async def until(predicate: Any, within_s: float) -> None:
    with trio.fail_after(within_s):
        while not predicate():
            await trio.sleep(0.01)


async def test_nodes_see_each_other_and_each_change_at_once(redis_server: RedisServer) -> None:
    # Heartbeats far apart: what the peers see within EVENT_WITHIN_S came by the events.
    slow = {"heartbeat_s": HEARTBEAT_S, "node_ttl_s": 3 * HEARTBEAT_S}
    async with (
        registered(redis_server.url, "n1", **slow) as (pool1, node1),
        registered(redis_server.url, "n2", **slow) as (_, node2),
    ):
        await until(
            lambda: "n1" in node2.registry.peers and "n2" in node1.registry.peers,
            EVENT_WITHIN_S,
        )
        record = node2.registry.peers["n1"]
        assert record["url"] == "http://n1.invalid:8011"
        assert record["gpu_host"] == HOST and record["epoch"] >= 1
        assert record["gpus"][0]["budget_mib"] == 10_000
        assert {m["name"]: m["state"] for m in record["models"]} == {
            "a": "unloaded",
            "b": "unloaded",
        }
        await pool1.respond(ask("a"))

        def a_loaded_on_n1() -> bool:
            models = node2.registry.peers["n1"]["models"]
            return any(m["name"] == "a" and m["state"] == "loaded" for m in models)

        await until(a_loaded_on_n1, EVENT_WITHIN_S)
        assert node1.status()["redis"] == "ok" and node1.status()["peers"] == ["n2"]
    # Leaving deletes the record at once (a crash lets it expire instead).
    async with open_ledger(redis_server.url) as ledger:
        assert await ledger.client.keys("llm-pool:node:*") == set()


async def test_a_node_that_leaves_drops_out_of_its_peers_view(redis_server: RedisServer) -> None:
    slow = {"heartbeat_s": HEARTBEAT_S, "node_ttl_s": 3 * HEARTBEAT_S}
    async with registered(redis_server.url, "n1", **slow) as (_, node1):
        async with registered(redis_server.url, "n2", **slow):
            await until(lambda: "n2" in node1.registry.peers, EVENT_WITHIN_S)
        await until(lambda: "n2" not in node1.registry.peers, EVENT_WITHIN_S)


async def test_every_boot_has_a_new_epoch(redis_server: RedisServer) -> None:
    epochs = []
    for _ in range(2):
        async with registered(redis_server.url, "n1") as (_, node):
            await until(lambda node=node: node.registry.epoch is not None, EVENT_WITHIN_S)
            epochs.append(node.registry.epoch)
    assert epochs[1] == epochs[0] + 1


def serve_settings(tmp_path: Path, redis_url: str, node: str) -> Path:
    path = tmp_path / f"{node}.json"
    settings = {
        "service": {"port": 0},
        "engine": {
            "gpu_budget_mib": [10_000],
            "virtual_gpus": True,
            "cluster": {
                "redis_url": redis_url,
                "node_id": node,
                "gpu_host": HOST,
                "lease_ttl_s": 2.0,
                "lease_renew_s": 0.5,
                "heartbeat_s": 0.5,
                "node_ttl_s": 2.0,
            },
            "models": {
                "a": {"backend": "stub", "enabled": True, "stub_vram_mib": 3000},
            },
        },
    }
    path.write_text(json.dumps(settings))
    return path


async def start_serve(settings: Path) -> tuple[trio.Process, str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pool", "serve", "--settings", str(settings)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    assert process.stdout is not None
    output = b""
    with trio.fail_after(60):
        while b"listening on" not in output:
            chunk = await process.stdout.receive_some(4096)
            assert chunk, "the pool exited before it listened"
            output += chunk
    url = output.split(b"listening on ", 1)[1].split()[0].decode()
    return process, url


async def test_a_killed_node_and_its_leases_expire(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    process, url = await start_serve(serve_settings(tmp_path, redis_server.url, "doomed"))
    try:
        async with (
            registered(redis_server.url, "watcher", heartbeat_s=0.3, node_ttl_s=1.5) as (_, me),
            open_ledger(redis_server.url) as ledger,
        ):
            await until(lambda: "doomed" in me.registry.peers, EVENT_WITHIN_S)
            assert me.registry.peers["doomed"]["url"] == url
            [lease] = [x for x in await ledger.list_leases(HOST) if x.purpose == "model a"]
            assert lease.gpus == ((0, 3000),)
            await until(lambda: me.others_mib() == {0: 3000}, EVENT_WITHIN_S)

            process.send_signal(signal.SIGKILL)
            # Its record expires (node_ttl_s 2) and the watcher's next look (every 0.3 s)
            # sees it: 2.3 s, given ten times the room. Nothing else removes it.
            await until(lambda: "doomed" not in me.registry.peers, 10 * (2.0 + 0.3))
            with trio.fail_after(10 * 2.0):  # its lease's ttl, ten times
                while await ledger.list_leases(HOST):
                    await trio.sleep(0.05)
            await until(lambda: me.others_mib() == {}, EVENT_WITHIN_S)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_peers_outlive_an_outage_longer_than_their_records(
    redis_server: RedisServer,
) -> None:
    """Redis away for longer than the records' expiry comes back empty. The first node
    to write again keeps the peers it knew: a live one writes its record within its own
    heartbeat, and until then its models are not unknown (the fault soak saw 404s
    there); one that went meanwhile drops out within an expiry."""
    # n1 looks at once; n2 writes again up to 0.6 s after Redis is back (n1 keeps its
    # view for 3 s, room for a loaded machine); n3's record expires in 1.5 s.
    n1 = {"heartbeat_s": 0.2, "node_ttl_s": 3.0}
    n2 = {"heartbeat_s": 0.6, "node_ttl_s": 1.5}
    n3 = {"heartbeat_s": 0.2, "node_ttl_s": 1.5}
    async with (
        registered(redis_server.url, "n1", **n1) as (_, node1),
        registered(redis_server.url, "n2", **n2) as (_, node2),
    ):
        async with registered(redis_server.url, "n3", **n3):
            await until(lambda: {"n2", "n3"} <= set(node1.registry.peers), EVENT_WITHIN_S)
            redis_server.stop()
            await until(lambda: not node1.registry.online, EVENT_WITHIN_S)
        # n3 left while Redis was away: its record could not be deleted, only expire.
        await trio.sleep(2.5)  # past n2's and n3's expiry
        redis_server.start()
        await until(lambda: node1.registry.online, EVENT_WITHIN_S)
        with trio.fail_after(EVENT_WITHIN_S):
            while not node2.registry.online or "n3" in node1.registry.peers:
                assert "n2" in node1.registry.peers  # never dropped, not for a moment
                await trio.sleep(0.005)
        await until(lambda: "n1" in node2.registry.peers, EVENT_WITHIN_S)
        assert "n2" in node1.registry.peers
