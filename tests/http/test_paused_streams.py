"""A paused stream over HTTP: the connection stays open with the dialect's keep-alive and
the text goes on where it stopped (docs/vram.md, "Pause and resume"; #46)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

from .conftest import start_server

WORDS = [f"w{i}" for i in range(30)]
MODELS = {
    "low": {
        "backend": "stub",
        "on_demand": True,
        "stub_vram_mib": 700,
        "vram_mb": 700,
        "stub_reply": " ".join(WORDS),
        "stub_tokens_per_second": 20,
    },
    "high": {
        "backend": "stub",
        "on_demand": True,
        "stub_vram_mib": 700,
        "vram_mb": 700,
        "stub_reply": "the answer",
        "stub_load_seconds": 0.3,
    },
}
ENGINE = {
    "gpu_budget_mib": [1000],
    "virtual_gpus": True,
    "gpu_reserve_mib": 0,
    "min_resident_s": 0,
}


async def test_an_openai_stream_paused_for_a_swap_keeps_its_connection_and_its_text(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, MODELS, engine=ENGINE)
    body = {"model": "low", "messages": [{"role": "user", "content": "go"}], "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        raw: list[str] = []
        high_done = trio.Event()

        async def high() -> None:
            reply = await http.post(
                "/v1/chat/completions",
                json={"model": "high", "messages": [{"role": "user", "content": "now"}]},
                headers={"X-Priority": "high"},
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == "the answer"
            high_done.set()

        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Priority": "low"}
        ) as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                raw.append(line)
                if sum(1 for r in raw if '"content": "' in r or '"content":"' in r) == 5:
                    nursery.start_soon(high)
        assert high_done.is_set()
    # The pause showed itself as SSE comments, between two pieces of the text.
    contents = [i for i, r in enumerate(raw) if '"content": "' in r or '"content":"' in r]
    assert any(contents[4] < i < contents[-1] for i, r in enumerate(raw) if r == ": keep-alive")
    chunks = [json.loads(r[6:]) for r in raw if r.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == " ".join(WORDS)
    assert raw[-1] == "data: [DONE]" or "data: [DONE]" in raw
    actions = [d.action for d in server.pool.decisions("low")]
    assert "pause" in actions and "resume" in actions


async def test_an_ollama_stream_stalls_through_a_pause_and_goes_on(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, MODELS, engine=ENGINE)
    body = {"model": "low", "messages": [{"role": "user", "content": "go"}], "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        lines: list[dict[str, object]] = []

        async def high() -> None:
            reply = await http.post(
                "/api/chat",
                json={"model": "high", "messages": [{"role": "user", "content": "now"}]},
                headers={"X-Priority": "high"},
            )
            assert reply.status_code == 200, reply.text

        async with http.stream(
            "POST", "/api/chat", json=body, headers={"X-Priority": "low"}
        ) as stream:
            async for line in stream.aiter_lines():
                assert line.strip(), "NDJSON has no blank keep-alive lines"
                lines.append(json.loads(line))
                if len(lines) == 5:
                    nursery.start_soon(high)
    text = "".join(str(line["message"]["content"]) for line in lines)  # type: ignore[index]
    assert text == " ".join(WORDS) and lines[-1]["done"] is True
    assert "pause" in [d.action for d in server.pool.decisions("low")]


def _piece(line: str) -> str | None:
    """The text piece an Anthropic or Responses SSE line carries; None for any other."""
    if not line.startswith("data: {"):
        return None
    event = json.loads(line[6:])
    if event.get("type") == "content_block_delta":
        return str(event["delta"].get("text", ""))
    if event.get("type") == "response.output_text.delta":
        return str(event["delta"])
    return None


async def _high(http: httpx.AsyncClient) -> None:
    reply = await http.post(
        "/v1/chat/completions",
        json={"model": "high", "messages": [{"role": "user", "content": "now"}]},
        headers={"X-Priority": "high"},
    )
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("path", "body", "keep_alive"),
    [
        (
            "/v1/messages",
            {"model": "low", "max_tokens": 100, "messages": [{"role": "user", "content": "go"}]},
            'data: {"type": "ping"}',
        ),
        ("/v1/responses", {"model": "low", "input": "go"}, ": keep-alive"),
    ],
)
async def test_an_anthropic_or_responses_stream_keeps_alive_through_a_pause(
    nursery: trio.Nursery, path: str, body: dict[str, Any], keep_alive: str
) -> None:
    """Anthropic's stream sends its `ping` event, the Responses stream an SSE comment,
    while the stream is paused; the text then goes on where it stopped."""
    server = await start_server(nursery, MODELS, engine=ENGINE)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        raw: list[str] = []
        deltas: list[int] = []
        async with http.stream(
            "POST", path, json={**body, "stream": True}, headers={"X-Priority": "low"}
        ) as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                line = line.replace('"type":"ping"', '"type": "ping"')
                if _piece(line) is not None:
                    deltas.append(len(raw))
                    if len(deltas) == 5:
                        nursery.start_soon(_high, http)
                raw.append(line)
    pings = [i for i, line in enumerate(raw) if line == keep_alive]
    assert any(deltas[4] < i < deltas[-1] for i in pings), raw
    assert "".join(_piece(line) or "" for line in raw) == " ".join(WORDS)
    assert "pause" in [d.action for d in server.pool.decisions("low")]


async def test_a_websocket_is_pinged_through_a_pause(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Responses WebSocket gets protocol pings (service.websocket_ping_s) while its
    stream is paused for a swap, then the rest of the text."""
    timeline: list[str] = []
    pong = WebSocketConnection._handle_ping_event

    async def seen(self: WebSocketConnection, event: Any) -> None:
        timeline.append("ping")
        await pong(self, event)

    monkeypatch.setattr(WebSocketConnection, "_handle_ping_event", seen)
    server = await start_server(nursery, MODELS, engine=ENGINE, websocket_ping_s=0.1)
    url = server.url.replace("http://", "ws://") + "/v1/responses"
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
        open_websocket_url(url, extra_headers=[("X-Priority", "low")]) as ws,
    ):
        await ws.send_message(json.dumps({"model": "low", "input": "go"}))
        text = ""
        while True:
            event = json.loads(await ws.get_message())
            if event["type"] == "response.output_text.delta":
                text += event["delta"]
                timeline.append("delta")
                if timeline.count("delta") == 5:
                    nursery.start_soon(_high, http)
            elif event["type"] in ("response.completed", "error"):
                break
    assert event["type"] == "response.completed", event
    assert text == " ".join(WORDS)
    # Pings came between two pieces of the text: the pause (the stub's pieces are 50 ms
    # apart, less than one ping interval).
    runs = "".join("p" if t == "ping" else "d" for t in timeline).split("d")
    assert max(len(r) for r in runs[5:-1]) >= 2, timeline
    assert "pause" in [d.action for d in server.pool.decisions("low")]
