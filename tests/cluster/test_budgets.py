"""One budget enforced by two pools that share a real redis-server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from pool import Pool, PoolError, open_pool
from pool.cluster import Keys, open_cluster, open_redis
from pool.config import Settings, build_settings

from ..actors.helpers import ask
from .conftest import RedisServer


def _settings(redis_url: str, node: str) -> Settings:
    return build_settings(
        {
            "service": {"budgets": [{"tenant": "acme", "tokens_per_day": 100}]},
            "engine": {
                "models": {"m": {"backend": "stub", "enabled": True}},
                "cluster": {
                    "redis_url": redis_url,
                    "node_id": node,
                    "heartbeat_s": 0.3,
                    "node_ttl_s": 1.5,
                    "budget_refresh_s": 0.1,
                },
            },
        }
    )


@asynccontextmanager
async def _node(redis_url: str, name: str) -> AsyncIterator[Pool]:
    settings = _settings(redis_url, name)
    async with open_cluster(settings) as node:
        assert node is not None
        async with open_pool(settings, ledger=node, budget_counters=node.budget_counters) as pool:
            yield pool


async def _refused_within(pool: Pool, seconds: float) -> PoolError:
    """Send small requests until the budget refuses one (the other pool's spending
    arrives with the next refresh), within ``seconds``."""
    with trio.fail_after(seconds):
        while True:
            try:
                await pool.respond(ask("m", "x"), tenant="acme")
            except PoolError as exc:
                return exc
            await trio.sleep(0.05)


async def test_two_pools_enforce_one_budget(redis_server: RedisServer) -> None:
    async with _node(redis_server.url, "a") as a, _node(redis_server.url, "b") as b:
        # Pool a spends 100 tokens (50 words echoed): the tenant's whole daily budget.
        await a.respond(ask("m", " ".join(["w"] * 50)), tenant="acme")
        with pytest.raises(PoolError) as on_a:
            await a.respond(ask("m", "x"), tenant="acme")
        assert on_a.value.code == "budget_exceeded"
        # Pool b spent nothing itself, yet refuses the tenant once it has read the count.
        refused = await _refused_within(b, 10)
        assert refused.code == "budget_exceeded" and refused.status == 429
        assert refused.retry_after_s is not None and 0 < refused.retry_after_s <= 86400
        assert refused.details["budget"]["spent_tokens"] >= 100
        # Another tenant still runs on both.
        await b.respond(ask("m", "x"), tenant="beta")
    # The count is one Redis key per window, with an expiry.
    async with open_redis(redis_server.url) as client:
        keys = [k async for k in client.scan_iter(match=f"{Keys().prefix}:tokens:*")]
        assert len(keys) == 1 and keys[0].startswith("llm-pool:tokens:tenant:acme:day:")
        assert int(await client.get(keys[0]) or 0) >= 100
        assert 0 < await client.ttl(keys[0]) <= 2 * 86400


async def test_spending_during_an_outage_reaches_redis_later(redis_server: RedisServer) -> None:
    async with _node(redis_server.url, "a") as a:
        redis_server.stop()
        # Redis is down: budgets are enforced with what this pool knows, nothing stalls.
        with trio.fail_after(10):
            await a.respond(ask("m", " ".join(["w"] * 30)), tenant="acme")
        redis_server.start()
        async with open_redis(redis_server.url) as client:
            with trio.fail_after(20):
                while True:
                    keys = [k async for k in client.scan_iter(match="llm-pool:tokens:*")]
                    if keys and int(await client.get(keys[0]) or 0) == 60:
                        break
                    await trio.sleep(0.1)
