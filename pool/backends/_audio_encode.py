"""Compressed speech audio (mp3, opus, aac, flac), encoded in-process by PyAV.

PyAV (the ``av`` package, which the ``speech`` and ``whisper`` extras install) carries
FFmpeg's libraries, so the pool never runs an ``ffmpeg`` from ``PATH``. A wheel built
without an encoder leaves that format out of :func:`encodable_formats`; the route then
refuses it with 400 ``response_format_unsupported``.

:class:`Encoder` takes 16-bit mono PCM piece by piece and returns the container's bytes
as the muxer writes them, so a streamed answer leaves as it is made. Every container
used here is written front to back (no seeking back to patch a header), so the streamed
bytes and the whole file are the same.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any


# Container, encoder, and the sample rate the encoder takes (None: the voice's own).
# Opus runs at 48 kHz only; the others take Piper's 22050 Hz as it is.
@dataclass(frozen=True, slots=True)
class _Codec:
    container: str
    encoder: str
    rate: int | None
    media_type: str


CODECS: dict[str, _Codec] = {
    "mp3": _Codec("mp3", "libmp3lame", None, "audio/mpeg"),
    "opus": _Codec("ogg", "libopus", 48000, "audio/ogg"),
    "aac": _Codec("adts", "aac", None, "audio/aac"),
    "flac": _Codec("flac", "flac", None, "audio/flac"),
}


def encodable_formats() -> tuple[str, ...]:
    """The compressed formats this process can encode: PyAV imports and has the
    format's encoder (checked at runtime, as wheels differ)."""
    try:
        import av
    except ImportError:
        return ()
    found = []
    for name, codec in CODECS.items():
        try:
            av.codec.Codec(codec.encoder, "w")
        except Exception:  # noqa: BLE001 (PyAV raises its own error types per version)
            continue
        if codec.container in av.formats_available:
            found.append(name)
    return tuple(found)


class _Collected(io.RawIOBase):
    """A write-only, unseekable file the muxer writes into; ``take`` empties it."""

    def __init__(self) -> None:
        self._pieces = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._pieces += bytes(data)
        return len(data)

    def take(self) -> bytes:
        out = bytes(self._pieces)
        self._pieces.clear()
        return out


class Encoder:
    """One answer's encoder: ``encode`` each PCM piece, then ``finish`` once; each
    returns the bytes the container wrote meanwhile (maybe none). Blocking (CPU): call
    it off the event loop."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        import av

        codec = CODECS[fmt]
        self._av = av
        self._out = _Collected()
        self._container = av.open(self._out, mode="w", format=codec.container)
        rate = codec.rate or sample_rate
        # Typed Any: PyAV's stubs give a union of stream kinds; this one is audio.
        stream: Any = self._container.add_stream(codec.encoder, rate=rate, layout="mono")
        self._stream = stream
        self._rate = sample_rate
        self._resampler = av.AudioResampler(
            format=stream.codec_context.format.name, layout="mono", rate=rate
        )

    def encode(self, pcm: bytes) -> bytes:
        if pcm:
            import numpy as np

            samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
            frame = self._av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate = self._rate
            for converted in self._resampler.resample(frame):
                self._mux(converted)
        return self._out.take()

    def finish(self) -> bytes:
        for converted in self._resampler.resample(None):
            self._mux(converted)
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._out.take()

    def _mux(self, frame: Any) -> None:
        frame.pts = None
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
