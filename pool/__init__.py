"""llm-pool: one HTTP service in front of many local LLM runtimes, on Trio.

Embedded use::

    async with pool.open_pool(settings) as p:
        row = await p.load("stub-fast")
        async for event in p.stream(request): ...
"""

from pool._version import __version__
from pool.actors import Admission, Pool, open_pool
from pool.config import Settings, load_settings
from pool.errors import ConfigError, PoolError
from pool.http import ServerInfo, serve

__all__ = [
    "Admission",
    "ConfigError",
    "Pool",
    "PoolError",
    "ServerInfo",
    "Settings",
    "__version__",
    "load_settings",
    "open_pool",
    "serve",
]
