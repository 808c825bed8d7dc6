"""An admitted request as its caller sees it: a stream of typed events.

The replica hands raw output to the ticket's channel; :class:`Admission` turns it into
:class:`Delta` events (passed through as they are, so a token costs no allocation
here), then one :class:`Finished` with usage and timings, or a :class:`Failed`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncGenerator, Callable

import trio

from pool.actors.models._ticket import (
    JobCompleted,
    JobEmbedded,
    JobFailed,
    JobFinished,
    Output,
    Ticket,
)
from pool.actors.values._events import (
    Completed,
    Delta,
    Embedded,
    Event,
    Failed,
    Finished,
    Paused,
    Timings,
    Usage,
    Waiting,
)
from pool.backends import TaskJob, ToolCallDelta, assemble_calls
from pool.errors import PoolError

# Resumes a paused stream (Serving's): given the paused ticket, the reply so far and the
# output tokens made so far, it yields a Waiting at least every heartbeat while the
# pause lasts, then the new ticket once it runs; a pause past its bound raises PoolError.
Resumer = Callable[[Ticket, str, int], AsyncGenerator[Waiting | Ticket, None]]


def new_request_id() -> str:
    return "resp_" + uuid.uuid4().hex


def _ms(value: float) -> float:
    return round(value, 3)


def build_timings(ticket: Ticket, job: JobFinished, admitted_at: float) -> tuple[Timings, Usage]:
    """The nested timers of one request, from what the replica and the ticket saw."""
    stats = job.stats
    assert ticket.dispatched_at is not None
    engine_ms = (job.finished_at - ticket.dispatched_at) * 1000.0
    backend_ms = job.backend_ms
    first_ms = stats.time_to_first_token_ms
    if first_ms is None:
        first_ms = job.time_to_first_token_ms
    generate_ms = stats.generate_ms if stats.generate_ms is not None else backend_ms
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
        backend_queue_ms=stats.backend_queue_ms,
    )
    usage = Usage(
        prompt_tokens=stats.prompt_tokens,
        output_tokens=output_tokens,
        cached_tokens=stats.cached_tokens,
    )
    return timings, usage


class Admission:
    """A request that has a replica slot: read its events, then leave the ``admit`` block.

    ``events()`` yields every :class:`Delta` (or, for a request relayed on the
    pass-through path, the upstream's own bytes), then exactly one :class:`Finished` or
    :class:`Failed`; ``collect()`` returns the :class:`Finished` or raises the error.

    An admission that still waits for VRAM or a load (``admit(report_waits=True)``)
    reports the wait first: :meth:`waits` yields :class:`Queued` and :class:`Loading`
    until the request runs. ``events()`` waits silently where they were not read, and
    a wait that ends in an error (a timeout) is its :class:`Failed` event.
    """

    def __init__(
        self,
        ticket: Ticket | None,
        request_id: str,
        model: str,
        admitted_at: float,
        on_finished: Callable[[Admission, JobFinished, Finished], None] | None = None,
        waits: AsyncGenerator[Waiting | Ticket, None] | None = None,
        resumer: Resumer | None = None,
    ) -> None:
        self._ticket = ticket
        # Pause and resume across a swap: who resumes a paused stream, and what the
        # tickets before the current one used (the first one's prompt, every output).
        self._resumer = resumer
        self._carried_prompt: int | None = None
        self._carried_cached: int | None = None
        self._carried_output = 0
        # Load seconds the paused tickets were charged (their loads are this request's).
        self.carried_load_s = 0.0
        self.pauses = 0
        self._steps = waits
        self._wait_error: PoolError | None = None
        self.id = request_id
        self.model = model
        self.admitted_at = admitted_at
        # How it ended, for the pool's own accounting (renderers use the events).
        self.finished: Finished | None = None
        self.failed: PoolError | None = None
        self.embedding: Embedded | None = None
        self.completed: Completed | None = None
        # The replica's report of a finished job (its timestamps are the trace's).
        self.job: JobFinished | JobEmbedded | JobCompleted | None = None
        self._on_finished = on_finished

    @property
    def ticket(self) -> Ticket:
        """The queued request (after :meth:`waits`, where a door held it back)."""
        assert self._ticket is not None, "the request is not queued yet: read waits() first"
        return self._ticket

    @property
    def queued_ticket(self) -> Ticket | None:
        return self._ticket

    @property
    def waiting(self) -> bool:
        """Whether :meth:`waits` has a wait to report (it was not read yet)."""
        return self._steps is not None

    @property
    def queue_wait_ms(self) -> float:
        return 0.0 if self._ticket is None else self._ticket.queue_wait_ms

    @property
    def used(self) -> Usage:
        """What the request is charged for, however it ended: its final usage, or what
        its job had used when it stopped (the prompt once prefilled, every token the
        runtime generated, delivered or not). Nothing for one that never ran."""
        done = self.finished or self.embedding or self.completed
        if done is not None:
            return done.usage
        ticket = self._ticket
        if ticket is None or ticket.dispatched_at is None:
            return Usage(0, 0)
        used = ticket.used
        if isinstance(ticket.request, TaskJob):
            # A task's streamed pieces are chunks of its answer, not tokens: a task cut
            # short is charged only what its runtime counted.
            return Usage(used.prompt_tokens or 0, used.output_tokens or 0)
        if self.pauses:
            return self._with_carried(
                Usage(used.prompt_tokens or 0, used.output, used.cached_tokens)
            )
        return Usage(used.prompt_tokens or 0, used.output, used.cached_tokens)

    def _with_carried(self, usage: Usage) -> Usage:
        """``usage`` of the current ticket with what the paused ones before it used: the
        prompt is the first one's (a resumed job's prompt holds the reply so far, which
        was charged as output already), the output is every one's."""
        if self._carried_prompt is None:
            return usage
        return Usage(
            self._carried_prompt,
            (usage.output_tokens or 0) + self._carried_output,
            self._carried_cached,
        )

    def _carry(self, ticket: Ticket) -> None:
        used = ticket.used
        if self._carried_prompt is None:
            self._carried_prompt = used.prompt_tokens or 0
            self._carried_cached = used.cached_tokens
        self._carried_output += used.output
        self.carried_load_s += ticket.load_seconds

    async def _resume(self, pieces: list[str]) -> AsyncGenerator[Paused, None]:
        """The current ticket was paused: wait (reporting :class:`Paused`) until its
        resumed job runs, and read on from that one; ``failed`` is set where it cannot
        (a pause past ``engine.preempt_max_pause_s``, an unload, a shutdown)."""
        assert self._resumer is not None
        old = self.ticket
        self.pauses += 1
        made = self._carried_output + old.used.output
        started = trio.current_time()
        try:
            async with contextlib.aclosing(self._resumer(old, "".join(pieces), made)) as steps:
                async for step in steps:
                    if isinstance(step, Ticket):
                        self._carry(old)
                        self._ticket = step
                    else:
                        yield Paused(round(trio.current_time() - started, 3))
        except PoolError as exc:
            self.failed = exc

    def _pausable_end(self) -> bool:
        """The ticket's channel ended without a result because the stream was paused
        (and this admission can resume it)."""
        return self._resumer is not None and self.ticket.paused and self.failed is None

    async def waits(self) -> AsyncGenerator[Waiting, None]:
        """The wait before the request runs, as it changes; nothing for a request that
        was admitted without waiting for VRAM or a load."""
        steps, self._steps = self._steps, None
        if steps is None:
            return
        try:
            async for step in steps:
                if isinstance(step, Ticket):
                    self._ticket = step
                else:
                    yield step
        except PoolError as exc:
            self._wait_error = exc
        finally:
            await steps.aclose()

    async def _waited(self) -> PoolError | None:
        """Wait out an unread wait; the error it ended with, if any."""
        if self._steps is not None:
            async for _ in self.waits():
                pass
        return self._wait_error

    async def events(self) -> AsyncGenerator[Event, None]:
        if (error := await self._waited()) is not None:
            self.failed = error
            yield Failed(error)
            return
        pieces: list[str] = []
        call_pieces: list[ToolCallDelta] = []
        # A pass-through reply's body (Finished.body); a stream's events are not kept.
        ask = getattr(self.ticket.request, "pass_through", None)
        raw: list[bytes] | None = [] if ask is not None and not ask.stream else None
        while True:
            async for item in self.ticket.outputs():
                if type(item) is Delta:
                    pieces.append(item.text)
                    yield item
                elif isinstance(item, ToolCallDelta):
                    call_pieces.append(item)
                    yield item
                elif isinstance(item, bytes):
                    if raw is not None:
                        raw.append(item)
                    yield item
                else:
                    yield self._ending(item, pieces, call_pieces, raw)
                    return
            if not self._pausable_end():
                break
            async with contextlib.aclosing(self._resume(pieces)) as pauses:
                async for pause in pauses:
                    yield pause
            if self.failed is not None:
                yield Failed(self.failed)
                return
        yield self._closed_early()

    async def batches(self) -> AsyncGenerator[list[Event], None]:
        """The same events as :meth:`events`, as lists of every one already waiting.

        A reader that keeps up gets one event per list; one that falls behind gets the
        backlog in one list, so it pays one wake-up (and can write one send) for all of
        it instead of one per token. No event waits for another.
        """
        if (error := await self._waited()) is not None:
            self.failed = error
            yield [Failed(error)]
            return
        pieces: list[str] = []
        call_pieces: list[ToolCallDelta] = []
        while True:
            receive = self.ticket.receive_channel
            ended = False
            async for item in self.ticket.outputs():
                batch: list[Event] = []
                while True:
                    if type(item) is Delta:
                        pieces.append(item.text)
                        batch.append(item)
                    elif isinstance(item, ToolCallDelta):
                        call_pieces.append(item)
                        batch.append(item)
                    elif isinstance(item, bytes):  # a stream's events: not kept
                        batch.append(item)
                    else:
                        batch.append(self._ending(item, pieces, call_pieces, None))
                        yield batch
                        return
                    try:
                        item = receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                    except trio.EndOfChannel:
                        if not self._pausable_end():
                            batch.append(self._closed_early())
                            yield batch
                            return
                        ended = True
                        break
                yield batch
                if ended:
                    break
            if not self._pausable_end():
                break
            async with contextlib.aclosing(self._resume(pieces)) as pauses:
                async for pause in pauses:
                    yield [pause]
            if self.failed is not None:
                yield [Failed(self.failed)]
                return
        yield [self._closed_early()]

    def _ending(
        self,
        item: Output,
        pieces: list[str],
        call_pieces: list[ToolCallDelta],
        raw: list[bytes] | None,
    ) -> Finished | Failed:
        if isinstance(item, JobFinished):
            self.job = item
            timings, usage = build_timings(self.ticket, item, self.admitted_at)
            if self.pauses:
                usage = self._with_carried(usage)
            calls = assemble_calls(call_pieces)
            reason = item.stats.finish_reason
            if calls and reason == "stop":
                reason = "tool_calls"
            passed = item.stats.relay_path == "pass_through"
            finished = Finished(
                "".join(pieces),
                reason,
                usage,
                timings,
                calls,
                item.stats.stop_sequence,
                item.stats.relay_path,
                b"".join(raw) if passed and raw is not None else None,
            )
            self.finished = finished
            if self._on_finished is not None:
                self._on_finished(self, item, finished)
            return finished
        if isinstance(item, JobFailed):
            self.failed = item.error
            return Failed(item.error)
        raise AssertionError(f"a generation does not end with {type(item).__name__}")

    def _closed_early(self) -> Failed:
        # The channel closed without a result: the replica was stopped under us.
        self.failed = self.ticket.error or PoolError(
            "shutting_down", "the model stopped before the response completed"
        )
        return Failed(self.failed)

    @property
    def succeeded(self) -> bool:
        """Whether the request ended with its answer (of whatever kind)."""
        return self.finished is not None or self.embedding is not None or self.completed is not None

    def _one_call_timings(self, item: JobEmbedded | JobCompleted) -> Timings:
        """The timers of a job that is one backend call (no first token to time)."""
        assert self.ticket.dispatched_at is not None
        engine_ms = (item.finished_at - self.ticket.dispatched_at) * 1000.0
        return Timings(
            backend_ms=_ms(item.backend_ms),
            engine_ms=_ms(engine_ms),
            engine_outside_backend_ms=_ms(max(0.0, engine_ms - item.backend_ms)),
            pool_ms=_ms((item.finished_at - self.admitted_at) * 1000.0),
            queue_wait_ms=_ms(self.ticket.queue_wait_ms),
        )

    async def task_events(self) -> AsyncGenerator[Delta | bytes | Completed | Failed, None]:
        """A task request's streamed pieces (text as :class:`Delta`, or bytes), then its
        :class:`Completed` or :class:`Failed`."""
        if (error := await self._waited()) is not None:
            self.failed = error
            yield Failed(error)
            return
        async for item in self.ticket.outputs():
            if type(item) is Delta or isinstance(item, bytes):
                yield item
            elif isinstance(item, JobCompleted):
                self.job = item
                task = item.result.usage
                done = Completed(
                    item.result.value,
                    Usage(task.prompt_tokens, task.output_tokens),
                    task,
                    self._one_call_timings(item),
                )
                self.completed = done
                yield done
                return
            elif isinstance(item, JobFailed):
                self.failed = item.error
                yield Failed(item.error)
                return
        yield self._closed_early()

    async def task_result(self) -> Completed:
        """A task request's :class:`Completed` (its streamed pieces, if any, dropped), or
        its error raised."""
        async with contextlib.aclosing(self.task_events()) as events:
            async for event in events:
                if isinstance(event, Completed):
                    return event
                if isinstance(event, Failed):
                    raise event.error
        raise AssertionError("task_events() always ends with Completed or Failed")

    async def embedded(self) -> Embedded:
        """The result of an embedding request, or its error raised."""
        if (error := await self._waited()) is not None:
            self.failed = error
            raise error
        async for item in self.ticket.outputs():
            if isinstance(item, JobEmbedded):
                self.job = item
                timings = self._one_call_timings(item)
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
        # Closed here, not left to the garbage collector: Trio finalizes an abandoned
        # async generator through its wake-up socket, a system call per request.
        async with contextlib.aclosing(self.events()) as events:
            async for event in events:
                if isinstance(event, Finished):
                    return event
                if isinstance(event, Failed):
                    raise event.error
        raise AssertionError("events() always ends with Finished or Failed")
