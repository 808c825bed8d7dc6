"""Decoding an uploaded audio file into Whisper's input: 16 kHz mono float32 samples.

PyAV (the library faster-whisper itself decodes with, the ``whisper`` extra's ``av``)
reads the container from memory; no ``ffmpeg`` binary is ever looked up on ``PATH``.
The loop is faster-whisper's ``decode_audio`` with one addition: it stops as soon as
the audio passes ``max_seconds``, so a small file that expands to hours of samples
costs no more than the limit (a 400 ``audio_too_long``). Blocking: call it on a
worker thread.
"""

from __future__ import annotations

import io
from typing import Any

from pool.backends._transcription import SAMPLE_RATE
from pool.errors import PoolError


def decode_audio(data: bytes, max_seconds: float) -> Any:
    """``data`` (any container and codec FFmpeg's libraries read) as a numpy float32
    array of 16 kHz mono samples.

    Raises:
        PoolError: ``invalid_audio`` (400) for a file that holds no decodable audio,
            ``audio_too_long`` (400) past ``max_seconds``.
    """
    try:
        import av
        import numpy as np
    except ImportError as exc:  # pragma: no cover - the whisper extra is missing
        raise PoolError(
            "invalid_audio", "this pool cannot decode audio (pip install 'llm-pool[whisper]')"
        ) from exc
    limit = int(max_seconds * SAMPLE_RATE)
    chunks: list[Any] = []
    total = 0

    def take(frames: list[Any]) -> None:
        nonlocal total
        for frame in frames:
            samples = frame.to_ndarray().reshape(-1)
            total += samples.shape[0]
            if total > limit:
                raise PoolError(
                    "audio_too_long",
                    f"the audio is longer than {max_seconds:g} s (service.audio.max_seconds)",
                    details={"param": "file"},
                )
            chunks.append(samples)

    try:
        with av.open(io.BytesIO(data), mode="r", metadata_errors="ignore") as container:
            if not container.streams.audio:
                raise _invalid("the file holds no audio stream")
            resampler = av.audio.resampler.AudioResampler(
                format="s16", layout="mono", rate=SAMPLE_RATE
            )
            try:
                for frame in container.decode(audio=0):
                    take(resampler.resample(frame))
            except av.error.InvalidDataError:
                pass  # a damaged tail: keep what decoded, as faster-whisper does
            take(resampler.resample(None))
    except PoolError:
        raise
    except (av.error.FFmpegError, ValueError, IndexError, OSError) as exc:
        raise _invalid(f"the file could not be decoded as audio ({exc})") from exc
    if total == 0:
        raise _invalid("the file holds no audio samples")
    audio = np.concatenate(chunks).astype(np.float32)
    audio /= 32768.0
    return audio


def _invalid(message: str) -> PoolError:
    return PoolError("invalid_audio", message, details={"param": "file"})
