"""Stand-in for a backend whose runtime this build does not provide yet.

Its models validate, list and report their constraints; loading one fails with
``load_failed`` and a message that says so, instead of a traceback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from pool.backends._protocol import Capabilities, LoadContext, Runtime
from pool.config import load_constraints, load_recommendations
from pool.errors import BackendError

if TYPE_CHECKING:
    from pool.config import ModelDefinition


class UnavailableBackend:
    name: ClassVar[str] = "unavailable"

    def __init__(self, backend_name: str, reason: str | None = None) -> None:
        self.backend_name = backend_name
        self.reason = reason
        # Rows of its models still show the backend's real tables.
        self.load_constraints = load_constraints(backend_name)
        self.load_recommendations = load_recommendations(backend_name)

    def capabilities(self, definition: ModelDefinition) -> Capabilities:
        return Capabilities(modalities=tuple(definition.modalities))

    def effective_target_inflight(self, definition: ModelDefinition) -> int:
        return 1

    async def load(self, definition: ModelDefinition, context: LoadContext) -> Runtime:
        raise BackendError(
            f"backend {self.backend_name!r} is not available in this build of llm-pool"
        )
