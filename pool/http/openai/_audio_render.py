"""A :class:`~pool.backends.Transcript` in the answer formats of OpenAI's audio routes:
``json``, ``text``, ``srt``, ``vtt``, ``verbose_json``, and the events of a stream."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

from pool.backends import Segment, Transcript
from pool.schemas import (
    Transcription,
    TranscriptionVerbose,
    TranscriptTextDelta,
    TranscriptTextDone,
    renders,
)


def duration_usage(seconds: float) -> dict[str, Any]:
    """What OpenAI's whisper-1 reports as a transcription's usage: its whole seconds."""
    return {"type": "duration", "seconds": math.ceil(seconds)}


@renders(Transcription)
def transcription_body(transcript: Transcript, seconds: float, usage: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"text": transcript.text}
    if usage:
        body["usage"] = duration_usage(seconds)
    return body


@renders(TranscriptionVerbose)
def verbose_body(
    transcript: Transcript,
    task: str,
    seconds: float,
    granularities: Collection[str],
    usage: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "task": task,
        "language": transcript.language,
        "duration": transcript.duration,
        "text": transcript.text,
    }
    # OpenAI's default granularity is the segment; words only when asked for.
    if not granularities or "segment" in granularities:
        body["segments"] = [_segment(s) for s in transcript.segments]
    if "word" in granularities:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in transcript.words]
    if usage:
        body["usage"] = duration_usage(seconds)
    return body


def _segment(segment: Segment) -> dict[str, Any]:
    return {
        "id": segment.id,
        "seek": segment.seek,
        "start": segment.start,
        "end": segment.end,
        "text": segment.text,
        "tokens": list(segment.tokens),
        "temperature": segment.temperature,
        "avg_logprob": segment.avg_logprob,
        "compression_ratio": segment.compression_ratio,
        "no_speech_prob": segment.no_speech_prob,
    }


def _clock(seconds: float, separator: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{millis:03d}"


def srt_text(transcript: Transcript) -> str:
    """SubRip: numbered cues, ``HH:MM:SS,mmm`` times."""
    cues = [
        f"{n}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text.strip()}\n"
        for n, s in enumerate(transcript.segments, 1)
    ]
    return "\n".join(cues)


def vtt_text(transcript: Transcript) -> str:
    """WebVTT: the header, then cues with ``HH:MM:SS.mmm`` times."""
    cues = [
        f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text.strip()}\n"
        for s in transcript.segments
    ]
    return "WEBVTT\n\n" + "\n".join(cues)


@renders(TranscriptTextDelta)
def delta_event(text: str) -> dict[str, Any]:
    return {"type": "transcript.text.delta", "delta": text}


@renders(TranscriptTextDone)
def done_event(text: str, seconds: float) -> dict[str, Any]:
    return {"type": "transcript.text.done", "text": text, "usage": duration_usage(seconds)}
