"""Image refusals on every surface: 400 ``image_refused`` in each surface's error shape."""

from __future__ import annotations

import base64
import json
from typing import Any

import httpx
import trio
from trio_websocket import open_websocket_url

from pool import ServerInfo
from tests.media.helpers import PNG, PNG_URL

from .conftest import STUB_MODELS, start_server

MODELS: dict[str, dict[str, Any]] = {
    **STUB_MODELS,
    "vision": {"backend": "stub", "enabled": True, "modalities": ["text", "image"]},
}


def _content(url: str) -> list[dict[str, Any]]:
    return [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": url}},
    ]


async def _server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery, MODELS)


async def test_responses_and_chat_completions(nursery: trio.Nursery) -> None:
    server = await _server(nursery)
    loopback = f"http://127.0.0.1:{server.port}/health"
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        ok = await client.post(
            "/v1/responses", json={"model": "vision", "input": _content(PNG_URL)}
        )
        assert ok.status_code == 200 and ok.json()["output_text"] == "what is it?"

        refused = await client.post(
            "/v1/responses", json={"model": "vision", "input": _content(loopback)}
        )
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert (error["code"], error["reason"]) == ("image_refused", "fetch_disabled")

        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "vision", "messages": [{"role": "user", "content": _content(loopback)}]},
        )
        assert chat.status_code == 400
        assert chat.json()["error"]["code"] == "image_refused"
        assert chat.json()["error"]["type"] == "invalid_request_error"

        local_file = await client.post(
            "/v1/chat/completions",
            json={
                "model": "vision",
                "messages": [{"role": "user", "content": _content("file:///etc/passwd")}],
            },
        )
        assert local_file.status_code == 400
        assert "file_not_allowed" in local_file.json()["error"]["message"]


async def test_ollama(nursery: trio.Nursery) -> None:
    server = await _server(nursery)
    png = base64.b64encode(PNG).decode()
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        ok = await client.post(
            "/api/generate",
            json={"model": "vision", "prompt": "what?", "images": [png], "stream": False},
        )
        assert ok.status_code == 200 and ok.json()["response"] == "what?"
        # Not base64: refused by the document's pattern, naming the image, in Ollama's shape.
        refused = await client.post(
            "/api/chat",
            json={
                "model": "vision",
                "messages": [{"role": "user", "content": "what?", "images": ["bm90IGFuIGltYWdl!"]}],
                "stream": False,
            },
        )
        assert refused.status_code == 400
        assert set(refused.json()) == {"error"}
        assert refused.json()["error"].startswith("messages.0.images.0: String should match")


async def test_websocket(nursery: trio.Nursery) -> None:
    server = await _server(nursery)
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    async with open_websocket_url(url) as ws:
        body = {"model": "vision", "input": _content("http://169.254.169.254/latest/meta-data")}
        await ws.send_message(json.dumps(body))
        with trio.fail_after(5):
            event = json.loads(await ws.get_message())
        assert event["type"] == "error"
        assert (event["error"]["code"], event["error"]["reason"]) == (
            "image_refused",
            "fetch_disabled",
        )
