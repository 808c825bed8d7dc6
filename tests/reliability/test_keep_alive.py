"""A body that arrives after its headers never wedges the keep-alive connection, whatever
the route does with it (found by the soak: an unload answered without reading its body,
and the next request on that connection was never answered)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from pool.http import RequestPipeline
from tests.bounds import within

from .conftest import start_server


async def test_late_bodies_on_one_connection(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each body is sent only once the server has the request's headers and either waits
    # for the body or has answered without it: the body arrives late, whatever the route
    # does with it.
    waiting: list[trio.Event] = []
    http = RequestPipeline._http

    async def noticed(
        self: RequestPipeline, scope: Any, request: Any, receive: Any, send: Any
    ) -> None:
        async def receiving() -> Any:
            waiting[-1].set()
            return await receive()

        async def sending(message: dict[str, Any]) -> None:
            await send(message)
            if message["type"] == "http.response.start":
                waiting[-1].set()

        await http(self, scope, request, receiving, sending)

    monkeypatch.setattr(RequestPipeline, "_http", noticed)

    async def late_body() -> AsyncIterator[bytes]:
        await waiting[-1].wait()
        yield b"{}"

    info = await start_server(nursery, {"m": {"backend": "stub", "enabled": True}})
    async with httpx.AsyncClient(base_url=info.url, timeout=None) as client:
        calls = [
            ("/v1/admin/models/m/unload", 200),  # answers without needing the body
            ("/v1/admin/models/m/load", 200),
            ("/v1/admin/models/nope/unload", 404),  # refused whatever the body says
            ("/v1/admin/models/m/unload", 200),
            ("/v1/admin/models/m/load", 200),
        ]
        for path, status in calls:
            waiting.append(trio.Event())
            with within(f"the answer to POST {path}, the body late, on the kept-alive connection"):
                reply = await client.post(path, content=late_body())
            assert reply.status_code == status, (path, reply.text)
