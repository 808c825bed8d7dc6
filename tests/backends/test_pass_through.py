"""The pass-through relay's reading of an upstream stream (pool/backends/_pass_through.py),
fed byte by byte the way llama-server and vLLM send: where its events are cut, what the
request is charged while it runs, and what the client gets. The HTTP surface is tested
in tests/http/test_pass_through.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pool.backends import PassThrough, TokensUsed
from pool.backends._pass_through import relay_stream


class _Response:
    status = 200

    def __init__(self, parts: list[bytes]) -> None:
        self._parts = parts

    async def chunks(self) -> AsyncIterator[bytes]:
        for part in self._parts:
            yield part

    async def read(self) -> bytes:
        return b"".join(self._parts)


class _Transport:
    """Answers every request with ``parts``, one read each."""

    def __init__(self, parts: list[bytes]) -> None:
        self.parts = parts
        self.bodies: list[Any] = []

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        headers: Any = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[_Response]:
        self.bodies.append(json.loads(body or b"null"))
        yield _Response(self.parts)

    async def aclose(self) -> None:
        pass


class _Sink:
    takes_raw = True

    def __init__(self) -> None:
        self.used = TokensUsed()
        self.sent: list[bytes] = []
        self.charged: list[tuple[int | None, int | None, int | None]] = []

    async def send(self, data: Any) -> None:
        assert isinstance(data, bytes)
        self.sent.append(data)
        used = self.used
        self.charged.append((used.prompt_tokens, used.cached_tokens, used.output_tokens))


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    return _event(
        {
            "id": "chatcmpl-up",
            "model": "served",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            **extra,
        }
    )


async def test_llama_server_timings_charge_the_prompt_while_it_streams() -> None:
    timings = {"prompt_n": 7, "cache_n": 5, "predicted_n": 1}
    events = [
        _chunk({"role": "assistant", "content": None}),
        _chunk({"content": "one"}, timings=timings),
        _chunk({"content": " two"}, timings={**timings, "predicted_n": 2}),
        _chunk({}, "stop", timings={**timings, "predicted_n": 2}),
        b"data: [DONE]\n\n",
    ]
    # Cut anywhere, CRLF line ends: the events come out whole, with LF.
    whole = b"".join(events).replace(b"\n", b"\r\n")
    parts = [whole[i : i + 37] for i in range(0, len(whole), 37)]
    transport, sink = _Transport(parts), _Sink()
    stats = await relay_stream(
        transport, "/v1/chat/completions", {"model": "served"}, sink, PassThrough("client")
    )
    assert transport.bodies[0]["stream_options"] == {"include_usage": True}
    out = b"".join(sink.sent)
    assert out == b"".join(events[:4]).replace(b'"model":"served"', b'"model":"client"')
    # The first send holds the opening and the first token; from then on the prompt
    # (computed plus reused) is charged, and the tokens counted so far.
    assert b'"content":"one"' in sink.sent[0] and b'"role"' in sink.sent[0]
    assert sink.charged[-1] == (12, 5, 2)
    assert (stats.prompt_tokens, stats.output_tokens, stats.finish_reason) == (None, 2, "stop")
    assert stats.relay_path == "pass_through" and stats.time_to_first_token_ms is not None


async def test_vllm_continuous_usage_and_the_usage_event() -> None:
    def usage(completion: int) -> dict[str, int]:
        return {"prompt_tokens": 4, "completion_tokens": completion, "total_tokens": 4 + completion}

    events = [
        _chunk({"role": "assistant", "content": ""}, usage=usage(0)),
        _chunk({"content": "a"}, usage=usage(1)),
        _chunk({"content": "b"}, "length", usage=usage(2)),
        _event({"id": "chatcmpl-up", "model": "served", "choices": [], "usage": usage(2)}),
        b"data: [DONE]\n\n",
    ]
    transport, sink = _Transport(events), _Sink()
    body = {"model": "served", "stream_options": {"continuous_usage_stats": True}}
    stats = await relay_stream(transport, "/v1/chat/completions", body, sink, PassThrough("c"))
    assert transport.bodies[0]["stream_options"] == {
        "continuous_usage_stats": True,
        "include_usage": True,
    }
    out = b"".join(sink.sent)
    # The client did not ask for usage: the usage event is dropped; the upstream's own
    # per-event stats stay (they are not the pool's to remove).
    assert out == b"".join(events[:3]).replace(b'"model":"served"', b'"model":"c"')
    assert sink.charged[0][0] == 4
    assert (stats.prompt_tokens, stats.output_tokens, stats.finish_reason) == (4, 2, "length")


def _one_read_stream(usage: bool) -> list[bytes]:
    events = [
        _chunk({"role": "assistant", "content": ""}, usage=None),
        *(_chunk({"content": f"t{index}"}, usage=None) for index in range(5)),
        _chunk({}, "stop", usage=None),
    ]
    if usage:
        closing = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        events.append(
            _event({"id": "chatcmpl-up", "model": "served", "choices": [], "usage": closing})
        )
    return [*events, b"data: [DONE]\n\n"]


async def test_a_whole_stream_in_one_read_is_forwarded_in_one_send() -> None:
    # A fast upstream's events arrive many to a read: the scans find the finish and the
    # usage event in the batch without cutting it into events.
    events = _one_read_stream(usage=True)
    transport, sink = _Transport([b"".join(events)]), _Sink()
    stats = await relay_stream(transport, "/v1/chat/completions", {}, sink, PassThrough("c"))
    assert len(sink.sent) == 1
    expected = b"".join(events[:7]).replace(b',"usage":null', b"")
    assert sink.sent[0] == expected.replace(b'"model":"served"', b'"model":"c"')
    assert (stats.prompt_tokens, stats.output_tokens, stats.finish_reason) == (3, 5, "stop")


async def test_events_are_counted_the_same_in_one_read_or_one_a_read() -> None:
    # No usage from the upstream: the charge is the events that carried a token (not the
    # role-only opening, not the finish), however the reads split them.
    events = _one_read_stream(usage=False)
    for parts in ([b"".join(events)], events):
        transport, sink = _Transport(parts), _Sink()
        ask = PassThrough("c", include_usage=True)
        stats = await relay_stream(transport, "/v1/chat/completions", {}, sink, ask)
        assert b"".join(sink.sent) == b"".join(events[:7]).replace(
            b'"model":"served"', b'"model":"c"'
        )
        assert (stats.output_tokens, stats.finish_reason) == (5, "stop")
