"""How the media loader says no: 400 ``image_refused`` with a machine-readable reason."""

from __future__ import annotations

from pool.errors import PoolError

# Every reason an image is refused, as ``error.reason`` names it.
REFUSAL_REASONS: dict[str, str] = {
    "too_many_images": "the request carries more than service.media_max_images images",
    "invalid_url": "the URL cannot be parsed, names credentials or a remote file host",
    "scheme_not_allowed": "not a data:, file:// or http(s) URL (also for a redirect target)",
    "invalid_data_url": "a data: URL that is not base64 or is empty",
    "unsupported_type": "not a PNG, JPEG, GIF, WebP or BMP image",
    "too_large": "larger than service.media_max_bytes",
    "file_not_allowed": "a file:// URL outside service.media_dirs (none by default)",
    "file_unreadable": "a file under service.media_dirs that cannot be read",
    "fetch_disabled": "an http(s) URL while service.media_fetch is off (the default)",
    "address_not_allowed": "a name that resolves to a non-public address",
    "too_many_redirects": "more redirects than service.media_max_redirects",
    "fetch_failed": "the fetch failed: no answer, a non-200 status, a broken connection",
    "fetch_timeout": "fetching took longer than service.media_fetch_timeout_s",
}

_SHOWN_CHARS = 200


def refused(reason: str, message: str) -> PoolError:
    """The error for an image refused for ``reason`` (a key of :data:`REFUSAL_REASONS`)."""
    assert reason in REFUSAL_REASONS, reason
    return PoolError(
        "image_refused", f"image refused ({reason}): {message}", details={"reason": reason}
    )


def shown(url: str) -> str:
    """A URL as an error message may quote it: never a data: payload, never very long."""
    if url[:5].lower() == "data:":
        return "the data: URL"
    return repr(url if len(url) <= _SHOWN_CHARS else url[:_SHOWN_CHARS] + "...")


def too_large(url: str, max_bytes: int) -> PoolError:
    return refused("too_large", f"{shown(url)} is larger than {max_bytes} bytes")
