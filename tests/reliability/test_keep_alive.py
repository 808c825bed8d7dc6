"""A body that arrives after its headers never wedges the keep-alive connection, whatever
the route does with it (found by the soak: an unload answered without reading its body,
and the next request on that connection was never answered)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import trio

from .conftest import start_server


async def _late_body() -> AsyncIterator[bytes]:
    await trio.sleep(0.2)  # the route has run by now
    yield b"{}"


async def test_late_bodies_on_one_connection(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, {"m": {"backend": "stub", "enabled": True}})
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        calls = [
            ("/v1/admin/models/m/unload", 200),  # answers without needing the body
            ("/v1/admin/models/m/load", 200),
            ("/v1/admin/models/nope/unload", 404),  # refused before the body is read
            ("/v1/admin/models/m/unload", 200),
            ("/v1/admin/models/m/load", 200),
        ]
        for path, status in calls:
            with trio.fail_after(3):
                reply = await client.post(path, content=_late_body())
            assert reply.status_code == status, (path, reply.text)
