"""The round trip on the real models: text spoken by espeak-ng, served to the pool's
``whisper`` model over HTTP by OpenAI's own client, and the words come back, in every
answer format, streamed and not, under both base URLs; and the whole trip inside the
pool, its ``piper`` voice speaking what its ``whisper`` model then hears."""

from __future__ import annotations

import io
import wave
from typing import Any

import httpx
import openai
import pytest
import trio

from pool import ServerInfo
from tests.backends.test_piper import VOICE, assert_speech
from tests.backends.whisper_audio import SENTENCE, recall, speak, whisper_model, words
from tests.http.conftest import start_server

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def spoken() -> bytes:
    return speak(SENTENCE)


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    models = {"whisper": whisper_model(), "chat": {"backend": "stub", "enabled": True}}
    return await start_server(nursery, models)


def _client(server: ServerInfo, base: str = "/v1") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + base, api_key="unused", max_retries=0)


# The client marks translations deprecated (OpenAI's newer models do not offer them).
@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
async def test_the_openai_client_transcribes(server: ServerInfo, spoken: bytes) -> None:
    upload: Any = ("fox.wav", spoken, "audio/wav")
    for base in ("/v1", "/openai/v1"):
        client = _client(server, base)
        plain = await client.audio.transcriptions.create(model="whisper", file=upload)
        assert recall(SENTENCE, plain.text) >= 0.8, plain.text
        assert plain.usage is not None and plain.usage.type == "duration"
        assert plain.usage.seconds >= 2  # type: ignore[union-attr]
    client = _client(server)
    verbose = await client.audio.transcriptions.create(
        model="whisper",
        file=upload,
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
        language="en",
    )
    assert verbose.language == "en" and verbose.duration > 2
    assert verbose.segments and verbose.words and len(verbose.words) >= 7
    assert recall(SENTENCE, " ".join(w.word for w in verbose.words)) >= 0.8
    text = await client.audio.transcriptions.create(
        model="whisper", file=upload, response_format="text"
    )
    assert isinstance(text, str) and recall(SENTENCE, text) >= 0.8
    srt = await client.audio.transcriptions.create(
        model="whisper", file=upload, response_format="srt"
    )
    assert srt.startswith("1\n00:00:00,") and " --> 00:00:0" in srt  # type: ignore[union-attr]
    vtt = await client.audio.transcriptions.create(
        model="whisper", file=upload, response_format="vtt"
    )
    assert vtt.startswith("WEBVTT\n\n00:00:00.")  # type: ignore[union-attr]
    translated = await client.audio.translations.create(model="whisper", file=upload)
    assert recall(SENTENCE, translated.text) >= 0.8


async def test_the_openai_client_streams_a_transcription(server: ServerInfo, spoken: bytes) -> None:
    stream = await _client(server).audio.transcriptions.create(
        model="whisper", file=("fox.wav", spoken, "audio/wav"), stream=True
    )
    events = [event async for event in stream]
    kinds = [event.type for event in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    deltas = "".join(e.delta for e in events[:-1])  # type: ignore[union-attr]
    done = events[-1]
    assert deltas == done.text  # type: ignore[union-attr]
    assert recall(SENTENCE, deltas) >= 0.8


async def test_refusals_reach_the_client(server: ServerInfo, spoken: bytes) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        await _client(server).audio.transcriptions.create(
            model="whisper", file=("fox.wav", spoken, "audio/wav"), language="zz"
        )
    assert refused.value.code == "invalid_request"
    assert refused.value.param == "language"  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as refused:
        await _client(server).audio.transcriptions.create(
            model="chat", file=("fox.wav", spoken, "audio/wav")
        )
    assert refused.value.code == "wrong_model_kind"
    with pytest.raises(openai.BadRequestError) as refused:
        await _client(server).chat.completions.create(
            model="whisper", messages=[{"role": "user", "content": "hi"}]
        )
    assert refused.value.code == "wrong_model_kind"


async def test_speech_made_by_the_pool_is_transcribed_back(nursery: trio.Nursery) -> None:
    """The issue's round trip, both ends served by one pool over HTTP: the ``piper``
    voice speaks the sentence, the ``whisper`` model hears that WAV, the words come back.
    A control on silence of the same length shows the recall check can fail."""
    models = {
        "tts": {"backend": "piper", "model_path": VOICE, "enabled": True},
        "whisper": whisper_model(),
    }
    info = await start_server(nursery, models)
    async with httpx.AsyncClient(base_url=info.url, timeout=60) as http:
        spoken = await http.post(
            "/v1/audio/speech",
            json={
                "model": "tts",
                "voice": "joe",
                "input": SENTENCE,
                "response_format": "wav",
                "stream": False,
            },
        )
        assert spoken.status_code == 200, spoken.text
        assert spoken.headers["content-type"] == "audio/wav"
        with wave.open(io.BytesIO(spoken.content)) as wav:
            rate, frames = wav.getframerate(), wav.getnframes()
            assert_speech(wav.readframes(frames), rate, words=len(words(SENTENCE)))

        async def heard(audio: bytes) -> str:
            answer = await http.post(
                "/v1/audio/transcriptions",
                data={"model": "whisper", "language": "en"},
                files={"file": ("spoken.wav", audio, "audio/wav")},
            )
            assert answer.status_code == 200, answer.text
            text = answer.json()["text"]
            assert isinstance(text, str)
            return text

        text = await heard(spoken.content)
        assert recall(SENTENCE, text) >= 0.8, text
        silence = io.BytesIO()
        with wave.open(silence, "wb") as quiet:
            quiet.setnchannels(1)
            quiet.setsampwidth(2)
            quiet.setframerate(rate)
            quiet.writeframes(bytes(2 * frames))
        assert recall(SENTENCE, await heard(silence.getvalue())) < 0.5
