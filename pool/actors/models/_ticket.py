"""One admitted request on its way through a model: queued, running, then finished.

A ticket is shared by exactly two parties: the requester (an HTTP handler or embedded
caller), which waits for dispatch and then reads the output channel, and the replica
job that produces the output. Either side may end it; closing the receive end or
cancelling the job's scope is how a departing client stops generation.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import trio

from pool.actors.values._events import Delta
from pool.backends import TokensUsed, ToolCallDelta
from pool.errors import PoolError

if TYPE_CHECKING:
    from pool.actors.models._affinity import ReplyRecorder
    from pool.backends import (
        EmbeddingJob,
        EmbeddingResult,
        GenerationRequest,
        GenerationStats,
        TaskJob,
        TaskResult,
    )


@dataclass(slots=True)
class JobFinished:
    """The replica's report of a completed generation (the requester builds metrics)."""

    stats: GenerationStats
    backend_ms: float
    time_to_first_token_ms: float | None
    sent_chunks: int
    finished_at: float


@dataclass(slots=True)
class JobEmbedded:
    """The replica's report of a completed embedding job."""

    result: EmbeddingResult
    backend_ms: float
    finished_at: float


@dataclass(slots=True)
class JobCompleted:
    """The replica's report of a completed task job (rerank, transcription, ...)."""

    result: TaskResult
    backend_ms: float
    finished_at: float


@dataclass(slots=True)
class JobFailed:
    error: PoolError


# A streamed task's pieces are text (a Delta) or bytes (audio, a forwarded body).
Output = Delta | ToolCallDelta | bytes | JobFinished | JobEmbedded | JobCompleted | JobFailed


@dataclass(eq=False, slots=True)
class Ticket:
    request: GenerationRequest | EmbeddingJob | TaskJob
    tenant: str = "default"
    priority: Literal["high", "normal", "low"] = "normal"
    buffer: int = 32
    enqueued_at: float = field(default_factory=time.perf_counter)
    dispatched_at: float | None = None
    sequence: int = 0
    # The prompt's block keys (pool/actors/models/_affinity.py), hashed at the first dispatch
    # that has replicas to choose between, and what records the answer for the next turn.
    prefix_keys: tuple[bytes, ...] | None = None
    reply: ReplyRecorder | None = None
    error: PoolError | None = None
    # What the job has used so far (its runtime and its sink keep it current): a request
    # that ends before its result is charged from it.
    used: TokensUsed = field(default_factory=TokensUsed)
    # Seconds of model loading this request caused (it found its model unloaded and
    # started the load): charged to its tenant and key with its usage row.
    load_seconds: float = 0.0
    # The key that sent it (None: no key), and whether its usage row was written (a
    # load that ends after its requester left is then charged with a row of its own).
    key_name: str | None = None
    accounted: bool = False
    # A stream the residency owner may pause for a swap (priority ``low``, or its key's
    # or tenant's ``preemptible``), and whether it was: its job was stopped at a token
    # boundary and its requester resumes it once the model is back.
    preemptible: bool = False
    paused: bool = False
    # What a request's trace reads (pool/tracing): whether it waited in the queue (found
    # no free replica on arrival), whether for a load of its model, the replica that ran
    # it, and when its job began (perf_counter).
    waited: bool = False
    waits_for_load: bool = False
    replica: int | None = None
    started_at: float | None = None
    ready: trio.Event = field(default_factory=trio.Event)
    # Set by the job when it begins (or on rejection): the requester waits for it, so
    # the backend starts working before the client is told anything.
    started: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    send_channel: trio.MemorySendChannel[Output] = field(init=False)
    receive_channel: trio.MemoryReceiveChannel[Output] = field(init=False)

    def __post_init__(self) -> None:
        self.send_channel, self.receive_channel = trio.open_memory_channel[Output](self.buffer)

    @property
    def queue_wait_ms(self) -> float:
        end = self.dispatched_at if self.dispatched_at is not None else time.perf_counter()
        return (end - self.enqueued_at) * 1000.0

    def mark_dispatched(self) -> None:
        self.dispatched_at = time.perf_counter()
        self.ready.set()

    def reject(self, error: PoolError) -> None:
        """Fail a queued ticket: its waiter wakes and raises ``error``."""
        self.error = error
        self.send_channel.close()
        self.ready.set()
        self.started.set()

    def pause(self) -> None:
        """Stop the job at its next token boundary and mark it paused: its requester
        keeps the reply so far and resumes it (pool/actors/serving/_admission.py)."""
        self.paused = True
        self.scope.cancel()

    def abandon(self) -> None:
        """The requester is gone: stop the job (if any) and drop buffered output."""
        self.scope.cancel()
        self.receive_channel.close()

    def outputs(self) -> AsyncIterator[Output]:
        """The requester's read of the job's output, to the channel's end."""
        return _Outputs(self.receive_channel)

    def hand_over(self, output: Output) -> bool:
        """Put ``output`` in the channel if it has room (False: it is full). A requester
        that left is no error: its output is dropped."""
        try:
            self.send_channel.send_nowait(output)
        except trio.WouldBlock:
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        return True


class _Outputs:
    """A ticket's channel read as :meth:`Ticket.outputs` gives it: an item already waiting
    is taken at once. Trio's ``receive`` passes through the scheduler even when it need
    not wait (a checkpoint), a task step for the requester on every read; a job's output
    is finite, so taking what waits never keeps the loop for long, and a read that waits
    is still Trio's (and a cancellation point)."""

    __slots__ = ("_channel",)

    def __init__(self, channel: trio.MemoryReceiveChannel[Output]) -> None:
        self._channel = channel

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> Output:
        try:
            return self._channel.receive_nowait()
        except trio.WouldBlock:
            pass
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
        try:
            return await self._channel.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None
