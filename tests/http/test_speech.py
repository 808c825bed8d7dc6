"""``POST /v1/audio/speech`` and ``GET /v1/audio/voices`` on a real Piper voice, with the
official openai client; the refusals; and what the pool counts (usage rows, budgets,
metrics) in characters."""

from __future__ import annotations

import io
import sqlite3
import wave
from pathlib import Path
from typing import Any

import av
import httpx
import openai
import pytest
import trio

from pool.actors import USAGE_FILE_NAME as FILE_NAME
from pool.backends import wav_header

from ..actors.helpers import wait_until
from ..backends.test_piper import SENTENCE, VOICE, assert_speech
from .conftest import start_server

MODELS: dict[str, dict[str, Any]] = {
    "tts": {"backend": "piper", "model_path": VOICE, "enabled": True, "max_input_characters": 600},
    "echo": {"backend": "stub", "enabled": True},
}
RATE = 22050


def _rows(state: Path) -> list[tuple[Any, ...]]:
    with sqlite3.connect(state / FILE_NAME) as db:
        return db.execute(
            "SELECT tenant, model, characters, status FROM usage ORDER BY rowid"
        ).fetchall()


@pytest.mark.real_model
async def test_the_openai_client_gets_speech(nursery: trio.Nursery, private_state: Path) -> None:
    info = await start_server(nursery, MODELS, usage={"flush_ms": 10})
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    whole = await client.audio.speech.create(
        model="tts",
        voice="joe",
        input=SENTENCE,
        response_format="wav",
        extra_body={"stream": False},
    )
    with wave.open(io.BytesIO(whole.content)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, RATE)
        assert_speech(wav.readframes(wav.getnframes()), RATE, words=9)
    assert whole.response.headers["X-Sample-Rate"] == str(RATE)

    # Streamed (the default), read as it comes, under OpenAI's base URL too.
    base = openai.AsyncOpenAI(base_url=info.url + "/openai/v1", api_key="unused", max_retries=0)
    text = "First sentence of three. The second one follows. And here is the last."
    async with base.audio.speech.with_streaming_response.create(
        model="tts", voice="joe", input=text, response_format="pcm"
    ) as streamed:
        assert streamed.headers["content-type"] == "audio/pcm"
        chunks = [chunk async for chunk in streamed.iter_bytes()]
    pcm = b"".join(chunks)
    assert_speech(pcm, RATE, words=14)
    await wait_until(lambda: info.pool.parts_for_tests().usage.written == 2)  # type: ignore[union-attr]
    assert _rows(private_state) == [
        ("default", "tts", len(SENTENCE), "success"),
        ("default", "tts", len(text), "success"),
    ]
    metrics = (await httpx.AsyncClient().get(info.url + "/metrics")).text
    assert (
        f'llm_pool_speech_characters_total{{model="tts"}} {float(len(SENTENCE) + len(text))}'
        in (metrics)
    )


@pytest.mark.real_model
async def test_a_streamed_wav_leaves_its_sizes_open(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS)
    async with httpx.AsyncClient(base_url=info.url) as http:
        async with http.stream(
            "POST", "/v1/audio/speech", json={"model": "tts", "input": "Hello there. Goodbye now."}
        ) as answer:
            assert answer.status_code == 200 and answer.headers["content-type"] == "audio/wav"
            chunks = [chunk async for chunk in answer.aiter_raw() if chunk]
        body = b"".join(chunks)
        assert body[:44] == wav_header(RATE, None)
        assert_speech(body[44:], RATE, words=4)


@pytest.mark.real_model
async def test_the_voices_are_listed(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS)
    async with httpx.AsyncClient(base_url=info.url) as http:
        listed = await http.get("/v1/audio/voices")
        assert listed.json() == {
            "object": "list",
            "data": [{"id": "joe", "model": "tts", "language": "en_US"}],
        }
        assert (await http.get("/openai/v1/audio/voices?model=echo")).json()["data"] == []
        missing = await http.get("/v1/audio/voices?model=nope")
        assert missing.status_code == 404


async def test_requests_the_pool_cannot_serve_are_refused(
    nursery: trio.Nursery, private_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A PyAV built without an MP3 encoder: the format is refused, not a 500.
    monkeypatch.setattr("pool.backends._speech.encodable_formats", lambda: ("opus", "aac", "flac"))
    info = await start_server(nursery, MODELS, usage={"flush_ms": 10})
    async with httpx.AsyncClient(base_url=info.url) as http:

        async def refused(body: dict[str, Any]) -> tuple[int, str]:
            answer = await http.post("/v1/audio/speech", json={"model": "tts", **body})
            return answer.status_code, answer.json()["error"]["code"]

        assert await refused({"input": "x" * 601}) == (400, "input_too_long")
        assert await refused({"input": "hi", "response_format": "mp3"}) == (
            400,
            "response_format_unsupported",
        )
        assert await refused({"input": "hi", "model": "echo"}) == (400, "wrong_model_kind")
        assert (await refused({"input": "hi", "model": "nope"}))[0] == 404
        assert (await refused({"input": ""}))[0] == 422
        assert (await refused({"input": "hi", "speed": 9}))[0] == 422
        # A chat route refuses the speech model with the same code.
        chat = {"model": "tts", "messages": [{"role": "user", "content": "hi"}]}
        answer = await http.post("/v1/chat/completions", json=chat)
        assert answer.json()["error"]["code"] == "wrong_model_kind"
    await wait_until(lambda: info.pool.parts_for_tests().usage.written >= 2)  # type: ignore[union-attr]
    assert ("default", "echo", 0, "wrong_model_kind") in _rows(private_state)


@pytest.mark.real_model
async def test_an_unknown_voice_is_a_400_before_any_audio(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, MODELS)
    client = openai.AsyncOpenAI(base_url=info.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        await client.audio.speech.create(model="tts", voice="alloy", input=SENTENCE)
    assert refused.value.code == "unknown_voice"


@pytest.mark.real_model
async def test_a_client_that_leaves_stops_the_synthesis(
    nursery: trio.Nursery, private_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from piper import PiperVoice

    made = 0
    real = PiperVoice.phoneme_ids_to_audio

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal made
        made += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PiperVoice, "phoneme_ids_to_audio", counted)
    info = await start_server(nursery, MODELS, usage={"flush_ms": 10})
    text = " ".join(f"This is sentence number {n} of a long text." for n in range(12))
    async with (
        httpx.AsyncClient(base_url=info.url) as http,
        http.stream("POST", "/v1/audio/speech", json={"model": "tts", "input": text}) as answer,
    ):
        async for chunk in answer.aiter_raw():
            if chunk:
                break
    actor = info.pool.parts_for_tests().residency.model("tts")
    await wait_until(lambda: actor.snapshot().running == 0)
    await wait_until(lambda: info.pool.parts_for_tests().usage.written == 1)  # type: ignore[union-attr]
    assert made < 12, made
    assert _rows(private_state) == [("default", "tts", 0, "cancelled")]


@pytest.mark.real_model
async def test_a_characters_budget_caps_speech(nursery: trio.Nursery) -> None:
    budgets = [{"tenant": "team-a", "characters_per_day": 50}]
    info = await start_server(nursery, MODELS, budgets=budgets)
    async with httpx.AsyncClient(base_url=info.url, headers={"X-Tenant-ID": "team-a"}) as http:
        body = {"model": "tts", "input": SENTENCE, "stream": False}
        for _ in range(2):  # 44 characters, then 88: past the budget
            assert (await http.post("/v1/audio/speech", json=body)).status_code == 200
        over = await http.post("/v1/audio/speech", json=body)
        assert over.status_code == 429
        error = over.json()["error"]
        assert error["code"] == "budget_exceeded"
        assert "budget of 50 characters per day" in error["message"]
        # Tokens are another budget: chat is not capped by characters.
        chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
        assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200


def _decoded_seconds(audio: bytes) -> float:
    """The duration PyAV decodes ``audio`` to, and that it is one audio stream."""
    with av.open(io.BytesIO(audio)) as container:
        samples, rate = 0, 0
        for frame in container.decode(audio=0):
            samples += frame.samples
            rate = frame.sample_rate
    assert rate > 0
    return samples / rate


@pytest.mark.real_model
async def test_compressed_formats_decode_back_to_the_speech(nursery: trio.Nursery) -> None:
    """mp3, opus, aac and flac (encoded by PyAV in the pool), whole and streamed, decode
    back to audio of the synthesized length: the answer's ``X-Audio-Seconds`` (encoders
    pad by some ms). Piper's pace varies a little between runs, so a streamed answer
    (which has no such header) is held to the WAV of the same input within 15%."""
    info = await start_server(nursery, MODELS)
    async with httpx.AsyncClient(base_url=info.url, timeout=60) as http:

        async def speech(fmt: str, stream: bool) -> httpx.Response:
            body = {"model": "tts", "voice": "joe", "input": SENTENCE, "response_format": fmt}
            answer = await http.post("/v1/audio/speech", json={**body, "stream": stream})
            assert answer.status_code == 200, answer.text
            return answer

        wav = (await speech("wav", False)).content
        with wave.open(io.BytesIO(wav)) as plain:
            seconds = plain.getnframes() / plain.getframerate()
        media = {"mp3": "audio/mpeg", "opus": "audio/ogg", "aac": "audio/aac", "flac": "audio/flac"}
        for fmt, media_type in media.items():
            whole = await speech(fmt, False)
            assert whole.headers["content-type"] == media_type
            decoded = _decoded_seconds(whole.content)
            said = float(whole.headers["X-Audio-Seconds"])
            assert abs(decoded - said) < 0.1, (fmt, decoded, said)
            streamed = await speech(fmt, True)
            assert streamed.headers["content-type"] == media_type
            decoded = _decoded_seconds(streamed.content)
            assert abs(decoded - seconds) < 0.15 * seconds, (fmt, decoded, seconds)
        # Compressed, not PCM in disguise.
        assert len((await speech("mp3", False)).content) < len(wav) / 4
