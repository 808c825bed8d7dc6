"""Node ids (issue #25): a pool's default id follows the port it serves, and two live
nodes never share an id (a real redis-server; real ``llm-pool serve`` processes where the
command line is the point)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool.cluster import ClusterNode, NodeIdInUse, open_ledger
from pool.cluster import _registry as registry_module
from pool.cluster._redis import RedisUnavailable, call

from .conftest import RedisServer, free_port
from .test_pool_leases import cluster_settings
from .test_registry import registered, until

ROOT = Path(__file__).resolve().parents[2]
FAST = {"heartbeat_s": 0.3, "node_ttl_s": 1.5, "lease_renew_s": 0.3, "lease_ttl_s": 3.0}


def settings_file(tmp_path: Path, name: str, redis_url: str, **cluster: Any) -> Path:
    """A settings file that names no port (``service.port`` keeps its default, 8011) and,
    unless ``cluster`` says otherwise, no node id: one model of its own, loaded at start."""
    settings = {
        "service": {"host": "127.0.0.1"},
        "engine": {
            "cluster": {"redis_url": redis_url, **FAST, **cluster},
            "models": {
                f"only-{name}": {"backend": "stub", "enabled": True, "stub_reply": f"from {name}"}
            },
        },
    }
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(settings))
    return path


class Served:
    def __init__(self, process: trio.Process, log: Path) -> None:
        self.process = process
        self.log = log
        self.url = ""

    async def output(self) -> str:
        return await trio.Path(self.log).read_text(errors="replace")


@asynccontextmanager
async def serving() -> AsyncIterator[list[Served]]:
    """Start ``llm-pool serve`` processes (this worktree's package); kill them on the way out."""
    started: list[Served] = []
    try:
        yield started
    finally:
        for served in started:
            if served.process.returncode is None:
                served.process.kill()
        with trio.CancelScope(shield=True):
            for served in started:
                await served.process.wait()


async def start(started: list[Served], tmp_path: Path, settings: Path, *argv: str) -> Served:
    log = tmp_path / f"{settings.stem}-{len(started)}.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with log.open("wb") as out:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "pool", "serve", "--settings", str(settings), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
        )
    served = Served(process, log)
    started.append(served)
    return served


async def listening(served: Served) -> str:
    """The URL the process prints once it listens (its output goes to a file)."""
    with trio.fail_after(60):
        while "listening on " not in (text := await served.output()):
            assert served.process.poll() is None, f"the pool exited before it listened:\n{text}"
            await trio.sleep(0.05)
    served.url = text.split("listening on ", 1)[1].split()[0]
    return served.url


async def test_pools_given_ports_on_the_command_line_are_two_nodes_and_route(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    host = socket.gethostname()
    port_a, port_b = free_port(), free_port()
    async with serving() as started, httpx.AsyncClient(timeout=30) as http:
        a = await start(started, tmp_path, settings_file(tmp_path, "a", redis_server.url),
                        "--port", str(port_a))  # fmt: skip
        b = await start(started, tmp_path, settings_file(tmp_path, "b", redis_server.url),
                        "--port", str(port_b))  # fmt: skip
        url_a, url_b = await listening(a), await listening(b)
        assert url_a.endswith(f":{port_a}") and url_b.endswith(f":{port_b}")
        # The node id follows the port served, not the settings' 8011.
        ids = [(await http.get(f"{u}/health")).json()["cluster"]["node_id"] for u in (url_a, url_b)]
        assert ids == [f"{host}:{port_a}", f"{host}:{port_b}"]

        async def sees(url: str, peer: str) -> bool:
            body = (await http.get(f"{url}/v1/admin/models")).json()
            return any(m["node"] == peer and m["state"] == "loaded" for m in body["cluster"])

        with trio.fail_after(30):
            while not (await sees(url_a, ids[1]) and await sees(url_b, ids[0])):
                await trio.sleep(0.05)
        async with open_ledger(redis_server.url) as ledger:
            records = {
                key: json.loads(await ledger.client.get(key) or "{}")
                for key in await ledger.client.keys("llm-pool:node:*")
            }
            epochs = [await ledger.client.get(f"llm-pool:epoch:{i}") for i in ids]
        assert {r["node"]: r["url"] for r in records.values()} == dict(
            zip(ids, (url_a, url_b), strict=True)
        )
        assert epochs == ["1", "1"]  # each registered once, nobody overwrote the other

        # A model only the other node has is routed there and answered.
        for url, model, reply in ((url_a, "only-b", "from b"), (url_b, "only-a", "from a")):
            answer = await http.post(f"{url}/v1/responses", json={"model": model, "input": "hi"})
            assert answer.status_code == 200, answer.text
            assert answer.json()["output_text"] == reply


async def test_a_second_live_pool_under_the_same_id_is_refused(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    async with serving() as started, httpx.AsyncClient(timeout=30) as http:
        first = await start(
            started, tmp_path, settings_file(tmp_path, "a", redis_server.url, node_id="twin"),
            "--port", "0",
        )  # fmt: skip
        url = await listening(first)
        second = await start(
            started, tmp_path, settings_file(tmp_path, "b", redis_server.url, node_id="twin"),
            "--port", "0",
        )  # fmt: skip
        with trio.fail_after(60):
            code = await second.process.wait()
        text = await second.output()
        assert code == 2, text
        assert "listening on" not in text
        assert "node id 'twin' is already used by another live node" in text
        assert url in text  # names the other node
        assert "Traceback" not in text

        # The first node is untouched: its record, its one boot, its view.
        async with open_ledger(redis_server.url) as ledger:
            record = json.loads(await ledger.client.get("llm-pool:node:twin") or "{}")
            assert record["url"] == url and record["epoch"] == 1
            assert await ledger.client.get("llm-pool:epoch:twin") == "1"
        health = (await http.get(f"{url}/health")).json()["cluster"]
        assert health["node_id"] == "twin" and health["redis"] == "ok" and health["error"] is None
        answer = await http.post(f"{url}/v1/responses", json={"model": "only-a", "input": "hi"})
        assert answer.status_code == 200, answer.text


async def test_a_second_node_in_process_is_refused_before_its_pool_opens(
    redis_server: RedisServer,
) -> None:
    # A heartbeat of 1 s: the second node watches the record for two of them, and a
    # loaded CI machine once let 0.6 s (FAST's two) pass without a renewal.
    steady = {**FAST, "heartbeat_s": 1.0, "node_ttl_s": 5.0}
    async with registered(redis_server.url, "n1", **steady) as (_, first):
        await until(lambda: first.registry.epoch is not None, 5)
        with pytest.raises(NodeIdInUse) as refused:
            async with registered(redis_server.url, "n1", **steady):
                raise AssertionError("joined under a live node's id")
        assert refused.value.node_id == "n1"
        assert refused.value.other["boot"] == first.boot
        assert "http://n1.invalid:8011" in str(refused.value)
        assert first.status()["redis"] == "ok"


async def test_an_id_check_cut_short_once_is_tried_again(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loaded CI host once cut the second node's first Redis connection short (its
    handshake failed): the check gave up and the node joined under a live id."""
    steady = {**FAST, "heartbeat_s": 1.0, "node_ttl_s": 5.0}
    async with registered(redis_server.url, "n1", **steady) as (_, first):
        await until(lambda: first.registry.epoch is not None, 5)
        failed: list[str] = []
        # The second node's check runs in this task (open_cluster awaits it before its
        # nursery starts); the first node's renewals run in tasks of their own.
        checking = trio.lowlevel.current_task()

        async def cut_short_once(awaitable: Any) -> Any:
            if not failed and trio.lowlevel.current_task() is checking:
                failed.append("first call")
                raise RedisUnavailable("ConnectionError: Connection attempt failed")
            return await call(awaitable)

        monkeypatch.setattr(registry_module, "call", cut_short_once)
        with pytest.raises(NodeIdInUse) as refused:
            async with registered(redis_server.url, "n1", **steady):
                raise AssertionError("joined under a live node's id")
        assert failed and refused.value.other["boot"] == first.boot


async def test_a_dead_nodes_record_is_taken_over(redis_server: RedisServer) -> None:
    # A record nobody renews (its node was killed), far from expiring by itself.
    dead = {"node": "n1", "epoch": 4, "boot": "dead00", "beat": 9, "heartbeat_s": 0.2,
            "url": "http://gone.invalid:8011", "models": [], "gpus": []}  # fmt: skip
    async with open_ledger(redis_server.url) as ledger:
        await ledger.client.set("llm-pool:node:n1", json.dumps(dead), px=600_000)
        await ledger.client.set("llm-pool:epoch:n1", "4")
        async with registered(redis_server.url, "n1", **FAST) as (_, node):
            await until(lambda: node.registry.epoch is not None and node.online, 10)
            record = json.loads(await ledger.client.get("llm-pool:node:n1") or "{}")
            assert record["boot"] == node.boot and record["epoch"] == 5
            assert record["url"] == "http://n1.invalid:8011"


async def test_a_node_whose_id_was_taken_meanwhile_stops_registering(
    redis_server: RedisServer,
) -> None:
    async with (
        open_ledger(redis_server.url) as ledger,
        registered(redis_server.url, "n1", **FAST) as (_, node),
    ):
        await until(lambda: node.online, 5)
        # Another pool took the id while this one could not renew (an outage, say).
        other = {"node": "n1", "epoch": 2, "boot": "other0", "beat": 1, "heartbeat_s": 0.3,
                 "url": "http://other.invalid:8011", "models": [], "gpus": []}  # fmt: skip
        await ledger.client.set("llm-pool:node:n1", json.dumps(other), px=600_000)
        await until(lambda: node.registry.refused is not None, 5)
        status = node.status()
        assert status["redis"] == "ok" and not node.online
        assert "node id 'n1' is already used" in status["error"]
        assert "http://other.invalid:8011" in status["error"]
    # Neither overwritten nor deleted on the way out: the record is the other node's.
    async with open_ledger(redis_server.url) as ledger:
        record = json.loads(await ledger.client.get("llm-pool:node:n1") or "{}")
        assert record["boot"] == "other0"


async def test_a_first_write_refused_looks_at_the_record_as_a_start_does(
    redis_server: RedisServer,
) -> None:
    # Redis was out of reach when the node started, so nothing was checked then; when
    # it answers, the record in the way is a dead node's, and the node takes it over.
    dead = {"node": "n1", "epoch": 1, "boot": "dead00", "beat": 3, "heartbeat_s": 0.2,
            "url": "http://gone.invalid:8011", "models": [], "gpus": []}  # fmt: skip
    settings = cluster_settings(redis_server.url, {"a": {}}, "n1", cluster=FAST)
    async with open_ledger(redis_server.url) as ledger:
        await ledger.client.set("llm-pool:node:n1", json.dumps(dead), px=600_000)
        node = ClusterNode(settings, ledger)  # no check_id: as after a start without Redis
        async with trio.open_nursery() as nursery:
            await nursery.start(node.registry.run)
            node.registry.attach(lambda: {"models": [], "gpus": []}, "http://n1.invalid:8011")
            await until(lambda: node.registry.online, 10)
            record = json.loads(await ledger.client.get("llm-pool:node:n1") or "{}")
            assert record["boot"] == node.boot and node.registry.refused is None
            nursery.cancel_scope.cancel()
