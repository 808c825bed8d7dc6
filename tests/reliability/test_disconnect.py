"""A client that goes away stops its generation, on every streaming surface, both when
the model runs in this pool and when it is relayed to an upstream.

The proof is the model's running count (``snapshot().running``) falling back to 0 while
the stub still had most of its words to send (2000 words at 20 per second: 100 s); for
the relay, the upstream pool's count falls too, so its request ended as well. The bound,
ABORT_WITHIN_S, is ten times what a stop takes on a loaded machine (about one token, or
a relay's round trip), and a tenth of the stream.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from pool import ServerInfo

from .conftest import start_server, wait_for, words

ABORT_WITHIN_S = 10.0
SLOW = {
    "backend": "stub",
    "enabled": True,
    "target_inflight": 4,
    "stub_reply": words(2000),
    "stub_tokens_per_second": 20,
}


# A request names no max_tokens: this default lets the stub's 2000 words run (a relay
# forwards its own default upstream).
ENGINE = {"decoding": {"max_tokens": 4000}}


async def _pools(nursery: trio.Nursery, relayed: bool) -> tuple[ServerInfo, list[ServerInfo]]:
    """The pool the client talks to, and every pool whose model must stop."""
    if not relayed:
        front = await start_server(nursery, {"m": SLOW}, engine=ENGINE)
        return front, [front]
    upstream = await start_server(nursery, {"m": SLOW}, engine=ENGINE)
    remote = {
        "backend": "openai_remote",
        "enabled": True,
        "target_inflight": 4,
        "remote_base_url": upstream.url + "/v1",
        "remote_model": "m",
    }
    front = await start_server(nursery, {"m": remote}, engine=ENGINE)
    return front, [front, upstream]


def _stopped(info: ServerInfo) -> bool:
    return info.pool.snapshot("m").running == 0


def _all_running(pools: list[ServerInfo]) -> None:
    assert [info.pool.snapshot("m").running for info in pools] == [1] * len(pools)


async def _sse_then_leave(
    url: str, path: str, body: dict[str, Any], pools: list[ServerInfo]
) -> None:
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as client,
        client.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        seen = 0
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                seen += 1
                if seen == 3:
                    _all_running(pools)
                    return  # leaving the block closes the connection mid-stream


async def _websocket_then_leave(url: str, body: dict[str, Any], pools: list[ServerInfo]) -> None:
    ws_url = url.replace("http://", "ws://") + "/v1/responses"
    async with open_websocket_url(ws_url) as ws:
        await ws.send_message(json.dumps(body))
        deltas = 0
        while deltas < 2:
            event = json.loads(await ws.get_message())
            assert event["type"] != "error", event
            deltas += event["type"] == "response.output_text.delta"
        _all_running(pools)


@pytest.mark.parametrize("relayed", [False, True], ids=["in-process", "relayed"])
@pytest.mark.parametrize("surface", ["sse", "websocket", "chat"])
async def test_disconnect_stops_generation(
    nursery: trio.Nursery, surface: str, relayed: bool
) -> None:
    front, pools = await _pools(nursery, relayed)
    extra = {"allow_remote": True} if relayed else {}
    with trio.fail_after(60):
        if surface == "sse":
            body = {"model": "m", "input": "x", "stream": True, **extra}
            await _sse_then_leave(front.url, "/v1/responses", body, pools)
        elif surface == "chat":
            messages = [{"role": "user", "content": "x"}]
            body = {"model": "m", "messages": messages, "stream": True, **extra}
            await _sse_then_leave(front.url, "/v1/chat/completions", body, pools)
        else:
            await _websocket_then_leave(front.url, {"model": "m", "input": "x", **extra}, pools)
    # Running everywhere when the client left (with ~100 s of words to go) ...
    left_at = trio.current_time()
    # ... and stopped everywhere within the bound.
    for info in pools:
        await wait_for(partial(_stopped, info), ABORT_WITHIN_S)
    assert trio.current_time() - left_at < ABORT_WITHIN_S
    # Nothing else was disturbed: the same pool serves the next request.
    async with httpx.AsyncClient(base_url=front.url, timeout=10) as client:
        reply = await client.post(
            "/v1/responses",
            json={"model": "m", "input": "x", "decoding": {"max_tokens": 2}, **extra},
        )
    assert reply.status_code == 200 and reply.json()["output_text"] == "w0 w1"
