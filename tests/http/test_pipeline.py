"""The request pipeline in front of every route (pool/http/_pipeline.py): its steps, on
the hot routes it serves without Quart and on Quart's alike."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import httpx
import pytest
import trio
from trio.testing import wait_all_tasks_blocked

from pool import ServerInfo
from pool.config import build_settings
from pool.errors import ConfigError

from .conftest import STUB_MODELS, start_server

CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}


async def test_hot_routes_keep_each_surface_error_shape(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, allowed_hosts=["pool.example"], max_body_bytes=200)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        # Host refused: OpenAI's error object on Chat Completions, the pool's elsewhere.
        chat = await client.post("/v1/chat/completions", json=CHAT, headers={"host": "evil.test"})
        assert chat.status_code == 403
        assert chat.json()["error"]["type"] == "invalid_request_error"
        responses = await client.post(
            "/v1/responses", json={"model": "echo", "input": "x"}, headers={"host": "evil.test"}
        )
        assert responses.status_code == 403 and "type" not in responses.json()["error"]
        ok = {"host": "pool.example"}
        # Too large, by its Content-Length: 413 before the body is read.
        big = await client.post("/v1/chat/completions", content=b"x" * 300, headers=ok)
        assert big.status_code == 413
        assert big.json()["error"]["code"] == "request_too_large"
        # Not JSON, and a schema failure, in OpenAI's shape.
        bad = await client.post("/v1/chat/completions", content=b"{", headers=ok)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
        schema = await client.post("/v1/chat/completions", json={"model": "echo"}, headers=ok)
        assert schema.status_code == 422 and schema.json()["error"]["param"] == "messages"
        # The client's request id comes back; other methods are still Quart's.
        echoed = await client.post(
            "/v1/chat/completions", json=CHAT, headers={**ok, "x-request-id": "abc-1"}
        )
        assert echoed.status_code == 200 and echoed.headers["x-request-id"] == "abc-1"
        assert echoed.json()["choices"][0]["message"]["content"] == "hi"
        wrong = await client.get("/v1/chat/completions", headers=ok)
        assert wrong.status_code == 405


@pytest.mark.parametrize(
    ("method", "path", "status", "dialect"),
    [
        ("GET", "/api/chat", 405, "ollama"),
        ("GET", "/api/nope", 404, "ollama"),
        ("PATCH", "/api/pull/echo", 405, "ollama"),
        ("GET", "/v1/messages", 405, "anthropic"),
        ("GET", "/v1/messages/nope", 404, "anthropic"),
        ("PUT", "/openai/v1/responses", 405, "openai"),
        ("GET", "/openai/v1/nope", 404, "openai"),
        ("GET", "/v1/chat/completions", 405, "openai"),
        # The runner's route under /api/ is the runner's, in the pool's shape.
        ("POST", "/api/status", 405, "pool"),
        ("GET", "/v1/nope", 404, "pool"),
        ("DELETE", "/v1/admin/models", 405, "pool"),
    ],
)
async def test_a_404_or_405_answers_in_the_shape_of_the_path(
    server: ServerInfo, method: str, path: str, status: int, dialect: str
) -> None:
    """A client of a dialect reads every error under its base URL: a method the route
    does not take is answered in the route's error shape, a path no route serves in the
    shape of the dialect whose prefix it has (Ollama's /api/, Anthropic's
    /v1/messages/, OpenAI's /openai/)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        reply = await client.request(method, path)
    assert reply.status_code == status, reply.text
    body = reply.json()
    code = {404: "not_found", 405: "method_not_allowed"}[status]
    if status == 405:
        assert reply.headers["allow"]
    if dialect == "ollama":
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        assert path in body["error"]
    elif dialect == "anthropic":
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        assert body["type"] == "error" and body["error"]["type"] == kind, body
        assert reply.headers["request-id"] == reply.headers["x-request-id"]
    elif dialect == "openai":
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["code"] == code
    else:
        assert body == {"error": {"code": code, "message": body["error"]["message"]}}


async def test_a_chunked_request_body_is_read_whole(nursery: trio.Nursery) -> None:
    server = await start_server(nursery)

    async def body() -> AsyncIterator[bytes]:
        yield b'{"model": "echo", '
        await trio.sleep(0.01)
        yield b'"input": "in two parts"}'

    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        reply = await client.post("/v1/responses", content=body())
        assert reply.status_code == 200 and reply.json()["output_text"] == "in two parts"


class RawHttp:
    """One HTTP/1.1 connection spoken by hand (h11), to send what httpx will not: a body
    cut short, a body that stalls, or chunks past the limit with no Content-Length."""

    def __init__(self, stream: trio.SocketStream, port: int) -> None:
        self.stream = stream
        self.port = port
        self.conn = h11.Connection(h11.CLIENT)

    async def start(self, path: str, *headers: tuple[str, str], host: str = "") -> None:
        host = host or f"127.0.0.1:{self.port}"
        head = [("host", host), ("content-type", "application/json")]
        await self.send(h11.Request(method="POST", target=path, headers=[*head, *headers]))

    async def send(self, event: h11.Event) -> None:
        data = self.conn.send(event)
        if data:
            await self.stream.send_all(data)

    async def response(self) -> tuple[int, dict[str, str], bytes]:
        """The server's answer (h11 takes one that comes before the request ended)."""
        status, headers, body = 0, {}, b""
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.stream.receive_some())
            elif isinstance(event, h11.Response):
                status = event.status_code
                headers = {k.decode(): v.decode() for k, v in event.headers}
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                return status, headers, body


@asynccontextmanager
async def raw_http(server: ServerInfo) -> AsyncIterator[RawHttp]:
    stream = await trio.open_tcp_stream("127.0.0.1", server.port)
    async with stream:
        yield RawHttp(stream, server.port)


def _error_code(body: bytes) -> str:
    code: str = json.loads(body)["error"]["code"]
    return code


async def _still_answers(server: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        reply = await client.post("/v1/responses", json={"model": "echo", "input": "still here"})
        assert reply.status_code == 200 and reply.json()["output_text"] == "still here"


async def test_a_chunked_body_past_the_limit_is_413(nursery: trio.Nursery) -> None:
    """No Content-Length to refuse it by: the limit holds while the chunks arrive."""
    server = await start_server(nursery, max_body_bytes=200)
    async with raw_http(server) as http:
        await http.start(
            "/v1/responses", ("transfer-encoding", "chunked"), ("x-request-id", "big-1")
        )
        await http.send(h11.Data(data=b'{"model": "echo", "input": "' + b"x" * 130))
        await http.send(h11.Data(data=b"y" * 150))  # 300 bytes in all, and more to come
        with trio.fail_after(10):
            status, headers, body = await http.response()
    assert status == 413, body
    assert _error_code(body) == "request_too_large"
    assert b"200 bytes" in body and headers["x-request-id"] == "big-1"
    assert headers["connection"] == "close"  # the rest of the body is not read
    # The same body within a larger limit is read whole, so the 413 came from the size.
    await _still_answers(server)


@pytest.mark.parametrize(
    ("host", "declared", "status", "code"),
    [
        ("evil.example", 60, 403, "host_not_allowed"),
        ("", 300, 413, "request_too_large"),  # by its Content-Length
    ],
)
async def test_a_refusal_before_the_body_is_read_closes_the_connection(
    nursery: trio.Nursery, host: str, declared: int, status: int, code: str
) -> None:
    """Answered from the head alone, the body still on its way: the answer says
    ``Connection: close`` and the server closes, so a client never sends its next request
    on a connection it believes kept alive (that request met a closed socket)."""
    server = await start_server(nursery, max_body_bytes=200)
    async with raw_http(server) as http:
        await http.start("/v1/chat/completions", ("content-length", str(declared)), host=host)
        with trio.fail_after(10):
            answer, headers, body = await http.response()
        assert (answer, _error_code(body)) == (status, code)
        assert headers["connection"] == "close"
        await http.stream.send_all(b"x" * declared)  # the body, late
        with trio.fail_after(10):
            assert await _closed_by_server(http.stream)
    await _still_answers(server)


async def _closed_by_server(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some() == b""
    except trio.BrokenResourceError:  # reset: the late body was not read
        return True


async def test_a_body_slower_than_body_timeout_s_is_408(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, body_timeout_s=0.5)
    for path in ("/v1/chat/completions", "/v1/responses", "/api/chat"):  # hot, hot, Quart
        async with raw_http(server) as http:
            await http.start(path, ("content-length", "100"), ("x-request-id", "slow-1"))
            await http.send(h11.Data(data=b'{"model": "echo", '))  # and then nothing
            # The answer comes from the server's timeout; this limit only stops a hang.
            with trio.fail_after(30):
                status, headers, body = await http.response()
        assert status == 408, (path, body)
        assert headers["x-request-id"] == "slow-1" and headers["connection"] == "close"
        if path.startswith("/v1/"):
            assert _error_code(body) == "request_timeout"
        else:  # in Ollama's error shape, on Ollama's route
            assert "within 0.5 s" in json.loads(body)["error"]
    await _still_answers(server)


def test_body_timeout_s_is_positive_and_defaults_to_a_minute() -> None:
    assert build_settings({}).service.body_timeout_s == 60
    with pytest.raises(ConfigError) as info:
        build_settings({"service": {"body_timeout_s": 0}})
    assert "service.body_timeout_s" in info.value.problems[0]


async def test_a_view_that_raises_is_a_500_with_the_request_id(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An unexpected error in a view is logged with its traceback and request id; the
    client gets the pool's ``internal_error`` (no traceback) and the same id."""
    server = await start_server(nursery)

    def broken_admit(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in the pool")

    monkeypatch.setattr(server.pool, "admit", broken_admit)
    caplog.set_level(logging.ERROR, logger="pool.http")
    bodies = {"/v1/responses": {"model": "echo", "input": "x"}, "/v1/chat/completions": CHAT}
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        for path, body in bodies.items():
            rid = f"crash-{path.rsplit('/', 1)[1]}"
            reply = await client.post(path, json=body, headers={"x-request-id": rid})
            assert reply.status_code == 500, reply.text
            assert reply.headers["x-request-id"] == rid
            assert reply.json() == {
                "error": {"code": "internal_error", "message": "internal error; see the server log"}
            }
            assert "a bug in the pool" not in reply.text
            (record,) = [r for r in caplog.records if f"request_id={rid} " in r.getMessage()]
            assert f"POST {path}" in record.getMessage()
            assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    monkeypatch.undo()
    await _still_answers(server)


def _task_count() -> int:
    def tasks_under(task: trio.lowlevel.Task) -> int:
        return 1 + sum(tasks_under(t) for n in task.child_nurseries for t in n.child_tasks)

    return tasks_under(trio.lowlevel.current_root_task())


async def test_a_client_leaving_during_the_body_read(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    """The request ends quietly: nothing logged as an error, its tasks gone, the model
    untouched and the server answering."""
    server = await start_server(nursery)
    await _still_answers(server)
    caplog.set_level(logging.WARNING)
    await wait_all_tasks_blocked()
    idle = _task_count()
    async with raw_http(server) as http:
        await http.start("/v1/responses", ("content-length", "1000"))
        await http.send(h11.Data(data=b'{"model": "echo", "input": "'))
        await wait_all_tasks_blocked()
        # The server is serving it (its connection's tasks wait for the rest of the body).
        assert _task_count() > idle
    await wait_all_tasks_blocked()
    assert _task_count() == idle
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    echo = server.pool.model("echo")
    assert echo.scheduler.queue_depth == 0 and server.pool.snapshot("echo").state == "loaded"
    await _still_answers(server)


async def _kept_alive_requests(
    server: ServerInfo, count: int, instrument: trio.abc.Instrument
) -> None:
    """``count`` Chat Completions on one kept-alive connection, ``instrument`` installed
    for them alone (not for the connection's opening)."""
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        await client.post("/v1/chat/completions", json=CHAT)  # the connection is opened
        trio.lowlevel.add_instrument(instrument)
        try:
            for _ in range(count):
                reply = await client.post("/v1/chat/completions", json=CHAT)
                assert reply.status_code == 200
        finally:
            trio.lowlevel.remove_instrument(instrument)


class _Spawned(trio.abc.Instrument):
    """The names of the tasks started while installed."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.names.append(task.name)


async def test_a_served_hot_route_is_cancelled_by_the_protocol_not_a_watcher_task(
    nursery: trio.Nursery,
) -> None:
    """Served by Hypercorn, a hot route needs no task waiting for ``http.disconnect``
    (pool/http/_h11_protocol.py): a request starts Hypercorn's app task and the replica's
    job alone, and a client that leaves still stops its generation."""
    slow = {"backend": "stub", "enabled": True, "stub_reply": "w " * 400}
    models = {"echo": STUB_MODELS["echo"], "slow": slow | {"stub_tokens_per_second": 20}}
    server = await start_server(nursery, models)
    spawned = _Spawned()
    await _kept_alive_requests(server, 5, spawned)
    started = Counter(name.rpartition(".")[2] for name in spawned.names)
    assert started["_handle"] == started["_run_job"] == 5, spawned.names
    # Neither a watcher of the route's nor a keep-alive timer of Hypercorn's.
    assert not [name for name in started if "disconnect" in name or name == "_idle_timeout"]

    async with httpx.AsyncClient(base_url=server.url, timeout=0.5) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            await impatient.post("/v1/responses", json={"model": "slow", "input": "x"})
    with trio.fail_after(5):
        while server.pool.model("slow").scheduler.running:
            await trio.sleep(0.02)


class _ServerSteps(trio.abc.Instrument):
    """Counts the steps of every task but the client's (the test's own task), by the
    task's function."""

    def __init__(self, client: trio.lowlevel.Task) -> None:
        self.client = client
        self.by_task: Counter[str] = Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is not self.client:
            self.by_task[task.name.rpartition(".")[2]] += 1


async def test_a_json_request_passes_through_the_scheduler_only_where_it_waits(
    nursery: trio.Nursery,
) -> None:
    """A hot JSON request's messages are taken without Trio's pass through the scheduler
    where nothing has to wait: its body and end (Hypercorn's ``app_put`` and the
    pipeline's read), the job's output and its result (``Ticket.outputs``,
    ``hand_over``), the connection's reads, writes and write lock (``PoolTCPServer``).
    Each such pass was a task step: 17 a request before, 6-7 now (the connection woken
    by the socket, the app's and the job's first steps, the job's start waited for, the
    usage recorder and the residency owner woken)."""
    server = await start_server(nursery)
    steps = _ServerSteps(trio.lowlevel.current_task())
    await _kept_alive_requests(server, 20, steps)
    per_request = {task: count / 20 for task, count in steps.by_task.items()}
    assert sum(per_request.values()) <= 8, per_request
    # Each cut on its own: the job's one step is its first (the result is handed over
    # without a pass); the app's two are its first and the wait for the job to start
    # (its body read, the job's output read, the write and its lock pass through none);
    # the connection's are the socket's wake-up and, in some requests, Hypercorn's
    # pause until the answer is written (the app's messages are put without a pass).
    assert per_request["_run_job"] <= 1.3, per_request
    assert per_request["_handle"] <= 2.7, per_request
    assert per_request["_run_handler"] <= 2, per_request
