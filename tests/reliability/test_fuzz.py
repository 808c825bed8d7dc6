"""Hostile input on every route: generated bodies, path segments and WebSocket frames.
Never a 5xx, never a traceback in a response, and the pool serves normally afterwards.

Bounded: 50 examples per route, generated up front (hypothesis runs synchronously),
then sent over one connection. ``POST /api/pull`` is left out: a valid body starts a
download, which these loopback-only tests must not attempt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trio_websocket import open_websocket_url

from .conftest import start_server

EXAMPLES = 50
_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30)
)
_json_values = st.recursive(
    _scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    ["model", "name", "input", "messages", "prompt", "stream", "options", "format", "keep_alive",
     "decoding", "allow_remote", "replicas", "gguf_n_ctx", "modelId", "verifiedOpToken",
     "taskId", "cacheTag", "evictModel", "type", "content", "role", "images", "think", "tools",
     "max_tokens", "temperature", "stop", "n", "logprobs", "response_format", "surprise"]
)  # fmt: skip
_models = st.sampled_from(["echo", "x", "nope", ""]) | st.text(max_size=12)
_bodies = st.one_of(
    st.dictionaries(_fields, _json_values, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.tuples(_models, st.dictionaries(_fields, _json_values, max_size=4)).map(
        lambda t: json.dumps({"model": t[0], "input": "x", "messages": [], **t[1]}).encode()
    ),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
_segments = st.one_of(
    st.sampled_from(["echo", "x", "nope", "..", "%00", "a" * 300]),
    st.text(min_size=1, max_size=20).map(lambda t: quote(t, safe="")),
)

BODY_ROUTES = [
    ("POST", "/v1/responses"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/api/chat"),
    ("POST", "/api/generate"),
    ("POST", "/api/show"),
    ("DELETE", "/api/delete"),
    ("POST", "/v1/models/load"),
    ("POST", "/v1/models/unload"),
    ("POST", "/v1/cache/flush"),
    ("POST", "/v1/admin/models/x/load"),
    ("POST", "/v1/admin/models/x/unload"),
]
PATH_ROUTES = [
    ("GET", "/v1/admin/models/{}"),
    ("POST", "/v1/admin/models/{}/load"),
    ("POST", "/v1/admin/models/{}/unload"),
    ("GET", "/v1/models/load/{}"),
    ("GET", "/api/pull/status/{}"),
    ("DELETE", "/api/pull/{}"),
]


def _generate(strategy: st.SearchStrategy[object]) -> list[object]:
    found: list[object] = []

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(strategy)
    def collect(value: object) -> None:
        found.append(value)

    collect()
    return found


def _check(method: str, path: str, reply: httpx.Response, sent: object) -> None:
    assert reply.status_code < 500, (method, path, sent, reply.text)
    assert "Traceback" not in reply.text and 'File "' not in reply.text, reply.text
    if reply.status_code >= 400:
        assert "error" in reply.json(), reply.text  # a shaped error (OpenAI or Ollama form)


async def _still_serving(client: httpx.AsyncClient) -> None:
    # A generated unload may have named `echo` (an allowed admin action): load it again.
    assert (await client.post("/v1/admin/models/echo/load", json={})).status_code == 200
    ok = await client.post("/v1/responses", json={"model": "echo", "input": "still fine"})
    assert ok.status_code == 200 and ok.json()["output_text"] == "still fine"


@pytest.fixture
async def server_url(nursery: trio.Nursery, tmp_path: Path) -> str:
    models: dict[str, dict[str, Any]] = {
        "echo": {"backend": "stub", "enabled": True},
        "x": {"backend": "stub"},
    }
    info = await start_server(nursery, models, model_store=str(tmp_path / "store"))
    return info.url


@pytest.mark.parametrize(("method", "path"), BODY_ROUTES, ids=[p for _, p in BODY_ROUTES])
async def test_generated_bodies(server_url: str, method: str, path: str) -> None:
    bodies = _generate(_bodies)
    async with httpx.AsyncClient(base_url=server_url, timeout=10) as client:
        with trio.fail_after(60):
            for body in bodies:
                assert isinstance(body, bytes)
                headers = {"Content-Type": "application/json"}
                reply = await client.request(method, path, content=body, headers=headers)
                _check(method, path, reply, body)
        await _still_serving(client)


@pytest.mark.parametrize(("method", "path"), PATH_ROUTES, ids=[p for _, p in PATH_ROUTES])
async def test_generated_path_segments(server_url: str, method: str, path: str) -> None:
    segments = _generate(_segments)
    async with httpx.AsyncClient(base_url=server_url, timeout=10) as client:
        with trio.fail_after(60):
            for segment in segments:
                assert isinstance(segment, str)
                url = path.format(segment)
                reply = await client.request(method, url, json={})
                _check(method, url, reply, segment)
        await _still_serving(client)


async def test_generated_websocket_frames(server_url: str) -> None:
    frames = _generate(_bodies)
    ws_url = server_url.replace("http://", "ws://") + "/v1/responses"
    with trio.fail_after(60):
        async with open_websocket_url(ws_url) as ws:
            for frame in frames:
                assert isinstance(frame, bytes)
                await ws.send_message(frame.decode("utf-8", "replace"))
                # Every frame gets its answer: an error event, or a request's events.
                while True:
                    text = await ws.get_message()
                    assert "Traceback" not in text and 'File "' not in text, text
                    event = json.loads(text)
                    if event["type"] in ("error", "response.completed"):
                        if event["type"] == "error":
                            assert event["error"]["code"] != "internal_error", event
                        break
            await ws.send_message(json.dumps({"model": "echo", "input": "still fine"}))
            while (event := json.loads(await ws.get_message()))["type"] != "response.completed":
                assert event["type"] != "error", event
            assert event["response"]["output_text"] == "still fine"
