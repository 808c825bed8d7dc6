"""The media loader: every image of a request becomes an inline ``data:`` URL, or a 400.

Applied once, in ``Pool.admit``, so every surface and embedded use meet the same policy
and a backend never fetches or opens anything a client named:

- ``data:`` URLs are checked (an image type, strict base64, the size cap) and kept as sent;
- ``file://`` URLs are read only under ``service.media_dirs`` (none by default);
- ``http(s)`` URLs are fetched only with ``service.media_fetch``, only from public
  addresses (each redirect checked again), within the size and time caps.

Files and fetched bodies must be PNG, JPEG, GIF, WebP or BMP by their first bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import httpcore
import trio

from pool.config import ServiceSettings
from pool.media._addresses import GuardedNetwork, Resolver, system_resolver
from pool.media._fetch import ImageFetcher
from pool.media._files import MediaFiles
from pool.media._images import (
    IMAGE_TYPES,
    SNIFF_BYTES,
    data_url,
    decode_payload,
    parse_data_url,
    sniff_image_type,
)
from pool.media._refusal import refused, shown, too_large

T = TypeVar("T")

_WORKER_THREADS = 4  # file reads and large base64 work at once
# Base64 work on more than this many characters leaves the event loop (about 1 ms here).
_INLINE_CHARS = 1 << 20


class MediaLoader:
    """Inlines the images of requests under the ``service.media_*`` policy.

    Args:
        settings: the ``service`` settings (``media_*``).
        resolver: how host names are resolved before their addresses are checked.
        network: the httpcore backend that opens connections to checked addresses
            (tests point it at loopback servers; the check itself is never replaced).
    """

    def __init__(
        self,
        settings: ServiceSettings,
        *,
        resolver: Resolver | None = None,
        network: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self._max_bytes = settings.media_max_bytes
        self._max_images = settings.media_max_images
        self._fetch_timeout_s = settings.media_fetch_timeout_s
        self._limiter = trio.CapacityLimiter(_WORKER_THREADS)
        self._files = MediaFiles(
            settings.media_dirs, max_bytes=settings.media_max_bytes, limiter=self._limiter
        )
        self._fetcher: ImageFetcher | None = None
        if settings.media_fetch:
            guarded = GuardedNetwork(resolver or system_resolver, network or httpcore.TrioBackend())
            self._fetcher = ImageFetcher(
                guarded,
                max_bytes=settings.media_max_bytes,
                max_redirects=settings.media_max_redirects,
            )

    async def inline(self, urls: Sequence[str]) -> list[str]:
        """Each URL as an inline ``data:`` URL, in order (a valid ``data:`` URL unchanged).

        The fetches of one call share ``service.media_fetch_timeout_s``.

        Raises:
            PoolError: ``image_refused`` (400) naming the ``reason``.
        """
        if len(urls) > self._max_images:
            raise refused(
                "too_many_images",
                f"{len(urls)} images; at most {self._max_images} per request",
            )
        deadline = trio.current_time() + self._fetch_timeout_s
        return [await self._inline_one(url, deadline) for url in urls]

    async def _inline_one(self, url: str, deadline: float) -> str:
        scheme = url.partition(":")[0].lower() if ":" in url else ""
        if scheme == "data":
            return await self._checked_data_url(url)
        if scheme == "file":
            data = await self._files.read(url)
        elif scheme in ("http", "https"):
            data = await self._fetch(url, deadline)
        else:
            raise refused(
                "scheme_not_allowed", f"{shown(url)}: images are data:, file:// or http(s) URLs"
            )
        mime = sniff_image_type(data[:SNIFF_BYTES])
        if mime is None:
            raise refused("unsupported_type", f"{shown(url)} is none of {', '.join(IMAGE_TYPES)}")
        return await self._cpu(len(data) * 4 // 3, data_url, mime, data)

    async def _checked_data_url(self, url: str) -> str:
        parsed = parse_data_url(url)
        if parsed.size_bound > self._max_bytes + 2:  # + 2: padding the bound ignores
            raise too_large(url, self._max_bytes)
        data = await self._cpu(len(parsed.payload), decode_payload, parsed.payload)
        if len(data) > self._max_bytes:
            raise too_large(url, self._max_bytes)
        return url

    async def _fetch(self, url: str, deadline: float) -> bytes:
        if self._fetcher is None:
            raise refused(
                "fetch_disabled",
                "the pool does not fetch http(s) images (service.media_fetch is off);"
                " send the image as a data: URL",
            )
        with trio.move_on_at(deadline):
            return await self._fetcher.fetch(url)
        raise refused(
            "fetch_timeout",
            f"{shown(url)} took longer than {self._fetch_timeout_s:g} s"
            " (service.media_fetch_timeout_s, for all images of a request)",
        )

    async def _cpu(self, chars: int, fn: Callable[..., T], *args: object) -> T:
        if chars <= _INLINE_CHARS:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)
