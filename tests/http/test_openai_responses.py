"""``/openai/v1``: OpenAI's Responses API with the official ``openai`` client, on stub
models: message items and usage, the stream's events in order with their sequence
numbers, stored responses per tenant (retrieve, delete, input items,
``previous_response_id``), function calls, errors in OpenAI's shape, and the other
OpenAI routes under the same base URL."""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from pool import ServerInfo
from pool._sqlite import open_database
from pool.actors import open_pool
from pool.backends import register_backend, unregister_backend
from pool.backends.stub import StubRuntime
from pool.config import build_settings, state_dir
from pool.errors import BackendError, PoolError
from pool.http import create_app
from pool.http._thinking import ThinkSplitter
from pool.http.openai_responses import _store as store_module
from pool.http.openai_responses._store import FILE_NAME, ResponseStore

from . import recording_backend, tool_backend
from .conftest import running, sse_events, start_server, wait_stopped

MODELS: dict[str, dict[str, Any]] = {
    "echo": {"backend": "stub", "enabled": True},
    "think": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": "<think> Paris is the capital. </think> It is Paris.",
    },
    "long": {"backend": "stub", "enabled": True, "stub_reply": "one two three four five six"},
    "vec": {"backend": "stub", "enabled": True, "embedding": True},
    "rec": {"backend": "recorder", "enabled": True},
    "caller": {"backend": "toolcaller", "enabled": True},
}
WEATHER: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}

# OpenAI's event order for one text item.
TEXT_EVENTS = [
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture
async def info(nursery: trio.Nursery) -> AsyncIterator[ServerInfo]:
    register_backend("recorder", recording_backend.__name__)
    register_backend("toolcaller", tool_backend.__name__)
    try:
        yield await start_server(nursery, MODELS)
    finally:
        unregister_backend("recorder")
        unregister_backend("toolcaller")


def _client(info: ServerInfo, tenant: str | None = None) -> openai.AsyncOpenAI:
    headers = {"X-Tenant-ID": tenant} if tenant else None
    return openai.AsyncOpenAI(
        base_url=info.url + "/openai/v1", api_key="unused", max_retries=0, default_headers=headers
    )


def _collapse(kinds: list[str]) -> list[str]:
    """``kinds`` with runs of one delta kind as one."""
    out: list[str] = []
    for kind in kinds:
        if not (kind.endswith(".delta") and out and out[-1] == kind):
            out.append(kind)
    return out


async def test_create_answers_a_message_item_with_usage(info: ServerInfo) -> None:
    client = _client(info)
    reply = await client.responses.create(
        model="echo",
        input="hello there",
        instructions="Be brief.",
        metadata={"purpose": "test"},
        temperature=0.5,
    )
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.status == "completed" and reply.error is None
    assert reply.output_text == "hello there"
    (item,) = reply.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.text == "hello there"
    assert part.annotations == []
    assert reply.instructions == "Be brief." and reply.metadata == {"purpose": "test"}
    assert reply.temperature == 0.5 and reply.store is True
    assert reply.usage is not None
    assert reply.usage.input_tokens == 2 and reply.usage.output_tokens == 2
    assert reply.usage.total_tokens == 4
    assert reply.usage.input_tokens_details.cached_tokens == 0
    assert reply.usage.output_tokens_details.reasoning_tokens == 0


async def test_stream_sends_openai_events_in_order(info: ServerInfo) -> None:
    client = _client(info)
    kinds: list[str] = []
    numbers: list[int] = []
    text = ""
    async with client.responses.stream(model="long", input="hi") as stream:
        async for event in stream:
            kinds.append(event.type)
            numbers.append(event.sequence_number)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = await stream.get_final_response()
    assert _collapse(kinds) == [
        "response.created",
        "response.in_progress",
        *TEXT_EVENTS,
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") == 6
    assert numbers == list(range(len(kinds)))
    assert text == final.output_text == "one two three four five six"
    # The stored response is the streamed one.
    stored = await client.responses.retrieve(final.id)
    assert (stored.output_text, stored.usage, stored.status) == (
        final.output_text,
        final.usage,
        "completed",
    )

    # On the wire: each SSE event's name is its data's type.
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        streamed = await http.post(
            "/openai/v1/responses", json={"model": "echo", "input": "a b", "stream": True}
        )
    assert streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed.text)
    assert all(json.loads(data)["type"] == name for name, data in events)
    done = json.loads(events[-1][1])
    assert done["type"] == "response.completed" and done["response"]["status"] == "completed"


async def test_reasoning_becomes_its_own_item(info: ServerInfo) -> None:
    client = _client(info)
    reply = await client.responses.create(model="think", input="Capital of France?")
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert reasoning.content is not None
    assert "".join(c.text for c in reasoning.content).strip() == "Paris is the capital."
    assert message.type == "message" and reply.output_text == "It is Paris."
    assert reply.usage is not None and reply.usage.output_tokens_details.reasoning_tokens > 0

    kinds = []
    async with client.responses.stream(model="think", input="Capital of France?") as stream:
        async for event in stream:
            kinds.append(event.type)
        final = await stream.get_final_response()
    assert _collapse(kinds) == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *TEXT_EVENTS,
        "response.completed",
    ]
    assert final.output_text == "It is Paris."


async def test_max_output_tokens_makes_it_incomplete(info: ServerInfo) -> None:
    client = _client(info)
    reply = await client.responses.create(model="long", input="hi", max_output_tokens=2)
    assert reply.status == "incomplete"
    assert reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.output_text == "one two" and reply.output[0].status == "incomplete"
    kinds = []
    async with client.responses.stream(model="long", input="hi", max_output_tokens=2) as stream:
        async for event in stream:
            kinds.append(event.type)
    assert kinds[-1] == "response.incomplete"


async def test_previous_response_id_continues_the_conversation(info: ServerInfo) -> None:
    client = _client(info)
    runtime: Any = info.pool.model("rec").replicas[0].runtime
    first = await client.responses.create(model="rec", input="My name is Ada.", instructions="A")
    second = await client.responses.create(
        model="rec", input="What is my name?", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id
    seen = runtime.requests[-1]
    assert [(t.role, t.text) for t in seen.turns] == [
        ("user", "My name is Ada."),
        ("assistant", "My name is Ada."),
        ("user", "What is my name?"),
    ]
    # Instructions are not carried over (as OpenAI's).
    assert seen.instructions is None
    third = await client.responses.create(
        model="rec",
        input=[{"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
        previous_response_id=second.id,
        instructions="B",
    )
    seen = runtime.requests[-1]
    assert len(seen.turns) == 5 and seen.instructions == "B\n\nBe kind."
    items = await client.responses.input_items.list(third.id)
    assert [i.type for i in items.data] == ["message", "message"]
    assert [i.role for i in items.data] == ["user", "developer"]  # newest first
    assert items.first_id == items.data[0].id and not items.has_more
    page = await client.responses.input_items.list(third.id, order="asc", limit=1)
    assert [i.role for i in page.data] == ["developer"] and page.has_more
    rest = await client.responses.input_items.list(third.id, order="asc", after=page.data[0].id)
    assert [i.role for i in rest.data] == ["user"]


async def test_stored_responses_belong_to_their_tenant(info: ServerInfo) -> None:
    alice, bob = _client(info, "alice"), _client(info, "bob")
    reply = await alice.responses.create(model="echo", input="secret")
    assert (await alice.responses.retrieve(reply.id)).output_text == "secret"
    for attempt in (
        bob.responses.retrieve(reply.id),
        bob.responses.delete(reply.id),
        bob.responses.input_items.list(reply.id),
        bob.responses.create(model="echo", input="x", previous_response_id=reply.id),
    ):
        with pytest.raises(openai.NotFoundError) as missing:
            await attempt
        body: Any = missing.value.body
        assert body["type"] == "invalid_request_error" and body["code"] == "not_found"
    assert (await alice.responses.retrieve(reply.id)).id == reply.id
    await alice.responses.delete(reply.id)
    with pytest.raises(openai.NotFoundError):
        await alice.responses.retrieve(reply.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await alice.responses.create(model="echo", input="x", previous_response_id=reply.id)
    assert missing.value.param == "previous_response_id"  # type: ignore[attr-defined]

    unstored = await alice.responses.create(model="echo", input="forget me", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await alice.responses.retrieve(unstored.id)


async def test_function_call_round_trip(info: ServerInfo) -> None:
    client = _client(info)
    reply = await client.responses.create(
        model="caller", input="Weather in Paris?", tools=[WEATHER], tool_choice="required"
    )
    message, call = reply.output
    assert message.type == "message" and reply.output_text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id == "call_toy1" and json.loads(call.arguments) == {"n": 1}
    assert call.status == "completed"
    assert reply.tools[0].type == "function" and reply.tool_choice == "required"

    kinds = []
    arguments = ""
    async with client.responses.stream(
        model="caller", input="Weather in Paris?", tools=[WEATHER]
    ) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
        final = await stream.get_final_response()
    assert _collapse(kinds) == [
        "response.created",
        "response.in_progress",
        *TEXT_EVENTS,
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert arguments == final.output[1].arguments  # type: ignore[union-attr]

    # The result goes back as a function_call_output item, by previous_response_id ...
    answer = await client.responses.create(
        model="caller",
        previous_response_id=reply.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C"}],
    )
    assert answer.output_text == "22 C"  # (without tools it echoes the last turn)
    # ... or with the whole conversation, as the Agents SDK sends it.
    again = await client.responses.create(
        model="caller",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            *[item.model_dump(exclude_none=True) for item in reply.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "23 C"},
        ],
        store=False,
    )
    assert again.output_text == "23 C"


async def test_errors_are_openai_error_objects(info: ServerInfo) -> None:
    client = _client(info)
    with pytest.raises(openai.NotFoundError) as missing:
        await client.responses.create(model="nope", input="hi")
    assert missing.value.code == "unknown_model"
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(
            model="echo",
            input="hi",
            tools=[{"type": "web_search"}],  # type: ignore[list-item]
        )
    assert refused.value.param == "tools[0].type"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="echo", input="hi", background=True)
    assert refused.value.param == "background"  # type: ignore[attr-defined]
    with pytest.raises(openai.UnprocessableEntityError) as invalid:
        await client.responses.create(model="echo", input="hi", temperature=5)
    assert invalid.value.param == "temperature"  # type: ignore[attr-defined]
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        for method, path in (("GET", "/openai/v1/nothing"), ("PUT", "/openai/v1/responses")):
            r = await http.request(method, path)
            error = r.json()["error"]
            assert r.status_code in (404, 405) and set(error) == {
                "message",
                "type",
                "param",
                "code",
            }
        r = await http.post("/openai/v1/responses", content=b"not json")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.post(
            "/openai/v1/responses",
            json={"model": "echo", "input": "hi"},
            headers={"Host": "evil.example"},
        )
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
        r = await http.get("/openai/v1/responses/resp_x", headers={"Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"


async def test_a_failure_after_the_stream_started_is_response_failed(
    nursery: trio.Nursery,
) -> None:
    info = await start_server(
        nursery,
        {"slow": {"backend": "stub", "enabled": True, "stub_reply": "w " * 400,
                  "stub_tokens_per_second": 20}},
        engine={"unload_drain_s": 0.05, "decoding": {"max_tokens": 1000}},
    )  # fmt: skip
    client = _client(info)
    kinds = []
    async with client.responses.stream(model="slow", input="hi") as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta" and len(kinds) == 5:
                await info.pool.model("slow").unload()
            if event.type == "response.failed":
                assert event.response.status == "failed"
                assert event.response.error is not None
                assert event.response.error.code == "model_unloading"
    # The open item is closed first, so every item added is also done.
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.failed",
    ]


async def _fail_after_two_tokens(self: StubRuntime, request: Any, sink: Any) -> Any:
    await sink.send("The")
    await sink.send(" capital")
    raise BackendError("the runtime fell over")


async def test_a_failure_without_stream_is_an_http_error_and_nothing_is_stored(
    info: ServerInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The JSON answer is built from the events as they come: a generation that fails
    # midway is the client's HTTP error (OpenAI's error object), never a 500 or a
    # half-built response, and there is no response to retrieve afterwards.
    works = StubRuntime.generate
    monkeypatch.setattr(StubRuntime, "generate", _fail_after_two_tokens)
    async with httpx.AsyncClient(base_url=info.url + "/openai/v1", timeout=30) as http:
        reply = await http.post("/responses", json={"model": "echo", "input": "hi"})
        assert reply.status_code == 502, reply.text
        assert reply.json()["error"]["code"] == "backend_error"
        assert "fell over" in reply.json()["error"]["message"]
        # Once the runtime works again, the one response stored is the new one.
        monkeypatch.setattr(StubRuntime, "generate", works)
        kept = await http.post("/responses", json={"model": "echo", "input": "hi"})
        assert kept.status_code == 200, kept.text
    with sqlite3.connect(state_dir() / FILE_NAME) as db:
        rows = db.execute("SELECT id FROM responses").fetchall()
    assert rows == [(kept.json()["id"],)]


async def test_the_other_openai_routes_share_the_base_url(info: ServerInfo) -> None:
    client = _client(info)
    chat = await client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": "hi"}]
    )
    assert chat.choices[0].message.content == "hi"
    completion = await client.completions.create(model="echo", prompt="hey")
    assert completion.choices[0].text == "hey"
    vectors = await client.embeddings.create(model="vec", input=["a", "b"])
    assert len(vectors.data) == 2
    models = await client.models.list()
    assert {"echo", "vec"} <= {m.id for m in models.data}
    assert (await client.models.retrieve("echo")).id == "echo"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError) as missing:
        await client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}]
        )
    assert missing.value.code == "unknown_model"


async def test_the_store_keeps_a_bounded_history(tmp_path: Path) -> None:
    now = [1000.0]
    store = ResponseStore(
        tmp_path / "r.sqlite3", retention_s=60, max_stored=2, clock=lambda: now[0]
    )

    def response(rid: str, previous: str | None = None) -> dict[str, Any]:
        return {"id": rid, "created_at": now[0], "previous_response_id": previous, "output": []}

    await store.save("t", response("a"), [{"id": "i1"}])
    await store.save("t", response("b", "a"), [{"id": "i2"}])
    chain = await store.chain("t", "b")
    assert chain is not None and [t.input for t in chain] == [[{"id": "i1"}], [{"id": "i2"}]]
    await store.save("t", response("c", "b"), [])
    assert await store.get("t", "a") is None  # past max_stored: the oldest went
    assert await store.get("t", "c") is not None
    now[0] += 61
    assert await store.get("t", "c") is None  # past the retention
    await store.save("u", response("d"), [])
    assert await store.get("u", "d") is not None and await store.get("t", "d") is None
    await store.aclose()
    with sqlite3.connect(tmp_path / "r.sqlite3") as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT COUNT(*) FROM responses").fetchone()[0] == 1


async def test_inference_tokens_guard_every_route(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery,
        {"echo": {"backend": "stub", "enabled": True}},
        auth={"inference_tokens": ["user-token"]},
    )
    stranger = openai.AsyncOpenAI(base_url=info.url + "/openai/v1", api_key="wrong", max_retries=0)
    for attempt in (
        stranger.responses.create(model="echo", input="hi"),
        stranger.responses.retrieve("resp_x"),
        stranger.models.list(),
    ):
        with pytest.raises(openai.AuthenticationError) as refused:
            await attempt
        body: Any = refused.value.body
        assert body["type"] == "authentication_error" and body["code"] == "unauthorized"
    user = openai.AsyncOpenAI(base_url=info.url + "/openai/v1", api_key="user-token", max_retries=0)
    reply = await user.responses.create(model="echo", input="hi")
    assert (await user.responses.retrieve(reply.id)).output_text == "hi"


@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        (["<", "think", ">\n", "Rea", "son.", "</", "think", ">", "\n\n", "Answer."],
         [("reasoning", "Reason."), ("text", "Answer.")]),
        ([" <think>Why</think>So"], [("reasoning", "Why"), ("text", "So")]),
        (["Hi <think>", "x</think>"], [("text", "Hi <think>x</think>")]),
        (["<thi"], [("text", "<thi")]),  # cut at the very end: text after all
        (["<think>", "unfinished </th"], [("reasoning", "unfinished </th")]),
        (["\n", "\n", "Plain"], [("text", "\n\nPlain")]),  # no think block: as it came
    ],
)  # fmt: skip
def test_think_blocks_split_however_the_pieces_fall(
    pieces: list[str], expected: list[tuple[str, str]]
) -> None:
    splitter = ThinkSplitter()
    out = [piece for text in pieces for piece in splitter.feed(text)] + splitter.flush()
    joined: list[tuple[str, str]] = []
    for kind, text in out:
        if joined and joined[-1][0] == kind:
            joined[-1] = (kind, joined[-1][1] + text)
        else:
            joined.append((kind, text))
    assert joined == expected


async def test_leaving_a_stream_stops_generation_and_stores_nothing(endless: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=endless.url, timeout=30) as client:
        body = {"model": "endless", "input": "x", "stream": True}
        async with client.stream("POST", "/openai/v1/responses", json=body) as reply:
            # Held, so that leaving the loop does not let the collector close the stream.
            lines = reply.aiter_lines()
            async for line in lines:
                if line.startswith("data: ") and '"response.created"' in line:
                    created = json.loads(line[len("data: ") :])["response"]["id"]
                if line.startswith("event: response.output_text.delta"):
                    break
            assert await running(client, "endless") == 1
        await wait_stopped(client, "endless")
        gone = await client.get(f"/openai/v1/responses/{created}")
        assert gone.status_code == 404


async def test_body_limits_hold_on_both_request_paths(nursery: trio.Nursery) -> None:
    """The lean layer (a served pool) and Quart alone (an embedded app) both refuse a body
    past ``service.max_body_bytes`` with 413, in OpenAI's error object."""
    models = {"echo": {"backend": "stub", "enabled": True}}
    info = await start_server(nursery, models, max_body_bytes=2000)
    big = {"model": "echo", "input": "x" * 5000}
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        r = await http.post("/openai/v1/responses", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = await http.post("/openai/v1/responses", json={"model": "echo", "input": "hi"})
        assert r.status_code == 200 and r.json()["output"][0]["type"] == "message"

    settings = build_settings({"service": {"max_body_bytes": 2000}, "engine": {"models": models}})
    async with open_pool(settings) as pool:
        await pool.load("echo")
        app = create_app(pool, settings).test_client()
        r = await app.post("/openai/v1/responses", json=big)
        assert r.status_code == 413
        assert set((await r.get_json())["error"]) == {"message", "type", "param", "code"}
        r = await app.post("/openai/v1/responses", json={"model": "echo", "input": "hi"})
        assert r.status_code == 200
        reply = await r.get_json()
        assert reply["output"][0]["content"][0]["text"] == "hi"
        r = await app.get(f"/openai/v1/responses/{reply['id']}")
        assert r.status_code == 200 and (await r.get_json())["id"] == reply["id"]


class _FullDisk:
    """Opens the store's database capped at the pages it has (``PRAGMA max_page_count``):
    a write that needs another page fails as on a full disk, with SQLite's own
    ``database or disk is full``, until :meth:`free` lifts the cap."""

    def __init__(self) -> None:
        self.connections: list[sqlite3.Connection] = []

    def open(self, path: Path, schema: str) -> sqlite3.Connection:
        db = open_database(path, schema)
        pages = db.execute("PRAGMA page_count").fetchone()[0]
        db.execute(f"PRAGMA max_page_count = {pages}")
        self.connections.append(db)
        return db

    def free(self) -> None:
        for db in self.connections:
            db.execute("PRAGMA max_page_count = 1073741823")


async def test_a_full_disk_refuses_a_save_with_insufficient_storage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _FullDisk()
    monkeypatch.setattr(store_module, "open_database", disk.open)
    store = ResponseStore(tmp_path / "r.sqlite3", retention_s=60, max_stored=10)
    big = {"id": "a", "created_at": time.time(), "output": ["x" * 20_000]}
    with pytest.raises(PoolError) as refused:
        await store.save("t", big, [])
    assert (refused.value.code, refused.value.status) == ("insufficient_storage", 507)
    assert "disk is full" in refused.value.message
    assert await store.get("t", "a") is None  # reads go on; nothing half-written
    disk.free()
    await store.save("t", big, [])
    assert await store.get("t", "a") is not None
    await store.aclose()


async def test_a_full_disk_answers_507_or_ends_the_stream_with_an_error_event(
    info: ServerInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = _FullDisk()
    monkeypatch.setattr(store_module, "open_database", disk.open)
    body = {"model": "echo", "input": " ".join(["word"] * 3000)}
    async with httpx.AsyncClient(base_url=info.url + "/openai/v1", timeout=30) as http:
        reply = await http.post("/responses", json=body)
        assert reply.status_code == 507, reply.text
        error = reply.json()["error"]
        assert error["code"] == "insufficient_storage" and "disk is full" in error["message"]
        assert reply.headers["X-Error-Code"] == "insufficient_storage"
        # Not stored: no store at all serves as before.
        assert (await http.post("/responses", json={**body, "store": False})).status_code == 200
        streamed = await http.post("/responses", json={**body, "stream": True})
        assert streamed.status_code == 200
        events = [json.loads(data) for _, data in sse_events(streamed.text)]
        kinds = [event["type"] for event in events]
        # (3000 words run past the stub's default max tokens: incomplete, as stored.)
        assert kinds[-2:] == ["response.incomplete", "error"], kinds
        assert events[-1]["code"] == "insufficient_storage"
        numbers = [event["sequence_number"] for event in events]
        assert numbers == sorted(numbers)
        completed = events[-2]["response"]
        assert (await http.get(f"/responses/{completed['id']}")).status_code == 404
        disk.free()  # space returns
        kept = await http.post("/responses", json=body)
        assert kept.status_code == 200, kept.text
        assert (await http.get(f"/responses/{kept.json()['id']}")).status_code == 200
