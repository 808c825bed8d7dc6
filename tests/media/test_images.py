"""What counts as an image, and which data: URLs pass."""

from __future__ import annotations

import pytest

from pool.errors import PoolError
from pool.media import sniff_image_type
from pool.media._images import decode_payload, parse_data_url


@pytest.mark.parametrize(
    ("head", "mime"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00", "image/png"),
        (b"\xff\xd8\xff\xe0\x00\x10JFIF", "image/jpeg"),
        (b"GIF89a\x01\x00", "image/gif"),
        (b"RIFF\x00\x00\x00\x00WEBPVP8 ", "image/webp"),
        (b"BM\x00\x00", "image/bmp"),
        (b"RIFF\x00\x00\x00\x00WAVEfmt ", None),
        (b"<svg xmlns=", None),
        (b"root:x:0:0:", None),
        (b"", None),
    ],
)
def test_sniff(head: bytes, mime: str | None) -> None:
    assert sniff_image_type(head) == mime


def _reason(url: str) -> str:
    with pytest.raises(PoolError) as info:
        decode_payload(parse_data_url(url).payload)
    assert info.value.code == "image_refused" and info.value.status == 400
    return str(info.value.details["reason"])


def test_data_urls() -> None:
    assert parse_data_url("data:image/png;base64,AAAA").mime == "image/png"
    assert parse_data_url("data:IMAGE/JPG;base64,AAAA").mime == "image/jpeg"
    assert decode_payload(parse_data_url("data:image/webp;base64,AAAA").payload) == bytes(3)
    assert _reason("data:image/png,rawbytes") == "invalid_data_url"
    assert _reason("data:image/png;base64") == "invalid_data_url"
    assert _reason("data:image/png;base64,") == "invalid_data_url"
    assert _reason("data:image/png;base64,AAA") == "invalid_data_url"
    assert _reason("data:image/png;base64,AA AA") == "invalid_data_url"
    assert _reason("data:image/png;base64,ÄÄÄÄ") == "invalid_data_url"
    assert _reason("data:image/svg+xml;base64,AAAA") == "unsupported_type"
    assert _reason("data:text/html;base64,AAAA") == "unsupported_type"
    assert _reason("data:x") == "invalid_data_url"
