"""/v1/responses over real loopback HTTP: JSON, SSE, errors, headers, disconnects."""

from __future__ import annotations

import json
import typing

import httpx
import pytest
import trio

from pool import ServerInfo
from pool.actors import WaitReason
from pool.http._common import dumps
from pool.http.responses._render import sse
from pool.schemas import WaitingFor

from .conftest import WAITING_MODELS, running, sse_events, start_server, wait_stopped


async def test_json_response_envelope_and_headers(client: httpx.AsyncClient) -> None:
    reply = await client.post(
        "/v1/responses",
        json={"model": "echo", "input": "hi there"},
        headers={"X-Request-Id": "abc-123"},
    )
    assert reply.status_code == 200
    body = reply.json()
    assert body["object"] == "response" and body["model"] == "echo"
    assert body["output"] == [{"type": "output_text", "text": "hi there"}]
    assert body["output_text"] == "hi there"
    metrics = body["metrics"]
    for key in (
        "backend_inference_wall_ms",
        "engine_total_wall_ms",
        "pool_total_wall_ms",
        "engine_queue_wait_ms",
        "engine_output_tokens",
        "engine_prompt_tokens",
    ):
        assert metrics[key] is not None
    assert (
        metrics["pool_total_wall_ms"]
        >= metrics["engine_total_wall_ms"]
        >= metrics["backend_inference_wall_ms"]
    )
    assert reply.headers["x-request-id"] == "abc-123"
    assert int(reply.headers["x-queue-wait-ms"]) >= 0
    assert reply.headers["x-cache-hit"] == "false"
    generated = await client.get("/v1/models")
    assert len(generated.headers["x-request-id"]) == 32


async def test_sse_deltas_concatenate_to_output_text(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/responses", json={"model": "slow", "input": "x", "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith(
        "text/event-stream"
    )
    events = sse_events(reply.text)
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "response.created" and kinds[-2:] == [
        "response.metrics",
        "response.completed",
    ]
    deltas = [
        json.loads(data)["delta"] for kind, data in events if kind == "response.output_text.delta"
    ]
    assert len(deltas) == 40
    completed = json.loads(events[-1][1])["response"]
    assert "".join(deltas) == completed["output_text"] == " ".join(f"w{i}" for i in range(40))


async def test_stream_deltas_arrive_as_generated(client: httpx.AsyncClient) -> None:
    times = []
    async with client.stream(
        "POST", "/v1/responses", json={"model": "slow", "input": "x", "stream": True}
    ) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("event: response.output_text.delta"):
                times.append(trio.current_time())
    assert len(times) == 40
    assert times[-1] - times[0] > 1.5  # 20 tokens/s: spread over ~2 s, not one burst


async def test_unload_ends_a_stream_past_the_drain_deadline(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    long_reply = " ".join(f"w{i}" for i in range(400))  # 200 s at 2 tokens/s
    info = await start_server(
        nursery,
        {
            "m": {
                "backend": "stub",
                "enabled": True,
                "stub_reply": long_reply,
                "stub_tokens_per_second": 2,
                "target_inflight": 2,
            }
        },
        engine={"unload_drain_s": 5},
    )
    long_stream: list[tuple[str, str]] = []
    fast: list[tuple[str, str]] = []

    async def read(body: dict[str, object], into: list[tuple[str, str]]) -> None:
        async with httpx.AsyncClient(base_url=info.url, timeout=None) as client:
            reply = await client.post("/v1/responses", json=body)
            into.extend(sse_events(reply.text))

    async with httpx.AsyncClient(base_url=info.url, timeout=None) as client:
        async with trio.open_nursery() as readers:
            readers.start_soon(read, {"model": "m", "input": "x", "stream": True}, long_stream)
            # 4 tokens: 2 s, inside the deadline.
            body = {"model": "m", "input": "x", "stream": True, "decoding": {"max_tokens": 4}}
            readers.start_soon(read, body, fast)
            with trio.fail_after(5):
                while await running(client, "m") < 2:
                    await trio.sleep(0.01)
            started = trio.current_time()
            unloaded = await client.post("/v1/admin/models/m/unload")
            took = trio.current_time() - started
        assert unloaded.status_code == 200 and unloaded.json()["runtime_state"] == "unloaded"
        assert took == pytest.approx(5, abs=0.6)
        row = (await client.get("/v1/admin/models/m")).json()
        assert row["runtime_state"] == "unloaded" and row["runtime_inflight"] == 0
    assert [kind for kind, _ in fast][-1] == "response.completed"
    assert json.loads(fast[-1][1])["response"]["output_text"] == "w0 w1 w2 w3"
    kinds = [kind for kind, _ in long_stream]
    assert 8 <= kinds.count("response.output_text.delta") <= 11  # about 5 s of tokens
    assert kinds[-1] == "error" and "response.completed" not in kinds
    error = json.loads(long_stream[-1][1])["error"]
    assert error["code"] == "model_unloading" and "unload_drain_s" in error["message"]


async def test_errors_have_codes_and_statuses(client: httpx.AsyncClient) -> None:
    cases = [
        ({"model": "nope", "input": "x"}, 404, "unknown_model"),
        ({"model": "cold", "input": "x"}, 409, "model_not_loaded"),
        (
            {"model": "single", "messages": [{"role": "user", "content": "x"}]},
            400,
            "multi_turn_unsupported",
        ),
        (
            {"model": "echo", "input": [{"type": "image_url", "image_url": {"url": "data:x"}}]},
            400,
            "modality_unsupported",
        ),
        ({"model": "echo", "input": "x", "decoding": {"max_tokens": 0}}, 422, "validation_error"),
        ({"model": "echo"}, 422, "validation_error"),
        ({"model": "echo", "input": "x", "surprise": 1}, 422, "validation_error"),
    ]
    for body, status, code in cases:
        reply = await client.post("/v1/responses", json=body)
        assert (reply.status_code, reply.json()["error"]["code"]) == (status, code), body


async def test_malformed_bodies_and_routes(client: httpx.AsyncClient, server: ServerInfo) -> None:
    bad = await client.post("/v1/responses", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_request"
    utf = await client.post("/v1/responses", content=b'{"model": "\xff\xfe"}')
    assert utf.status_code == 400
    missing = await client.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # The WebSocket route without the handshake: 426, naming the upgrade.
    plain = await client.get("/v1/responses")
    assert plain.status_code == 426 and plain.json()["error"]["code"] == "upgrade_required"
    assert plain.headers["upgrade"] == "websocket"
    wrong = await client.put("/v1/responses")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.headers["allow"] == "GET, HEAD, OPTIONS, POST"
    ok = await client.post("/v1/responses", json={"model": "echo", "input": "ok"})
    assert ok.status_code == 200


async def test_oversized_body_is_413(nursery: trio.Nursery) -> None:
    # A small limit, so the whole body fits in the socket buffers: httpx writes it all
    # before reading (curl, with Expect: 100-continue, gets the 413 before sending).
    info = await start_server(nursery, max_body_bytes=1024)
    async with httpx.AsyncClient(base_url=info.url) as client:
        big = await client.post("/v1/responses", content=b'{"model": "' + b"x" * 2000 + b'"}')
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        ok = await client.post("/v1/responses", json={"model": "echo", "input": "ok"})
        assert ok.status_code == 200


async def test_bad_headers(client: httpx.AsyncClient) -> None:
    for headers in (
        {"X-Priority": "urgent"},
        {"X-Tenant-ID": "x" * 200},
        {"X-Cache-Mode": "always"},
    ):
        reply = await client.post(
            "/v1/responses", json={"model": "echo", "input": "x"}, headers=headers
        )
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"


async def test_queue_full_over_http(client: httpx.AsyncClient) -> None:
    statuses: list[int] = []
    retry_after: list[str] = []

    async def one() -> None:
        reply = await client.post("/v1/responses", json={"model": "slow", "input": "x"})
        statuses.append(reply.status_code)
        if reply.status_code == 503:
            assert reply.json()["error"]["code"] == "queue_full"
            retry_after.append(reply.headers["retry-after"])

    async with trio.open_nursery() as nursery:
        for _ in range(4):  # one runs, one waits (max_queue 1), two overflow
            nursery.start_soon(one)
    assert sorted(statuses) == [200, 200, 503, 503]
    assert all(int(r) >= 1 for r in retry_after)


async def test_closing_an_sse_stream_stops_generation(endless: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=endless.url, timeout=30) as client:
        async with client.stream(
            "POST", "/v1/responses", json={"model": "endless", "input": "x", "stream": True}
        ) as reply:
            # Held, so that leaving the loop does not let the collector close the stream.
            lines = reply.aiter_lines()
            async for line in lines:
                if line.startswith("event: response.output_text.delta"):
                    break
            assert await running(client, "endless") == 1
        await wait_stopped(client, "endless")


async def test_unload_waits_for_open_stream(server: ServerInfo, client: httpx.AsyncClient) -> None:
    text: list[str] = []
    unloaded: list[dict[str, object]] = []

    async def stream() -> None:
        async with client.stream(
            "POST", "/v1/responses", json={"model": "slow", "input": "x", "stream": True}
        ) as reply:
            text.append(await reply.aread())  # type: ignore[arg-type]

    async def unload() -> None:
        unloaded.append((await client.post("/v1/admin/models/slow/unload")).json())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream)
        with trio.fail_after(30):
            while await running(client, "slow") == 0:
                await trio.sleep(0.01)
        nursery.start_soon(unload)
        actor = server.pool.model("slow")
        with trio.fail_after(30):
            while actor.state != "unloading":
                await actor.wait_state_change()
        refused = await client.post("/v1/responses", json={"model": "slow", "input": "x"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_unloading"
    events = sse_events(text[0].decode() if isinstance(text[0], bytes) else text[0])
    assert events[-1][0] == "response.completed"
    assert unloaded[0]["runtime_state"] == "unloaded"


@pytest.mark.parametrize(
    "text", ["plain", 'quote " and \\ backslash', "line\nbreak", "é ü 中文 🙂", ""]
)
def test_delta_events_encode_like_any_other_event(text: str) -> None:
    event = {"type": "response.output_text.delta", "delta": text}
    generic = b"event: response.output_text.delta\ndata: " + dumps(event) + b"\n\n"
    assert sse(event) == generic
    assert json.loads(sse(event).split(b"data: ", 1)[1]) == event


async def test_a_stream_waiting_for_a_load_sees_queued_then_loading(
    nursery: trio.Nursery,
) -> None:
    info = await start_server(nursery, WAITING_MODELS)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        body = {"model": "lazy", "input": "x", "stream": True}
        reply = await client.post("/v1/responses", json=body)
        assert reply.status_code == 200
        events = [(kind, json.loads(data)) for kind, data in sse_events(reply.text)]
        kinds = [kind for kind, _ in events]
        first_delta = kinds.index("response.output_text.delta")
        assert kinds[0] == "response.created"
        assert kinds[1] == "response.queued"
        assert events[1][1] == {"type": "response.queued", "position": 1, "waiting_for": "load"}
        loading = [data["progress"] for kind, data in events if kind == "response.loading"]
        assert loading[0] is None and loading[1:4] == [0.25, 0.5, 0.75]
        assert set(kinds[1:first_delta]) == {"response.queued", "response.loading"}
        assert kinds[-1] == "response.completed"
        assert events[-1][1]["response"]["output_text"] == "a b c"
        # Loaded now: the next stream waits for nothing and shows no wait.
        again = await client.post("/v1/responses", json=body)
        assert "response.queued" not in again.text and "response.loading" not in again.text


async def test_a_stream_that_times_out_waiting_names_the_load(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, WAITING_MODELS)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        body = {"model": "never", "input": "x", "stream": True}
        reply = await client.post("/v1/responses", json=body)
        # The wait was streamed, so the timeout is the stream's last event.
        assert reply.status_code == 200
        events = sse_events(reply.text)
        assert [k for k, _ in events][:3] == [
            "response.created",
            "response.queued",
            "response.loading",
        ]
        kind, data = events[-1]
        error = json.loads(data)["error"]
        assert kind == "error" and error["code"] == "queue_timeout"
        assert error["waiting_for"] == "load"
        # Without streaming the same wait is a plain 504 that says the same.
        plain = await client.post("/v1/responses", json={"model": "never", "input": "x"})
        assert plain.status_code == 504 and plain.json()["error"]["waiting_for"] == "load"


async def test_leaving_a_stream_while_it_waits_leaves_the_queue(nursery: trio.Nursery) -> None:
    models = {**WAITING_MODELS, "never": {**WAITING_MODELS["never"], "queue_timeout_s": 60}}
    info = await start_server(nursery, models)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        body = {"model": "never", "input": "x", "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as reply:
            async for line in reply.aiter_lines():
                if line.startswith("event: response.loading"):
                    assert await _queued(client, "never") == 1
                    break
        with trio.fail_after(5):
            while await _queued(client, "never"):
                await trio.sleep(0.02)


async def _queued(client: httpx.AsyncClient, model: str) -> int:
    row = (await client.get(f"/v1/admin/models/{model}")).json()
    return int(row["queue_depth"])


async def test_a_conversation_has_user_and_assistant_turns_and_ends_with_the_user(
    client: httpx.AsyncClient,
) -> None:
    """The spec's rules for ``messages``: only user and assistant roles (``instructions``
    is the system prompt), so a ``system`` turn fails the schema (422); and the last
    message is the user's, so one that ends with the assistant is a 400 (a valid shape
    with a wrong value)."""
    user = {"role": "user", "content": "My favourite colour is teal."}
    system = await client.post(
        "/v1/responses",
        json={"model": "echo", "messages": [{"role": "system", "content": "Be terse."}, user]},
    )
    assert system.status_code == 422
    error = system.json()["error"]
    assert error["code"] == "validation_error"
    assert error["errors"][0]["loc"] == ["messages", 0, "role"], error

    assistant = {"role": "assistant", "content": "Noted."}
    ending = await client.post(
        "/v1/responses", json={"model": "echo", "messages": [user, assistant]}
    )
    assert ending.status_code == 400
    assert ending.json()["error"] == {
        "code": "invalid_conversation",
        "message": "the last message must have role `user` (or be a function_call_output)",
    }

    # The same turns, ending with the user's, are answered.
    again = {"role": "user", "content": "What is my favourite colour?"}
    answered = await client.post(
        "/v1/responses", json={"model": "echo", "messages": [user, assistant, again]}
    )
    assert answered.status_code == 200, answered.text


def test_the_wire_names_every_wait_the_actors_report() -> None:
    # The schema keeps its own copy (a wire shape imports no actor): the two must agree.
    assert typing.get_args(WaitingFor) == typing.get_args(WaitReason)
