"""The lean ASGI layer in front of Quart: the hot routes answer as Quart answered them."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import trio

from .conftest import start_server

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


async def test_hot_routes_keep_each_surface_error_shape(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, allowed_hosts=["pool.example"], max_body_bytes=200)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        # Host refused: OpenAI's error object on Chat Completions, the pool's elsewhere.
        chat = await client.post("/v1/chat/completions", json=CHAT, headers={"host": "evil.test"})
        assert chat.status_code == 403
        assert chat.json()["error"]["type"] == "invalid_request_error"
        responses = await client.post(
            "/v1/responses", json={"model": "echo", "input": "x"}, headers={"host": "evil.test"}
        )
        assert responses.status_code == 403 and "type" not in responses.json()["error"]
        ok = {"host": "pool.example"}
        # Too large, by its Content-Length: 413 before the body is read.
        big = await client.post("/v1/chat/completions", content=b"x" * 300, headers=ok)
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"
        # Not JSON, and a schema failure, in OpenAI's shape.
        bad = await client.post("/v1/chat/completions", content=b"{", headers=ok)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        schema = await client.post("/v1/chat/completions", json={"model": "echo"}, headers=ok)
        assert schema.status_code == 422 and schema.json()["error"]["param"] == "messages"
        # The client's request id comes back; other methods are still Quart's.
        echoed = await client.post(
            "/v1/chat/completions", json=CHAT, headers={**ok, "x-request-id": "abc-1"}
        )
        assert echoed.status_code == 200 and echoed.headers["x-request-id"] == "abc-1"
        assert echoed.json()["choices"][0]["message"]["content"] == "hi"
        wrong = await client.get("/v1/chat/completions", headers=ok)
        assert wrong.status_code == 405


async def test_a_chunked_request_body_is_read_whole(nursery: trio.Nursery) -> None:
    server = await start_server(nursery)

    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "echo", '
        await trio.sleep(0.01)
        yield b'"input": "in two parts"}'

    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        reply = await client.post("/v1/responses", content=body())
        assert reply.status_code == 200 and reply.json()["output_text"] == "in two parts"
