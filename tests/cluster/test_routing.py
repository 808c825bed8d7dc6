"""Routing across three pools on loopback ports (stub models on virtual GPUs, a real
redis-server): requests go where the model is loaded, one node loads for the cluster,
and a node killed with -9 costs at most its in-flight streams (as error events)."""

from __future__ import annotations

import json
import signal
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import trio

from pool import ServerInfo
from pool.actors import USAGE_FILE_NAME as FILE_NAME
from pool.cluster import ClusterRouter, open_ledger
from tests.bounds import within

from ..http.conftest import start_server
from .conftest import RedisServer
from .test_registry import start_serve

REPLY = " ".join(f"w{i}" for i in range(12))


def cluster(redis_url: str, node: str) -> dict[str, Any]:
    return {
        "redis_url": redis_url,
        "node_id": node,
        "gpu_host": f"host-{node}",
        "lease_ttl_s": 2.0,
        "lease_renew_s": 0.3,
        "heartbeat_s": 0.3,
        "node_ttl_s": 1.5,
        "redis_timeout_s": 1.0,
    }


def model(**fields: Any) -> dict[str, Any]:
    return {
        "backend": "stub",
        "on_demand": True,
        "keep_alive": -1,
        "stub_vram_mib": 3000,
        "stub_reply": REPLY,
        **fields,
    }


async def start_node(nursery: trio.Nursery, redis_url: str, node: str, **fields: Any) -> ServerInfo:
    return await start_server(
        nursery,
        {"a": model(**fields)},
        engine={
            "gpu_budget_mib": [10_000],
            "virtual_gpus": True,
            "cluster": cluster(redis_url, node),
        },
    )


def router(server: ServerInfo) -> ClusterRouter:
    assert isinstance(server.pool.parts_for_tests().router, ClusterRouter)
    return server.pool.parts_for_tests().router


async def until(predicate: Any, what: str) -> None:
    """Wait for a registry to show ``what`` (it publishes no event): a bound that names
    it, never a measure of how fast the heartbeats are."""
    with within(what):
        while not predicate():
            await trio.sleep(0.02)


def sees_loaded(server: ServerInfo, node: str) -> bool:
    record = router(server).node.registry.peers.get(node)
    return record is not None and any(
        m["name"] == "a" and m["state"] == "loaded" for m in record["models"]
    )


async def stream_text(client: httpx.AsyncClient) -> tuple[str, list[dict[str, Any]]]:
    """Stream a chat completion; the text and any error events."""
    body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    text, errors = "", []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
            for choice in chunk.get("choices", ()):
                text += choice.get("delta", {}).get("content") or ""
    return text, errors


async def test_a_request_to_a_node_without_the_model_streams_from_the_node_with_it(
    redis_server: RedisServer, nursery: trio.Nursery
) -> None:
    a, b, c = [await start_node(nursery, redis_server.url, n) for n in ("nA", "nB", "nC")]
    async with httpx.AsyncClient(timeout=10) as http:
        loaded = await http.post(f"{b.url}/v1/admin/models/a/load")
        assert loaded.status_code == 200, loaded.text
        await until(lambda: sees_loaded(a, "nB"), "nA sees nB's loaded model")
        async with httpx.AsyncClient(base_url=a.url, timeout=10) as client:
            listed = (await client.get("/v1/models")).json()["data"]
            assert [(m["id"], m["nodes"]) for m in listed] == [("a", ["nB"])]
            cluster_rows = (await client.get("/v1/admin/models")).json()["cluster"]
            assert sorted((r["node"], r["name"], r["state"]) for r in cluster_rows) == [
                ("nB", "a", "loaded"),
                ("nC", "a", "unloaded"),
            ]
            text, errors = await stream_text(client)
            assert (text.strip(), errors) == (REPLY, [])
            plain = await client.post("/v1/responses", json={"model": "a", "input": "hi"})
            assert plain.status_code == 200, plain.text
            assert REPLY in plain.text
    assert a.pool.model("a").state == "unloaded"
    assert c.pool.model("a").state == "unloaded"
    served = b.pool.parts_for_tests().metrics.requests.labels("a", "default", "success")
    assert served._value.get() == 2


async def test_a_model_loaded_nowhere_is_loaded_by_one_node_for_all(
    redis_server: RedisServer, nursery: trio.Nursery
) -> None:
    nodes = [
        await start_node(nursery, redis_server.url, n, stub_load_seconds=0.3)
        for n in ("nA", "nB", "nC")
    ]
    await until(
        lambda: all(len(router(s).node.registry.peers) == 2 for s in nodes),
        "each node sees its two peers",
    )
    texts: list[str] = []

    async def ask(server: ServerInfo) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as client:
            texts.append((await stream_text(client))[0].strip())

    async with trio.open_nursery() as requests:
        for _ in range(3):
            for server in nodes:
                requests.start_soon(ask, server)
    assert texts == [REPLY] * 9
    states = [s.pool.model("a").state for s in nodes]
    assert states.count("loaded") == 1 and states.count("unloaded") == 2, states
    # The load is over: its lock goes two heartbeats (0.6 s) later, not after
    # load_lock_ttl_s (120 s): 12 s is twenty times the one and a tenth of the other.
    async with open_ledger(redis_server.url) as ledger:
        with trio.fail_after(12):
            while await ledger.client.exists(["llm-pool:loadlock:a"]):
                await trio.sleep(0.05)


async def test_a_killed_node_costs_its_streams_an_error_and_the_model_loads_elsewhere(
    redis_server: RedisServer, nursery: trio.Nursery, tmp_path: Path
) -> None:
    settings = tmp_path / "nB.json"
    settings.write_text(
        json.dumps(
            {
                "service": {"port": 0},
                "engine": {
                    "gpu_budget_mib": [10_000],
                    "virtual_gpus": True,
                    "cluster": cluster(redis_server.url, "nB"),
                    "models": {"a": model(enabled=True, stub_tokens_per_second=10)},
                },
            }
        )
    )
    process, _ = await start_serve(settings)
    try:
        a = await start_node(nursery, redis_server.url, "nA")
        c = await start_node(nursery, redis_server.url, "nC")
        await until(
            lambda: sees_loaded(a, "nB") and sees_loaded(c, "nB"), "nA and nC see nB's model"
        )
        async with httpx.AsyncClient(base_url=a.url, timeout=10) as client:
            body = {"model": "a", "messages": [{"role": "user", "content": "hi"}], "stream": True}
            got: list[str] = []
            with trio.fail_after(10):  # never a hang
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    async for line in response.aiter_lines():
                        got.append(line)
                        if len(got) == 3:
                            process.send_signal(signal.SIGKILL)
            events = [json.loads(x[6:]) for x in got if x.startswith("data: {")]
            assert any("error" in e for e in events), got

            # nB's record expires (node_ttl_s, no heartbeat renews it), and the model is
            # served again by a load elsewhere.
            await until(lambda: "nB" not in router(a).node.registry.peers, "nB's expiry")
            with within("the request after nB's expiry"):
                text, errors = await stream_text(client)
            assert (text.strip(), errors) == (REPLY, [])
            states = {
                a.pool.model("a").state,
                c.pool.model("a").state,
            }
            assert "loaded" in states
        async with open_ledger(redis_server.url) as ledger:
            with within("the expiry of nB's leases (lease_ttl_s, never renewed)"):
                while any(x.host == "host-nB" for x in await ledger.list_leases()):
                    await trio.sleep(0.05)
    finally:
        if process.returncode is None:
            process.kill()
        await process.wait()


async def test_a_relayed_stream_its_client_leaves_is_charged_once_by_the_node_that_ran_it(
    redis_server: RedisServer, nursery: trio.Nursery, private_state: Path
) -> None:
    long = " ".join(f"w{i}" for i in range(400))
    a, b = [
        await start_node(nursery, redis_server.url, n, stub_reply=long, stub_tokens_per_second=50)
        for n in ("nA", "nB")
    ]
    body = {"model": "a", "messages": [{"role": "user", "content": "one two"}], "stream": True}
    async with httpx.AsyncClient(timeout=10) as http:
        loaded = await http.post(f"{b.url}/v1/admin/models/a/load")
        assert loaded.status_code == 200, loaded.text
        await until(lambda: sees_loaded(a, "nB"), 5)
        read = 0
        async with http.stream("POST", f"{a.url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            async for line in response.aiter_lines():
                read += '"content"' in line
                if read == 6:
                    break  # the client leaves node A; A's relay leaves node B
            else:
                raise AssertionError("the stream ended before the client left")
    assert b.pool.parts_for_tests().usage is not None and a.pool.parts_for_tests().usage is not None
    await until(lambda: b.pool.parts_for_tests().usage.written == 1, 10)  # type: ignore[union-attr]
    with sqlite3.connect(private_state / FILE_NAME) as db:
        rows = db.execute("SELECT prompt_tokens, output_tokens, status FROM usage").fetchall()
    ((prompt, output, status),) = rows
    assert (prompt, status) == (2, "cancelled")
    assert 5 <= output < 400
    # Node A relayed it and records nothing: one row in the cluster.
    assert a.pool.parts_for_tests().usage.written == 0
