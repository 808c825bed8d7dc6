"""What a request goes through in the pool: limits, intake, the wait for its model,
the queue, a peer's relay, and the metrics of what finished (Pool.admit)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from pool.actors.accounting._budgets import Budgets, Spent, Unit
from pool.actors.accounting._rate_limit import RateLimiter
from pool.actors.accounting._usage import UsageRecorder
from pool.actors.accounting._usage_store import UsageRecord
from pool.actors.models._affinity import PendingKeys
from pool.actors.models._metrics import PoolMetrics
from pool.actors.models._ticket import JobFinished, Ticket
from pool.actors.residency._residency import Residency
from pool.actors.serving._admission import Admission, Resumer, new_request_id
from pool.actors.serving._caller import CALLER
from pool.actors.serving._health import check_runner_queue
from pool.actors.serving._intake import (
    build_embedding_job,
    build_generation_request,
    build_task_job,
    cache_scope,
    inline_images,
)
from pool.actors.serving._relay import RELAYED, Route, Router, run_relay
from pool.actors.serving._request import (
    EmbeddingRequest,
    InferenceRequest,
    PoolRequest,
    TaskRequest,
)
from pool.actors.serving._waits import RequestWaits
from pool.actors.values._events import Finished, Waiting
from pool.backends import (
    ALL_THINKING_MODES,
    Capabilities,
    EmbeddingJob,
    GenerationRequest,
    TaskJob,
)
from pool.config import LoraAdapter, Settings
from pool.errors import PoolError
from pool.media import MediaLoader

if TYPE_CHECKING:
    from pool.actors.models._model import ModelActor
    from pool.actors.serving._trace_protocol import RequestTrace, Tracing

# What a request for a model this node does not have configured may ask of a peer;
# the peer checks it against the model's own capabilities.
RELAY_CAPABILITIES = Capabilities(
    modalities=("text", "image"), multi_turn=True, thinking_modes=ALL_THINKING_MODES
)

_Request = TypeVar("_Request", bound=PoolRequest)

log = logging.getLogger("pool")

# How often a paused stream shows its client it is alive where the surface gave no
# heartbeat of its own (well inside the idle timeouts of proxies, as HEARTBEAT_S).
PAUSE_HEARTBEAT_S = 5.0


class Serving:
    """Admission of requests (see :meth:`admit`); the pool hands it its parts."""

    def __init__(
        self,
        settings: Settings,
        residency: Residency,
        *,
        router: Router | None,
        rate_limiter: RateLimiter,
        media: MediaLoader,
        metrics: PoolMetrics,
        shutting_down: Callable[[], bool],
        nursery: Callable[[], trio.Nursery | None],
        budgets: Budgets | None = None,
        usage: UsageRecorder | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        self.residency = residency
        self.router = router
        self.rate_limiter = rate_limiter
        self.media = media
        self.metrics = metrics
        # The spans of each request where the pool traces (pool/tracing), else None.
        self.tracing = tracing
        self._shutting_down = shutting_down
        self._nursery = nursery
        self._waits = RequestWaits(residency)
        self.budgets = budgets or Budgets(())
        # None: usage recording is off (service.usage.enabled).
        self.usage = usage
        residency.on_load_charged = self._charge_load
        residency.on_pause = self._count_preemption

    @asynccontextmanager
    async def admit(
        self,
        request: PoolRequest,
        *,
        tenant: str = "default",
        priority: str = "normal",
        request_id: str | None = None,
        load_hint: dict[str, Any] | None = None,
        report_waits: bool = False,
        heartbeat_s: float | None = None,
    ) -> AsyncIterator[Admission]:
        """Validate, queue and wait for a replica slot; yields the :class:`Admission`.

        With ``report_waits``, a request that must wait for VRAM or a load (an
        on-demand model that is not loaded, or one making way for another) is yielded
        at once instead: its :meth:`Admission.waits` reports the wait (``Queued``,
        ``Loading``) and its events follow; a timeout then arrives as a ``Failed``
        event. A request to a loaded model waits here as without it, unless
        ``heartbeat_s`` is given: then a request that cannot run at once (its model's
        replicas are busy) is yielded at once too, and its wait repeats the current
        ``Queued``/``Loading`` at least every ``heartbeat_s`` (a surface that must show
        a waiting client something, never a silent gap).

        Leaving the block (normally, by error or by cancellation) removes the request
        from the queue or stops its generation, so nothing runs for a departed caller.

        Images are inlined under the media policy (``image_refused`` otherwise) after
        the capability checks and before the request is queued. An
        :class:`EmbeddingRequest` takes the same path; read it with
        :meth:`Admission.embedded`. So does a :class:`TaskRequest`; read it with
        :meth:`Admission.task_events` or :meth:`Admission.task_result`.

        Raises:
            PoolError: for unknown models, capability or state violations, a refused
                image, a full queue (``queue_full``) or waiting past ``queue_timeout_s``.
        """
        admitted_at = time.perf_counter()
        # Tracing off: this None check is all it costs (pool/tracing).
        trace = None if self.tracing is None else self.tracing.request(request, tenant, admitted_at)
        try:
            self._check_open()
            request, key_limit = self._identify_caller(request)
            # Before routing: a spent budget is refused here, not relayed to a peer.
            self._check_budget(request.model, tenant, request.key_name, _spends(request))
            route, prefix_keys = await self._route(request, tenant)
            if route is not None:
                assert isinstance(request, InferenceRequest)  # only those are routed
                async with self._relayed(
                    request, route, tenant, priority, request_id, admitted_at, key_limit, trace
                ) as relayed:
                    yield relayed
                return
            async with self._served_here(
                request,
                tenant=tenant,
                priority=priority,
                request_id=request_id,
                load_hint=load_hint,
                report_waits=report_waits,
                heartbeat_s=heartbeat_s,
                admitted_at=admitted_at,
                key_limit=key_limit,
                prefix_keys=prefix_keys,
                trace=trace,
            ) as admission:
                yield admission
        except BaseException as exc:
            if trace is not None:
                trace.fail(exc)
            raise
        finally:
            if trace is not None:
                trace.end()

    def _check_open(self) -> None:
        if self._shutting_down():
            raise PoolError("shutting_down", "the pool is shutting down", retry_after_s=5.0)

    @staticmethod
    def _identify_caller(
        request: _Request,
    ) -> tuple[_Request, tuple[str, float] | None]:
        """The request named by the key that sent it, and that key's own rate limit."""
        caller = CALLER.get()
        if caller is None:
            return request, None
        request = dataclasses.replace(request, key_name=caller.key_name)
        if caller.rate_limit_rpm is None:
            return request, None
        return request, (caller.key_name, caller.rate_limit_rpm)

    async def _route(
        self, request: PoolRequest, tenant: str
    ) -> tuple[Route | None, PendingKeys | None]:
        """The peer that serves ``request`` (None: this node does), and its prefix keys
        where the cluster routes by prefix affinity."""
        if self.router is None or not isinstance(request, InferenceRequest) or RELAYED.get():
            return None, None
        prefix_keys: PendingKeys | None = None
        if self.settings.engine.prefix_affinity:
            prefix_keys = PendingKeys(request, cache_scope(request, tenant))
        route = await self.router.route(request.model, self._local(request.model), prefix_keys)
        return route, prefix_keys

    @asynccontextmanager
    async def _served_here(
        self,
        request: PoolRequest,
        *,
        tenant: str,
        priority: str,
        request_id: str | None,
        load_hint: dict[str, Any] | None,
        report_waits: bool,
        heartbeat_s: float | None,
        admitted_at: float,
        key_limit: tuple[str, float] | None,
        prefix_keys: PendingKeys | None,
        trace: RequestTrace | None,
    ) -> AsyncIterator[Admission]:
        """:meth:`admit` for a request that this node serves: intake, the queue and the
        wait, then the request's metrics and usage row however it ends."""
        actor, adapter = self.residency.serving(request.model)
        status = "cancelled"
        admission: Admission | None = None
        try:
            request_id = request_id or new_request_id()
            job = await self._intake(request, actor, request_id, tenant, key_limit, trace)
            if adapter is not None:
                job = self._with_adapter(job, actor, adapter)
            deadline = trio.current_time() + actor.queue_timeout_s
            if load_hint:
                # A loaded copy that does not serve the hint is unloaded first; the
                # request's own on-demand load then brings it back with the hint.
                await self.residency.reload_for_hint(actor, load_hint)
            preemptible = self._preemptible(job, priority, tenant)
            enqueue = self._enqueuer(
                actor,
                job,
                tenant=tenant,
                priority=priority,
                keep_alive=request.keep_alive,
                load_hint=load_hint,
                prefix_keys=prefix_keys,
                key_name=request.key_name,
                preemptible=preemptible,
            )
            ticket, steps = await self._queue(
                actor, enqueue, deadline, report_waits or heartbeat_s is not None, heartbeat_s
            )
            resumer = (
                self._resumer(
                    actor,
                    job,
                    tenant=tenant,
                    priority=priority,
                    keep_alive=request.keep_alive,
                    key_name=request.key_name,
                    heartbeat_s=heartbeat_s,
                    preemptible=preemptible,
                )
                if isinstance(job, GenerationRequest)
                else None
            )
            admission = Admission(
                ticket,
                request_id,
                request.model,
                admitted_at,
                self._record_finished,
                steps,
                resumer=resumer,
            )
            if trace is not None:
                trace.admission, trace.actor = admission, actor
            try:
                if ticket is not None and steps is None:
                    await self._waits.ready(actor, ticket, deadline)
                yield admission
                if admission.succeeded:
                    status = "success"
                elif admission.failed is not None:
                    status = admission.failed.code
            finally:
                self._leave_queue(actor, admission)
        except PoolError as exc:
            status = exc.code
            raise
        finally:
            self.metrics.requests.labels(actor.name, tenant, status).inc()
            self._account(actor.name, tenant, request.key_name, admission, status)

    def _local(self, model: str) -> ModelActor | None:
        """The model of this node that serves ``model`` (an adapter's base), if any."""
        try:
            return self.residency.serving(model)[0]
        except PoolError:
            return None

    @staticmethod
    def _with_adapter(
        job: GenerationRequest | EmbeddingJob | TaskJob, actor: ModelActor, adapter: LoraAdapter
    ) -> GenerationRequest:
        """A request for adapter ``adapter`` of ``actor``: a generation with it applied."""
        if not isinstance(job, GenerationRequest):
            raise PoolError(
                "wrong_model_kind",
                f"{adapter.name!r} is a LoRA adapter of {actor.name!r}: it serves generation only",
            )
        return dataclasses.replace(job, adapter=actor.adapter_used(adapter.name))

    async def _intake(
        self,
        request: PoolRequest,
        actor: ModelActor,
        request_id: str,
        tenant: str,
        key_limit: tuple[str, float] | None,
        trace: RequestTrace | None,
    ) -> GenerationRequest | EmbeddingJob | TaskJob:
        """The job the model runs, checked against its capabilities; then the rate limit
        is charged, and a generation's images are inlined (after the checks, so a
        refused request fetches nothing)."""
        if isinstance(request, EmbeddingRequest):
            embedding = build_embedding_job(
                request, request_id=request_id, capabilities=actor.capabilities
            )
            self.rate_limiter.admit(tenant, key_limit)
            return embedding
        if isinstance(request, TaskRequest):
            task = build_task_job(request, request_id=request_id, capabilities=actor.capabilities)
            self.rate_limiter.admit(tenant, key_limit)
            return task
        job = build_generation_request(
            request,
            request_id=request_id,
            capabilities=actor.capabilities,
            decoding_defaults=self.settings.engine.decoding,
            tenant=tenant,
            trace_parent=None if trace is None else trace.traceparent,
        )
        self.rate_limiter.admit(tenant, key_limit)
        return await inline_images(job, self.media)

    def _enqueuer(
        self,
        actor: ModelActor,
        job: GenerationRequest | EmbeddingJob | TaskJob,
        *,
        tenant: str,
        priority: str,
        keep_alive: float | str | None,
        load_hint: dict[str, Any] | None,
        prefix_keys: PendingKeys | None,
        key_name: str | None = None,
        preemptible: bool = False,
    ) -> Callable[[], Ticket]:
        """What queues the job at its model, checking the runner-wide queue limit first
        (called when the request may queue: at once, or once a door opens)."""
        admit = partial(
            actor.admit,
            job,
            tenant=tenant,
            priority=priority,
            buffer=self.settings.engine.stream_buffer_tokens,
            keep_alive=keep_alive,
            load_hint=load_hint,
            # Hashed once: what the router hashed, the scheduler uses.
            prefix_keys=prefix_keys.value if prefix_keys is not None else None,
        )

        def enqueue() -> Ticket:
            check_runner_queue(
                self.residency.models.values(), self.settings.engine.max_queue_total, actor
            )
            ticket = admit()
            ticket.key_name = key_name
            ticket.preemptible = preemptible
            return ticket

        return enqueue

    def _preemptible(self, job: object, priority: str, tenant: str) -> bool:
        """Whether a swap may pause ``job`` (docs/vram.md, "Pause and resume"): a
        generation (only those resume through their prompt) of priority ``low``, or one
        whose key (the caller's) or tenant (``service.tenancy``) says so, whatever its
        priority."""
        if not isinstance(job, GenerationRequest):
            return False
        if priority == "low":
            return True
        caller = CALLER.get()
        if caller is not None and caller.preemptible:
            return True
        tenancy = self.settings.service.tenancy
        return tenancy.tenants.get(tenant, tenancy.default).preemptible

    async def _queue(
        self,
        actor: ModelActor,
        enqueue: Callable[[], Ticket],
        deadline: float,
        report_waits: bool,
        heartbeat_s: float | None,
    ) -> tuple[Ticket | None, AsyncGenerator[Waiting | Ticket, None] | None]:
        """Queue the request, or wait at its model's door first; with the waits to
        report to the caller where it gets its admission before it runs."""
        ticket: Ticket | None = None
        steps: AsyncGenerator[Waiting | Ticket, None] | None = None
        door_closed = self.residency.door_closed(actor)
        if report_waits and (door_closed or (actor.loads_on_request and actor.state != "loaded")):
            # It waits for VRAM or a load: the caller gets the admission now and
            # reads the wait from it. Queued here unless a door holds it, so a full
            # queue is still refused before anything is sent.
            if not door_closed:
                ticket = enqueue()
            steps = self._waits.steps(actor, ticket, enqueue, deadline, heartbeat_s)
        else:
            await self._waits.at_door(actor, deadline)
            ticket = enqueue()
            if heartbeat_s is not None and not ticket.ready.is_set():
                steps = self._waits.steps(actor, ticket, enqueue, deadline, heartbeat_s)
        return ticket, steps

    @staticmethod
    def _leave_queue(actor: ModelActor, admission: Admission) -> None:
        """A request that leaves before its turn leaves the queue, so nothing runs for a
        departed caller."""
        queued = admission.queued_ticket
        if queued is not None:
            if not queued.ready.is_set():
                actor.withdraw(queued)
            queued.abandon()

    @asynccontextmanager
    async def _relayed(
        self,
        request: InferenceRequest,
        route: Route,
        tenant: str,
        priority: str,
        request_id: str | None,
        admitted_at: float,
        key_limit: tuple[str, float] | None,
        trace: RequestTrace | None,
    ) -> AsyncIterator[Admission]:
        """:meth:`admit` for a request that a peer serves (docs/cluster.md)."""
        local = self._local(request.model)
        request_id = request_id or new_request_id()
        job = build_generation_request(
            request,
            request_id=request_id,
            capabilities=local.capabilities if local is not None else RELAY_CAPABILITIES,
            decoding_defaults=self.settings.engine.decoding,
            # The peer serves it in the tenant's own cache scope (the relay sends it).
            tenant=tenant,
            trace_parent=None if trace is None else trace.traceparent,
        )
        self.rate_limiter.admit(tenant, key_limit)
        job = await inline_images(job, self.media)
        ticket = Ticket(
            job,
            tenant=tenant,
            priority=priority,  # type: ignore[arg-type]
            buffer=self.settings.engine.stream_buffer_tokens,
        )
        nursery = self._nursery()
        if nursery is None:
            raise PoolError("shutting_down", "the pool is not running")
        idle_s = self.settings.engine.generation_idle_timeout_s
        nursery.start_soon(run_relay, route, ticket, request.model, idle_s)
        try:
            await ticket.started.wait()
            admission = Admission(
                ticket, request_id, request.model, admitted_at, self._record_finished
            )
            if trace is not None:
                trace.admission, trace.relayed_to = admission, route.node
            yield admission
        finally:
            ticket.abandon()

    def _check_budget(
        self, model: str, tenant: str, key: str | None, units: frozenset[Unit]
    ) -> None:
        try:
            self.budgets.check(tenant, key, units)
        except PoolError as exc:
            budget = exc.details.get("budget", {})
            self.metrics.budget_refusals.labels("key" if "key" in budget else "tenant").inc()
            # Refused, like a rate-limited request: a row with its status, no tokens.
            self._account(model, tenant, key, None, exc.code)
            raise

    def _account(
        self,
        model: str,
        tenant: str,
        key: str | None,
        admission: Admission | None,
        status: str,
    ) -> None:
        """The one place where every request that reached a model is accounted for when
        it ends, on every route: its usage record, per-tenant tokens, budgets.

        However it ended (finished, cut by its client, a deadline, an unload, a failure
        mid-stream), it is charged what it used (:attr:`Admission.used`), and its row
        keeps the status it ended with. Relayed requests are left to the peer that ran
        them (it records and charges them), so a request is never counted twice in a
        cluster.
        """
        prompt = cached = output = 0
        audio_seconds = 0.0
        queue_wait_ms = load_seconds = 0.0
        generate_ms: float | None = None
        if admission is not None:
            queue_wait_ms = admission.queue_wait_ms
            ticket = admission.queued_ticket
            if ticket is not None:
                ticket.accounted = True
                load_seconds = ticket.load_seconds + admission.carried_load_s
            used = admission.used
            prompt = used.prompt_tokens or 0
            cached = used.cached_tokens or 0
            output = used.output_tokens or 0
            done = admission.finished or admission.embedding or admission.completed
            if admission.completed is not None:
                # A transcription is charged the audio it was given once it finished.
                audio_seconds = admission.completed.task_usage.audio_seconds
                if audio_seconds > 0:
                    self.metrics.audio_seconds.labels(model).inc(audio_seconds)
            if done is not None:
                timings = done.timings
                generate_ms = (
                    timings.generate_ms if timings.generate_ms is not None else timings.backend_ms
                )
            elif prompt or output:
                # A finished request counted these as it finished (_record_finished).
                self._count_tokens(model, tenant, prompt, output)
        # Text said by a speech model: what its finished job counted (a cut stream
        # counts nothing, as a task cut short is charged only what its runtime counted).
        characters = 0
        if admission is not None and admission.completed is not None:
            characters = admission.completed.task_usage.characters
        if characters:
            self.metrics.characters.labels(model).inc(characters)
        if prompt or output:
            self.metrics.record_tenant_tokens(tenant, prompt, output)
        # Every request that reached a model counts against request budgets, whatever
        # it used (an image costs no tokens); audio is counted in whole seconds.
        self.budgets.charge(
            tenant,
            key,
            Spent(
                tokens=prompt + output,
                requests=1,
                audio_seconds=math.ceil(audio_seconds),
                characters=characters,
            ),
        )
        if self.usage is not None:
            self.usage.record(
                UsageRecord(
                    at=self.usage.clock(),
                    key=key,
                    tenant=tenant,
                    model=model,
                    prompt_tokens=prompt,
                    cached_tokens=cached,
                    output_tokens=output,
                    queue_wait_ms=round(queue_wait_ms, 3),
                    generate_ms=None if generate_ms is None else round(generate_ms, 3),
                    status=status,
                    audio_seconds=audio_seconds,
                    characters=characters,
                    load_seconds=round(load_seconds, 3),
                )
            )

    def _count_preemption(self, actor: ModelActor, streams: int, cut: bool) -> None:
        if streams:
            self.metrics.preemptions.labels(actor.name, "cut" if cut else "pause").inc(streams)

    def _resumer(
        self,
        actor: ModelActor,
        job: GenerationRequest,
        *,
        tenant: str,
        priority: str,
        keep_alive: float | str | None,
        key_name: str | None,
        heartbeat_s: float | None,
        preemptible: bool,
    ) -> Resumer:
        """How a paused stream of ``job`` resumes (docs/vram.md, "Pause and resume").

        The same request, with the reply so far as ``continue_text`` and the tokens left
        as its ``max_tokens``, queues at its model again as a new request would: it waits
        at the model's door while the swap it made way for happens, then its arrival
        loads the model back (an evicted model comes back for a request), and it runs
        once a replica takes it. The wait reports itself at least every heartbeat (the
        stream's, else ``PAUSE_HEARTBEAT_S``) and is bounded by
        ``engine.preempt_max_pause_s``: past it, ``preempted``.
        """
        engine = self.settings.engine
        beat = heartbeat_s or PAUSE_HEARTBEAT_S

        async def resume(
            paused: Ticket, text: str, made: int
        ) -> AsyncGenerator[Waiting | Ticket, None]:
            paused_at = trio.current_time()
            again = dataclasses.replace(
                job,
                continue_text=text,
                decoding=dataclasses.replace(
                    job.decoding, max_tokens=max(1, job.decoding.max_tokens - made)
                ),
            )
            enqueue = self._enqueuer(
                actor,
                again,
                tenant=tenant,
                priority=priority,
                keep_alive=keep_alive,
                load_hint=None,
                prefix_keys=None,
                key_name=key_name,
                # Still preemptible: it may be paused again (two swaps in a row).
                preemptible=preemptible,
            )
            deadline = paused_at + engine.preempt_max_pause_s
            outcome = "left"
            try:
                ticket, steps = await self._queue(actor, enqueue, deadline, True, beat)
                if ticket is not None:
                    yield ticket
                if steps is not None:
                    async with contextlib.aclosing(steps) as waits:
                        async for step in waits:
                            yield step
                else:
                    assert ticket is not None
                    await self._waits.ready(actor, ticket, deadline)
                outcome = "resumed"
            except PoolError as exc:
                if exc.code != "queue_timeout":
                    raise
                outcome = "expired"
                raise PoolError(
                    "preempted",
                    f"the stream was paused for a swap of model {actor.name!r} and its"
                    f" model was not back within {engine.preempt_max_pause_s:g}s"
                    " (engine.preempt_max_pause_s); it is charged only what it generated",
                    details={"paused_s": round(trio.current_time() - paused_at, 3)},
                ) from exc
            finally:
                paused_s = trio.current_time() - paused_at
                self.metrics.pause_duration.labels(actor.name, outcome).observe(paused_s)
                if outcome == "resumed":
                    self.residency.decisions.record(
                        "resume",
                        actor.name,
                        f"a paused stream runs again after {paused_s:.2f}s, continuing"
                        f" after {made} generated token(s)",
                        request=job.request_id,
                        paused_s=round(paused_s, 3),
                    )

        return resume

    def _charge_load(self, actor: ModelActor, ticket: Ticket, seconds: float) -> None:
        """A load that ``ticket``'s request started took ``seconds``: charged to its
        tenant and key (budgets, fair scheduling), and kept on its usage row; where that
        row was written already (its client left during the load), in a row of its own
        with status ``load`` and no tokens."""
        log.info(
            "request_id=%s model=%s caused a load of %.2fs tenant=%s key=%s",
            getattr(ticket.request, "request_id", None),
            actor.name,
            seconds,
            ticket.tenant,
            ticket.key_name,
        )
        self.budgets.charge(ticket.tenant, ticket.key_name, Spent(load_ms=round(seconds * 1000)))
        actor.scheduler.charge_load(ticket.tenant, seconds)
        self.metrics.record_tenant_load(ticket.tenant, seconds)
        if not ticket.accounted:
            ticket.load_seconds += seconds
        elif self.usage is not None:
            self.usage.record(
                UsageRecord(
                    at=self.usage.clock(),
                    key=ticket.key_name,
                    tenant=ticket.tenant,
                    model=actor.name,
                    prompt_tokens=0,
                    cached_tokens=0,
                    output_tokens=0,
                    queue_wait_ms=0.0,
                    generate_ms=None,
                    status="load",
                    load_seconds=round(seconds, 3),
                )
            )

    def _record_finished(self, admission: Admission, job: JobFinished, done: Finished) -> None:
        model = admission.model
        self.metrics.queue_wait.labels(model).observe(admission.queue_wait_ms / 1000.0)
        self.metrics.inference.labels(model).observe(job.backend_ms / 1000.0)
        first_ms = done.timings.time_to_first_token_ms
        if first_ms is not None:
            self.metrics.first_token.labels(model).observe(first_ms / 1000.0)
        self.metrics.record_cache(model, done.usage.cached_tokens)
        self._count_tokens(
            model,
            admission.ticket.tenant,
            done.usage.prompt_tokens or 0,
            done.usage.output_tokens or 0,
        )

    def _count_tokens(self, model: str, tenant: str, prompt: int, output: int) -> None:
        """The model's token counters and the tenant's token rate limit."""
        self.metrics.tokens.labels(model).inc(output)
        self.metrics.prompt_tokens.labels(model).inc(prompt)
        self.rate_limiter.charge_tokens(tenant, output + prompt)


# Every request spends a request and may cause a load; speech spends characters, not
# tokens; audio budgets bind only the requests that bring audio.
_ANY_REQUEST: frozenset[Unit] = frozenset({"tokens", "requests", "load_ms"})
_TRANSCRIPTION: frozenset[Unit] = _ANY_REQUEST | {"audio_seconds"}
_SPEECH: frozenset[Unit] = frozenset({"requests", "load_ms", "characters"})


def _spends(request: PoolRequest) -> frozenset[Unit]:
    """The budget units that bind ``request`` at admission."""
    if isinstance(request, TaskRequest):
        if "transcription" in request.job.served_by:
            return _TRANSCRIPTION
        if "speech" in request.job.served_by:
            return _SPEECH
    return _ANY_REQUEST
