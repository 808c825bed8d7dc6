"""llm-pool: one HTTP service in front of many local LLM runtimes, on Trio.

Embedded use::

    async with pool.open_pool(settings) as p:
        snapshot = await p.load("stub-fast")
        reply = await p.respond(pool.InferenceRequest.prompt("stub-fast", "hello"))
        async for event in p.stream(request): ...  # Delta..., then Finished or Failed
"""

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from pool import actors
from pool._version import __version__
from pool.actors import (
    Admission,
    Delta,
    Failed,
    Finished,
    InferenceRequest,
    ModelSnapshot,
    Pool,
)
from pool.config import Settings, load_settings
from pool.errors import ConfigError, ListenError, PoolError
from pool.http import ServerInfo, request_from_responses, serve
from pool.tracing import open_tracing


@asynccontextmanager
async def open_pool(settings: Settings, **options: Any) -> AsyncIterator[Pool]:
    """:func:`pool.actors.open_pool`, traced as the settings say (``service.tracing``,
    else the standard ``OTEL_*`` variables; a ConfigError before anything starts when
    tracing is asked for without its packages). ``options`` are the actor tree's."""
    if "tracing" not in options:
        options["tracing"] = open_tracing(settings.service.tracing)
    async with actors.open_pool(settings, **options) as pool:
        yield pool


__all__ = [
    "Admission",
    "ConfigError",
    "Delta",
    "Failed",
    "Finished",
    "InferenceRequest",
    "ListenError",
    "ModelSnapshot",
    "Pool",
    "PoolError",
    "ServerInfo",
    "Settings",
    "__version__",
    "load_settings",
    "open_pool",
    "request_from_responses",
    "serve",
]
