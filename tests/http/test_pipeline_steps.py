"""Each step of the request pipeline (pool/http/_pipeline.py), case by case, against every
operation of the OpenAPI document: a route cannot miss a step.

The steps' refusals come in the error shape the document gives the route (its
``errors``: the pool's, OpenAI's, Ollama's or Anthropic's), with the request id; the
rate-limit headers have their own table over every route that runs a model
(tests/http/test_rate_limit_headers.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

import h11
import httpx
import pytest
import trio

from pool import ServerInfo
from pool.http._openapi import ROUTES, Route, Served, openapi_document

from .conftest import start_server
from .test_pipeline import raw_http

ADMIN, USER = "admin-secret", "user-secret"
MAX_BODY = 4096
# Path parameters, filled so that a step that let a request through would find a route.
_PARAMS = {"name": "echo", "model": "echo", "task_id": "t-1", "response_id": "resp_1"}


def _path(route: Route) -> str:
    return re.sub(r"{(\w+)}", lambda m: _PARAMS.get(m.group(1), "x"), route.path)


def _case_id(route: Route) -> str:
    return f"{route.method.upper()} {route.path}"


OPERATIONS = [pytest.param(route, id=_case_id(route)) for route in ROUTES]


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(
        nursery,
        {"echo": {"backend": "stub", "enabled": True}},
        max_body_bytes=MAX_BODY,
        body_timeout_s=0.5,
        auth={"inference_tokens": [USER], "admin_token": ADMIN},
    )


def error_of(route: Route, answer: httpx.Response | tuple[int, bytes]) -> str:
    """The code (Ollama: the message) of an error answer, checked to be in the route's
    documented error shape."""
    raw = answer.content if isinstance(answer, httpx.Response) else answer[1]
    if route.method == "head":  # no body, by HTTP's rule
        assert not raw
        return route.errors
    body: dict[str, Any] = json.loads(raw)
    error = body["error"]
    if route.errors == "ollama":
        assert isinstance(error, str) and error, body
        return error
    if route.errors == "anthropic":
        assert body["type"] == "error" and set(error) == {"type", "message"}, body
        return str(error["type"])
    if route.errors == "openai":
        assert {"message", "type", "param", "code"} <= set(error), body
    else:
        assert {"code", "message"} <= set(error) and "type" not in error, body
    return str(error["code"])


async def _each(server: ServerInfo, **request: Any) -> list[tuple[Route, httpx.Response]]:
    """Every operation asked once, with ``request``'s headers and body."""
    answers = []
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        for route in ROUTES:
            answer = await client.request(route.method.upper(), _path(route), **request)
            answers.append((route, answer))
    return answers


async def test_every_documented_operation_is_in_the_table() -> None:
    # The document's operations are the table's rows (test_openapi.py checks that every
    # route of the app is documented).
    assert len(ROUTES) >= 40
    assert len({(r.method, r.path) for r in ROUTES}) == len(ROUTES)


async def test_a_host_not_served_is_refused_first(server: ServerInfo) -> None:
    """Step 4, before authentication and the body: 403 in the route's own shape."""
    for route, answer in await _each(
        server, headers={"host": "evil.test", "x-request-id": "host-1"}, content=b"{"
    ):
        assert answer.status_code == 403, (_case_id(route), answer.text)
        code = error_of(route, answer)
        if route.errors == "anthropic":  # Anthropic's shape has no code: its type says 403
            assert code == "permission_error"
        elif route.method != "head":
            assert "host" in code.lower(), _case_id(route)
        assert answer.headers["x-request-id"] == "host-1", _case_id(route)


async def test_a_browser_origin_not_served_is_refused(server: ServerInfo) -> None:
    for route, answer in await _each(server, headers={"origin": "http://evil.test"}):
        assert answer.status_code == 403, (_case_id(route), answer.text)
        code = error_of(route, answer)
        if route.errors == "anthropic":
            assert code == "permission_error"
        elif route.method != "head":
            assert "origin" in code.lower(), _case_id(route)


async def test_a_body_past_the_limit_is_413_on_every_route(server: ServerInfo) -> None:
    """Step 5, by ``Content-Length``: refused before a byte is read, token or not."""
    for route, answer in await _each(server, content=b"x" * (MAX_BODY + 1)):
        assert answer.status_code == 413, (_case_id(route), answer.text)
        code = error_of(route, answer)
        assert code in (
            route.errors,
            "request_too_large",
            f"the body is larger than {MAX_BODY} bytes",
        ), code


async def test_a_body_that_stalls_is_408_on_every_route(server: ServerInfo) -> None:
    """Step 5, past ``service.body_timeout_s``: every route at once, by hand (h11)."""
    answers: dict[str, tuple[int, dict[str, str], bytes]] = {}

    async def ask(route: Route) -> None:
        async with raw_http(server) as http:
            await http.send(
                h11.Request(
                    method=route.method.upper(),
                    target=_path(route),
                    headers=[("host", f"127.0.0.1:{server.port}"), ("content-length", "100")],
                )
            )
            await http.send(h11.Data(data=b'{"model": '))  # and then nothing
            with trio.fail_after(30):
                answers[_case_id(route)] = await http.response()

    async with trio.open_nursery() as nursery:
        for route in ROUTES:
            nursery.start_soon(ask, route)
    for route in ROUTES:
        status, headers, body = answers[_case_id(route)]
        assert status == 408, (_case_id(route), body)
        assert re.fullmatch(r"[0-9a-f]{32}", headers["x-request-id"]), headers
        code = error_of(route, (status, body))
        if route.errors in ("pool", "openai"):
            assert code == "request_timeout"
        elif route.method != "head":
            assert "0.5 s" in body.decode(), body


async def test_every_answer_carries_the_request_id(server: ServerInfo) -> None:
    """Step 2: a sane ``X-Request-Id`` comes back; any other is replaced by a fresh id."""
    for route, answer in await _each(server, headers={"x-request-id": "trace-me.1"}):
        assert answer.headers["x-request-id"] == "trace-me.1", _case_id(route)
    for route, answer in await _each(server, headers={"x-request-id": "no spaces, please"}):
        assert re.fullmatch(r"[0-9a-f]{32}", answer.headers["x-request-id"]), _case_id(route)


async def test_a_guarded_route_without_a_token_is_401(server: ServerInfo) -> None:
    """Authentication before the body: a malformed body without a token is still 401,
    on every operation the document says needs a token, in its own shape."""
    document = openapi_document(
        served=Served(inference_open=False, admin_open=False, lifecycle_open=False)
    )
    open_routes = set()
    for route, answer in await _each(server, content=b"{"):
        if not document["paths"][route.path][route.method].get("security"):
            assert answer.status_code != 401, _case_id(route)
            open_routes.add(_case_id(route))
            continue
        assert answer.status_code == 401, (_case_id(route), answer.text)
        code = error_of(route, answer)
        assert code in (route.errors, "unauthorized", "authentication_error") or "token" in code
    # Open: liveness, Ollama's probes, the document and the dashboard's page and assets.
    assert open_routes == {
        "GET /health", "GET /", "HEAD /", "GET /api/version", "GET /openapi.json", "GET /docs",
        "GET /ui", "GET /ui/", "GET /ui/app.js", "GET /ui/app.css",
    }  # fmt: skip
