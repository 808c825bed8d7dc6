"""Cluster prefix affinity across two pools (stub models, a real redis-server): a
conversation's next turn goes to the node whose record names its prefix, in its own
tenant's scope only, and only while that node has a free slot for it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from pool import ServerInfo
from pool.cluster import ClusterRouter

from ..http.conftest import start_server
from .conftest import RedisServer
from .test_routing import cluster, until

# A first turn of five whole 512-character blocks; the stub echoes it as its answer.
FIRST = " ".join(f"word{i}" for i in range(400))


async def start_node(
    nursery: trio.Nursery, redis_url: str, node: str, **cluster_fields: Any
) -> ServerInfo:
    """A pool whose stub model "a" (two slots, echoing) is loaded."""
    model = {"backend": "stub", "target_inflight": 2, "stub_tokens_per_second": 1000}
    server = await start_server(
        nursery,
        {"a": model},
        engine={"cluster": {**cluster(redis_url, node), **cluster_fields}},
    )
    async with httpx.AsyncClient(timeout=10) as http:
        loaded = await http.post(f"{server.url}/v1/admin/models/a/load")
        assert loaded.status_code == 200, loaded.text
    return server


def router(server: ServerInfo) -> ClusterRouter:
    assert isinstance(server.pool.parts_for_tests().router, ClusterRouter)
    return server.pool.parts_for_tests().router


def peer_model(server: ServerInfo, node: str) -> dict[str, Any]:
    """Model "a" as ``server`` last read it in ``node``'s record ({} before that)."""
    record = router(server).node.registry.peers.get(node) or {}
    return next((m for m in record.get("models", ()) if m["name"] == "a"), {})


def dispatched(server: ServerInfo) -> int:
    """Requests the node served itself (not relayed)."""
    return server.pool.model("a").scheduler.dispatched_total


async def ask(url: str, messages: list[dict[str, str]], tenant: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        response = await client.post(
            "/v1/chat/completions",
            json={"model": "a", "messages": messages},
            headers={"X-Tenant-ID": tenant},
        )
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["message"]["content"]
    return text


async def first_turn(url: str, tenant: str, opening: str = FIRST) -> list[dict[str, str]]:
    """Ask ``opening`` at ``url``: the next turn's messages."""
    answer = await ask(url, [{"role": "user", "content": opening}], tenant)
    return [
        {"role": "user", "content": opening},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "and then?"},
    ]


async def sees_prompts_of(a: ServerInfo, b: ServerInfo, node: str) -> None:
    """Until ``a`` has read the recent prompts that ``b`` (``node``) has now."""
    mine = [key.hex() for key in b.pool.model("a").recent_prompts()]
    assert mine
    await until(lambda: peer_model(a, node).get("prefixes") == mine, 5)


@asynccontextmanager
async def busy(url: str, count: int) -> AsyncIterator[None]:
    """``count`` long requests of another tenant running at ``url`` meanwhile (each
    stream is held unread, so it stays in flight until the block is left)."""
    long = " ".join(["busy"] * 50_000)
    body = {"model": "a", "messages": [{"role": "user", "content": long}], "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        streams = [
            client.stream("POST", "/v1/chat/completions", json=body, headers={"X-Tenant-ID": "z"})
            for _ in range(count)
        ]
        opened = [await stream.__aenter__() for stream in streams]
        try:
            assert all(r.status_code == 200 for r in opened)
            yield
        finally:
            for stream in reversed(streams):
                await stream.__aexit__(None, None, None)


async def test_a_next_turn_goes_to_the_node_holding_its_prefix_even_when_busier(
    redis_server: RedisServer, nursery: trio.Nursery
) -> None:
    a = await start_node(nursery, redis_server.url, "nA")
    b = await start_node(nursery, redis_server.url, "nB")
    turn = await first_turn(b.url, "t1")
    async with busy(b.url, 1):
        await until(lambda: peer_model(a, "nB").get("in_flight") == 1, 5)
        await sees_prompts_of(a, b, "nB")
        served_by_b = dispatched(b)
        # A has the model loaded and is idle: by load it would serve this itself.
        await ask(a.url, turn, "t1")
        assert (dispatched(a), dispatched(b)) == (0, served_by_b + 1)
        # B served it in tenant t1's scope (the relay carries it), not in a shared one.
        assert (
            b.pool.parts_for_tests().metrics.requests.labels("a", "t1", "success")._value.get() == 2
        )
        # The same conversation from another tenant holds nothing on B: served by A.
        await ask(a.url, turn, "t2")
        assert (dispatched(a), dispatched(b)) == (1, served_by_b + 1)
        # B holds less than half of a turn that adds a long text: balance decides (A).
        longer = [*turn[:2], {"role": "user", "content": "and then? " * 1000}]
        await ask(a.url, longer, "t1")
        assert (dispatched(a), dispatched(b)) == (2, served_by_b + 1)


async def test_a_node_without_a_free_slot_is_not_preferred_for_its_prefix(
    redis_server: RedisServer, nursery: trio.Nursery
) -> None:
    a = await start_node(nursery, redis_server.url, "nA")
    b = await start_node(nursery, redis_server.url, "nB")
    turn = await first_turn(b.url, "t1")
    other_turn = await first_turn(b.url, "t1", "another conversation: " + FIRST)
    async with busy(b.url, 2):
        await until(lambda: peer_model(a, "nB").get("in_flight") == 2, 5)
        await sees_prompts_of(a, b, "nB")
        served_by_b = dispatched(b)
        # Both of B's slots are taken: the request would wait there, so A serves it.
        await ask(a.url, turn, "t1")
        assert (dispatched(a), dispatched(b)) == (1, served_by_b)
    # B is free again: the next turn of the other conversation goes to its prefix.
    await until(lambda: peer_model(a, "nB").get("in_flight") == 0, 5)
    await ask(a.url, other_turn, "t1")
    assert (dispatched(a), dispatched(b)) == (1, served_by_b + 1)


async def test_a_wait_up_to_the_bound_is_allowed_for_a_prefix(
    redis_server: RedisServer, nursery: trio.Nursery
) -> None:
    a = await start_node(nursery, redis_server.url, "nA", affinity_max_queue=1)
    b = await start_node(nursery, redis_server.url, "nB")
    turn = await first_turn(b.url, "t1")
    async with busy(b.url, 2):
        await until(lambda: peer_model(a, "nB").get("in_flight") == 2, 5)
        await sees_prompts_of(a, b, "nB")
        async with trio.open_nursery() as asking:
            # First in B's queue is within A's bound of 1: it goes to B and waits there
            # (behind the held streams).
            asking.start_soon(ask, a.url, turn, "t1")
            await until(lambda: b.pool.model("a").queue_depth == 1, 5)
            assert dispatched(a) == 0
            asking.cancel_scope.cancel()


async def test_the_summary_in_the_record_keeps_the_newest_prompts_within_its_cap(
    redis_server: RedisServer, nursery: trio.Nursery
) -> None:
    a = await start_node(nursery, redis_server.url, "nA")
    b = await start_node(nursery, redis_server.url, "nB", affinity_keys=3)
    turns = [await first_turn(b.url, "t1", f"conversation {n}: {FIRST}") for n in range(5)]
    # Conversation 4's next turn on B takes the place of its first one, not a second:
    # B's three are then conversations 4, 3 and 2.
    answer = await ask(b.url, turns[4], "t1")
    turns[4] += [{"role": "assistant", "content": answer}, {"role": "user", "content": "so?"}]
    await sees_prompts_of(a, b, "nB")
    prefixes = peer_model(a, "nB")["prefixes"]
    assert len(prefixes) == 3 and all(len(p) == 16 and int(p, 16) >= 0 for p in prefixes)
    served_by_b = dispatched(b)
    for n in (4, 2):
        await ask(a.url, turns[n], "t1")
    assert (dispatched(a), dispatched(b)) == (0, served_by_b + 2)
    # Conversations 0 and 1 fell out of B's list: their next turns are A's own.
    for n in (0, 1):
        await ask(a.url, turns[n], "t1")
    assert (dispatched(a), dispatched(b)) == (2, served_by_b + 2)


def test_tenants_reach_the_peer_one_to_one() -> None:
    from pool.cluster._routing import _header_safe

    tenants = ["t1", "team a", "é", "%C3%A9", "日本", "%"]
    sent = [_header_safe(t) for t in tenants]
    assert sent[:2] == ["t1", "team a"]  # plain names go as they are
    assert len(set(sent)) == len(tenants)
    assert all(s.isascii() and s.isprintable() for s in sent)
