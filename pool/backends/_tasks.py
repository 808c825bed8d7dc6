"""Jobs that are one call to a runtime with one answer: rerank, transcription, speech, a
forwarded route. Not a token generation, and not an embedding (which predates these).

A task job names the model kinds that serve it; the pool checks the model's kind
before queueing (400 ``wrong_model_kind``), then the job goes through the same queue,
replicas, residency and accounting as a generation. The replica calls :meth:`TaskJob.run`
with its runtime; a streamed task hands its pieces (text or bytes) to the sink as it
makes them, and the answer comes back as a :class:`TaskResult` whose
:class:`TaskUsage` is what the request is charged for.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pool.backends._protocol import ModelKind, Runtime


@dataclass(frozen=True, slots=True)
class TaskUsage:
    """What a task used, in its own units (tokens where they apply)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    audio_seconds: float = 0.0
    characters: int = 0


@dataclass(frozen=True, slots=True)
class TaskResult:
    """A task's answer (its kind's own value, rendered by the route) and its usage."""

    value: Any
    usage: TaskUsage = TaskUsage()


class TaskSink(Protocol):
    """Where a streamed task delivers its pieces; ``send`` may block (backpressure) and
    raises ``trio.Cancelled`` once the client left."""

    async def send(self, piece: str | bytes) -> None: ...


class TaskJob(ABC):
    """One task for one model. Subclasses are frozen dataclasses with ``request_id``
    and ``model`` fields; ``served_by`` names the model kinds that can run them."""

    served_by: ClassVar[frozenset[ModelKind]]
    # What traces and logs call the operation (``rerank``, ``transcription``, ...).
    operation: ClassVar[str]
    request_id: str
    model: str

    @property
    def wanted(self) -> str:
        """The kinds that serve this job, as an error message names them."""
        return " or ".join(sorted(self.served_by))

    @abstractmethod
    async def run(self, runtime: Runtime, sink: TaskSink) -> TaskResult:
        """Do the job on one replica's ``runtime``.

        Raises:
            BackendError: the runtime failed (the request gets ``backend_error``).
            PoolError: the request cannot be served as asked (its own code).
        """
