"""A replica actor: owns one backend runtime and runs the jobs dispatched to it."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from pool.actors.models._ticket import (
    JobCompleted,
    JobEmbedded,
    JobFailed,
    JobFinished,
    Output,
    Ticket,
)
from pool.actors.values._events import Delta
from pool.backends import EmbeddingJob, TaskJob, ToolCallDelta, out_of_memory
from pool.errors import BackendError, PoolError

if TYPE_CHECKING:
    from pool.backends import Backend, EmbeddingRuntime, LoadContext, Runtime
    from pool.config import ModelDefinition

log = logging.getLogger("pool.replica")

_RESULT_HANDOVER_S = 5.0


class _TicketSink:
    """Delivers text to the requester; a departed requester cancels the job.

    Every streamed token crosses ``send``, so it costs no scheduler round while the
    channel has room: the text goes in with ``send_nowait`` and the requester's task
    (woken by the first piece) later takes every piece that piled up in one go. Only a
    full channel (a slow reader: backpressure) makes it wait. Cancellation is still
    checked on every call.

    It also keeps the idle watchdog's deadline: each piece of text pushes it on by the
    idle timeout (lazily: moving a deadline costs more than a token, so it moves only
    once it is a twentieth of the timeout stale), and while a send waits for a slow
    reader the watchdog is off, so only the backend's own silence counts.
    """

    __slots__ = ("_idle", "_idle_s", "_slack_s", "_ticket", "first_at", "used")

    def __init__(self, ticket: Ticket, idle: trio.CancelScope, idle_s: float) -> None:
        self._ticket = ticket
        self._idle = idle
        self._idle_s = idle_s
        self._slack_s = idle_s / 20
        # The ticket's: what the request is charged for, however it ends.
        self.used = ticket.used
        self.first_at: float | None = None

    # An upstream's bytes may stand for the text (pool/backends/_pass_through.py); the
    # reply recorder of prefix affinity reads their text once, at the end.
    takes_raw = True

    async def send(self, text: str | bytes | ToolCallDelta) -> None:
        if not text:
            return
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.used.pieces += 1
        if self._ticket.reply is not None:
            if isinstance(text, str):
                self._ticket.reply.add(text)
            elif isinstance(text, bytes):
                self._ticket.reply.add_raw(text)
        await trio.lowlevel.checkpoint_if_cancelled()
        channel = self._ticket.send_channel
        # A tool-call piece (or a task's bytes) is its own event; text goes out as a Delta.
        item = Delta(text) if isinstance(text, str) else text
        try:
            channel.send_nowait(item)
        except trio.WouldBlock:
            self._idle.deadline = math.inf
            try:
                await channel.send(item)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self._requester_left()
            self._idle.deadline = trio.current_time() + self._idle_s
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            await self._requester_left()
        deadline = trio.current_time() + self._idle_s
        if deadline - self._idle.deadline > self._slack_s:
            self._idle.deadline = deadline

    async def _requester_left(self) -> None:
        # Nobody reads any more: stop generating. The checkpoint raises Cancelled.
        self._ticket.scope.cancel()
        await trio.lowlevel.checkpoint()


async def _deliver(ticket: Ticket, outcome: Output) -> None:
    """Hand a job's result to its requester: at once while the channel has room (no
    scheduler pass, as :class:`_TicketSink` sends text); else waiting, shielded (a
    stopping replica must still hand it over) but bounded (a client that stopped reading
    cannot hold it up)."""
    if ticket.hand_over(outcome):
        return
    with (
        trio.move_on_after(_RESULT_HANDOVER_S, shield=True),
        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
    ):
        await ticket.send_channel.send(outcome)


class Replica:
    """One loaded instance of a model.

    ``run`` loads the runtime before it reports started (so ``nursery.start`` raises a
    load failure to the caller), serves jobs until :meth:`stop`, then releases the
    runtime under a shielded, bounded ``finally``.
    """

    def __init__(
        self,
        *,
        backend: Backend,
        definition: ModelDefinition,
        context: LoadContext,
        capacity: int,
        unload_timeout_s: float,
        idle_timeout_s: float = math.inf,
        on_job_done: Callable[[], None],
        on_failure: Callable[[Replica, str], None] | None = None,
        on_hang: Callable[[Replica, str], None] | None = None,
        on_out_of_memory: Callable[[Replica, str], None] | None = None,
    ) -> None:
        self.backend = backend
        self.definition = definition
        self.context = context
        self.capacity = capacity
        self.inflight = 0
        self.runtime: Runtime | None = None
        self._unload_timeout_s = unload_timeout_s
        self._idle_timeout_s = idle_timeout_s
        self._on_job_done = on_job_done
        self._on_failure = on_failure
        # A generation that produced no token within the idle timeout: the model's
        # watchdog recycles the replica (docs/faults.md).
        self._on_hang = on_hang
        # A job that failed for want of GPU memory fails alone (the next may fit), but
        # the model hears of it: /health reports it (docs/api.md, "Health").
        self._on_out_of_memory = on_out_of_memory
        self._running: set[Ticket] = set()
        # The output canary running here, if any: it holds no slot, and a request
        # dispatched here cancels it (a canary never delays a user's request).
        self._probe: Ticket | None = None
        self._jobs: trio.Nursery | None = None
        self._stop = trio.Event()
        self.stopped = trio.Event()

    @property
    def index(self) -> int:
        return self.context.replica_index

    async def run(
        self, *, task_status: trio.TaskStatus[Replica] = trio.TASK_STATUS_IGNORED
    ) -> None:
        try:
            runtime = self.runtime = await self.backend.load(self.definition, self.context)
            try:
                async with trio.open_nursery() as jobs:
                    self._jobs = jobs
                    watch = getattr(runtime, "wait_failed", None)
                    if watch is not None:
                        jobs.start_soon(self._watch_runtime, watch)
                    task_status.started(self)
                    await self._stop.wait()
                    # The model actor drains before stopping; anything left is cut here.
                    jobs.cancel_scope.cancel()
            except Exception as exc:
                # Supervision boundary: a replica never takes its model actor down with
                # it; it reports the failure and the model goes `failed`.
                log.exception("replica %s/%d crashed", self.context.model_name, self.index)
                self._report_failure(f"{type(exc).__name__}: {exc}")
            finally:
                self._jobs = None
                await self._close_runtime(runtime)
        finally:
            self.stopped.set()

    async def _close_runtime(self, runtime: Runtime) -> None:
        with trio.move_on_after(self._unload_timeout_s, shield=True) as cleanup:
            try:
                await runtime.close()
            except Exception:
                log.exception(
                    "replica %s/%d: closing the runtime failed", self.context.model_name, self.index
                )
        if cleanup.cancelled_caught:
            log.warning(
                "replica %s/%d: runtime did not close within %.1fs",
                self.context.model_name,
                self.index,
                self._unload_timeout_s,
            )
        self.runtime = None

    async def _watch_runtime(self, wait_failed: Callable[[], Awaitable[str]]) -> None:
        reason = await wait_failed()
        self._report_failure(reason)

    def _report_failure(self, reason: str) -> None:
        if self._stop.is_set():
            return  # an exit we asked for is not a failure
        error = PoolError(
            "backend_error", f"the runtime of model {self.context.model_name!r} failed: {reason}"
        )
        for ticket in self._running:
            ticket.error = error
        self._close_doors()
        if self._on_failure is not None:
            self._on_failure(self, reason)

    def _close_doors(self) -> None:
        # A stuck or dead runtime takes no further job: the slot a failed request frees
        # must not go to the next queued request before the model actor has heard of
        # the fault (the scheduler fills only replicas with room below their capacity).
        self.capacity = 0

    def _note_if_out_of_memory(self, exc: Exception) -> None:
        if self._on_out_of_memory is not None and out_of_memory(exc):
            self._on_out_of_memory(self, str(exc) or type(exc).__name__)

    def stop(self) -> None:
        self._stop.set()

    @property
    def running_tickets(self) -> frozenset[Ticket]:
        return frozenset(self._running)

    def start_job(self, ticket: Ticket) -> None:
        if self._jobs is None:
            ticket.reject(PoolError("model_unloading", "the replica is stopping"))
            return
        if self._probe is not None:
            self._probe.scope.cancel()
        self.inflight += 1
        self._running.add(ticket)
        ticket.replica = self.index
        log.debug(
            "request_id=%s model=%s replica=%d started inflight=%d",
            ticket.request.request_id,
            self.context.model_name,
            self.index,
            self.inflight,
        )
        self._jobs.start_soon(self._run_job, ticket)

    @property
    def probing(self) -> bool:
        """Whether an output canary runs here now."""
        return self._probe is not None

    def start_probe(self, ticket: Ticket) -> None:
        """Run an output canary (pool/actors/models/_probe.py) in the replica's job
        nursery, so stopping the replica cancels it before the runtime closes.

        It takes no slot: the scheduler does not see it, nothing counts it as a request,
        and the first job dispatched here cancels it (a runtime that decodes one sequence
        at a time serializes the two on its own lock, so the request waits at most for
        the canary's next token)."""
        if self._jobs is None or self._probe is not None:
            ticket.reject(PoolError("model_unloading", "the replica is stopping or busy"))
            return
        self._probe = ticket
        self._jobs.start_soon(self._run_probe, ticket)

    async def _run_probe(self, ticket: Ticket) -> None:
        try:
            with ticket.send_channel:
                outcome = await self._generate(ticket)
                if outcome is not None:
                    await _deliver(ticket, outcome)
        finally:
            self._probe = None

    async def _run_job(self, ticket: Ticket) -> None:
        released = False
        # Runs on to the backend's first checkpoint (the request sent upstream, the
        # worker thread started) before the requester wakes to send headers.
        ticket.started.set()
        try:
            with ticket.send_channel:
                outcome = await self._generate(ticket)
                self._running.discard(ticket)
                # The generation is over: free the slot before delivering the result,
                # so a client that sends its next request at once finds it free.
                released = True
                self._release()
                if outcome is not None:
                    await _deliver(ticket, outcome)
        finally:
            self._running.discard(ticket)
            if not released:
                self._release()

    def _release(self) -> None:
        self.inflight -= 1
        self._on_job_done()

    async def _generate(
        self, ticket: Ticket
    ) -> JobFinished | JobEmbedded | JobCompleted | JobFailed | None:
        """Run the backend; None when the request was cancelled."""
        assert self.runtime is not None
        idle = trio.CancelScope(deadline=trio.current_time() + self._idle_timeout_s)
        sink = _TicketSink(ticket, idle, self._idle_timeout_s)
        request = ticket.request
        with ticket.scope:
            started = ticket.started_at = time.perf_counter()
            try:
                if isinstance(request, TaskJob):
                    # A task job runs without the idle watchdog, as an embedding does:
                    # one call that may think long before its one answer.
                    done = await request.run(self.runtime, sink)
                    ended = time.perf_counter()
                    return JobCompleted(done, (ended - started) * 1000.0, ended)
                if isinstance(request, EmbeddingJob):
                    runtime: EmbeddingRuntime = self.runtime  # type: ignore[assignment]
                    result = await runtime.embed(request)
                    if len(result.vectors) != len(request.texts):
                        raise BackendError(
                            f"the runtime returned {len(result.vectors)} vectors"
                            f" for {len(request.texts)} texts"
                        )
                    ended = time.perf_counter()
                    return JobEmbedded(result, (ended - started) * 1000.0, ended)
                with idle:
                    stats = await self.runtime.generate(request, sink)
                if idle.cancelled_caught:
                    # A hung backend must not hold its slot for ever: fail the request,
                    # free the slot, and report the hang (the watchdog recycles the
                    # replica: a runtime that went silent once rarely recovers alone).
                    log.warning(
                        "replica %s/%d: no token for %.1fs, request failed",
                        self.context.model_name,
                        self.index,
                        self._idle_timeout_s,
                    )
                    if self._on_hang is not None and not self._stop.is_set():
                        self._close_doors()
                        self._on_hang(
                            self,
                            f"no token for {self._idle_timeout_s:g} s"
                            f" (request {request.request_id})",
                        )
                    return JobFailed(
                        PoolError(
                            "backend_timeout",
                            f"model {self.context.model_name!r} produced no token for"
                            f" {self._idle_timeout_s:g} s (engine.generation_idle_timeout_s)",
                        )
                    )
            except BackendError as exc:
                self._note_if_out_of_memory(exc)
                return JobFailed(PoolError("backend_error", str(exc)))
            except PoolError as exc:
                return JobFailed(exc)
            except trio.Cancelled:
                raise
            except Exception as exc:
                # A backend bug fails this request only, not the replica's other jobs.
                # The client gets a clean error: the exception (a TypeError, say) and its
                # traceback are the operator's, in the log under the request id.
                log.exception(
                    "request_id=%s model=%s replica %d: job failed",
                    request.request_id,
                    self.context.model_name,
                    self.index,
                )
                self._note_if_out_of_memory(exc)
                return JobFailed(
                    PoolError(
                        "internal_error",
                        f"model {self.context.model_name!r}: the backend failed unexpectedly;"
                        f" the server log has the details (request {request.request_id})",
                    )
                )
            ended = time.perf_counter()
            first_ms = None if sink.first_at is None else (sink.first_at - started) * 1000.0
            if ticket.reply is not None:
                ticket.reply.finish()
            log.debug(
                "request_id=%s model=%s replica=%d finished ms=%.1f first_token_ms=%s chunks=%d",
                request.request_id,
                self.context.model_name,
                self.index,
                (ended - started) * 1000.0,
                "-" if first_ms is None else f"{first_ms:.1f}",
                sink.used.pieces,
            )
            return JobFinished(stats, (ended - started) * 1000.0, first_ms, sink.used.pieces, ended)
        return None
