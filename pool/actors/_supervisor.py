"""The pool supervisor: the root of the actor tree and the embedded API.

``open_pool`` holds the root nursery; every model actor lives in it for the life of
the pool. Requests are served in the caller's task (an HTTP handler or an embedded
caller): admission and queueing happen there, generation happens in the replica that
the scheduler picked, and the two meet through the request's :class:`Ticket`.

The pool speaks typed values only: an :class:`InferenceRequest` in, :class:`Delta`,
:class:`Finished` and :class:`Failed` events out, snapshots for state. Every wire
format is rendered from these in ``pool/http``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import trio

from pool.actors._admission import Admission, new_request_id
from pool.actors._events import (
    Embedded,
    Event,
    Finished,
    Loading,
    Queued,
    Waiting,
    WaitReason,
)
from pool.actors._footprints import FootprintStore, default_path
from pool.actors._gpu import GpuSource, NoGpus, VirtualGpus
from pool.actors._intake import build_embedding_job, build_generation_request, inline_images
from pool.actors._ledger import LedgerBinding, SharedLedger
from pool.actors._metrics import PoolMetrics
from pool.actors._model import ModelActor
from pool.actors._rate_limit import RateLimiter
from pool.actors._relay import RELAYED, Route, Router, run_relay
from pool.actors._request import EmbeddingRequest, InferenceRequest
from pool.actors._snapshots import (
    FlushResult,
    GpuReading,
    ModelSnapshot,
    PoolHealth,
    QueueStats,
)
from pool.actors._stats import percentile
from pool.actors._tasks import LoadTask, LoadTasks
from pool.actors._ticket import JobFinished, Ticket
from pool.actors._vram import (
    CudaContexts,
    LoadMeter,
    charges,
    eviction_candidates,
    gpu_ceilings,
    gpu_room,
    place,
)
from pool.backends import (
    ALL_THINKING_MODES,
    CacheUsage,
    Capabilities,
    EmbeddingJob,
    GenerationRequest,
    GpuPlacement,
)
from pool.config import (
    LoadRequest,
    ModelDefinition,
    Settings,
    apply_override,
    validate_load_request,
)
from pool.errors import PoolError
from pool.media import MediaLoader
from pool.pulls import PullManager

log = logging.getLogger("pool")


def _held(gpu: GpuReading) -> int:
    return gpu.used_mib if gpu.pool_used_mib is None else gpu.pool_used_mib


T = TypeVar("T")

# What a request for a model this node does not have configured may ask of a peer;
# the peer checks it against the model's own capabilities.
RELAY_CAPABILITIES = Capabilities(
    modalities=("text", "image"), multi_turn=True, thinking_modes=ALL_THINKING_MODES
)

# A load waiting for room re-reads the GPUs at least this often (besides every change).
RECHECK_S = 5.0
# After an eviction: how long to wait for the GPU source to show the memory back, and
# how often to look (CUDA hands memory back some time after the process lets go).
RECLAIM_WAIT_S = 10.0
RECLAIM_POLL_S = 0.25
# A request that reports its wait looks at its place in the queue at least this often
# (it moves as others are dispatched, which wakes nobody).
WAIT_TICK_S = 1.0


class _OnDemandLoads:
    """The pool's side of :class:`OnDemandLoader` for its model actors."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def request(self, actor: ModelActor, hint: dict[str, Any] | None) -> None:
        self._pool._request_on_demand_load(actor, hint)

    def pending(self, actor: ModelActor) -> bool:
        return actor in self._pool._on_demand


def _hinted(actor: ModelActor, hint: dict[str, Any] | None) -> LoadRequest | None:
    """``hint`` as the load request of ``actor``; None (logged) if it does not suit it."""
    if not hint:
        return None
    try:
        body = LoadRequest.model_validate(hint)
        validate_load_request(body, actor.definition)
    except (ValueError, PoolError) as exc:
        log.info("model=%s ignoring load hint %s: %s", actor.name, hint, exc)
        return None
    return body


class Pool:
    """The embedded API: lifecycle commands, snapshots and inference.

    Create it with :func:`open_pool`; every method is safe to call from any task.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        gpus: GpuSource | None = None,
        media: MediaLoader | None = None,
        ledger: SharedLedger | None = None,
        router: Router | None = None,
    ) -> None:
        self.settings = settings
        # Sends requests for models that peers serve to them (pool.cluster).
        self.router = router
        budgets = settings.engine.gpu_budget_mib
        if gpus is None and budgets:
            # No GPU source given and budgets declared: virtual GPUs (see VirtualGpus).
            gpus = VirtualGpus(budgets)
        if isinstance(gpus, VirtualGpus):
            gpus.bind(self._holdings)
        self.gpus: GpuSource = gpus or NoGpus()
        # Images named by URL become inline data here, once, for every surface.
        self.media = media or MediaLoader(settings.service)
        # Footprints are kept only where there is a GPU to measure them on.
        measurable = isinstance(gpus, VirtualGpus) or bool(self.gpus.view().gpus)
        self.footprints = FootprintStore(default_path() if measurable else None)
        self.meter = LoadMeter(self.gpus)
        self.contexts = CudaContexts(self.footprints, lambda actor: self._charges(actor)[0])
        self.metrics = PoolMetrics(lambda: self.models.values(), lambda: self.gpus.view().gpus)
        self.models: dict[str, ModelActor] = {
            name: ModelActor(
                name,
                definition,
                settings,
                metrics=self.metrics,
                on_change=self._notify_change,
                loader=_OnDemandLoads(self),
                meter=self.meter,
                footprints=self.footprints,
                contexts=self.contexts,
            )
            for name, definition in settings.engine.models.items()
        }
        self.started_at = time.time()
        self.shutting_down = False
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self._was_unloading = False
        # Loads that the VRAM gate let through, with the GPUs of each replica, until they
        # are `loading`; evictions and the decisions that lead to them, one at a time;
        # models asked to make way (new requests wait at their door), with who asked.
        self._reserved: dict[ModelActor, tuple[GpuPlacement, ...]] = {}
        self._room_lock = trio.Lock()
        self._yielding: dict[ModelActor, tuple[trio.Event, ModelActor]] = {}
        # On-demand loads that found no room and wait for it (their requests wait for VRAM).
        self._waiting_for_room: set[ModelActor] = set()
        self.evictions = 0
        # On-demand loads under way, with the overrides their first request hinted at.
        self._on_demand: dict[ModelActor, dict[str, Any]] = {}
        self.rate_limiter = RateLimiter(settings.service.tenancy)
        self.load_tasks = LoadTasks(self, settings.service.max_load_tasks)
        self.pulls = PullManager(settings, self.models)
        # Leases shared with other GPU users (pool.cluster); None: this pool alone.
        self.ledger = ledger
        if ledger is not None:
            ledger.bind(LedgerBinding(self._notify_change, self._lease_holdings, self._budgets))

    def model(self, name: str) -> ModelActor:
        try:
            return self.models[name]
        except KeyError:
            raise PoolError("unknown_model", f"model {name!r} is not configured") from None

    # -- lifecycle ---------------------------------------------------------------
    async def load(
        self, name: str, body: LoadRequest | dict[str, Any] | None = None
    ) -> ModelSnapshot:
        """Load a configured model; returns its snapshot when the load has finished.

        On GPUs (real or virtual) the load must fit: idle models that may be evicted
        for it are unloaded first (docs/vram.md); if it still does not fit it fails
        with ``load_failed`` at once rather than waiting.
        """
        if isinstance(body, dict):
            body = LoadRequest.model_validate(body)
        actor = self.model(name)
        body = body or LoadRequest()
        replicas, patch = validate_load_request(body, actor.definition)
        explicit = bool(body.model_fields_set)
        while True:
            if actor.state == "unloading":
                raise PoolError("model_unloading", f"model {name!r} is unloading; retry after")
            resident = actor.resident_row(explicit)
            if resident is None:
                break
            if actor.state == "loaded":
                return resident
            await actor.wait_state_change()  # loading: answer once that load is over
        try:
            gpus = await self._make_room(actor, replicas, patch, wait=False)
            assert gpus is not None
            return await actor.load_placed(replicas, patch, explicit=explicit, gpus=gpus)
        finally:
            self._release(actor)

    async def unload(self, name: str) -> ModelSnapshot:
        return await self.model(name).unload()

    async def preload(self, name: str, hint: dict[str, Any] | None = None) -> ModelSnapshot:
        """Load ``name`` as a request to it would (Ollama's empty request): through the
        VRAM gate as :meth:`load`, with ``hint`` (load overrides, e.g. the context
        length a client asked for) applied if this call starts the load and the backend
        accepts it; an unsuitable hint is ignored, as on an on-demand load.
        """
        actor = self.model(name)
        body = _hinted(actor, hint) if actor.state in ("unloaded", "failed") else None
        return await self.load(name, body)

    def snapshot(self, name: str) -> ModelSnapshot:
        return self.model(name).snapshot()

    def snapshots(self) -> list[ModelSnapshot]:
        return [actor.snapshot() for actor in self.models.values()]

    async def wait_change(self) -> None:
        """Wait until a model changes state or goes idle (for whoever pushes state out)."""
        await self._changed.wait()

    def servable_models(self) -> list[str]:
        return [n for n, a in self.models.items() if a.state == "loaded" or a.loads_on_request]

    # -- inference ---------------------------------------------------------------
    @asynccontextmanager
    async def admit(
        self,
        request: InferenceRequest | EmbeddingRequest,
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
        :meth:`Admission.embedded`.

        Raises:
            PoolError: for unknown models, capability or state violations, a refused
                image, a full queue (``queue_full``) or waiting past ``queue_timeout_s``.
        """
        admitted_at = time.perf_counter()
        if self.shutting_down:
            raise PoolError("shutting_down", "the pool is shutting down", retry_after_s=5.0)
        if self.router is not None and isinstance(request, InferenceRequest) and not RELAYED.get():
            route = await self.router.route(request.model, self.models.get(request.model))
            if route is not None:
                async with self._relayed(
                    request, route, tenant, priority, request_id, admitted_at
                ) as admission:
                    yield admission
                return
        actor = self.model(request.model)
        status = "cancelled"
        try:
            request_id = request_id or new_request_id()
            job: GenerationRequest | EmbeddingJob
            if isinstance(request, EmbeddingRequest):
                job = build_embedding_job(
                    request, request_id=request_id, capabilities=actor.capabilities
                )
                self.rate_limiter.admit(tenant)
            else:
                job = build_generation_request(
                    request,
                    request_id=request_id,
                    capabilities=actor.capabilities,
                    decoding_defaults=self.settings.engine.decoding,
                    tenant=tenant,
                )
                self.rate_limiter.admit(tenant)
                job = await inline_images(job, self.media)
            deadline = trio.current_time() + actor.queue_timeout_s
            enqueue = partial(
                actor.admit,
                job,
                tenant=tenant,
                priority=priority,
                buffer=self.settings.engine.stream_buffer_tokens,
                keep_alive=request.keep_alive,
                load_hint=load_hint,
            )
            ticket: Ticket | None = None
            steps: AsyncGenerator[Waiting | Ticket, None] | None = None
            door_closed = self._door_closed(actor)
            report_waits = report_waits or heartbeat_s is not None
            if report_waits and (
                door_closed or (actor.loads_on_request and actor.state != "loaded")
            ):
                # It waits for VRAM or a load: the caller gets the admission now and
                # reads the wait from it. Queued here unless a door holds it, so a full
                # queue is still refused before anything is sent.
                if not door_closed:
                    ticket = enqueue()
                steps = self._wait_steps(actor, ticket, enqueue, deadline, heartbeat_s)
            else:
                await self._wait_at_door(actor, deadline)
                ticket = enqueue()
                if heartbeat_s is not None and not ticket.ready.is_set():
                    steps = self._wait_steps(actor, ticket, enqueue, deadline, heartbeat_s)
            admission = Admission(
                ticket, request_id, request.model, admitted_at, self._record_finished, steps
            )
            try:
                if ticket is not None and steps is None:
                    await self._wait_ready(actor, ticket, deadline)
                yield admission
                if admission.finished is not None or admission.embedding is not None:
                    status = "success"
                elif admission.failed is not None:
                    status = admission.failed.code
            finally:
                queued = admission.queued_ticket
                if queued is not None:
                    if not queued.ready.is_set():
                        actor.scheduler.remove(queued)
                    queued.abandon()
        except PoolError as exc:
            status = exc.code
            raise
        finally:
            self.metrics.requests.labels(actor.name, tenant, status).inc()

    @asynccontextmanager
    async def _relayed(
        self,
        request: InferenceRequest,
        route: Route,
        tenant: str,
        priority: str,
        request_id: str | None,
        admitted_at: float,
    ) -> AsyncIterator[Admission]:
        """:meth:`admit` for a request that a peer serves (docs/cluster.md)."""
        local = self.models.get(request.model)
        request_id = request_id or new_request_id()
        job = build_generation_request(
            request,
            request_id=request_id,
            capabilities=local.capabilities if local is not None else RELAY_CAPABILITIES,
            decoding_defaults=self.settings.engine.decoding,
        )
        self.rate_limiter.admit(tenant)
        job = await inline_images(job, self.media)
        ticket = Ticket(
            job,
            tenant=tenant,
            priority=priority,  # type: ignore[arg-type]
            buffer=self.settings.engine.stream_buffer_tokens,
        )
        if self._nursery is None:
            raise PoolError("shutting_down", "the pool is not running")
        idle_s = self.settings.engine.generation_idle_timeout_s
        self._nursery.start_soon(run_relay, route, ticket, request.model, idle_s)
        try:
            await ticket.started.wait()
            yield Admission(ticket, request_id, request.model, admitted_at, self._record_finished)
        finally:
            ticket.abandon()

    def _record_finished(self, admission: Admission, job: JobFinished, done: Finished) -> None:
        model = admission.model
        self.metrics.queue_wait.labels(model).observe(admission.queue_wait_ms / 1000.0)
        self.metrics.inference.labels(model).observe(job.backend_wall_ms / 1000.0)
        first_ms = done.timings.time_to_first_token_ms
        if first_ms is not None:
            self.metrics.first_token.labels(model).observe(first_ms / 1000.0)
        output = done.usage.output_tokens or 0
        prompt = done.usage.prompt_tokens or 0
        self.metrics.tokens.labels(model).inc(output)
        self.metrics.prompt_tokens.labels(model).inc(prompt)
        self.metrics.record_cache(model, done.usage.cached_tokens)
        self.rate_limiter.charge_tokens(admission.ticket.tenant, output + prompt)

    async def stream(self, request: InferenceRequest, **kwargs: Any) -> AsyncIterator[Event]:
        """Run ``request`` and yield its events (see :meth:`Admission.events`).

        Close the iterator (``contextlib.aclosing``) if you stop reading early.
        """
        async with self.admit(request, **kwargs) as admission:
            async for event in admission.events():
                yield event

    async def respond(self, request: InferenceRequest, **kwargs: Any) -> Finished:
        """Run ``request`` to completion; the :class:`Finished` event, or its error raised."""
        async with self.admit(request, **kwargs) as admission:
            return await admission.collect()

    async def embed(self, request: EmbeddingRequest, **kwargs: Any) -> Embedded:
        """Embed ``request``'s texts: the :class:`Embedded` result, or its error raised."""
        async with self.admit(request, **kwargs) as admission:
            done = await admission.embedded()
        tokens = done.usage.prompt_tokens or 0
        self.metrics.prompt_tokens.labels(request.model).inc(tokens)
        self.rate_limiter.charge_tokens(admission.ticket.tenant, tokens)
        return done

    async def detached(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` in the pool's nursery and wait for its result.

        The work belongs to the pool: a caller that is cancelled (a client that
        disconnects) stops waiting, but the work itself runs to completion.
        """
        if self._nursery is None:
            raise PoolError("shutting_down", "the pool is not running")
        done = trio.Event()
        outcome: dict[str, Any] = {}

        async def run() -> None:
            try:
                outcome["value"] = await fn(*args)
            except Exception as exc:  # noqa: BLE001 - re-raised in the caller below
                outcome["error"] = exc
            finally:
                done.set()

        self._nursery.start_soon(run)
        await done.wait()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]  # type: ignore[no-any-return]

    # -- runner API -------------------------------------------------------------------
    def start_load_task(
        self,
        name: str,
        body: LoadRequest | dict[str, Any] | None = None,
        evict: str | None = None,
    ) -> LoadTask:
        """Start loading ``name`` in the background (after unloading ``evict``).

        Raises:
            PoolError: at once, for an unknown model or ``evict``, or a body that does not
                suit the backend (``invalid_load_request``).
            pydantic.ValidationError: ``body`` is a dict that fails the load schema.
        """
        if self._nursery is None or self.shutting_down:
            raise PoolError("shutting_down", "the pool is shutting down", retry_after_s=5.0)
        if not isinstance(body, LoadRequest):
            body = LoadRequest.model_validate(body or {})
        return self.load_tasks.start(self._nursery, name, body, evict)

    async def flush_cache(
        self,
        scope: str,
        *,
        model: str | None = None,
        tenant: str | None = None,
        tag: str | None = None,
    ) -> FlushResult:
        """Flush prompt caches by scope; backends without one report nothing removed.

        ``model`` narrows any scope to that model's replicas; ``tenant`` and ``tag``
        narrow the ``tenant`` and ``tag`` scopes (each needs its own value).
        """
        actors = [self.model(model)] if model else list(self.models.values())
        entries = 0
        freed_mib = 0.0
        for actor in actors:
            for replica in actor.replicas:
                flush = getattr(replica.runtime, "flush_cache", None)
                if flush is not None:
                    flushed = await flush(scope=scope, tenant=tenant, tag=tag)
                    entries += flushed.entries
                    freed_mib += flushed.memory_mib
            actor.scheduler.forget_prefixes()  # (all of them: routing only loses a hint)
        return FlushResult(entries, freed_mib)

    def prefix_caching(self) -> bool:
        """Whether any loaded replica keeps a prefix cache (one the pool can flush)."""
        return any(
            hasattr(replica.runtime, "flush_cache")
            for actor in self.models.values()
            for replica in actor.replicas
        )

    def cache_usage(self) -> CacheUsage | None:
        """The prompt caches of every loaded replica together (None: no runtime has one)."""
        size = used = 0.0
        found = False
        for actor in self.models.values():
            for replica in actor.replicas:
                usage_of = getattr(replica.runtime, "cache_usage", None)
                usage = usage_of() if usage_of is not None else None
                if usage is not None:
                    found = True
                    size += usage.size_mib
                    used += usage.used_mib
        return CacheUsage(size, used) if found else None

    def health(self) -> PoolHealth:
        """Whether the pool serves, and why not."""
        reason = None
        if self.shutting_down:
            reason = "the pool is shutting down"
        elif self.models and all(a.state == "failed" for a in self.models.values()):
            reason = "every model failed to load"
        return PoolHealth(
            serving=reason is None,
            uptime_s=time.time() - self.started_at,
            models_loaded=sum(1 for a in self.models.values() if a.state == "loaded"),
            queue_depth=sum(a.scheduler.queue_depth for a in self.models.values()),
            reason=reason,
        )

    def queue_stats(self) -> QueueStats:
        """Every model's queue together; ``max_depth`` counts loaded models only."""
        actors = list(self.models.values())
        waits = [w for a in actors for w in a.scheduler.stats.waits_ms]
        return QueueStats(
            depth=sum(a.scheduler.queue_depth for a in actors),
            max_depth=sum(a.scheduler.max_queue for a in actors if a.state == "loaded"),
            avg_wait_ms=sum(waits) / len(waits) if waits else 0.0,
            p95_wait_ms=percentile(waits, 0.95),
        )

    # -- on-demand loading and eviction ----------------------------------------------
    def _notify_change(self) -> None:
        # Memory let go while a load is measured makes its delta low: an unload that
        # starts or ends (it is "unloading" at one of the two changes) disturbs it.
        unloading = any(a.state == "unloading" for a in self.models.values())
        if unloading or self._was_unloading:
            self.meter.disturb()
        self._was_unloading = unloading
        if self.ledger is not None:
            self.ledger.poke()
        self._changed.set()
        self._changed = trio.Event()

    def _request_on_demand_load(self, actor: ModelActor, hint: dict[str, Any] | None) -> None:
        # The load belongs to the pool, not to the request that triggered it: a client
        # that leaves does not cancel a load other requests may be waiting for.
        if actor in self._on_demand or self._nursery is None:
            return
        self._on_demand[actor] = dict(hint or {})
        self._nursery.start_soon(self._on_demand_load, actor)

    async def _on_demand_load(self, actor: ModelActor) -> None:
        try:
            body = self._hinted_load_request(actor) or LoadRequest()
            replicas, patch = validate_load_request(body, actor.definition)
            gpus = await self._make_room(actor, replicas, patch, wait=True)
            if gpus is not None:
                explicit = bool(body.model_fields_set)
                await actor.load_placed(replicas, patch, explicit=explicit, gpus=gpus)
        except PoolError as exc:
            log.warning("model=%s on-demand load failed: %s", actor.name, exc.message)
            if exc.code == "load_failed" and actor.state != "failed":
                # The gate refused it for good (it can never fit): fail the waiters now.
                actor.reject_waiting(PoolError("model_failed", exc.message))
        finally:
            self._release(actor)
            del self._on_demand[actor]
        # Requests that arrived after a failed load was answered wait for a new one.
        if actor.scheduler.queue_depth and actor.state in ("unloaded", "failed"):
            self._request_on_demand_load(actor, None)

    def _hinted_load_request(self, actor: ModelActor) -> LoadRequest | None:
        """The load overrides a triggering request hinted at, if they suit the backend."""
        return _hinted(actor, self._on_demand.get(actor))

    def _loaded_count(self, exclude: ModelActor) -> int:
        # Reserved: loads that made room but have not reached `loading` yet.
        return sum(
            1
            for a in self.models.values()
            if a is not exclude and (a.state in ("loaded", "loading") or a in self._reserved)
        )

    # -- the VRAM gate (docs/vram.md) ---------------------------------------------------
    def _holdings(self) -> list[tuple[int, int]]:
        """(GPU, MiB) of every loaded replica's runtime, for virtual GPUs: what the
        runtime reports, spread over the replica's GPUs as its placement says."""
        held: list[tuple[int, int]] = []
        for actor in self.models.values():
            for index, replica in enumerate(actor.replicas):
                mib = replica.runtime.vram_mib if replica.runtime is not None else None
                if not mib:
                    continue
                if index < len(actor.placement):
                    placement = actor.placement[index]
                    held.extend(zip(placement.gpus, placement.scaled(mib), strict=True))
                else:
                    held.append((0, mib))
        return held

    def _charges(self, exclude: ModelActor) -> tuple[dict[int, int], dict[int, int]]:
        """MiB per GPU charged to loaded models, and to loads under way or reserved."""
        loaded: dict[int, int] = {}
        pending: dict[int, int] = {}
        for actor in self.models.values():
            if actor is exclude:
                continue
            if actor in self._reserved and actor.state in ("unloaded", "failed"):
                for placement in self._reserved[actor]:
                    for index, mib in zip(placement.gpus, placement.mib, strict=True):
                        pending[index] = pending.get(index, 0) + mib
            elif actor.state == "loading":
                per_replica = actor.vram_estimate().per_replica_mib or 0
                charges(actor.placement, per_replica, pending, replicas=actor.selected_replicas)
            elif actor.state in ("loaded", "unloading"):
                if actor.observed_per_gpu is not None:
                    for index, mib in actor.observed_per_gpu.items():
                        loaded[index] = loaded.get(index, 0) + mib
                else:
                    per_replica = actor.vram_estimate().per_replica_mib or 0
                    charges(actor.placement, per_replica, loaded, replicas=len(actor.replicas))
        return loaded, pending

    def _place(
        self,
        actor: ModelActor,
        definition: ModelDefinition,
        room: dict[int, int],
        per_replica: int,
        replicas: int,
    ) -> tuple[GpuPlacement, ...] | None:
        """``place`` with the backend's way of splitting a replica over GPUs. An
        in-process runtime also pays the pool process's CUDA context on each GPU that has
        none yet (CudaContexts)."""
        if actor.backend.holds_cuda_context(definition):
            room = {gpu: mib - self.contexts.cost_mib(gpu) for gpu, mib in room.items()}
        return place(
            room,
            per_replica,
            replicas,
            gpus_per_replica=actor.backend.gpus_per_replica(definition),
            even=actor.backend.even_gpu_split,
            virtual=all(g.virtual for g in self.gpus.view().gpus),
        )

    def _fit(
        self, actor: ModelActor, definition: ModelDefinition, per_replica: int, replicas: int
    ) -> tuple[GpuPlacement, ...] | None:
        """Where ``actor``'s replicas would go now; ``()`` when there is no GPU to gate."""
        view = self.gpus.view()
        if not view.gpus:
            return ()
        loaded, pending = self._charges(exclude=actor)
        # What in-process runtimes left in the pool process is held, not free.
        for gpu, mib in self.contexts.held().items():
            loaded[gpu] = loaded.get(gpu, 0) + mib
        engine = self.settings.engine
        room = gpu_room(
            view,
            reserve_mib=engine.gpu_reserve_mib,
            caps_mib=engine.gpu_budget_mib,
            loaded=loaded,
            pending=pending,
            leased_by_others=self.ledger.others_mib() if self.ledger is not None else None,
        )
        return self._place(actor, definition, room, per_replica, replicas)

    def _could_ever_fit(
        self, actor: ModelActor, definition: ModelDefinition, per_replica: int, replicas: int
    ) -> bool:
        """Whether the load would fit with every unpinned model gone and no other
        process on the GPUs (those may leave: a load waits for them)."""
        view = self.gpus.view()
        engine = self.settings.engine
        room = gpu_ceilings(
            view, reserve_mib=engine.gpu_reserve_mib, caps_mib=engine.gpu_budget_mib
        )
        for gpu, mib in self.contexts.held().items():
            room[gpu] = room.get(gpu, 0) - mib  # the pool process keeps its contexts
        for other in self.models.values():
            # Only pinned models stay for good; a more important one may still leave by
            # keep_alive or an admin unload, so a load behind it waits.
            stays = other.definition.pinned
            if other is not actor and stays and other.state in ("loaded", "loading", "unloading"):
                estimate = other.vram_estimate().per_replica_mib or 0
                held = charges(other.placement, estimate, replicas=len(other.replicas))
                for index, mib in held.items():
                    room[index] = room.get(index, 0) - mib
        return self._place(actor, definition, room, per_replica, replicas) is not None

    async def _make_room(
        self, actor: ModelActor, replicas: int, patch: dict[str, Any], *, wait: bool
    ) -> tuple[GpuPlacement, ...] | None:
        """Find room for a load of ``actor``: the GPUs of each replica (``()`` without GPUs).

        The reservation is taken under one lock, for every GPU of every replica at once
        (all or nothing, in GPU index order): two loads that each need a split cannot
        each hold half of what the other needs.

        Evicts idle models that the spec's rules allow, one at a time, each followed by
        a bounded wait for the GPU source to show its memory back. ``wait`` (on-demand
        loads): while nothing may be evicted, wait for a change (an unload, a model
        going idle, every ``RECHECK_S``); after ``engine.warm_wait_s`` ask the best busy
        model to make way; give up (None) once no request waits for ``actor`` any more.
        Without ``wait`` (admin and startup loads) a load that does not fit fails.
        ``engine.max_loaded_models`` binds on-demand loads too.

        Raises:
            PoolError: ``load_failed`` when it cannot fit, even with every model gone
                that could be evicted for it (or, without ``wait``, now).
        """
        engine = self.settings.engine
        limit = engine.max_loaded_models if wait else 0
        definition = apply_override(actor.definition, patch) if patch else actor.definition
        estimate = actor.vram_estimate(definition=definition, replicas=replicas)
        per_replica = estimate.per_replica_mib or 0
        asked_at = trio.current_time()
        while True:
            async with self._room_lock:
                while True:
                    if wait and actor.scheduler.queue_depth == 0:
                        return None
                    gpus = self._fit(actor, definition, per_replica, replicas)
                    if gpus is not None and (not limit or self._loaded_count(actor) < limit):
                        self._waiting_for_room.discard(actor)
                        if await self._claim_lease(actor, gpus, per_replica):
                            self._reserved[actor] = gpus
                            self._release_yields(actor)
                            return gpus
                        gpus = None  # another holder took the room: evict or wait as if full
                    if gpus is None and not self._could_ever_fit(
                        actor, definition, per_replica, replicas
                    ):
                        raise PoolError(
                            "load_failed",
                            f"model {actor.name!r} needs {per_replica} MiB per replica"
                            f" ({estimate.source}) x {replicas}: more than the GPUs can give it",
                        )
                    victim = self._next_victim(actor, wait=wait)
                    if victim is None:
                        break
                    await self._evict(victim, actor)
            if wait and actor not in self._waiting_for_room:
                self._waiting_for_room.add(actor)
                self._notify_change()  # its requests now know they wait for VRAM
            if not wait:
                raise PoolError(
                    "load_failed",
                    f"model {actor.name!r} needs {per_replica} MiB per replica ({estimate.source});"
                    " no GPU has room and no idle model may be evicted for it now",
                )
            now = trio.current_time()
            warm_until = asked_at + engine.warm_wait_s
            if now >= warm_until:
                self._ask_to_yield(actor, now)
            wake = [now + RECHECK_S, warm_until if warm_until > now else math.inf]
            best = self._best_victim(actor)
            if best is not None:
                wake.append(best.resident_since + engine.min_resident_s)
            with trio.move_on_at(min(wake)):
                await self._changed.wait()

    def _best_victim(self, actor: ModelActor) -> ModelActor | None:
        """The idle model the spec's order picks for ``actor``, however fresh."""
        victims = eviction_candidates(
            self.models.values(), incoming=actor, now=trio.current_time(), min_resident_s=0.0
        )
        return victims[0] if victims else None

    def _next_victim(self, actor: ModelActor, *, wait: bool) -> ModelActor | None:
        """The model to evict for ``actor`` now, if any.

        The spec's order decides (lowest priority, then least recently used); a victim
        loaded less than ``engine.min_resident_s`` ago is waited for rather than passed
        over for a worse one (on-demand loads; an admin load does not wait).
        """
        best = self._best_victim(actor)
        if best is None:
            return None
        fresh = trio.current_time() - best.resident_since < self.settings.engine.min_resident_s
        return None if (fresh and wait) else best

    def _ask_to_yield(self, actor: ModelActor, now: float) -> None:
        """Warm promotion is over for ``actor``: the best busy model stops taking new
        requests (they wait at its door), serves what it has queued, then is evicted."""
        if any(claimant is actor for _, claimant in self._yielding.values()):
            return
        busy = eviction_candidates(
            self.models.values(),
            incoming=actor,
            now=now,
            min_resident_s=self.settings.engine.min_resident_s,
            busy=True,
        )
        busy = [b for b in busy if b not in self._yielding]
        if busy:
            log.info("model=%s asks busy model %s to make way", actor.name, busy[0].name)
            self._yielding[busy[0]] = (trio.Event(), actor)

    def _release_yields(self, actor: ModelActor) -> None:
        for victim, (door, claimant) in list(self._yielding.items()):
            if claimant is actor:
                del self._yielding[victim]
                door.set()

    def _release(self, actor: ModelActor) -> None:
        self._reserved.pop(actor, None)
        self._waiting_for_room.discard(actor)
        self._release_yields(actor)
        if self.ledger is not None:
            self.ledger.poke()

    # -- the shared lease ledger (pool.cluster, docs/cluster.md) ----------------------
    def _budgets(self) -> dict[int, int]:
        engine = self.settings.engine
        view = self.gpus.view()
        return gpu_ceilings(
            view, reserve_mib=engine.gpu_reserve_mib, caps_mib=engine.gpu_budget_mib
        )

    def _lease_holdings(self) -> dict[str, dict[int, int]]:
        """MiB per GPU of every model that holds or is about to hold memory."""
        held: dict[str, dict[int, int]] = {}
        for actor in self.models.values():
            per_replica = actor.vram_estimate().per_replica_mib or 0
            if actor in self._reserved and actor.state in ("unloaded", "failed"):
                held[actor.name] = charges(self._reserved[actor], per_replica)
            elif actor.state == "loading":
                held[actor.name] = charges(
                    actor.placement, per_replica, replicas=actor.selected_replicas
                )
            elif actor.state in ("loaded", "unloading"):
                if actor.observed_per_gpu is not None:
                    held[actor.name] = dict(actor.observed_per_gpu)
                else:
                    held[actor.name] = charges(
                        actor.placement, per_replica, replicas=len(actor.replicas)
                    )
        return held

    async def _claim_lease(
        self, actor: ModelActor, gpus: tuple[GpuPlacement, ...], per_replica: int
    ) -> bool:
        """Take the shared ledger's lease for a load the local gate let through."""
        wanted = {i: mib for i, mib in charges(gpus, per_replica).items() if mib > 0}
        if self.ledger is None or not wanted:
            return True
        reserve = self.settings.engine.gpu_reserve_mib
        free = {
            g.index: g.total_mib - g.used_mib - reserve
            for g in self.gpus.view().gpus
            if not g.virtual
        }
        refused = await self.ledger.claim(actor.name, wanted, free)
        if refused is not None:
            log.info("model=%s the shared lease ledger refused: %s", actor.name, refused)
        return refused is None

    async def _evict(self, victim: ModelActor, incoming: ModelActor) -> None:
        """Unload ``victim`` (idle) for ``incoming``, then wait (bounded) for its memory."""
        log.info(
            "model=%s evicting model %s (priority %d, placed on %s)",
            incoming.name,
            victim.name,
            victim.definition.priority,
            [list(p.gpus) for p in victim.placement],
        )
        # Its door closes first: a request for it that arrives now waits for the eviction
        # to finish (and then reloads it) instead of being refused by the unload.
        self._yielding.setdefault(victim, (trio.Event(), incoming))
        view = self.gpus.view()
        expected = charges(
            victim.placement,
            victim.vram_estimate().per_replica_mib or 0,
            replicas=len(victim.replicas),
        )
        if victim.observed_per_gpu is not None:
            expected = dict(victim.observed_per_gpu)
            # An in-process victim's CUDA context stays with the pool process.
            for gpu in victim.unsplit_context:
                expected[gpu] = max(0, expected[gpu] - self.contexts.expected_mib(gpu))
        before = {g.index: _held(g) for g in view.gpus}
        self.evictions += 1
        try:
            await victim.unload("evicted")
        except PoolError as exc:
            log.warning("model=%s eviction of %s failed: %s", incoming.name, victim.name, exc)
            return
        if not view.gpus or not any(expected.values()):
            return
        with trio.move_on_after(RECLAIM_WAIT_S):
            while True:
                now = {g.index: _held(g) for g in (await self.meter.refresh()).gpus}
                if all(now.get(i, 0) <= before.get(i, 0) - mib // 2 for i, mib in expected.items()):
                    return
                await trio.sleep(RECLAIM_POLL_S)
        log.warning(
            "model=%s memory of evicted model %s not back after %.0fs; going on",
            incoming.name,
            victim.name,
            RECLAIM_WAIT_S,
        )

    # -- what a waiting request waits for (docs/vram.md, "The client sees the wait") ----
    def _door_closed(self, actor: ModelActor) -> bool:
        """Whether new requests for ``actor`` wait at its door (it makes way for another
        model, or an on-demand model is unloading)."""
        unloading = actor.definition.on_demand and actor.state == "unloading"
        return actor in self._yielding or unloading

    def _wait_reason(self, actor: ModelActor) -> WaitReason | None:
        """What a queued request of ``actor`` waits for now; None while its on-demand
        load has not been through the VRAM gate yet (room or not is not known)."""
        if actor.state == "loaded":
            return "replica"
        if actor.state == "loading" or actor in self._reserved:
            return "load"
        if self._door_closed(actor) or actor in self._waiting_for_room:
            return "vram"
        if actor in self._on_demand:
            return None
        return "load"

    def _queue_timeout(self, actor: ModelActor, reason: WaitReason | None) -> PoolError:
        reason = reason or "load"
        waited = f"waited {actor.queue_timeout_s:g}s"
        message = {
            "replica": f"{waited} in the queue of model {actor.name!r}",
            "load": f"{waited} for model {actor.name!r} to load",
            "vram": f"{waited} for room on the GPUs for model {actor.name!r}",
        }[reason]
        return PoolError("queue_timeout", message, details={"waiting_for": reason})

    async def _wait_ready(self, actor: ModelActor, ticket: Ticket, deadline: float) -> None:
        """Wait until ``ticket`` runs (or is refused); ``queue_timeout`` at ``deadline``."""
        if not ticket.ready.is_set():
            with trio.move_on_at(deadline):
                await ticket.ready.wait()
            if not ticket.ready.is_set():
                reason = self._wait_reason(actor)
                actor.scheduler.remove(ticket)
                raise self._queue_timeout(actor, reason)
        await _started(ticket)

    async def _wait_steps(
        self,
        actor: ModelActor,
        ticket: Ticket | None,
        enqueue: Callable[[], Ticket],
        deadline: float,
        heartbeat_s: float | None = None,
    ) -> AsyncGenerator[Waiting | Ticket, None]:
        """The wait of a request that reports it: :class:`Queued` whenever its place or
        what it waits for changes, :class:`Loading` while its model loads (again as the
        progress moves), and the ticket once it is queued (``ticket`` None: a door holds
        it first). Ends when the request runs; raises its error otherwise.

        With ``heartbeat_s``, the latest of them is repeated when nothing was reported
        for that long (to within ``WAIT_TICK_S``)."""
        queued: Queued | None = None
        loading: Loading | None = None
        reported = trio.current_time()

        def beat(latest: Waiting | None) -> Waiting | None:
            nonlocal reported
            now = trio.current_time()
            if heartbeat_s is None or now - reported < heartbeat_s:
                return None
            reported = now
            return latest or Queued(actor.scheduler.queue_depth, "load")

        if ticket is None:
            while self._door_closed(actor):
                now = Queued(actor.scheduler.queue_depth + 1, "vram")
                if now != queued:
                    queued = now
                    reported = trio.current_time()
                    yield now
                elif (again := beat(queued)) is not None:
                    yield again
                await self._wait_change(None, min(deadline, trio.current_time() + WAIT_TICK_S))
                if trio.current_time() >= deadline and self._door_closed(actor):
                    raise self._queue_timeout(actor, "vram")
            ticket = enqueue()
            yield ticket
        while not ticket.ready.is_set():
            reason = self._wait_reason(actor)
            status = None if reason is None else Queued(actor.scheduler.position(ticket), reason)
            latest: Waiting | None = None
            if status is not None and status != queued:
                queued = latest = status
                yield status
            if actor.state == "loading":
                progress = Loading(actor.load_progress)
                if progress != loading:
                    loading = latest = progress
                    yield progress
            if latest is not None:
                reported = trio.current_time()
            elif (again := beat(loading if actor.state == "loading" else queued)) is not None:
                yield again
            await self._wait_change(ticket.ready, min(deadline, trio.current_time() + WAIT_TICK_S))
            if not ticket.ready.is_set() and trio.current_time() >= deadline:
                reason = self._wait_reason(actor)
                actor.scheduler.remove(ticket)
                raise self._queue_timeout(actor, reason)
        await _started(ticket)

    async def _wait_change(self, ready: trio.Event | None, until: float) -> None:
        """Until ``ready`` is set, any model changes, or ``until``."""
        changed = self._changed
        with trio.move_on_at(until):
            if ready is None:
                await changed.wait()
                return
            async with trio.open_nursery() as nursery:

                async def wake(event: trio.Event) -> None:
                    await event.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(wake, ready)
                nursery.start_soon(wake, changed)

    async def _wait_at_door(self, actor: ModelActor, deadline: float) -> None:
        """Hold a request for a model that makes way for another (or an on-demand model
        that is unloading) until that is over; it then queues (and reloads the model)."""
        while True:
            held = self._yielding.get(actor)
            unloading = actor.definition.on_demand and actor.state == "unloading"
            if held is None and not unloading:
                return
            with trio.move_on_at(deadline) as scope:
                if held is not None:
                    await held[0].wait()
                else:
                    await actor.wait_state_change()
            if scope.cancelled_caught:
                raise PoolError(
                    "queue_timeout",
                    f"waited {actor.queue_timeout_s:g}s for model {actor.name!r} to make way"
                    " for another model and load again",
                    details={"waiting_for": "vram"},
                )

    async def _startup_load(self, actor: ModelActor) -> None:
        try:
            await self.load(actor.name)
        except PoolError as exc:
            log.warning("model=%s startup load failed: %s", actor.name, exc.message)


@asynccontextmanager
async def open_pool(
    settings: Settings,
    *,
    startup_loads: bool = True,
    gpus: GpuSource | None = None,
    media: MediaLoader | None = None,
    ledger: SharedLedger | None = None,
    router: Router | None = None,
) -> AsyncIterator[Pool]:
    """Start the actor tree for ``settings`` and yield the :class:`Pool`.

    Models with ``enabled: true`` are loaded before this yields (a failed one is left
    ``failed``; the pool still opens). Leaving the block cancels every request and
    releases every runtime, each bounded by ``engine.unload_timeout_s``.

    Args:
        gpus: where GPU memory readings come from (``serve`` passes its NVML monitor);
            by default virtual GPUs when ``engine.gpu_budget_mib`` is set, else none.
        media: the image loader (default: one for ``settings.service``; tests inject
            one with their own resolver).
        ledger: a lease ledger shared with other GPU users (``pool.cluster``).
        router: sends requests for models that peers serve to them (``pool.cluster``).
    """
    pool = Pool(settings, gpus=gpus, media=media, ledger=ledger, router=router)
    await trio.to_thread.run_sync(pool.footprints.read)
    async with trio.open_nursery() as nursery:
        pool._nursery = nursery
        for actor in pool.models.values():
            await nursery.start(actor.run)
        await nursery.start(pool.pulls.run)
        if startup_loads:
            async with trio.open_nursery() as loads:
                for actor in pool.models.values():
                    if actor.definition.enabled:
                        loads.start_soon(pool._startup_load, actor)
        try:
            yield pool
        finally:
            pool.shutting_down = True
            nursery.cancel_scope.cancel()


async def _started(ticket: Ticket) -> None:
    """Once a ticket is ready: wait until its replica starts it, or raise its error."""
    if ticket.error is None:
        await ticket.started.wait()
    if ticket.error is not None:
        raise ticket.error
