"""``X-RateLimit-*`` on every inference route: JSON and streamed, every dialect, through
the request pipeline, on the hot routes and on Quart's alike (docs/api.md)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo
from pool.http._openapi import ROUTES, runs_a_model

from ..backends.test_piper import VOICE
from .conftest import start_server
from .test_audio_routes import tone

# The small real HTTP server the server-backend tests run by command: the only backend
# that serves images.
IMAGE_SERVER = Path(__file__).parents[1] / "backends" / "image_server.py"
MODELS: dict[str, dict[str, Any]] = {
    "echo": {"backend": "stub", "enabled": True, "stub_reply": "one two three"},
    "embed": {"backend": "stub", "enabled": True, "embedding": True, "stub_embedding_dim": 4},
    "heard": {
        "backend": "stub",
        "enabled": True,
        "kind": "transcription",
        "stub_reply": "hello there",
    },
    "painter": {
        "backend": "server",
        "kind": "image",
        "command": [sys.executable, str(IMAGE_SERVER), "--port", "${PORT}"],
        "ready_timeout_s": 30,
        "enabled": True,
    },
    # No stub speaks: the speech routes need a real (small, CPU) Piper voice.
    "tts": {"backend": "piper", "model_path": VOICE, "enabled": True},
}
# Two a minute with a burst of five: each test's three requests are answered, and no
# refill (one per 30 s) blurs the count between two of them.
LIMIT, BURST = 2, 5
METERED = {"X-Tenant-ID": "metered"}
CHAT = [{"role": "user", "content": "hello"}]
RERANK = {"model": "embed", "query": "hi", "documents": ["hello", "bye"]}
SCORE = {"model": "embed", "text_1": "hi", "text_2": ["hello", "bye"]}
HEARD = {"model": "heard"}  # a multipart form: these fields and ``file``
SPEECH = {"model": "tts", "input": "Hi.", "voice": "joe"}

# (path, body): every POST route that runs a model, streamed too where it streams; the
# audio routes' bodies are multipart forms (with a WAV file), the others JSON.
INFERENCE: list[Any] = [
    ("/v1/responses", {"model": "echo", "input": "hi"}),
    ("/v1/responses", {"model": "echo", "input": "hi", "stream": True}),
    ("/openai/v1/responses", {"model": "echo", "input": "hi"}),
    ("/openai/v1/responses", {"model": "echo", "input": "hi", "stream": True}),
    ("/v1/chat/completions", {"model": "echo", "messages": CHAT}),
    ("/v1/chat/completions", {"model": "echo", "messages": CHAT, "stream": True}),
    ("/openai/v1/chat/completions", {"model": "echo", "messages": CHAT}),
    ("/openai/v1/chat/completions", {"model": "echo", "messages": CHAT, "stream": True}),
    ("/v1/completions", {"model": "echo", "prompt": "hi"}),
    ("/v1/completions", {"model": "echo", "prompt": "hi", "stream": True}),
    ("/openai/v1/completions", {"model": "echo", "prompt": "hi"}),
    ("/openai/v1/completions", {"model": "echo", "prompt": "hi", "stream": True}),
    ("/v1/embeddings", {"model": "embed", "input": "hi"}),
    ("/openai/v1/embeddings", {"model": "embed", "input": "hi"}),
    ("/v1/messages", {"model": "echo", "max_tokens": 10, "messages": CHAT}),
    ("/v1/messages", {"model": "echo", "max_tokens": 10, "messages": CHAT, "stream": True}),
    ("/v1/messages/count_tokens", {"model": "echo", "messages": CHAT}),
    ("/api/generate", {"model": "echo", "prompt": "hi", "stream": False}),
    ("/api/generate", {"model": "echo", "prompt": "hi"}),  # Ollama streams by default
    ("/api/chat", {"model": "echo", "messages": CHAT, "stream": False}),
    ("/api/chat", {"model": "echo", "messages": CHAT}),
    ("/api/embed", {"model": "embed", "input": "hi"}),
    ("/api/embeddings", {"model": "embed", "prompt": "hi"}),
    *((path, RERANK) for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/openai/v1/rerank")),
    *((path, SCORE) for path in ("/v1/score", "/score", "/openai/v1/score")),
    ("/v1/images/generations", {"model": "painter", "prompt": "a fox"}),
    ("/openai/v1/images/generations", {"model": "painter", "prompt": "a fox"}),
    ("/v1/images/generations", {"model": "painter", "prompt": "a fox", "stream": True}),
    *(
        (f"{prefix}/audio/{task}", HEARD)
        for prefix in ("/v1", "/openai/v1")
        for task in ("transcriptions", "translations")
    ),
    pytest.param("/v1/audio/speech", SPEECH, marks=pytest.mark.real_model),
    pytest.param("/openai/v1/audio/speech", SPEECH, marks=pytest.mark.real_model),
]


def _path(case: Any) -> str:
    """The path of a case of INFERENCE: a (path, body) pair, or a ``pytest.param`` of one."""
    path: str = (case.values if hasattr(case, "marks") else case)[0]
    return path


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(
        nursery,
        MODELS,
        tenancy={"tenants": {"metered": {"requests_per_minute": LIMIT, "burst": BURST}}},
    )


def test_the_table_covers_every_inference_route_of_the_openapi_document() -> None:
    documented = {route.path for route in ROUTES if runs_a_model(route)}
    assert documented == {_path(case) for case in INFERENCE}
    # The routes of the dialects left out are the ones that run no model.
    dialects = {r.path for r in ROUTES if r.method == "post" and r.tag != "admin"}
    assert dialects - documented <= {"/api/pull", "/api/copy", "/api/show", "/v1/models/load",
                                     "/v1/models/unload", "/v1/cache/flush"}  # fmt: skip


@pytest.mark.parametrize(("path", "body"), INFERENCE, ids=lambda v: str(v)[:60])
async def test_a_metered_answer_carries_the_headers(
    server: ServerInfo, path: str, body: dict[str, Any]
) -> None:
    if body is HEARD:
        form: dict[str, Any] = {"data": body, "files": {"file": ("a.wav", tone(0.5), "audio/wav")}}
    else:
        form = {"json": body}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        first = await client.post(path, headers=METERED, **form)
        second = await client.post(path, headers=METERED, **form)
        unmetered = await client.post(path, **form)
    for reply in (first, second, unmetered):
        assert reply.status_code == 200, reply.text
    assert first.headers["x-ratelimit-limit"] == str(LIMIT)
    # Counted with the request itself, and the second request is counted too.
    assert int(first.headers["x-ratelimit-remaining"]) == BURST - 1
    assert int(second.headers["x-ratelimit-remaining"]) == BURST - 2
    reset = int(first.headers["x-ratelimit-reset"])
    assert time.time() <= reset <= time.time() + 2 * 60 / LIMIT + 5
    # A tenant without a request limit has no limit to report.
    assert not any(name.startswith("x-ratelimit") for name in unmetered.headers)


async def test_a_refused_request_carries_them_too(server: ServerInfo) -> None:
    """An error answer for a metered tenant (here a 404) reports the limit as well."""
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        chat = await client.post(
            "/v1/chat/completions", json={"model": "nope", "messages": CHAT}, headers=METERED
        )
        ollama = await client.post(
            "/api/chat", json={"model": "nope", "messages": CHAT}, headers=METERED
        )
    for reply in (chat, ollama):
        assert reply.status_code == 404
        assert reply.headers["x-ratelimit-limit"] == str(LIMIT)
        # An unknown model is refused before the limiter counts the request.
        assert reply.headers["x-ratelimit-remaining"] == str(BURST)
