"""The pass-through relay (pool/backends/_pass_through.py): a Chat Completions client of a
Chat Completions upstream gets the upstream's own bytes, ``model`` rewritten, and the
pool still accounts, times and fails the request as on the translated path.

The upstream is tests/backends/recording_upstream.py sending bytes no renderer of the
pool would write (odd spacing, a field of its own, its own id): they reach the client
unchanged only on the pass-through path, which is how these tests tell the paths apart.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import httpx
import pytest
import trio

from pool import InferenceRequest, ServerInfo, open_pool
from pool.backends import PassThrough, relayed_text
from pool.config import build_settings
from tests.backends.recording_upstream import RecordingUpstream

from .conftest import start_server


def _event(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


_ID = '"id":"up-7f3a","object":"chat.completion.chunk","created":1712345678'
_OPENING = _event(
    "{" + _ID + ',"model":"up-served","choices":[{"index":0,"delta":{"role":"assistant",'
    '"content":null},"finish_reason":null}],"usage":null,"x_odd" : [1,  2.50]}'
)
_WORDS = [
    _event(
        "{"
        + _ID
        + ',"model":"up-served","choices":[{"index":0,"delta":{"content":'
        + json.dumps(word)
        + '},"finish_reason":null}],"usage":null,"x_odd" : [1,  2.50]}'
    )
    for word in ("alpha", " beta", ' "model":"up-served"')
]
_FINISH = _event(
    "{" + _ID + ',"model":"up-served","choices":[{"index":0,"delta":{},'
    '"finish_reason":"length"}],"usage":null}'
)
_USAGE = _event(
    "{" + _ID + ',"model":"up-served","choices":[],"usage":{"prompt_tokens":11,'
    '"completion_tokens":17,"total_tokens":28,"prompt_tokens_details":{"cached_tokens":4}}}'
)
RAW_STREAM = _OPENING + b"".join(_WORDS) + _FINISH + _USAGE + b"data: [DONE]\n\n"
RAW_REPLY = (
    b'{"id":"up-reply-1","object":"chat.completion","created":1712345678,'
    b'"model":"up-served","choices":[{"index":0,"message":{"role":"assistant",'
    b'"content":"alpha beta"},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11},'
    b'"x_odd" : {"kept": true}}'
)


def _as_client_gets(raw: bytes, include_usage: bool) -> bytes:
    """``raw`` with the only edits the relay makes: the model's name, and the usage the
    client did not ask for."""
    out = raw.replace(b'"model":"up-served"', b'"model":"remote"')
    if not include_usage:
        out = out.replace(b',"usage":null', b"")
    return out


def _models(url: str, **fields: Any) -> dict[str, dict[str, Any]]:
    return {
        "remote": {
            "backend": "openai_remote",
            "enabled": True,
            "remote_base_url": url,
            "remote_model": "up-served",
            "allow_remote": True,
            **fields,
        }
    }


async def _serve(nursery: trio.Nursery, upstream: RecordingUpstream, **service: Any) -> ServerInfo:
    return await start_server(nursery, _models(upstream.url), **service)


async def _upstream(nursery: trio.Nursery, **fields: Any) -> RecordingUpstream:
    fields.setdefault("raw_stream", RAW_STREAM)
    fields.setdefault("raw_reply", RAW_REPLY)
    upstream: RecordingUpstream = await nursery.start(RecordingUpstream(**fields).run)
    return upstream


_CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("include_usage", [False, True], ids=["plain", "include_usage"])
async def test_the_upstreams_events_reach_the_client_byte_for_byte(
    nursery: trio.Nursery, include_usage: bool
) -> None:
    upstream = await _upstream(nursery)
    info = await _serve(nursery, upstream)
    body: dict[str, Any] = {"model": "remote", "messages": _CHAT, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    expected = _OPENING + b"".join(_WORDS) + _FINISH
    if include_usage:
        expected += _USAGE
    assert response.content == _as_client_gets(expected, include_usage) + b"data: [DONE]\n\n"
    # The text that happens to read like the model field is text, and stays as it is.
    assert b'\\"model\\":\\"up-served\\"' in response.content
    # The upstream was asked for its usage, whatever the client asked.
    (posted,) = upstream.posted()
    assert posted["stream"] is True
    assert posted["stream_options"] == {"include_usage": True}


async def test_a_reply_not_streamed_is_the_upstreams_body(nursery: trio.Nursery) -> None:
    upstream = await _upstream(nursery)
    info = await _serve(nursery, upstream)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        response = await client.post(
            "/v1/chat/completions", json={"model": "remote", "messages": _CHAT}
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.content == _as_client_gets(RAW_REPLY, True)
    (posted,) = upstream.posted()
    assert posted["stream"] is False
    assert "stream_options" not in posted
    assert response.headers["x-request-id"]


async def test_the_translated_path_can_be_forced(nursery: trio.Nursery) -> None:
    """``service.pass_through: false``: the same upstream, every reply rendered again."""
    upstream = await _upstream(nursery)
    info = await _serve(nursery, upstream, pass_through=False)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        streamed = await client.post(
            "/v1/chat/completions", json={"model": "remote", "messages": _CHAT, "stream": True}
        )
        plain = await client.post(
            "/v1/chat/completions", json={"model": "remote", "messages": _CHAT}
        )
    for response in (streamed, plain):
        assert response.status_code == 200
        assert b"x_odd" not in response.content
        assert b"up-7f3a" not in response.content and b"up-reply-1" not in response.content
        assert b'"model":"remote"' in response.content
    texts = [
        json.loads(line[6:])["choices"][0]["delta"].get("content")
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(t or "" for t in texts) == 'alpha beta "model":"up-served"'
    assert plain.json()["choices"][0]["message"]["content"] == 'alpha beta "model":"up-served"'


def _remote_settings(url: str, **fields: Any) -> Any:
    return build_settings({"engine": {"models": _models(url, **fields)}})


def _ask(stream: bool, include_usage: bool = False) -> InferenceRequest:
    request = InferenceRequest.prompt("remote", "hi", allow_remote=True)
    return dataclasses.replace(request, pass_through=PassThrough("remote", stream, include_usage))


async def test_usage_and_finish_are_read_from_the_upstreams_events(
    nursery: trio.Nursery,
) -> None:
    upstream = await _upstream(nursery)
    async with open_pool(_remote_settings(upstream.url)) as pool:
        events = [event async for event in pool.stream(_ask(stream=True))]
        finished = events[-1]
        streamed_bytes = b"".join(e for e in events if isinstance(e, bytes))
        reply = await pool.respond(_ask(stream=False))
    assert finished.relay_path == "pass_through"
    assert finished.finish_reason == "length"
    assert (finished.usage.prompt_tokens, finished.usage.output_tokens) == (11, 17)
    assert finished.usage.cached_tokens == 4
    assert finished.timings.time_to_first_token_ms is not None
    assert finished.body is None  # a stream's events are not kept
    assert streamed_bytes.startswith(_as_client_gets(_OPENING, False))
    assert reply.relay_path == "pass_through"
    assert reply.finish_reason == "stop"
    assert (reply.usage.prompt_tokens, reply.usage.output_tokens) == (9, 2)
    assert reply.body == _as_client_gets(RAW_REPLY, True)


async def test_without_usage_the_tokens_are_counted(nursery: trio.Nursery) -> None:
    raw = RAW_STREAM.replace(_USAGE, b"")
    upstream = await _upstream(nursery, raw_stream=raw)
    async with open_pool(_remote_settings(upstream.url)) as pool:
        finished = await pool.respond(_ask(stream=True))
    assert finished.relay_path == "pass_through"
    assert finished.usage.output_tokens == 3  # the events that carried a token


async def test_a_request_without_pass_through_is_translated(nursery: trio.Nursery) -> None:
    upstream = await _upstream(nursery)
    async with open_pool(_remote_settings(upstream.url)) as pool:
        finished = await pool.respond(InferenceRequest.prompt("remote", "hi", allow_remote=True))
    assert finished.relay_path == "translated"
    assert finished.text == 'alpha beta "model":"up-served"'
    assert (finished.usage.prompt_tokens, finished.usage.output_tokens) == (11, 17)


def test_the_text_of_relayed_events_for_affinity() -> None:
    """With replicas to choose between, each reply is recorded for the next turn's
    affinity: the recorder reads the text of the forwarded events once, at the end."""
    assert relayed_text(RAW_STREAM) == 'alpha beta "model":"up-served"'
    assert relayed_text(RAW_REPLY) == "alpha beta"
    reasoning = _event('{"choices":[{"delta":{"reasoning_content":"hm","content":"a\\n\\u00e9"}}]}')
    assert relayed_text(reasoning) == "a\né"


async def test_replicas_pass_through_and_learn_the_reply(nursery: trio.Nursery) -> None:
    upstream = await _upstream(nursery)
    async with open_pool(_remote_settings(upstream.url, replicas=2)) as pool:
        finished = await pool.respond(_ask(stream=True))
        second = await pool.respond(_ask(stream=False))
    assert finished.relay_path == second.relay_path == "pass_through"


async def test_other_dialects_are_translated(nursery: trio.Nursery) -> None:
    upstream = await _upstream(nursery)
    info = await _serve(nursery, upstream)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        response = await client.post(
            "/v1/responses", json={"model": "remote", "input": "hi", "allow_remote": True}
        )
        completion = await client.post(
            "/v1/completions", json={"model": "remote", "prompt": "hi", "stream": True}
        )
    assert response.status_code == 200, response.text
    assert b"x_odd" not in response.content
    assert completion.status_code == 200, completion.text
    assert b"x_odd" not in completion.content


@pytest.mark.parametrize("pass_through", [True, False], ids=["pass-through", "translated"])
async def test_an_upstream_failure_mid_stream_is_the_same_error_event(
    nursery: trio.Nursery, pass_through: bool
) -> None:
    error = _event('{"error":{"message":"the engine died","type":"server_error"}}')
    upstream = await _upstream(nursery, raw_stream=_OPENING + _WORDS[0] + error)
    info = await _serve(nursery, upstream, pass_through=pass_through)
    body = {"model": "remote", "messages": _CHAT, "stream": True}
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        response = await client.post("/v1/chat/completions", json=body)
    last = response.content.rstrip(b"\n").split(b"\n\n")[-1]
    assert json.loads(last[6:])["error"] == {
        "message": "remote API failed mid-stream: the engine died",
        "type": "server_error",
        "param": None,
        "code": "backend_error",
    }
    assert b"[DONE]" not in response.content
    assert (b"x_odd" in response.content) is pass_through


async def test_an_upstream_that_spells_its_json_with_spaces(nursery: trio.Nursery) -> None:
    """Whitespace in the upstream's JSON (a Python server's ``json.dumps``): the same
    edits, and the last token may come in the finish event itself (as vLLM sends it)."""
    chunks = [
        {"id": "x", "model": "up-served", "choices": [{"delta": {"content": w}}], "usage": None}
        for w in ("one", " two")
    ]
    chunks.append(
        {
            "id": "x",
            "model": "up-served",
            "choices": [{"delta": {"content": " three"}, "finish_reason": "stop"}],
            "usage": None,
        }
    )
    raw = b"".join(_event(json.dumps(c)) for c in chunks) + b"data: [DONE]\n\n"
    upstream = await _upstream(nursery, raw_stream=raw)
    info = await _serve(nursery, upstream)
    body = {"model": "remote", "messages": _CHAT, "stream": True}
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        response = await client.post("/v1/chat/completions", json=body)
    expected = b"".join(
        _event(json.dumps(c).replace('"model": "up-served"', '"model":"remote"')) for c in chunks
    ).replace(b', "usage": null', b"")
    assert response.content == expected + b"data: [DONE]\n\n"
    async with open_pool(_remote_settings(upstream.url)) as pool:
        finished = await pool.respond(_ask(stream=True))
    assert finished.usage.output_tokens == 3  # no usage came: the events with a token
    assert finished.finish_reason == "stop"


async def test_a_client_that_leaves_stops_the_upstream(nursery: trio.Nursery) -> None:
    """Cancellation on the pass-through path: the client leaves after a few events, the
    pool closes its upstream connection, and the upstream (a pool serving a slow stub)
    stops generating at once rather than after its 200 words."""
    slow = {
        "slow": {
            "backend": "stub",
            "enabled": True,
            "stub_reply": " ".join(f"w{i}" for i in range(200)),
            "stub_tokens_per_second": 20,
        }
    }
    upstream = await start_server(nursery, slow)
    front = await start_server(
        nursery,
        {
            "remote": {
                "backend": "openai_remote",
                "enabled": True,
                "remote_base_url": upstream.url + "/v1",
                "remote_model": "slow",
                "allow_remote": True,
            }
        },
    )
    body = {"model": "remote", "messages": _CHAT, "stream": True}
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream("POST", front.url + "/v1/chat/completions", json=body) as answer:
            seen = b""
            async for part in answer.aiter_bytes():
                seen += part
                if seen.count(b'"content":"w') >= 3:
                    break
        assert b'"model":"remote"' in seen

        async def inflight(info: ServerInfo, model: str) -> int:
            row = (await client.get(f"{info.url}/v1/admin/models/{model}")).json()
            return int(row["runtime_inflight"])

        with trio.fail_after(5):
            while await inflight(upstream, "slow") or await inflight(front, "remote"):
                await trio.sleep(0.05)
