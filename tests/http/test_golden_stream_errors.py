"""Golden bytes of an error that happens after a stream started, on every surface.

The stub is made to fail after two tokens (a monkeypatch at the runtime boundary, the
same on any version of the pool), so each surface's mid-stream error rendering is
pinned: the SSE ``error`` event, the OpenAI error chunk, the Ollama error line and the
WebSocket error frame, plus the plain JSON answers of the same failure.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from trio_websocket import open_websocket_url

from pool.backends.stub import StubRuntime
from pool.errors import BackendError

from .conftest import start_server
from .test_golden import Transcript, _client, _frames_until, _ws_url, normalize_text


async def _fail_after_two_tokens(self: StubRuntime, request: Any, sink: Any) -> Any:
    await sink.send("The")
    await sink.send(" capital")
    raise BackendError("the runtime fell over")


@pytest.fixture
def failing_stub(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(StubRuntime, "generate", _fail_after_two_tokens)


_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


async def test_errors_after_the_stream_started(nursery: trio.Nursery, failing_stub: None) -> None:
    models = {"broken": {"backend": "stub", "enabled": True}}
    info = await start_server(nursery, models, runner_id="golden-runner")
    transcript = Transcript("stream_errors")
    async with _client(info) as client:
        for path, body in (
            ("/v1/responses", {"model": "broken", "input": "hi", "stream": True}),
            ("/v1/responses", {"model": "broken", "input": "hi"}),
            ("/v1/chat/completions", {"model": "broken", "messages": _MESSAGES, "stream": True}),
            ("/v1/chat/completions", {"model": "broken", "messages": _MESSAGES}),
            ("/api/chat", {"model": "broken", "messages": _MESSAGES}),
            ("/api/chat", {"model": "broken", "messages": _MESSAGES, "stream": False}),
            ("/api/generate", {"model": "broken", "prompt": "hi"}),
        ):
            transcript.exchange(await client.post(path, json=body))
    async with open_websocket_url(_ws_url(info)) as ws:
        sent = json.dumps({"model": "broken", "input": "hi"})
        await ws.send_message(sent)
        transcript.note(f">>> {sent}")
        for frame in await _frames_until(ws, "response.completed", "error"):
            transcript.note(f"<<< {normalize_text(frame)}")
    transcript.check()
