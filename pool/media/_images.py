"""What the pool accepts as an image: the types, how they are recognised, ``data:`` URLs."""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass

from pool.media._refusal import refused

# SVG is left out on purpose: it is a document (scripts, external references), and no
# vision backend here reads it.
IMAGE_TYPES: tuple[str, ...] = ("image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp")
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg", "image/x-ms-bmp": "image/bmp"}
SNIFF_BYTES = 12  # enough of a file's head for every signature below


def sniff_image_type(head: bytes) -> str | None:
    """The image type that ``head`` (the first bytes) starts with, or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head[:2] == b"BM":
        return "image/bmp"
    return None


@dataclass(frozen=True, slots=True)
class DataUrl:
    """A ``data:`` URL whose header was checked; ``payload`` is still base64 text."""

    mime: str
    payload: str

    @property
    def size_bound(self) -> int:
        """Decoded bytes at most, known without decoding."""
        return len(self.payload) * 3 // 4


def parse_data_url(url: str) -> DataUrl:
    """Check a ``data:`` URL's header: base64, and one of :data:`IMAGE_TYPES`.

    Raises:
        PoolError: ``image_refused`` (``invalid_data_url`` or ``unsupported_type``).
    """
    header, comma, payload = url[5:].partition(",")
    if not comma:
        raise refused("invalid_data_url", "a data: URL needs a comma before its data")
    params = [p.strip().lower() for p in header.split(";")]
    if params[-1] != "base64" or len(params) < 2:
        raise refused("invalid_data_url", "image data: URLs must be base64 (`;base64,`)")
    mime = _ALIASES.get(params[0], params[0])
    if mime not in IMAGE_TYPES:
        raise refused(
            "unsupported_type", f"{params[0][:50]!r} is not one of {', '.join(IMAGE_TYPES)}"
        )
    if not payload:
        raise refused("invalid_data_url", "the data: URL carries no data")
    return DataUrl(mime, payload)


def decode_payload(payload: str) -> bytes:
    """Strict base64 (no stray characters, correct padding).

    Raises:
        PoolError: ``image_refused`` (``invalid_data_url``).
    """
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise refused("invalid_data_url", "the data: URL is not valid base64") from None


def data_url_bytes(url: str) -> bytes:
    """The image bytes of an inline ``data:`` URL (what the loader makes of every image).

    Raises:
        PoolError: ``image_refused`` (``invalid_data_url`` or ``unsupported_type``).
    """
    if not url.startswith("data:"):
        raise refused("invalid_data_url", "the image was not inlined as a data: URL")
    return decode_payload(parse_data_url(url).payload)


def data_url(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"
