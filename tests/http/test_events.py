"""``GET /v1/admin/events``: the admin state pushed as Server-Sent Events."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio

from pool import ServerInfo, open_pool
from pool.config import build_settings
from pool.http.admin._events import state_events
from tests.bounds import within
from tests.http.conftest import STUB_MODELS, start_server

MODELS = {**STUB_MODELS, "cold": {"backend": "stub", "stub_load_seconds": 0.5}}


@asynccontextmanager
async def state_stream(
    info: ServerInfo, token: str | None = None, kind: str = "state"
) -> AsyncIterator[trio.MemoryReceiveChannel[dict[str, Any]]]:
    """The decoded ``kind`` events of one open stream, as a channel."""
    send, receive = trio.open_memory_channel[dict[str, Any]](100)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        httpx.AsyncClient(base_url=info.url, timeout=httpx.Timeout(10, read=None)) as client,
        client.stream("GET", "/v1/admin/events", headers=headers) as response,
        trio.open_nursery() as nursery,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")

        async def read() -> None:
            event = ""
            async with send:
                async for line in response.aiter_lines():
                    if line.startswith("event: "):
                        event = line.removeprefix("event: ")
                    elif line.startswith("data: ") and event == kind:
                        await send.send(json.loads(line.removeprefix("data: ")))

        nursery.start_soon(read)
        yield receive
        nursery.cancel_scope.cancel()


def states(event: dict[str, Any]) -> dict[str, str]:
    return {row["name"]: row["runtime_state"] for row in event["models"]}


async def test_the_state_comes_at_once_then_each_change(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery, MODELS, engine={"gpu_budget_mib": [4096], "virtual_gpus": True}
    )
    async with (
        state_stream(info) as events,
        httpx.AsyncClient(base_url=info.url) as client,
        trio.open_nursery() as requests,  # left (the request answered) before the client
    ):
        with within("the first state event"):
            first = await events.receive()
        assert states(first)["cold"] == "unloaded" and states(first)["echo"] == "loaded"
        # The rows are the admin API's, with everything a dashboard needs.
        (row,) = (r for r in first["models"] if r["name"] == "cold")
        assert {"load_constraints", "vram_estimate_source", "queue_depth"} <= set(row)
        assert first["gpus"][0]["total_mib"] == 4096 and first["pulls"] == []
        requests.start_soon(client.post, "/v1/admin/models/cold/load")
        seen = []
        with within("cold's loading and loaded states"):
            while not seen or seen[-1] != "loaded":
                seen.append(states(await events.receive())["cold"])
        assert seen == ["loading", "loaded"]
        # Nothing more while nothing changes: test_an_unchanged_pool_sends_only_keep_alives.


async def test_counters_are_pushed_without_a_state_change(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS)
    async with (
        state_stream(info) as events,
        httpx.AsyncClient(base_url=info.url) as client,
        trio.open_nursery() as requests,
    ):
        await events.receive()
        # `slow` streams 40 words at 20 a second: its in-flight count shows while it runs.
        requests.start_soon(
            partial(client.post, "/v1/responses", json={"model": "slow", "input": "x"}, timeout=10)
        )
        with within("slow's in-flight count going to 1 and back"):
            while True:
                rows = {r["name"]: r for r in (await events.receive())["models"]}
                if rows["slow"]["runtime_inflight"] == 1:
                    break
            while rows["slow"]["runtime_inflight"] != 0:
                rows = {r["name"]: r for r in (await events.receive())["models"]}


async def test_events_need_the_admin_token(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS, auth={"admin_token": "s3cret"})
    async with httpx.AsyncClient(base_url=info.url) as client:
        refused = await client.get("/v1/admin/events")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "unauthorized"
    async with state_stream(info, token="s3cret") as events:
        with within("the first state event with the admin token"):
            assert "cold" in states(await events.receive())


async def test_the_stream_ends_at_shutdown(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS)
    async with state_stream(info) as events:
        await events.receive()
        info.shutdown()
        # A last event says so, then the stream ends: it does not hold up the shutdown.
        with within("the last event and the stream's end at shutdown"):
            async for event in events:
                last = event
        assert last["shutting_down"] is True


async def test_decisions_follow_as_their_own_events(nursery: trio.Nursery) -> None:
    """A load made while the stream is open pushes its placement as a ``decision`` event
    (decisions made before the stream opened are not replayed)."""
    info = await start_server(
        nursery, MODELS, engine={"gpu_budget_mib": [4096], "virtual_gpus": True}
    )
    async with (
        state_stream(info, kind="decision") as decisions,
        httpx.AsyncClient(base_url=info.url, timeout=10) as client,
    ):
        assert (await client.post("/v1/admin/models/cold/load")).status_code == 200
        # The first decision to come is this load's: the startup loads' decisions (echo's
        # and slow's placements) were made before the stream opened.
        with within("the load's decision event"):
            placed = await decisions.receive()
        assert (placed["action"], placed["model"]) == ("place", "cold")
        assert placed["gpus"] == [[0]] and placed["reason"]


async def test_an_unchanged_pool_sends_only_keep_alives(autojump_clock: trio.abc.Clock) -> None:
    """Between changes the stream looks at the pool once a second and sends nothing
    new: over a (virtual) minute of an idle pool, only the keep-alive comments."""
    settings = build_settings(
        {"engine": {"gpu_budget_mib": [4096], "virtual_gpus": True, "models": MODELS}}
    )
    async with open_pool(settings) as pool:
        with within("the startup loads"):
            while (
                pool.snapshot("echo").state != "loaded" or pool.snapshot("slow").state != "loaded"
            ):
                await pool.wait_change()
        async with contextlib.aclosing(state_events(pool)) as stream:
            assert await anext(stream) == b"retry: 2000\n\n"
            assert (await anext(stream)).startswith(b"event: state\n")
            sent: list[bytes] = []
            with trio.move_on_after(60):
                async for chunk in stream:
                    sent.append(chunk)
    # A keep-alive comment every 15 s, and no state event: each look found no change.
    assert sent and set(sent) == {b": keep-alive\n\n"}, sent
