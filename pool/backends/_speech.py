"""Text to speech as a task job: what a speech runtime provides, and the audio formats.

A speech runtime (``kind: speech``) turns text into 16-bit mono PCM, piece by piece
(sentence by sentence for Piper), and lists its voices. The :class:`SpeechJob` asks it
for one input and encodes the pieces into the format the client asked for: a streamed
job hands each encoded piece to its sink as soon as the runtime made it (a WAV header
first, with the sizes left open as streamed WAV has them), a plain one answers the whole
file with exact sizes. The job's usage is the input's characters.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import trio

from pool.backends._audio_encode import CODECS, Encoder, encodable_formats
from pool.backends._protocol import ModelKind, Runtime
from pool.backends._tasks import TaskJob, TaskResult, TaskSink, TaskUsage
from pool.errors import BackendError, PoolError

AudioFormat = Literal["wav", "pcm", "mp3", "opus", "aac", "flac"]
# What the pool writes itself (no encoder library needed).
AUDIO_FORMATS: tuple[AudioFormat, ...] = ("wav", "pcm")
# OpenAI's compressed formats, encoded by PyAV where its encoder is at hand
# (speech_formats); a request for one that is not gets 400 response_format_unsupported.
UNENCODED_FORMATS: tuple[AudioFormat, ...] = ("mp3", "opus", "aac", "flac")
MEDIA_TYPES: dict[AudioFormat, str] = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "mp3": CODECS["mp3"].media_type,
    "opus": CODECS["opus"].media_type,
    "aac": CODECS["aac"].media_type,
    "flac": CODECS["flac"].media_type,
}
SAMPLE_WIDTH = 2  # bytes: signed 16-bit little-endian samples, one channel
# The size fields of a streamed WAV file, whose length is not known when its header
# leaves (players read to the end of the stream; OpenAI's streamed WAV does the same).
_OPEN_SIZE = 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Voice:
    """One voice a speech model speaks in."""

    id: str
    language: str | None = None


@dataclass(frozen=True, slots=True)
class SpeechInput:
    """What to say, in which voice (``None``: the model's first), how fast (1.0 the
    voice's own pace)."""

    text: str
    voice: str | None
    speed: float = 1.0


@dataclass(frozen=True, slots=True)
class SpeechStats:
    """What one synthesis made: its samples (at ``sample_rate``) and the time it took."""

    samples: int
    sample_rate: int
    synthesis_ms: float

    @property
    def audio_seconds(self) -> float:
        return self.samples / self.sample_rate if self.sample_rate else 0.0


class PcmSink(Protocol):
    """Where a speech runtime delivers PCM as it makes it; ``send`` may block
    (backpressure) and raises ``trio.Cancelled`` once the client left."""

    async def send(self, piece: bytes, /) -> None: ...


@runtime_checkable
class SpeechRuntime(Runtime, Protocol):
    """A runtime of a speech model (``Capabilities.kind == "speech"``)."""

    @property
    def sample_rate(self) -> int:
        """Samples per second of the PCM it makes (one channel, 16-bit)."""
        ...

    @property
    def voices(self) -> tuple[Voice, ...]:
        """The voices it speaks in; the first is the default."""
        ...

    async def synthesize(self, speech: SpeechInput, sink: PcmSink) -> SpeechStats:
        """Say ``speech``, sending 16-bit mono PCM to ``sink`` piece by piece; a
        cancelled caller stops it at its next piece.

        Raises:
            PoolError: ``unknown_voice`` for a voice it does not have.
            BackendError: the engine failed.
        """
        ...


@runtime_checkable
class VoiceListing(Protocol):
    """A backend that can list a speech model's voices without loading it."""

    def voices(self, definition: Any, settings_dir: str | None) -> tuple[Voice, ...]:
        """The voices of a model of ``definition`` (blocking: it may read files).

        Raises:
            BackendError: what it reads is missing or unreadable.
        """
        ...


def speech_formats() -> tuple[AudioFormat, ...]:
    """The formats this process can answer: its own, and the compressed ones whose
    encoder PyAV has here."""
    encodable = encodable_formats()
    return AUDIO_FORMATS + tuple(f for f in UNENCODED_FORMATS if f in encodable)


def check_input(model: str, definition: Any, text: str) -> None:
    """Refuse an input longer than the model's ``max_input_characters`` (where its
    backend has that setting), before the request is queued.

    Raises:
        PoolError: ``input_too_long`` (400).
    """
    limit = getattr(definition, "max_input_characters", None)
    if isinstance(limit, int) and len(text) > limit:
        raise PoolError(
            "input_too_long",
            f"input has {len(text)} characters; model {model!r} takes at most {limit}",
            details={"param": "input", "limit": limit},
        )


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte RIFF/WAVE header of 16-bit mono PCM; ``None``: a stream of unknown length."""
    data = _OPEN_SIZE if data_bytes is None else data_bytes
    riff = _OPEN_SIZE if data_bytes is None else 36 + data_bytes
    byte_rate = sample_rate * SAMPLE_WIDTH
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, byte_rate, SAMPLE_WIDTH, 16)
        + b"data"
        + struct.pack("<I", data)
    )


def unknown_voice(model: str, voice: str, voices: tuple[Voice, ...]) -> PoolError:
    """The error of a voice the model does not speak in, listing those it does."""
    names = [v.id for v in voices]
    return PoolError(
        "unknown_voice",
        f"model {model!r} has no voice {voice!r} (its voices: {', '.join(names)})",
        details={"param": "voice", "voices": names},
    )


@dataclass(frozen=True, slots=True)
class SpeechAudio:
    """A speech job's answer: the whole encoded file (``None`` when it was streamed)
    and what it holds."""

    audio: bytes | None
    media_type: str
    sample_rate: int
    audio_seconds: float
    synthesis_ms: float


class _Encoding:
    """Hands PCM on in the asked format: to the task sink as it comes (streamed), or
    into one buffer for the whole file."""

    def __init__(self, fmt: AudioFormat, sample_rate: int, sink: TaskSink | None) -> None:
        self.fmt = fmt
        self.sample_rate = sample_rate
        self._sink = sink
        self.started = False
        self.buffer = bytearray()
        self._encoder = Encoder(fmt, sample_rate) if fmt in CODECS else None

    async def send(self, piece: bytes, /) -> None:
        if self._encoder is not None:
            # Encoding is CPU work: off the event loop, like the synthesis itself.
            piece = await trio.to_thread.run_sync(self._encoder.encode, piece)
            if self._sink is None:
                self.buffer += piece
            elif piece:
                self.started = True
                await self._sink.send(piece)
            return
        if self._sink is None:
            self.buffer += piece
            return
        if not self.started:
            self.started = True
            if self.fmt == "wav":
                piece = wav_header(self.sample_rate, None) + piece
        await self._sink.send(piece)

    async def finish(self) -> None:
        """Flush a compressed format's encoder: its last bytes and the container's end."""
        if self._encoder is None:
            return
        tail = await trio.to_thread.run_sync(self._encoder.finish)
        if self._sink is None:
            self.buffer += tail
        elif tail:
            self.started = True
            await self._sink.send(tail)

    def whole_file(self) -> bytes:
        if self.fmt == "wav":
            return wav_header(self.sample_rate, len(self.buffer)) + bytes(self.buffer)
        return bytes(self.buffer)


@dataclass(frozen=True, slots=True)
class SpeechJob(TaskJob):
    """Say ``input`` with a speech model (``POST /v1/audio/speech``).

    ``stream``: hand the audio to the sink as it is made; else the answer holds it all.
    """

    served_by: ClassVar[frozenset[ModelKind]] = frozenset({"speech"})
    operation: ClassVar[str] = "speech"
    model: str
    input: str
    voice: str | None = None
    response_format: AudioFormat = "wav"
    speed: float = 1.0
    stream: bool = False
    request_id: str = ""

    async def run(self, runtime: Runtime, sink: TaskSink) -> TaskResult:
        if not isinstance(runtime, SpeechRuntime):
            raise BackendError(f"the runtime of model {self.model!r} cannot synthesize speech")
        encoding = _Encoding(
            self.response_format, runtime.sample_rate, sink if self.stream else None
        )
        stats = await runtime.synthesize(SpeechInput(self.input, self.voice, self.speed), encoding)
        await encoding.finish()
        if self.stream and not encoding.started and self.response_format == "wav":
            # Nothing to say (punctuation only): still a valid, empty WAV stream.
            await sink.send(wav_header(stats.sample_rate, 0))
        audio = None if self.stream else encoding.whole_file()
        answer = SpeechAudio(
            audio,
            MEDIA_TYPES[self.response_format],
            stats.sample_rate,
            stats.audio_seconds,
            stats.synthesis_ms,
        )
        return TaskResult(answer, TaskUsage(characters=len(self.input)))
