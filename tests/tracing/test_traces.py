"""OpenTelemetry traces, as a real OTLP/HTTP receiver started here receives them.

Each test serves stub models with ``service.tracing.endpoint`` pointing at the
receiver, shuts the pool down (which flushes the batch exporter), then reads the
decoded spans: the request span, its queue/load/generation children, the GenAI
attributes, the first-token event, the caller's ``traceparent`` honoured, the
response header, error spans, and ``traceparent`` carried to an upstream pool.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import open_websocket_url

from pool import ServerInfo
from pool.backends import Decoding, GenerationRequest, TextPart, TokensUsed, ToolCallDelta, Turn
from pool.cluster import PeerRoute
from pool.tracing import FIRST_TOKEN_EVENT, GENERATION_SPAN, LOAD_SPAN, QUEUE_SPAN

from ..http.conftest import STUB_MODELS, WAITING_MODELS, start_server
from .otlp_receiver import ReceivedSpan, Receiver, otlp_receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{TRACE_ID}-{CALLER_SPAN}-01"
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "one two three"}]}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    # Only the settings of each test decide; a proxy must not take loopback exports.
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with otlp_receiver() as received:
        yield received


@asynccontextmanager
async def traced_server(
    receiver: Receiver, models: dict[str, dict[str, Any]] | None = None, **tracing: Any
) -> AsyncIterator[ServerInfo]:
    """A server that traces to ``receiver``; leaving the block shuts it down (which
    exports every span) and returns once it has stopped."""
    async with trio.open_nursery() as nursery:
        server = await start_server(nursery, models, tracing={"endpoint": receiver.url, **tracing})
        try:
            yield server
        finally:
            server.shutdown()


def requests_of(receiver: Receiver) -> list[ReceivedSpan]:
    """The request spans (those with a GenAI operation), in the order they started."""
    spans = [s for s in receiver.spans if "gen_ai.operation.name" in s.attributes]
    return sorted(spans, key=lambda s: s.start_ns)


def children(receiver: Receiver, parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    found = [s for s in receiver.spans if s.parent_span_id == parent.span_id]
    assert all(s.trace_id == parent.trace_id for s in found)
    by_name = {s.name: s for s in found}
    assert len(by_name) == len(found), "one span per phase"
    return by_name


def header_ids(answer: httpx.Response) -> tuple[str, str]:
    version, trace_id, span_id, flags = answer.headers["traceparent"].split("-")
    # Sampled (bit 0); the SDK may set bit 1 too (W3C level 2: a random trace id).
    assert version == "00" and int(flags, 16) & 1
    return trace_id, span_id


async def test_a_request_span_has_its_phases_and_the_caller_as_parent(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pool.access")
    body = {**CHAT, "max_tokens": 16, "temperature": 0.5}
    async with (
        traced_server(receiver) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        answer = await client.post(
            "/v1/chat/completions",
            json=body,
            headers={"traceparent": CALLER, "tracestate": "vendor=1", "x-tenant-id": "team-a"},
        )
        assert answer.status_code == 200
    trace_id, span_id = header_ids(answer)
    assert trace_id == TRACE_ID and span_id != CALLER_SPAN

    (request,) = requests_of(receiver)
    assert (request.name, request.kind, request.service) == (
        "chat echo",
        "SPAN_KIND_SERVER",
        "llm-pool",
    )
    assert (request.trace_id, request.span_id, request.parent_span_id) == (
        TRACE_ID,
        span_id,
        CALLER_SPAN,
    )
    assert request.error is None
    usage = answer.json()["usage"]
    attributes = request.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == "echo"
    assert attributes["gen_ai.request.max_tokens"] == 16
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 3
    assert attributes["gen_ai.response.finish_reasons"] == ["stop"]
    assert attributes["llm_pool.tenant"] == "team-a"
    assert attributes["gen_ai.response.id"]

    # A free replica took it on arrival: no queue wait, no load wait, only the generation.
    (generation,) = children(receiver, request).values()
    assert generation.name == GENERATION_SPAN
    assert request.start_ns <= generation.start_ns <= generation.end_ns <= request.end_ns
    assert generation.attributes["llm_pool.replica"] == 0
    ((event, at),) = generation.events
    assert event == FIRST_TOKEN_EVENT and generation.start_ns <= at <= generation.end_ns
    # The access line names the trace, to find it by.
    lines = [r.getMessage() for r in caplog.records if r.name == "pool.access"]
    assert any("path=/v1/chat/completions" in x and f"trace_id={TRACE_ID}" in x for x in lines)


async def test_every_surface_traces_its_requests(receiver: Receiver) -> None:
    user = [{"role": "user", "content": "one two"}]
    async with (
        traced_server(receiver) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        calls = [
            ("/v1/responses", {"model": "echo", "input": "one two", "stream": True}),
            ("/openai/v1/chat/completions", {"model": "echo", "messages": user}),
            ("/openai/v1/responses", {"model": "echo", "input": "one two"}),
            ("/v1/completions", {"model": "echo", "prompt": "one two"}),
            ("/api/chat", {"model": "echo", "messages": user, "stream": False}),
            ("/api/generate", {"model": "echo", "prompt": "one two"}),
            ("/v1/messages", {"model": "echo", "max_tokens": 8, "messages": user}),
        ]
        answered: dict[str, str] = {}
        for path, body in calls:
            answer = await client.post(path, json=body, headers={"traceparent": CALLER})
            assert answer.status_code == 200, (path, answer.text)
            answered[header_ids(answer)[1]] = path
        url = server.url.replace("http://", "ws://") + "/v1/responses"
        async with open_websocket_url(url, extra_headers=[(b"traceparent", CALLER.encode())]) as ws:
            for text in ("first turn", "second turn"):
                await ws.send_message(json.dumps({"model": "echo", "input": text}))
                while json.loads(await ws.get_message())["type"] != "response.completed":
                    pass
    spans = requests_of(receiver)
    assert len(spans) == len(calls) + 2
    for span in spans:
        assert span.trace_id == TRACE_ID and span.parent_span_id == CALLER_SPAN
        assert span.kind == "SPAN_KIND_SERVER" and span.error is None
        assert span.attributes["gen_ai.usage.output_tokens"] == 2
        assert set(children(receiver, span)) == {GENERATION_SPAN}
    # Each HTTP answer named its own request's span; the socket's turns are spans of their own.
    assert set(answered) <= {s.span_id for s in spans}
    assert len({s.span_id for s in spans} - set(answered)) == 2


async def test_a_request_that_waited_for_a_replica_has_a_queue_wait(receiver: Receiver) -> None:
    body = {"model": "slow", "input": "x"}  # 40 words at 20 a second, one at a time
    async with (
        traced_server(receiver) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        answers: list[httpx.Response] = []

        async def ask() -> None:
            answers.append(await client.post("/v1/responses", json=body))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)
        assert [a.status_code for a in answers] == [200, 200]
    first, second = requests_of(receiver)
    assert set(children(receiver, first)) == {GENERATION_SPAN}
    phases = children(receiver, second)
    assert set(phases) == {QUEUE_SPAN, GENERATION_SPAN}
    queue, generation = phases[QUEUE_SPAN], phases[GENERATION_SPAN]
    assert second.start_ns <= queue.start_ns <= queue.end_ns <= generation.start_ns
    # It waited for the first one's generation to end.
    ahead = children(receiver, first)[GENERATION_SPAN]
    assert queue.end_ns >= ahead.end_ns


async def test_a_request_that_waited_for_a_load_has_a_load_wait(receiver: Receiver) -> None:
    async with (
        traced_server(receiver, WAITING_MODELS) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        answer = await client.post("/v1/responses", json={"model": "lazy", "input": "x"})
        assert answer.status_code == 200
    (request,) = requests_of(receiver)
    phases = children(receiver, request)
    assert set(phases) == {QUEUE_SPAN, LOAD_SPAN, GENERATION_SPAN}
    queue, load, generation = phases[QUEUE_SPAN], phases[LOAD_SPAN], phases[GENERATION_SPAN]
    # The load wait is the first part of the queue wait; the generation follows both.
    assert queue.start_ns == load.start_ns <= load.end_ns <= queue.end_ns <= generation.start_ns
    assert load.error is None
    # The stub's load takes 0.4 s: the wait covers most of it.
    assert load.end_ns - load.start_ns >= 200_000_000


async def test_failed_requests_are_error_spans(receiver: Receiver) -> None:
    async with (
        traced_server(receiver, {**STUB_MODELS, **WAITING_MODELS}) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        unknown = await client.post("/v1/responses", json={"model": "nope", "input": "x"})
        assert unknown.status_code == 404
        waited = await client.post("/v1/responses", json={"model": "never", "input": "x"})
        assert waited.status_code == 504
    spans = {s.attributes["gen_ai.request.model"]: s for s in requests_of(receiver)}
    assert set(spans) == {"nope", "never"}
    assert header_ids(unknown)[1] == spans["nope"].span_id
    assert spans["nope"].error == "unknown_model"
    assert spans["nope"].attributes["error.type"] == "unknown_model"
    assert children(receiver, spans["nope"]) == {}
    never = spans["never"]
    assert never.error == "queue_timeout" and never.attributes["error.type"] == "queue_timeout"
    phases = children(receiver, never)
    assert set(phases) == {QUEUE_SPAN, LOAD_SPAN}  # it never reached a replica
    assert phases[QUEUE_SPAN].error == phases[LOAD_SPAN].error == "queue_timeout"


async def test_a_request_without_traceparent_starts_a_trace(receiver: Receiver) -> None:
    async with (
        traced_server(receiver, service_name="gpu-box-1") as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        answer = await client.post("/v1/chat/completions", json=CHAT)
        # A malformed traceparent is ignored (W3C): a new trace, never a refused request.
        garbled = await client.post(
            "/v1/chat/completions", json=CHAT, headers={"traceparent": "00-xyz-01"}
        )
        assert answer.status_code == garbled.status_code == 200
    first, second = requests_of(receiver)
    assert first.parent_span_id == second.parent_span_id == ""
    assert first.trace_id != second.trace_id
    assert header_ids(answer) == (first.trace_id, first.span_id)
    assert first.service == "gpu-box-1"


async def test_sampled_out_requests_export_nothing_but_still_answer(receiver: Receiver) -> None:
    async with (
        traced_server(receiver, sample_ratio=0.0) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        answer = await client.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200
    assert not int(answer.headers["traceparent"].rsplit("-", 1)[1], 16) & 1  # not sampled
    assert receiver.spans == []


async def test_the_exporters_variables_apply(
    receiver: Receiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A collector that wants a key, and compressed bodies: the OTLP exporter's own
    # variables, read by the HTTP client the pool's export thread posts through.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20k-29")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    async with (
        traced_server(receiver) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        answer = await client.post("/v1/chat/completions", json=CHAT)
        assert answer.status_code == 200
    (request,) = requests_of(receiver)
    assert request.span_id == header_ids(answer)[1]
    assert receiver.headers and all(
        h.get("authorization") == "Bearer k-29" and h.get("content-encoding") == "gzip"
        for h in receiver.headers
    )
    assert receiver.headers[0]["content-type"] == "application/x-protobuf"


class _Collect:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.used = TokensUsed()

    async def send(self, text: str | ToolCallDelta) -> None:
        assert isinstance(text, str)
        self.text.append(text)


async def test_relayed_requests_carry_traceparent_upstream(receiver: Receiver) -> None:
    async with traced_server(receiver, service_name="upstream") as upstream:
        relaying = {
            "remote": {
                "backend": "openai_remote",
                "enabled": True,
                "remote_base_url": upstream.url + "/v1",
                "remote_model": "echo",
                "allow_remote": True,
            }
        }
        # An openai_remote model in front of a traced pool: one trace across both.
        async with (
            traced_server(receiver, relaying, service_name="front") as front,
            httpx.AsyncClient(base_url=front.url, timeout=30) as client,
        ):
            answer = await client.post(
                "/v1/chat/completions",
                json={**CHAT, "model": "remote"},
                headers={"traceparent": CALLER},
            )
            assert answer.status_code == 200
        # A cluster peer route (what relays to another node) sends it the same way.
        peer = PeerRoute("upstream", upstream.url, "echo", timeout_s=30)
        given = f"00-{'ab' * 16}-{'cd' * 8}-01"
        request = GenerationRequest(
            request_id="relay-1",
            model="echo",
            turns=(Turn("user", (TextPart("relayed"),)),),
            decoding=Decoding(),
            trace_parent=given,
        )
        sink = _Collect()
        try:
            await peer.generate(request, sink)
        finally:
            await peer.close()
        assert "".join(sink.text) == "relayed"
    spans = requests_of(receiver)
    (front_span,) = [s for s in spans if s.service == "front"]
    upstream_spans = [s for s in spans if s.service == "upstream"]
    assert len(upstream_spans) == 2
    from_front, from_peer = sorted(upstream_spans, key=lambda s: s.start_ns)
    assert front_span.trace_id == from_front.trace_id == TRACE_ID
    assert front_span.parent_span_id == CALLER_SPAN
    # A Chat Completions client of a Chat Completions upstream: its bytes went through.
    generation = children(receiver, front_span)[GENERATION_SPAN]
    assert generation.attributes["llm_pool.relay_path"] == "pass_through"
    assert from_front.parent_span_id == front_span.span_id
    assert (from_peer.trace_id, from_peer.parent_span_id) == ("ab" * 16, "cd" * 8)
