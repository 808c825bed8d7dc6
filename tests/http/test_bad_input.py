"""Hundreds of generated bad bodies: always a 4xx with a code, and the pool keeps serving."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pool import ServerInfo
from pool.http._openapi import ROUTES, Route

from .conftest import start_server

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
_field_names = st.sampled_from(
    ["model", "input", "messages", "instructions", "stream", "thinking", "decoding", "allow_remote",
     "source_lang_code", "target_lang_code", "keep_alive", "replicas", "gguf_n_ctx",
     "exllama_cache_size", "llama_server_spec_draft_p_min", "surprise"]
)  # fmt: skip
_bodies = st.one_of(
    st.dictionaries(_field_names, _json_values, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.dictionaries(_field_names, _json_values, max_size=4).map(
        lambda d: json.dumps({"model": "echo", "input": "x", **d}).encode()
    ),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


async def test_generated_bad_bodies_never_5xx(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery, {"echo": {"backend": "stub", "enabled": True}, "x": {"backend": "stub"}}
    )
    seen: list[tuple[str, int, bytes]] = []

    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:

        async def send(path: str, body: bytes) -> None:
            reply = await client.post(path, content=body)
            seen.append((path, reply.status_code, body))
            assert reply.status_code < 500, (path, body, reply.text)
            if reply.status_code >= 400:
                assert reply.json()["error"]["code"]

        collected: list[bytes] = []

        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_bodies)
        def collect(body: bytes) -> None:
            collected.append(body)

        collect()
        for body in collected:
            for path in ("/v1/responses", "/v1/admin/models/x/load", "/v1/models/load"):
                await send(path, body)
        ok = await client.post("/v1/responses", json={"model": "echo", "input": "still fine"})
        assert ok.json()["output_text"] == "still fine"
        row = (await client.get("/v1/admin/models/x")).json()
        assert row["load_override"] == {}
    assert len(seen) >= 600


# More digits than Python reads into an int (sys.get_int_max_str_digits(): 4300).
_LONG_INTEGER = b"9" * 5000
# (A multipart form's fields are text: no JSON number to overflow.)
_BODY_ROUTES = [
    r for r in ROUTES if r.request is not None and r.request_media == "application/json"
]


@pytest.fixture
async def stub_server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery, {"echo": {"backend": "stub", "enabled": True}})


@pytest.mark.parametrize("route", _BODY_ROUTES, ids=lambda r: f"{r.method} {r.path}")
async def test_a_very_long_integer_is_a_400_in_the_dialect_shape(
    stub_server: ServerInfo, route: Route, caplog: pytest.LogCaptureFixture
) -> None:
    """Every route that reads a JSON body (the OpenAPI document lists them all) refuses
    an integer past Python's limit as bad input: a 400 in its dialect's error shape,
    not a 500 with a traceback in the log."""
    caplog.set_level(logging.ERROR, logger="pool.http")
    path = route.path.replace("{name}", "echo")
    body = b'{"model": "echo", "n": ' + _LONG_INTEGER + b"}"
    async with httpx.AsyncClient(base_url=stub_server.url, timeout=10) as client:
        reply = await client.request(
            route.method, path, content=body, headers={"content-type": "application/json"}
        )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    message = error if route.errors == "ollama" else error["message"]
    assert "more than 4300 digits" in message, reply.text
    if route.errors == "ollama":  # {"error": "..."}
        assert isinstance(error, str)
    elif route.errors == "anthropic":  # {"type": "error", "error": {"type", "message"}}
        assert reply.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:  # the pool's and OpenAI's: {"error": {"code", "message", ...}}
        assert error["code"] == "invalid_request"
        if route.errors == "openai":
            assert error["type"] == "invalid_request_error"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def _names_only_the_body(path: list[Any], body: Any, missing: bool) -> bool:
    """Whether ``path`` walks ``body`` by its own keys and indexes (the last part may be
    the field a ``missing`` error names)."""
    node = body
    for position, part in enumerate(path):
        key = isinstance(node, dict) and part in node
        index = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if not (key or index):
            return missing and position == len(path) - 1
        node = node[part]
    return True


# Bodies that fail inside a union (a string or a list, a tagged content block), where
# pydantic's loc names the union's members: `input.constrained-str` was the param.
_UNION_FAILURES = [
    ("/v1/embeddings", {"model": "vec", "input": 5}, "input"),
    ("/v1/chat/completions",
     {"model": "echo", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"model": "echo", "messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    ("/v1/completions", {"model": "echo", "prompt": [5]}, "prompt.0"),
    ("/openai/v1/responses", {"model": "echo", "input": [{"type": "message", "role": "user"}]},
     "input.0.content"),
]  # fmt: skip


async def test_schema_errors_name_the_clients_fields(nursery: trio.Nursery) -> None:
    """A schema failure names the field by the client's path (keys and indexes of the
    body), never by the names of pydantic's union members, on every error shape."""
    info = await start_server(
        nursery,
        {"echo": {"backend": "stub", "enabled": True},
         "vec": {"backend": "stub", "enabled": True, "embedding": True}},
    )  # fmt: skip
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        for path, body, param in _UNION_FAILURES:
            error = (await client.post(path, json=body)).json()["error"]
            assert error["param"] == param, (path, error)
            assert error["message"].startswith(f"{param}: "), (path, error)

        # The pool's own shape lists every error's loc: each one a path through the body.
        body = {"model": "echo", "input": [{"type": "text", "text": 5}]}
        answer = await client.post("/v1/responses", json=body)
        assert answer.status_code == 422
        errors = answer.json()["error"]["errors"]
        assert errors and all(
            _names_only_the_body(e["loc"], body, e["type"] == "missing") for e in errors
        ), errors
        assert answer.json()["error"]["message"].startswith("input.0.text: "), errors

        # Ollama's and Anthropic's messages name the field the same way.
        chat = {"model": "echo", "messages": [{"role": "user", "content": [5]}]}
        ollama = await client.post("/api/chat", json={**chat, "stream": False})
        assert ollama.status_code == 400
        assert ollama.json()["error"].startswith("messages.0.content: "), ollama.text
        anthropic = await client.post(
            "/v1/messages", json={**chat, "max_tokens": 8, "messages": [
                {"role": "user", "content": [{"type": "text", "text": 5}]}]}
        )  # fmt: skip
        assert anthropic.status_code == 400
        message = anthropic.json()["error"]["message"]
        assert message.startswith("messages.0.content.0.text: "), message

        # A body inside a body (the runner's load `overrides`): the path starts at the top.
        load = await client.post("/v1/models/load", json={"modelId": "echo", "overrides": {
            "replicas": "two"}})  # fmt: skip
        assert load.status_code == 422
        assert load.json()["error"]["message"].startswith("overrides.replicas: "), load.text
