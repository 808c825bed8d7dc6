"""openai_remote against real upstreams on loopback: another pool, a server that records
what it receives (recording_upstream.py), and a silent socket."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from pool import (
    Delta,
    InferenceRequest,
    PoolError,
    ServerInfo,
    open_pool,
    request_from_responses,
    serve,
)
from pool.actors import EmbeddingRequest, TaskRequest
from pool.backends import Ranked, rerank_job
from pool.backends.stub import stub_embedding
from pool.config import RerankLimits, build_settings
from tests.media.helpers import PNG, PNG_URL

from .recording_upstream import RecordingUpstream


async def _upstream(nursery: trio.Nursery) -> ServerInfo:
    settings = build_settings(
        {
            "engine": {
                "models": {
                    "up": {
                        "backend": "stub",
                        "enabled": True,
                        "target_inflight": 4,
                        "stub_reply": "alpha beta gamma delta",
                    }
                }
            }
        }
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, port=0, task_status=task_status)
    )
    return info


def _remote(base_url: str, service: dict[str, Any] | None = None, **fields: Any) -> Any:
    return build_settings(
        {
            "service": service or {},
            "engine": {
                "models": {
                    "remote": {
                        "backend": "openai_remote",
                        "remote_base_url": base_url,
                        "remote_model": "up",
                        "enabled": True,
                        **fields,
                    }
                }
            },
        }
    )


def _ask(**fields: Any) -> InferenceRequest:
    return request_from_responses(
        {"model": "remote", "input": "hi", "allow_remote": True, **fields}
    )


async def test_plain_and_streamed(nursery: trio.Nursery) -> None:
    upstream = await _upstream(nursery)
    async with open_pool(
        _remote(upstream.url + "/v1", remote_health_check="models_endpoint")
    ) as pool:
        reply = await pool.respond(_ask())
        assert reply.text == "alpha beta gamma delta"
        assert reply.usage.output_tokens == 4
        deltas = [
            e.text
            async for e in pool.stream(_ask(decoding={"max_tokens": 2}))
            if isinstance(e, Delta)
        ]
        assert deltas == ["alpha", " beta"]


async def test_refused_without_allow_remote(nursery: trio.Nursery) -> None:
    upstream = await _upstream(nursery)
    async with open_pool(_remote(upstream.url + "/v1")) as pool:
        with pytest.raises(PoolError) as info:
            await pool.respond(InferenceRequest.prompt("remote", "hi"))
        assert info.value.code == "remote_not_allowed" and info.value.status == 400


async def test_upstream_errors_become_backend_errors(nursery: trio.Nursery) -> None:
    upstream = await _upstream(nursery)
    async with open_pool(_remote(upstream.url + "/v1", remote_model="no-such-model")) as pool:
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask())
        assert info.value.code == "backend_error" and "404" in info.value.message


async def test_a_request_the_upstream_refuses_is_the_clients_400(nursery: trio.Nursery) -> None:
    """The upstream's 4xx for the request itself (here an image to its text-only model)
    is the client's 400 ``invalid_request`` with the upstream's reason, not a 502."""
    upstream = await _upstream(nursery)
    async with open_pool(_remote(upstream.url + "/v1", modalities=["text", "image"])) as pool:
        image = {"type": "image_url", "image_url": {"url": PNG_URL}}
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask(input=[{"type": "text", "text": "What is it?"}, image]))
        assert info.value.code == "invalid_request" and info.value.status == 400
        assert "accepts text input only" in info.value.message
        assert (await pool.respond(_ask())).text == "alpha beta gamma delta"


async def test_a_hanging_upstream_times_out(nursery: trio.Nursery) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    accepted: list[trio.SocketStream] = []

    async def accept_and_say_nothing() -> None:
        while True:
            accepted.append(await listeners[0].accept())

    nursery.start_soon(accept_and_say_nothing)
    port = listeners[0].socket.getsockname()[1]
    async with open_pool(_remote(f"http://127.0.0.1:{port}/v1", remote_timeout_s=1)) as pool:
        started = trio.current_time()
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask())
        assert info.value.code == "backend_timeout" and info.value.status == 504
        # The 1 s limit, not a hang: ten times its length is room enough on a busy machine.
        assert 1 <= trio.current_time() - started < 10
    nursery.cancel_scope.cancel()


async def test_unreachable_upstream_is_retried_then_fails() -> None:
    async with open_pool(_remote("http://127.0.0.1:9/v1", remote_max_retries=2)) as pool:
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask())
        assert info.value.code == "backend_error" and "connection failed" in info.value.message


async def test_missing_api_key_fails_the_load() -> None:
    async with open_pool(
        _remote("http://127.0.0.1:9/v1", remote_api_key_env="NO_SUCH_KEY_VAR")
    ) as pool:
        assert "NO_SUCH_KEY_VAR" in pool.snapshot("remote").last_error


async def test_embeddings_pass_through_in_batches(nursery: trio.Nursery) -> None:
    """Ten texts in batches of three to an upstream pool's stub embedding model."""
    settings = build_settings(
        {
            "engine": {
                "models": {
                    "vec": {"backend": "stub", "enabled": True, "embedding": True,
                            "stub_embedding_dim": 12},
                    "up": {"backend": "stub", "enabled": True},
                }
            }
        }
    )  # fmt: skip
    upstream: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, port=0, task_status=task_status)
    )
    remote = _remote(
        upstream.url + "/v1",
        remote_model="vec",
        embedding=True,
        embedding_batch_size=3,
        embedding_dimensions=True,
    )
    texts = tuple(f"text {i}" for i in range(10))
    async with open_pool(remote) as pool:
        done = await pool.embed(EmbeddingRequest("remote", texts, allow_remote=True))
        assert len(done.vectors) == 10
        for vector, text in zip(done.vectors, texts, strict=True):
            assert vector == pytest.approx(stub_embedding(text, 12))
        assert done.usage.prompt_tokens == 10 * 2
        short = await pool.embed(
            EmbeddingRequest("remote", texts[:1], dimensions=4, allow_remote=True)
        )
        assert short.vectors[0] == pytest.approx(stub_embedding(texts[0], 4))
        with pytest.raises(PoolError) as info:
            await pool.embed(EmbeddingRequest("remote", texts))
        assert info.value.code == "remote_not_allowed"
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask())
        assert info.value.code == "wrong_model_kind"
    # The upstream refuses the input (a generation model): the client's 400, not a 502.
    async with open_pool(_remote(upstream.url + "/v1", remote_model="up", embedding=True)) as pool:
        with pytest.raises(PoolError) as info:
            await pool.embed(EmbeddingRequest("remote", ("x",), allow_remote=True))
        assert info.value.code == "invalid_request" and "is of kind chat" in info.value.message


async def test_consent_per_request_or_per_model_on_every_surface(nursery: trio.Nursery) -> None:
    """``allow_remote: true`` in a model's settings stands for every request's consent;
    without it each surface, the Ollama routes included, takes the per-request flag."""
    import httpx

    upstream = await _upstream(nursery)
    common = {
        "backend": "openai_remote",
        "remote_base_url": upstream.url + "/v1",
        "remote_model": "up",
        "enabled": True,
    }
    settings = build_settings(
        {"engine": {"models": {"asks": common, "consented": common | {"allow_remote": True}}}}
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, port=0, task_status=task_status)
    )
    bodies = {
        "/api/chat": {"messages": [{"role": "user", "content": "hi"}], "stream": False},
        "/api/generate": {"prompt": "hi", "stream": False},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/responses": {"input": "hi"},
    }
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        for path, body in bodies.items():
            refused = await client.post(path, json={"model": "asks", **body})
            assert refused.status_code == 400, (path, refused.text)
            assert "calls a remote API" in refused.text, path
            for model, flag in (("asks", {"allow_remote": True}), ("consented", {})):
                served = await client.post(path, json={"model": model, **body, **flag})
                assert served.status_code == 200, (path, model, served.text)
                assert "alpha beta gamma delta" in served.text, (path, model)


async def test_the_stop_string_an_upstream_names(nursery: trio.Nursery) -> None:
    """vLLM's OpenAI server names the stop string that ended a reply (``stop_reason``);
    it becomes the reply's ``stop_sequence`` (the Messages API's)."""
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "It is "}, "finish_reason": None}]},
        {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "Paris"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2},
        },
    ]
    upstream = await nursery.start(RecordingUpstream(chunks).run)
    async with open_pool(_remote(upstream.url)) as pool:
        reply = await pool.respond(_ask(decoding={"stop": ["Paris"]}))
        assert reply.text == "It is " and reply.finish_reason == "stop"
        assert reply.stop_sequence == "Paris"
    assert upstream.posted()[0]["stop"] == ["Paris"]


async def test_the_api_key_is_the_bearer_token_of_every_call(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``remote_api_key_env`` names the variable; its value goes as ``Authorization:
    Bearer`` on the health check and on each completion."""
    monkeypatch.setenv("LLM_POOL_TEST_REMOTE_KEY", "sk-test-7f3a")
    upstream = await nursery.start(RecordingUpstream().run)
    settings = _remote(
        upstream.url,
        remote_api_key_env="LLM_POOL_TEST_REMOTE_KEY",
        remote_health_check="models_endpoint",
    )
    async with open_pool(settings) as pool:
        assert (await pool.respond(_ask())).text == "alpha beta"
    assert [(r.method, r.path) for r in upstream.received] == [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
    ]
    assert {r.headers.get("authorization") for r in upstream.received} == {"Bearer sk-test-7f3a"}
    # Without a key configured, no Authorization header at all.
    keyless = await nursery.start(RecordingUpstream().run)
    async with open_pool(_remote(keyless.url)) as pool:
        await pool.respond(_ask())
    assert "authorization" not in keyless.received[0].headers


async def test_remote_thinking_reaches_the_upstream(nursery: trio.Nursery) -> None:
    """``remote_thinking`` is the provider's ``thinking`` field on every call; a
    request's own ``thinking`` wins over it; with neither, no field is sent."""
    upstream = await nursery.start(RecordingUpstream().run)
    async with open_pool(_remote(upstream.url, remote_thinking="disabled")) as pool:
        await pool.respond(_ask())
        await pool.respond(_ask(thinking="enabled"))
    plain = await nursery.start(RecordingUpstream().run)
    async with open_pool(_remote(plain.url)) as pool:
        await pool.respond(_ask())
        await pool.respond(_ask(thinking="disabled"))
    assert [b.get("thinking") for b in upstream.posted()] == [
        {"type": "disabled"},
        {"type": "enabled"},
    ]
    assert [b.get("thinking") for b in plain.posted()] == [None, {"type": "disabled"}]


async def test_images_reach_the_upstream_as_image_url_parts(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A vision model's images go upstream as Chat Completions ``image_url`` parts, in
    place among the text, with their ``detail``; a local file goes inline (the upstream
    cannot read this machine's files)."""
    (tmp_path / "cat.png").write_bytes(PNG)
    upstream = await nursery.start(RecordingUpstream().run)
    settings = _remote(
        upstream.url, service={"media_dirs": [str(tmp_path)]}, modalities=["text", "image"]
    )
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}},
        {"type": "text", "text": "with"},
        {"type": "image_url", "image_url": {"url": (tmp_path / "cat.png").as_uri()}},
    ]
    async with open_pool(settings) as pool:
        assert pool.snapshot("remote").capabilities.modalities == ("text", "image")
        await pool.respond(_ask(input=content))
    (body,) = upstream.posted()
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare"},
                {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}},
                {"type": "text", "text": "with"},
                {"type": "image_url", "image_url": {"url": PNG_URL}},
            ],
        }
    ]


async def test_a_text_only_content_array_goes_as_one_text(nursery: trio.Nursery) -> None:
    """A text model takes a content array of text parts: one prompt, the parts joined
    by newlines, sent as plain string content."""
    upstream = await nursery.start(RecordingUpstream().run)
    content = [
        {"type": "text", "text": "What is the capital of France?"},
        {"type": "text", "text": "Answer in one word."},
    ]
    async with open_pool(_remote(upstream.url)) as pool:
        assert pool.snapshot("remote").capabilities.modalities == ("text",)
        assert (await pool.respond(_ask(input=content))).text == "alpha beta"
    (body,) = upstream.posted()
    assert body["messages"] == [
        {"role": "user", "content": "What is the capital of France?\nAnswer in one word."}
    ]


async def test_rerank_passes_through_to_the_upstreams_rerank(nursery: trio.Nursery) -> None:
    """A rerank model (``kind: rerank``) sends its pairs to the upstream's ``/rerank``:
    here an upstream pool's stub rank head, whose scores come back in document order."""
    settings = build_settings(
        {"engine": {"models": {"ranker": {"backend": "stub", "enabled": True, "kind": "rerank"},
                               "up": {"backend": "stub", "enabled": True}}}}
    )  # fmt: skip
    upstream: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, port=0, task_status=task_status)
    )
    documents = ("berlin is in germany", "paris capital of france", "capital of spain")
    async with open_pool(
        _remote(upstream.url + "/v1", remote_model="ranker", kind="rerank")
    ) as pool:
        job = rerank_job("remote", ("capital of france",), documents, RerankLimits())
        done = await pool.run_task(TaskRequest("remote", job, allow_remote=True))
        assert done.value == Ranked((0.0, 1.0, 2 / 3), "rank_head")
        assert done.usage.prompt_tokens == 3 * 3 + 4 + 4 + 3
        with pytest.raises(PoolError) as info:
            await pool.run_task(TaskRequest("remote", job))
        assert info.value.code == "remote_not_allowed"
    # An upstream model that cannot rank refuses the input: the client's 400, not a 502.
    async with open_pool(_remote(upstream.url + "/v1", remote_model="up", kind="rerank")) as pool:
        job = rerank_job("remote", ("q",), ("d",), RerankLimits())
        with pytest.raises(PoolError) as info:
            await pool.run_task(TaskRequest("remote", job, allow_remote=True))
        assert info.value.code == "invalid_request" and "is of kind chat" in info.value.message
