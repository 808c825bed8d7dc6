"""The WebSocket on /v1/responses: sequences, cancel, errors, disconnects."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from pool import ServerInfo

from .conftest import WAITING_MODELS, running, start_server, wait_stopped


def _ws_url(server: ServerInfo) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


async def _until(ws: WebSocketConnection, kind: str) -> list[dict[str, Any]]:
    events = []
    with trio.fail_after(30):
        while True:
            event = json.loads(await ws.get_message())
            events.append(event)
            if event["type"] in (kind, "error"):
                return events


async def test_requests_in_sequence(server: ServerInfo) -> None:
    async with open_websocket_url(_ws_url(server)) as ws:
        for text in ("first one", "second one", "third"):
            await ws.send_message(json.dumps({"model": "echo", "input": text}))
            events = await _until(ws, "response.completed")
            deltas = "".join(
                e["delta"] for e in events if e["type"] == "response.output_text.delta"
            )
            assert events[0]["type"] == "response.created"
            assert deltas == events[-1]["response"]["output_text"] == text


async def test_the_handshake_cache_headers_reach_every_request(
    server: ServerInfo, cache_asked: list[tuple[str, str | None]]
) -> None:
    """X-Cache-Mode and X-Cache-Tag of the handshake apply to each request of the socket,
    as on the POST of the same path; a malformed one closes it (1008) like a bad tenant."""
    asked = cache_asked
    tagged = [("X-Cache-Mode", "none"), ("X-Cache-Tag", "conversation-7")]
    async with open_websocket_url(_ws_url(server), extra_headers=tagged) as ws:
        for text in ("one", "two"):
            await ws.send_message(json.dumps({"model": "echo", "input": text}))
            await _until(ws, "response.completed")
    async with open_websocket_url(_ws_url(server)) as ws:
        await ws.send_message(json.dumps({"model": "echo", "input": "plain"}))
        await _until(ws, "response.completed")
    assert asked == [("none", "conversation-7")] * 2 + [("auto", None)]

    bad = [("X-Cache-Mode", "always")]
    async with open_websocket_url(_ws_url(server), extra_headers=bad) as ws:
        event = json.loads(await ws.get_message())
        assert event["type"] == "error" and "X-Cache-Mode" in event["error"]["message"]
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason.code == 1008


async def test_errors_keep_the_connection_usable(server: ServerInfo) -> None:
    async with open_websocket_url(_ws_url(server)) as ws:
        for bad, code in [
            ("{not json", "invalid_request"),
            # Past Python's limit on reading an integer (4300 digits).
            ('{"model": "echo", "input": "x", "seed": ' + "9" * 5000 + "}", "invalid_request"),
            (json.dumps({"model": "echo"}), "validation_error"),
            (json.dumps({"model": "nope", "input": "x"}), "unknown_model"),
            (json.dumps({"type": "response.cancel"}), "invalid_request"),
        ]:
            await ws.send_message(bad)
            event = json.loads(await ws.get_message())
            assert event["type"] == "error" and event["error"]["code"] == code
        await ws.send_message(json.dumps({"model": "echo", "input": "still here"}))
        assert (await _until(ws, "response.completed"))[-1]["response"][
            "output_text"
        ] == "still here"


async def test_cancel_then_reuse(server: ServerInfo) -> None:
    async with (
        open_websocket_url(_ws_url(server)) as ws,
        httpx.AsyncClient(base_url=server.url) as client,
    ):
        await ws.send_message(json.dumps({"model": "slow", "input": "x"}))
        await _until(ws, "response.output_text.delta")
        await ws.send_message(json.dumps({"model": "echo", "input": "too soon"}))
        busy = await _until(ws, "error")
        assert busy[-1]["error"]["message"].startswith("a request is already running")
        await ws.send_message(json.dumps({"type": "response.cancel"}))
        events = await _until(ws, "response.cancelled")
        assert events[-1] == {"type": "response.cancelled"}
        row = (await client.get("/v1/admin/models/slow")).json()
        assert row["runtime_inflight"] == 0
        await ws.send_message(json.dumps({"model": "echo", "input": "after cancel"}))
        assert (await _until(ws, "response.completed"))[-1]["response"][
            "output_text"
        ] == "after cancel"


async def test_closing_the_socket_cancels(endless: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=endless.url, timeout=30) as client:
        async with open_websocket_url(_ws_url(endless)) as ws:
            await ws.send_message(json.dumps({"model": "endless", "input": "x"}))
            await _until(ws, "response.output_text.delta")
            assert await running(client, "endless") == 1
        await wait_stopped(client, "endless")


async def test_a_socket_waiting_for_a_load_sees_queued_then_loading(
    nursery: trio.Nursery,
) -> None:
    info = await start_server(nursery, WAITING_MODELS)
    async with open_websocket_url(_ws_url(info)) as ws:
        await ws.send_message(json.dumps({"model": "lazy", "input": "x"}))
        events = await _until(ws, "response.completed")
    kinds = [e["type"] for e in events]
    first_delta = kinds.index("response.output_text.delta")
    assert kinds[:3] == ["response.created", "response.queued", "response.loading"]
    assert events[1] == {"type": "response.queued", "position": 1, "waiting_for": "load"}
    assert set(kinds[1:first_delta]) == {"response.queued", "response.loading"}
    assert [e["progress"] for e in events if e["type"] == "response.loading"][1:4] == [
        0.25,
        0.5,
        0.75,
    ]
    assert events[-1]["response"]["output_text"] == "a b c"


async def _access_line(caplog: pytest.LogCaptureFixture, path: str) -> str:
    """The access log line of the socket on ``path``, once the server has closed it."""
    with trio.fail_after(10):
        while True:
            lines = [
                r.getMessage()
                for r in caplog.records
                if r.name == "pool.access" and f"path={path} " in r.getMessage()
            ]
            if lines:
                (line,) = lines
                return line
            await trio.sleep(0.01)


async def test_the_handshake_answer_carries_the_request_id(
    server: ServerInfo, caplog: pytest.LogCaptureFixture
) -> None:
    """As every HTTP answer does: the client's sane X-Request-Id, else a fresh one, on the
    101 and on the socket's access line."""
    caplog.set_level(logging.INFO, logger="pool.access")
    async with open_websocket_url(_ws_url(server), extra_headers=[("X-Request-Id", "ws-7")]) as ws:
        assert dict(ws.handshake_headers)[b"x-request-id"] == b"ws-7"
    line = await _access_line(caplog, "/v1/responses")
    assert line.startswith("request_id=ws-7 method=WEBSOCKET ")
    caplog.clear()
    async with open_websocket_url(_ws_url(server)) as ws:
        fresh = dict(ws.handshake_headers)[b"x-request-id"].decode()
    assert len(fresh) == 32
    assert (await _access_line(caplog, "/v1/responses")).startswith(f"request_id={fresh} ")


async def test_a_socket_whose_request_raises_is_logged_with_its_request_id(
    server: ServerInfo, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error on a socket is the pool's to log (traceback, request id) and
    closes it with 1011; the error handler itself does not fail on a WebSocket."""

    def broken_admit(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the pool")

    monkeypatch.setattr(server.pool, "admit", broken_admit)
    caplog.set_level(logging.ERROR)
    async with open_websocket_url(_ws_url(server), extra_headers=[("X-Request-Id", "ws-9")]) as ws:
        await ws.send_message(json.dumps({"model": "echo", "input": "x"}))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason.code == 1011
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.getMessage() == "request_id=ws-9 unhandled error on WEBSOCKET /v1/responses"
