"""llm-pool: one HTTP service in front of many local LLM runtimes, on Trio.

Embedded use::

    async with pool.open_pool(settings) as p:
        snapshot = await p.load("stub-fast")
        reply = await p.respond(pool.InferenceRequest.prompt("stub-fast", "hello"))
        async for event in p.stream(request): ...  # Delta..., then Finished or Failed
"""

from pool._version import __version__
from pool.actors import (
    Admission,
    Delta,
    Failed,
    Finished,
    InferenceRequest,
    ModelSnapshot,
    Pool,
    open_pool,
)
from pool.config import Settings, load_settings
from pool.errors import ConfigError, PoolError
from pool.http import ServerInfo, request_from_responses, serve

__all__ = [
    "Admission",
    "ConfigError",
    "Delta",
    "Failed",
    "Finished",
    "InferenceRequest",
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
