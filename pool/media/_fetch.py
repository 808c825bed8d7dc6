"""``http(s)`` images, fetched by the pool: redirects followed by hand, every hop checked.

The connections go through :class:`~pool.media._addresses.GuardedNetwork`, so each
redirect target is resolved and checked again before anything is sent to it. Bodies are
read up to ``media_max_bytes``; the caller bounds the time.
"""

from __future__ import annotations

from urllib.parse import urljoin, urlsplit

import httpcore

from pool._version import __version__
from pool.media._refusal import refused, shown, too_large

_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_HEADERS = [(b"Accept", b"image/*"), (b"User-Agent", f"llm-pool/{__version__}".encode())]
# What a broken or refused exchange raises inside httpcore.
_TRANSPORT_ERRORS = (
    httpcore.NetworkError,
    httpcore.TimeoutException,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
)


def checked_url(url: str) -> str:
    """An http(s) URL the fetcher may ask for: an ASCII host, no credentials.

    Raises:
        PoolError: ``image_refused`` (``scheme_not_allowed`` or ``invalid_url``).
    """
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise refused("invalid_url", f"{shown(url)} is not a valid URL") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise refused("scheme_not_allowed", f"{shown(url)} is not an http(s) URL")
    if not parts.hostname:
        raise refused("invalid_url", f"{shown(url)} names no host")
    if not url.isascii():
        raise refused("invalid_url", f"{shown(url)} must be ASCII (IDNA host, %-escaped path)")
    if parts.username is not None or parts.password is not None:
        raise refused("invalid_url", "image URLs with credentials are not fetched")
    return url


class ImageFetcher:
    """GETs images over a network backend that only reaches allowed addresses.

    Args:
        network: the guarded backend every connection is opened with.
        max_bytes: ``service.media_max_bytes``.
        max_redirects: ``service.media_max_redirects``.
    """

    def __init__(
        self, network: httpcore.AsyncNetworkBackend, *, max_bytes: int, max_redirects: int
    ) -> None:
        self._network = network
        self._max_bytes = max_bytes
        self._max_redirects = max_redirects

    async def fetch(self, url: str) -> bytes:
        """The body of ``url`` after at most ``max_redirects`` redirects.

        Raises:
            PoolError: ``image_refused`` with the reason.
        """
        current = url
        # A pool per fetch: no connection outlives the request that asked for it.
        async with httpcore.AsyncConnectionPool(network_backend=self._network) as http:
            for _ in range(self._max_redirects + 1):
                try:
                    async with http.stream(
                        "GET", checked_url(current), headers=_HEADERS
                    ) as response:
                        if response.status in _REDIRECTS:
                            location = _header(response, b"location")
                            if not location:
                                raise refused("fetch_failed", f"{shown(current)} redirects nowhere")
                            current = urljoin(current, location)
                            continue
                        if response.status != 200:
                            raise refused(
                                "fetch_failed", f"{shown(current)} answered {response.status}"
                            )
                        return await self._body(current, response)
                except _TRANSPORT_ERRORS as exc:
                    reason = str(exc) or type(exc).__name__
                    raise refused("fetch_failed", f"{shown(current)}: {reason}") from None
        raise refused(
            "too_many_redirects", f"{shown(url)} redirects more than {self._max_redirects} times"
        )

    async def _body(self, url: str, response: httpcore.Response) -> bytes:
        length = _header(response, b"content-length")
        if length.isdigit() and int(length) > self._max_bytes:
            raise too_large(url, self._max_bytes)
        body = bytearray()
        async for chunk in response.aiter_stream():
            body += chunk
            if len(body) > self._max_bytes:
                raise too_large(url, self._max_bytes)
        return bytes(body)


def _header(response: httpcore.Response, name: bytes) -> str:
    for key, value in response.headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return ""
