"""OpenAI's audio routes: the multipart forms of ``/v1/audio/transcriptions`` and
``/v1/audio/translations``, and what they answer.

A form's fields arrive as text, so the request models are read leniently (``"0.2"``
is a temperature, ``"true"`` a boolean) and ignore the fields OpenAI has that the pool
does not act on. ``file`` is the upload's bytes; the document describes it as a
binary string, as multipart clients send it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, StringConstraints, Tag

from pool.schemas._compat import ModelName
from pool.schemas._replies import OpenAIError

TranscriptFormat = Literal["json", "text", "srt", "verbose_json", "vtt"]
Granularity = Literal["word", "segment"]
Prompt = Annotated[str, StringConstraints(max_length=8192)]
# ISO-639-1 (or Whisper's few longer codes, `haw`, `yue`).
Language = Annotated[str, StringConstraints(min_length=2, max_length=8, pattern=r"^[A-Za-z-]+$")]


class _Form(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    file: bytes = Field(
        description="The audio file: any container and codec FFmpeg's libraries decode"
        " (wav, mp3, m4a, ogg/opus, flac, webm, ...), at most `service.audio.max_bytes`."
    )
    model: ModelName = Field(description="A model of kind `transcription`.")
    prompt: Prompt | None = Field(
        None, description="Text that primes the decoder: spellings, or the previous part."
    )
    response_format: TranscriptFormat = Field(
        "json",
        description="`json` (`text` and `usage`), `text`, `srt`, `vtt` or `verbose_json`"
        " (language, duration, segments, words).",
    )
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.0,
        description="0: the decoder's fallback ladder (0.0, 0.2, ... 1.0, taken when a"
        " window decodes badly); above 0: sample at that temperature only.",
    )


class TranscriptionForm(_Form):
    """``POST /v1/audio/transcriptions`` (multipart/form-data)."""

    language: Language | None = Field(
        None,
        description="The spoken language (ISO-639-1, `en`); unset: the model's `language`"
        " setting, else detected from the first 30 s.",
    )
    timestamp_granularities: list[Granularity] = Field(
        default_factory=list,
        alias="timestamp_granularities[]",
        max_length=2,
        description="With `verbose_json`: `segment` (the default) and/or `word` (each word's"
        " times, in `words`).",
    )
    stream: bool = Field(
        False,
        description="Send the text as Server-Sent Events as it is decoded:"
        " `transcript.text.delta` events, then `transcript.text.done`.",
    )


class TranslationForm(_Form):
    """``POST /v1/audio/translations`` (multipart/form-data): speech into English text."""


# -- answers ------------------------------------------------------------------------------
class _Reply(BaseModel):
    # A client may meet fields added later; the document lists those we send today.
    model_config = ConfigDict(extra="allow")


class TranscriptUsage(_Reply):
    type: Literal["duration"]
    seconds: int = Field(description="The audio's length, rounded up to whole seconds.")


class Transcription(_Reply):
    """``response_format: json``."""

    text: str
    usage: TranscriptUsage | None = Field(
        None, description="The audio transcribed (transcriptions only; as OpenAI's whisper-1)."
    )


class TranscriptSegment(_Reply):
    id: int
    seek: int = Field(description="Where the segment's window starts, in 10 ms frames.")
    start: float = Field(description="Seconds from the start of the audio.")
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class TranscriptWord(_Reply):
    word: str
    start: float
    end: float


class TranscriptionVerbose(_Reply):
    """``response_format: verbose_json``."""

    task: Literal["transcribe", "translate"]
    language: str = Field(description="The language's code (`en`), given or detected.")
    duration: float = Field(description="The audio's length in seconds.")
    text: str
    segments: list[TranscriptSegment] | None = Field(
        None, description="Unless `timestamp_granularities[]` leaves out `segment`."
    )
    words: list[TranscriptWord] | None = Field(
        None, description="With `timestamp_granularities[]` `word`."
    )
    usage: TranscriptUsage | None = None


class TranscriptionReply(RootModel[TranscriptionVerbose | Transcription]):
    """A JSON answer: ``verbose_json``'s, or ``json``'s (the others are text)."""


class TranscriptTextDelta(_Reply):
    type: Literal["transcript.text.delta"]
    delta: str = Field(description="The next piece of the text (one decoded segment).")


class TranscriptTextDone(_Reply):
    type: Literal["transcript.text.done"]
    text: str = Field(description="The whole text: the deltas joined.")
    usage: TranscriptUsage


def _event_kind(event: Any) -> str | None:
    """An error event is OpenAI's error object (no ``type``); the rest name theirs."""
    if isinstance(event, dict):
        return "error" if "error" in event else event.get("type")
    return "error" if hasattr(event, "error") else getattr(event, "type", None)


class TranscriptionStreamEvent(
    RootModel[
        Annotated[
            Annotated[TranscriptTextDelta, Tag("transcript.text.delta")]
            | Annotated[TranscriptTextDone, Tag("transcript.text.done")]
            | Annotated[OpenAIError, Tag("error")],
            Discriminator(_event_kind),
        ]
    ]
):
    """The JSON of each ``data:`` event of ``stream: true`` on ``/v1/audio/transcriptions``:
    deltas, then the done event, or OpenAI's error object for a failure after the
    stream started (nothing follows it)."""
