"""A request its client leaves early is charged what it used, on every surface.

Each surface streams a long stub reply to a key with a small daily budget; the client
reads a few events and leaves. The usage row then carries the prompt and the tokens
generated, with the status ``cancelled``, and two such streams spend the budget: the
next request is refused.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from pool import ServerInfo
from pool.actors import USAGE_FILE_NAME as FILE_NAME

from .conftest import start_server

KEY = "sk-metered"
PROMPT = "one two three"  # 3 prompt tokens on the stub
MODELS = {
    "long": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": " ".join(f"w{i}" for i in range(400)),
        "stub_tokens_per_second": 50,
    }
}
# One cut stream (3 prompt tokens and the 8 or so generated) stays under it; two spend it.
BUDGET = 20
BEARER = {"Authorization": f"Bearer {KEY}"}
# Pieces of text the client reads before it leaves (the first may be an empty opening).
READS = 8


async def metered_server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(
        nursery,
        MODELS,
        auth={"keys": [{"name": "metered", "key": KEY}]},
        budgets=[{"key": "metered", "tokens_per_day": BUDGET}],
        usage={"flush_ms": 10},
    )


def _rows(state: Path) -> list[tuple[Any, ...]]:
    if not (state / FILE_NAME).exists():
        return []
    with sqlite3.connect(state / FILE_NAME) as db:
        return db.execute(
            "SELECT key, prompt_tokens, output_tokens, status FROM usage ORDER BY rowid"
        ).fetchall()


async def _recorded(state: Path, count: int) -> list[tuple[Any, ...]]:
    """The usage rows, once ``count`` of them are written (within a flush)."""
    with trio.fail_after(30):
        while len(rows := _rows(state)) < count:
            await trio.sleep(0.02)
    return rows


async def _read_lines_then_leave(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                                 needle: str, reads: int) -> None:  # fmt: skip
    """POST a streamed request; leave once ``reads`` lines containing ``needle`` came."""
    seen = 0
    async with client.stream("POST", path, json=body, headers=BEARER) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            seen += needle in line
            if seen >= reads:
                return  # closing the response here closes the connection
    raise AssertionError(f"the stream of {path} ended before {reads} pieces")


def _http_stream(path: str, body: dict[str, Any], needle: str) -> Callable[..., Awaitable[None]]:
    async def cut(server: ServerInfo, client: httpx.AsyncClient) -> None:
        await _read_lines_then_leave(client, path, body, needle, reads=READS)

    return cut


def _ws_url(server: ServerInfo) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


async def _ws_deltas(ws: Any, count: int) -> None:
    with trio.fail_after(30):
        seen = 0
        while seen < count:
            event = json.loads(await ws.get_message())
            assert event["type"] != "error", event
            seen += event["type"] == "response.output_text.delta"


async def _websocket_closed(server: ServerInfo, client: httpx.AsyncClient) -> None:
    async with open_websocket_url(_ws_url(server), extra_headers=list(BEARER.items())) as ws:
        await ws.send_message(json.dumps({"model": "long", "input": PROMPT}))
        await _ws_deltas(ws, READS)


async def _websocket_cancelled(server: ServerInfo, client: httpx.AsyncClient) -> None:
    """The socket's own ``response.cancel``, the socket kept open."""
    async with open_websocket_url(_ws_url(server), extra_headers=list(BEARER.items())) as ws:
        await ws.send_message(json.dumps({"model": "long", "input": PROMPT}))
        await _ws_deltas(ws, READS)
        await ws.send_message(json.dumps({"type": "response.cancel"}))
        with trio.fail_after(30):
            while json.loads(await ws.get_message())["type"] != "response.cancelled":
                pass


async def _json_abandoned(server: ServerInfo, client: httpx.AsyncClient) -> None:
    """A plain (not streamed) request whose client gives up while it generates."""
    async with httpx.AsyncClient(base_url=server.url, timeout=0.2) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post(
                "/v1/responses", json={"model": "long", "input": PROMPT}, headers=BEARER
            )


CHAT = [{"role": "user", "content": PROMPT}]
SURFACES: dict[str, Callable[..., Awaitable[None]]] = {
    "responses-sse": _http_stream(
        "/v1/responses", {"model": "long", "input": PROMPT, "stream": True}, '"delta"'
    ),
    "responses-json": _json_abandoned,
    "responses-websocket-closed": _websocket_closed,
    "responses-websocket-cancel": _websocket_cancelled,
    "chat-completions": _http_stream(
        "/v1/chat/completions", {"model": "long", "messages": CHAT, "stream": True}, '"content"'
    ),
    "completions": _http_stream(
        "/v1/completions", {"model": "long", "prompt": PROMPT, "stream": True}, '"text"'
    ),
    "openai-responses": _http_stream(
        "/openai/v1/responses",
        {"model": "long", "input": PROMPT, "stream": True},
        '"delta"',
    ),
    "messages": _http_stream(
        "/v1/messages",
        {"model": "long", "max_tokens": 1000, "messages": CHAT, "stream": True},
        "text_delta",
    ),
    "ollama-chat": _http_stream("/api/chat", {"model": "long", "messages": CHAT}, '"content"'),
    "ollama-generate": _http_stream(
        "/api/generate", {"model": "long", "prompt": PROMPT}, '"response"'
    ),
}


@pytest.mark.parametrize("surface", SURFACES)
async def test_a_cut_request_is_charged_and_spends_the_budget(
    nursery: trio.Nursery, private_state: Path, surface: str
) -> None:
    server = await metered_server(nursery)
    cut = SURFACES[surface]
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        await cut(server, client)
        (row,) = await _recorded(private_state, 1)
        key, prompt, output, status = row
        assert (key, status) == ("metered", "cancelled")
        assert prompt == 3
        # Every token generated counts, read by the client or not.
        assert READS - 1 <= output < 400
        assert prompt + output < BUDGET, "one cut stream must leave budget for a second"

        await cut(server, client)
        await _recorded(private_state, 2)
        refused = await client.post(
            "/v1/chat/completions", json={"model": "long", "messages": CHAT}, headers=BEARER
        )
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "budget_exceeded"
        # The refusal is a usage row of its own, with no tokens.
        rows = await _recorded(private_state, 3)
        assert rows[2] == ("metered", 0, 0, "budget_exceeded")

        # The tenant's token counters count the cut streams too.
        metrics = (await client.get("/metrics")).text
        assert 'llm_pool_tenant_prompt_tokens_total{tenant="default"} 6.0' in metrics
        by_key = (await client.get("/v1/admin/usage", params={"group_by": "key"})).json()
        (totals,) = by_key["usage"]
        assert totals["requests"] == 3
        assert totals["prompt_tokens"] == 6
        assert totals["output_tokens"] == rows[0][2] + rows[1][2]
