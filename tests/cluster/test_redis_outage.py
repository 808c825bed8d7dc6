"""Redis goes away and comes back: the node serves its own models meanwhile, says so in
/health and the capabilities, and puts its record and leases back afterwards."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from pool.cluster import open_ledger

from ..http.conftest import start_server
from .conftest import RedisServer
from .test_pool_leases import HOST


async def test_a_node_keeps_serving_without_redis_and_rejoins(
    redis_server: RedisServer, nursery: trio.Nursery
) -> None:
    cluster = {
        "redis_url": redis_server.url,
        "node_id": "n1",
        "gpu_host": HOST,
        "lease_ttl_s": 2.0,
        "lease_renew_s": 0.3,
        "heartbeat_s": 0.3,
        "node_ttl_s": 1.5,
        "redis_timeout_s": 0.5,
    }
    models = {
        "a": {"backend": "stub", "enabled": True, "stub_vram_mib": 3000, "stub_reply": "ok"},
        "b": {"backend": "stub", "on_demand": True, "stub_vram_mib": 2000, "stub_reply": "ok"},
    }
    server = await start_server(
        nursery,
        models,
        engine={"gpu_budget_mib": [10_000], "virtual_gpus": True, "cluster": cluster},
    )
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=10) as client,
        open_ledger(redis_server.url) as ledger,
    ):

        async def cluster_state() -> dict[str, Any]:
            body: dict[str, Any] = (await client.get("/health")).json()
            return body["cluster"]

        async def until_redis(state: str) -> None:
            with trio.fail_after(10):
                while (await cluster_state())["redis"] != state:
                    await trio.sleep(0.05)

        async def ask(model: str) -> None:
            reply = await client.post("/v1/responses", json={"model": model, "input": "hi"})
            assert reply.status_code == 200, reply.text
            assert '"ok"' in reply.text, reply.text

        await until_redis("ok")
        status = await cluster_state()
        assert (status["node_id"], status["gpu_host"], status["error"]) == ("n1", HOST, None)
        assert {x.purpose for x in await ledger.list_leases()} == {"model a"}

        redis_server.stop()
        await until_redis("unreachable")
        assert "Redis unreachable" in (await cluster_state())["error"]
        capabilities = (await client.get("/v1/capabilities")).json()
        assert capabilities["health"] == "healthy"
        assert capabilities["cluster"]["redis"] == "unreachable"
        # The loaded model serves; an on-demand one loads by the local gate alone.
        await ask("a")
        with trio.fail_after(10):
            await ask("b")

        redis_server.start()  # empty: a restart without persistence
        await until_redis("ok")
        with trio.fail_after(10):
            while {x.purpose for x in await ledger.list_leases()} != {"model a", "model b"}:
                await trio.sleep(0.05)
            while not await ledger.client.exists(["llm-pool:node:n1"]):
                await trio.sleep(0.05)
        await ask("a")
