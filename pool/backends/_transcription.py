"""Transcription as a task job: decoded audio in, a :class:`Transcript` out.

The HTTP route decodes the upload (:mod:`pool.backends._audio`) before admission, so
the job carries 16 kHz mono samples and the duration that budgets and usage rows
count; a runtime of kind ``transcription`` implements :class:`Transcriber`. The
runtime hands each segment's text to the sink as it is decoded (a streamed request
sends it on as ``transcript.text.delta``), and a request whose client left stops the
decoding at the next segment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

from pool.backends._protocol import ModelKind, Runtime
from pool.backends._tasks import TaskJob, TaskResult, TaskSink, TaskUsage
from pool.errors import BackendError

# Whisper's input rate; every decoded upload is resampled to it.
SAMPLE_RATE = 16_000

TranscriptionTask = Literal["transcribe", "translate"]


@dataclass(frozen=True, slots=True)
class Word:
    """One word with its times (seconds from the start of the audio)."""

    word: str
    start: float
    end: float
    probability: float


@dataclass(frozen=True, slots=True)
class Segment:
    """One decoded stretch of speech, with the decoder's own figures for it."""

    id: int
    seek: int  # where its window starts, in 10 ms frames
    start: float
    end: float
    text: str
    tokens: tuple[int, ...]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: tuple[Word, ...] = ()


@dataclass(frozen=True, slots=True)
class Transcript:
    """The whole answer: the text, the language it was heard in, the audio's length."""

    text: str
    language: str
    duration: float
    segments: tuple[Segment, ...]

    @property
    def words(self) -> tuple[Word, ...]:
        return tuple(w for s in self.segments for w in s.words)


@runtime_checkable
class Transcriber(Protocol):
    """A runtime that transcribes (the ``whisper`` backend's)."""

    async def transcribe(self, job: TranscriptionJob, sink: TaskSink) -> Transcript:
        """Decode ``job``'s audio, sending each segment's text to ``sink`` as it comes.

        Raises:
            BackendError: the runtime failed.
        """
        ...


@dataclass(frozen=True, slots=True, eq=False)
class TranscriptionJob(TaskJob):
    """Transcribe (or translate into English) one decoded upload.

    Attributes:
        audio: 16 kHz mono float32 samples (a numpy array).
        language: the spoken language's code; None leaves it to the model's default
            (the model's ``language`` setting, else detection).
        prompt: text the decoder is primed with (spellings, the previous part).
        temperature: None for the runtime's fallback ladder, else that one value.
        word_timestamps: whether segments carry their words' times.
    """

    served_by: ClassVar[frozenset[ModelKind]] = frozenset({"transcription"})
    operation: ClassVar[str] = "transcription"
    model: str
    audio: Any
    task: TranscriptionTask = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperature: float | None = None
    word_timestamps: bool = False
    request_id: str = ""

    @property
    def seconds(self) -> float:
        """The audio's length in seconds."""
        return len(self.audio) / SAMPLE_RATE

    async def run(self, runtime: Runtime, sink: TaskSink) -> TaskResult:
        if not isinstance(runtime, Transcriber):
            raise BackendError(f"the runtime of model {self.model!r} cannot transcribe")
        transcript = await runtime.transcribe(self, sink)
        tokens = sum(len(s.tokens) for s in transcript.segments)
        usage = TaskUsage(output_tokens=tokens, audio_seconds=round(self.seconds, 3))
        return TaskResult(transcript, usage)
