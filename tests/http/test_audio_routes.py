"""OpenAI's audio routes on stub models: the multipart form, the limits of
``service.audio``, the refusals and the answer formats (the stub's transcript is known in
advance; the real transcriptions are in tests/http/test_audio_real_model.py).

Decoding is real here too (PyAV): the uploads are WAV files this test writes."""

from __future__ import annotations

import io
import json
import math
import struct
import wave
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo
from tests.http.conftest import start_server

MODELS = {
    "chat": {"backend": "stub", "enabled": True},
    # A stub of kind transcription: the kind is what the generation routes check.
    "heard": {
        "backend": "stub",
        "enabled": True,
        "kind": "transcription",
        "stub_reply": "hello there world",
    },
}
PATHS = ["/v1/audio/transcriptions", "/openai/v1/audio/transcriptions"]


def tone(seconds: float, rate: int = 8000) -> bytes:
    """A WAV file of a 440 Hz tone."""
    out = io.BytesIO()
    with wave.open(out, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate)
        frames = (
            struct.pack("<h", int(8000 * math.sin(2 * math.pi * 440 * i / rate)))
            for i in range(int(seconds * rate))
        )
        wav.writeframes(b"".join(frames))
    return out.getvalue()


@pytest.fixture
async def client(nursery: trio.Nursery) -> httpx.AsyncClient:
    server: ServerInfo = await start_server(
        nursery, MODELS, audio={"max_bytes": 200_000, "max_seconds": 5}
    )
    return httpx.AsyncClient(base_url=server.url, timeout=30)


async def _post(
    client: httpx.AsyncClient, path: str, audio: bytes | None, **fields: Any
) -> httpx.Response:
    files = {"file": ("a.wav", audio, "audio/wav")} if audio is not None else None
    return await client.post(path, data=fields, files=files)


@pytest.mark.parametrize("path", [*PATHS, "/v1/audio/translations"])
async def test_a_model_of_another_kind_is_refused(client: httpx.AsyncClient, path: str) -> None:
    r = await _post(client, path, tone(0.5), model="chat")
    assert r.status_code == 400, r.text
    assert r.headers["X-Error-Code"] == "wrong_model_kind"
    assert "needs a model of kind transcription" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", PATHS)
async def test_what_is_no_audio_is_invalid_audio(client: httpx.AsyncClient, path: str) -> None:
    for junk in (b"not audio at all", b"RIFF\x00\x00\x00\x00WAVEfmt ", b"\x00" * 4096):
        r = await _post(client, path, junk, model="heard")
        assert r.status_code == 400, r.text
        assert r.headers["X-Error-Code"] == "invalid_audio"
        assert r.json()["error"]["param"] == "file"


async def test_the_limits_of_size_and_length(client: httpx.AsyncClient) -> None:
    path = PATHS[0]
    # 8 kHz 16-bit: 16 kB a second, so 14 s is past 200 kB, 6 s is past 5 s.
    large = await _post(client, path, tone(14), model="heard")
    assert large.status_code == 413 and large.headers["X-Error-Code"] == "audio_too_large"
    long = await _post(client, path, tone(6), model="heard")
    assert long.status_code == 400 and long.headers["X-Error-Code"] == "audio_too_long"
    assert "service.audio.max_seconds" in long.json()["error"]["message"]


async def test_a_file_past_quarts_own_bound_reaches_the_route(nursery: trio.Nursery) -> None:
    """Quart bounds a form at 16 MiB by default; the pool's settings are the bound."""
    size = 17 * 1024 * 1024
    server = await start_server(
        nursery,
        MODELS,
        max_body_bytes=size + 65536,
        audio={"max_bytes": size + 1024, "max_seconds": 2},
    )
    silence = io.BytesIO()
    with wave.open(silence, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(8000)
        wav.writeframes(b"\x00" * size)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
        r = await _post(client, PATHS[0], silence.getvalue(), model="heard")
    # Decoded (and stopped at 2 s), not refused for its size.
    assert r.status_code == 400 and r.headers["X-Error-Code"] == "audio_too_long", r.text


async def test_the_form_is_checked(client: httpx.AsyncClient) -> None:
    path = PATHS[0]
    missing = await _post(client, path, None, model="heard")
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "file"
    as_json = await client.post(path, json={"model": "heard", "file": "x"})
    assert as_json.status_code == 422
    bad_format = await _post(client, path, tone(0.5), model="heard", response_format="mp3")
    assert bad_format.status_code == 422
    assert bad_format.json()["error"]["param"] == "response_format"
    words_as_json = await _post(
        client, path, tone(0.5), model="heard", **{"timestamp_granularities[]": "word"}
    )
    assert words_as_json.status_code == 400
    assert words_as_json.json()["error"]["param"] == "timestamp_granularities[]"
    streamed_srt = await _post(
        client, path, tone(0.5), model="heard", stream="true", response_format="srt"
    )
    assert streamed_srt.status_code == 400
    assert streamed_srt.json()["error"]["param"] == "response_format"


async def test_every_answer_format(client: httpx.AsyncClient) -> None:
    audio = tone(1.5)
    path = PATHS[0]
    plain = await _post(client, path, audio, model="heard")
    assert plain.status_code == 200, plain.text
    assert plain.json() == {
        "text": "hello there world",
        "usage": {"type": "duration", "seconds": 2},
    }
    assert int(plain.headers["X-Queue-Wait-Ms"]) >= 0
    text = await _post(client, path, audio, model="heard", response_format="text")
    assert text.headers["content-type"].startswith("text/plain")
    assert text.text == "hello there world"
    srt = await _post(client, path, audio, model="heard", response_format="srt")
    assert srt.text == (
        "1\n00:00:00,000 --> 00:00:00,500\nhello\n\n"
        "2\n00:00:00,500 --> 00:00:01,000\nthere\n\n"
        "3\n00:00:01,000 --> 00:00:01,500\nworld\n"
    )
    vtt = await _post(client, path, audio, model="heard", response_format="vtt")
    assert vtt.text.startswith("WEBVTT\n\n00:00:00.000 --> 00:00:00.500\nhello\n\n")
    verbose = await _post(
        client,
        path,
        audio,
        model="heard",
        language="de",
        response_format="verbose_json",
        **{"timestamp_granularities[]": ["word", "segment"]},
    )
    body = verbose.json()
    assert (body["task"], body["language"], body["duration"]) == ("transcribe", "de", 1.5)
    assert [s["text"] for s in body["segments"]] == ["hello", " there", " world"]
    assert body["words"][1] == {"word": " there", "start": 0.5, "end": 1.0}
    only_words = await _post(
        client, path, audio, model="heard", response_format="verbose_json",
        **{"timestamp_granularities[]": "word"},
    )  # fmt: skip
    assert "segments" not in only_words.json() and len(only_words.json()["words"]) == 3
    translated = await _post(client, "/openai/v1/audio/translations", audio, model="heard")
    assert translated.json() == {"text": "hello there world"}


async def test_a_stream_sends_deltas_then_the_whole_text(client: httpx.AsyncClient) -> None:
    r = await _post(client, PATHS[1], tone(1.0), model="heard", stream="true")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.split("\n") if line.startswith("data: ")]
    assert events == [
        {"type": "transcript.text.delta", "delta": "hello"},
        {"type": "transcript.text.delta", "delta": " there"},
        {"type": "transcript.text.delta", "delta": " world"},
        {
            "type": "transcript.text.done",
            "text": "hello there world",
            "usage": {"type": "duration", "seconds": 1},
        },
    ]


async def test_a_client_that_leaves_a_stream_cancels_the_transcription(
    nursery: trio.Nursery,
) -> None:
    # 40 words at 4 a second: 10 s if nobody left.
    slow = {
        "backend": "stub",
        "enabled": True,
        "kind": "transcription",
        "stub_reply": " ".join(f"w{i}" for i in range(40)),
        "stub_tokens_per_second": 4,
    }
    server = await start_server(nursery, {"slow": slow}, usage={"flush_ms": 10})
    files = {"file": ("a.wav", tone(0.5), "audio/wav")}
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
        client.stream("POST", PATHS[0], data={"model": "slow", "stream": "true"}, files=files) as r,
    ):
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                assert json.loads(line[6:]) == {"type": "transcript.text.delta", "delta": "w0"}
                break
    started = trio.current_time()
    while server.pool.snapshot("slow").running:
        await trio.sleep(0.05)
    assert trio.current_time() - started < 5  # stopped, not run to its end
    await trio.sleep(0.2)
    (row,) = await server.pool.usage_totals("model")
    assert (row.group, row.requests, row.audio_seconds) == ("slow", 1, 0.0)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False}),
        ("/api/generate", {"prompt": "hi", "stream": False}),
        ("/v1/messages", {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}),
    ],
)
async def test_ollama_and_anthropic_refuse_an_audio_model(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    r = await client.post(path, json={"model": "heard", **body})
    assert r.status_code == 400, r.text
    assert r.headers["X-Error-Code"] == "wrong_model_kind"
    assert "is of kind transcription;" in r.text
