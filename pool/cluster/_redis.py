"""The Redis connection (coredis, which runs on Trio through anyio) and its failures.

Callers outside this package see :class:`RedisUnavailable`, never coredis's own
exception types, so nothing else has to import coredis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import coredis

T = TypeVar("T")


class RedisUnavailable(Exception):
    """Redis could not be reached, or did not answer in time."""


def _down_errors() -> tuple[type[BaseException], ...]:
    import coredis.exceptions

    return (coredis.exceptions.ConnectionError, TimeoutError, OSError)


async def call(awaitable: Awaitable[T]) -> T:
    """Await one Redis command; a connection failure becomes :class:`RedisUnavailable`."""
    try:
        return await awaitable
    except _down_errors() as exc:
        raise RedisUnavailable(f"{type(exc).__name__}: {exc}") from exc


def missing_client_reason() -> str | None:
    """Why the cluster cannot run here (the ``cluster`` extra not installed), or None."""
    try:
        import coredis  # noqa: F401
    except ImportError as exc:
        return f"the Redis client is not installed (pip install 'llm-pool[cluster]'): {exc}"
    return None


@asynccontextmanager
async def open_redis(url: str, *, timeout_s: float = 2.0) -> AsyncIterator[coredis.Redis[str]]:
    """A client for ``url`` (``redis://host:port/db``) with string replies.

    Opening it does not need Redis to be up: commands raise (wrap them in :func:`call`)
    until it is, and then work.
    """
    import coredis

    kwargs: dict[str, Any] = {"connect_timeout": timeout_s, "stream_timeout": timeout_s}
    client: coredis.Redis[str] = coredis.Redis.from_url(url, decode_responses=True, **kwargs)
    try:
        async with client:
            yield client
    except BaseExceptionGroup as group:
        # coredis runs its connections in a task group, which wraps whatever the block
        # raised; callers expect the exception itself.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
