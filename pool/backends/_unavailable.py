"""The base of a backend whose runtime this build does not provide yet.

Its models validate, list and report their constraints; loading one fails with
``load_failed`` and a message that says so, instead of a traceback.
"""

from __future__ import annotations

from pool.backends._protocol import Backend, Capabilities, ConfigT, LoadContext, Runtime
from pool.errors import BackendError


class UnavailableBackend(Backend[ConfigT]):
    """A backend module's class while its runtime is missing: it has all but ``load``."""

    def capabilities(self, definition: ConfigT) -> Capabilities:
        return Capabilities(modalities=tuple(definition.modalities))

    def effective_target_inflight(self, definition: ConfigT) -> int:
        return 1

    async def load(self, definition: ConfigT, context: LoadContext) -> Runtime:
        raise BackendError(f"backend {self.name!r} is not available in this build of llm-pool")
