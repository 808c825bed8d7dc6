"""An admitted request as its caller sees it: a stream of typed events.

The replica hands raw output to the ticket's channel; :class:`Admission` turns it into
:class:`Delta` events (passed through as they are, so a token costs no allocation
here), then one :class:`Finished` with usage and timings, or a :class:`Failed`.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from pool.actors._events import Delta, Embedded, Event, Failed, Finished, Timings, Usage
from pool.actors._ticket import JobEmbedded, JobFailed, JobFinished, Ticket
from pool.errors import PoolError


def new_request_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _ms(value: float) -> float:
    return round(value, 3)


def build_timings(ticket: Ticket, job: JobFinished, admitted_at: float) -> tuple[Timings, Usage]:
    """The nested timers of one request, from what the replica and the ticket saw."""
    stats = job.stats
    assert ticket.dispatched_at is not None
    engine_ms = (job.finished_at - ticket.dispatched_at) * 1000.0
    backend_ms = job.backend_wall_ms
    first_ms = stats.time_to_first_token_ms
    if first_ms is None:
        first_ms = job.first_token_ms
    generate_ms = stats.generate_total_ms if stats.generate_total_ms is not None else backend_ms
    output_tokens = stats.output_tokens if stats.output_tokens is not None else job.sent_chunks
    timings = Timings(
        backend_ms=_ms(backend_ms),
        engine_ms=_ms(engine_ms),
        engine_outside_backend_ms=_ms(max(0.0, engine_ms - backend_ms)),
        pool_ms=_ms((job.finished_at - admitted_at) * 1000.0),
        queue_wait_ms=_ms(ticket.queue_wait_ms),
        tokenize_ms=stats.tokenize_ms,
        time_to_first_token_ms=None if first_ms is None else _ms(first_ms),
        generate_ms=_ms(generate_ms),
        decode_after_first_token_ms=(
            None if first_ms is None else _ms(max(0.0, generate_ms - first_ms))
        ),
        tokens_per_second=(
            _ms(output_tokens / (generate_ms / 1000.0))
            if generate_ms > 0 and output_tokens
            else None
        ),
    )
    usage = Usage(
        prompt_tokens=stats.prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=stats.cached_tokens,
    )
    return timings, usage


class Admission:
    """A request that has a replica slot: read its events, then leave the ``admit`` block.

    ``events()`` yields every :class:`Delta`, then exactly one :class:`Finished` or
    :class:`Failed`; ``collect()`` returns the :class:`Finished` or raises the error.
    """

    def __init__(
        self,
        ticket: Ticket,
        request_id: str,
        model: str,
        admitted_at: float,
        on_finished: Callable[[Admission, JobFinished, Finished], None] | None = None,
    ) -> None:
        self.ticket = ticket
        self.id = request_id
        self.model = model
        self.admitted_at = admitted_at
        # How it ended, for the pool's own accounting (renderers use the events).
        self.finished: Finished | None = None
        self.failed: PoolError | None = None
        self.embedding: Embedded | None = None
        self._on_finished = on_finished

    @property
    def queue_wait_ms(self) -> float:
        return self.ticket.queue_wait_ms

    async def events(self) -> AsyncIterator[Event]:
        pieces: list[str] = []
        async for item in self.ticket.receive_channel:
            if type(item) is Delta:
                pieces.append(item.text)
                yield item
            elif isinstance(item, JobFinished):
                timings, usage = build_timings(self.ticket, item, self.admitted_at)
                finished = Finished("".join(pieces), item.stats.finish_reason, usage, timings)
                self.finished = finished
                if self._on_finished is not None:
                    self._on_finished(self, item, finished)
                yield finished
                return
            elif isinstance(item, JobFailed):
                self.failed = item.error
                yield Failed(item.error)
                return
        # The channel closed without a result: the replica was stopped under us.
        self.failed = self.ticket.error or PoolError(
            "shutting_down", "the model stopped before the response completed"
        )
        yield Failed(self.failed)

    async def embedded(self) -> Embedded:
        """The result of an embedding request, or its error raised."""
        async for item in self.ticket.receive_channel:
            if isinstance(item, JobEmbedded):
                assert self.ticket.dispatched_at is not None
                engine_ms = (item.finished_at - self.ticket.dispatched_at) * 1000.0
                timings = Timings(
                    backend_ms=_ms(item.backend_wall_ms),
                    engine_ms=_ms(engine_ms),
                    engine_outside_backend_ms=_ms(max(0.0, engine_ms - item.backend_wall_ms)),
                    pool_ms=_ms((item.finished_at - self.admitted_at) * 1000.0),
                    queue_wait_ms=_ms(self.ticket.queue_wait_ms),
                )
                done = Embedded(item.result.vectors, Usage(item.result.prompt_tokens, 0), timings)
                self.embedding = done
                return done
            if isinstance(item, JobFailed):
                self.failed = item.error
                raise item.error
        self.failed = self.ticket.error or PoolError(
            "shutting_down", "the model stopped before the embeddings were computed"
        )
        raise self.failed

    async def collect(self) -> Finished:
        """Run to the end; the :class:`Finished` event, or its error raised."""
        async for event in self.events():
            if isinstance(event, Finished):
                return event
            if isinstance(event, Failed):
                raise event.error
        raise AssertionError("events() always ends with Finished or Failed")
