"""The loader's data: URL path, including payloads large enough to leave the event loop."""

from __future__ import annotations

import base64

import pytest

from pool.config import build_settings
from pool.errors import PoolError
from pool.media import MediaLoader

from .helpers import PNG, PNG_URL


def _loader(**service: object) -> MediaLoader:
    return MediaLoader(build_settings({"service": service}).service)


async def _reason(loader: MediaLoader, url: str) -> str:
    with pytest.raises(PoolError) as info:
        await loader.inline([url])
    return str(info.value.details["reason"])


async def test_data_urls_are_kept_as_sent() -> None:
    loader = _loader()
    url = "data:image/jpeg;base64," + base64.b64encode(b"\xff\xd8\xff" + bytes(100)).decode()
    assert await loader.inline([PNG_URL, url]) == [PNG_URL, url]
    assert await loader.inline([]) == []


async def test_large_payloads() -> None:
    big = "data:image/png;base64," + base64.b64encode(PNG + bytes(3 << 20)).decode()
    assert await _loader().inline([big]) == [big]  # decoded in a worker thread
    assert await _reason(_loader(media_max_bytes=2 << 20), big) == "too_large"
    broken = big[:-10] + "!" + big[-9:]
    assert await _reason(_loader(), broken) == "invalid_data_url"
    exact = "data:image/png;base64," + base64.b64encode(PNG + bytes(1000)).decode()
    assert await _reason(_loader(media_max_bytes=len(PNG) + 999), exact) == "too_large"
    assert await _loader(media_max_bytes=len(PNG) + 1000).inline([exact]) == [exact]
