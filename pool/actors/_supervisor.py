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
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol, TypeVar

import trio

from pool.actors._admission import Admission, new_request_id
from pool.actors._events import Event, Finished
from pool.actors._intake import build_generation_request, inline_images
from pool.actors._keep_alive import eviction_candidates
from pool.actors._metrics import PoolMetrics
from pool.actors._model import ModelActor
from pool.actors._rate_limit import RateLimiter
from pool.actors._request import InferenceRequest
from pool.actors._snapshots import FlushResult, GpuView, ModelSnapshot, PoolHealth, QueueStats
from pool.actors._stats import percentile
from pool.actors._tasks import LoadTask, LoadTasks
from pool.actors._ticket import JobFinished
from pool.config import LoadRequest, Settings, validate_load_request
from pool.errors import PoolError
from pool.media import MediaLoader
from pool.pulls import PullManager

log = logging.getLogger("pool")

T = TypeVar("T")


class GpuSource(Protocol):
    """Where the pool reads GPU memory from (the NVML monitor, or a test's fake)."""

    def view(self) -> GpuView: ...


class NoGpus:
    """The GPU source of a pool that runs no monitor (embedded use, tests)."""

    def view(self) -> GpuView:
        return GpuView((), "no GPU monitor is running")


class _OnDemandLoads:
    """The pool's side of :class:`OnDemandLoader` for its model actors."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def request(self, actor: ModelActor, hint: dict[str, Any] | None) -> None:
        self._pool._request_on_demand_load(actor, hint)

    def pending(self, actor: ModelActor) -> bool:
        return actor in self._pool._on_demand


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
    ) -> None:
        self.settings = settings
        self.gpus: GpuSource = gpus or NoGpus()
        # Images named by URL become inline data here, once, for every surface.
        self.media = media or MediaLoader(settings.service)
        self.metrics = PoolMetrics(lambda: self.models.values(), lambda: self.gpus.view().gpus)
        self.models: dict[str, ModelActor] = {
            name: ModelActor(
                name,
                definition,
                settings,
                metrics=self.metrics,
                on_change=self._notify_change,
                loader=_OnDemandLoads(self),
            )
            for name, definition in settings.engine.models.items()
        }
        self.started_at = time.time()
        self.shutting_down = False
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self._reserved: set[ModelActor] = set()
        # On-demand loads under way, with the overrides their first request hinted at.
        self._on_demand: dict[ModelActor, dict[str, Any]] = {}
        self.rate_limiter = RateLimiter(settings.service.tenancy)
        self.load_tasks = LoadTasks(self, settings.service.max_load_tasks)
        self.pulls = PullManager(settings, self.models)

    def model(self, name: str) -> ModelActor:
        try:
            return self.models[name]
        except KeyError:
            raise PoolError("unknown_model", f"model {name!r} is not configured") from None

    # -- lifecycle ---------------------------------------------------------------
    async def load(
        self, name: str, body: LoadRequest | dict[str, Any] | None = None
    ) -> ModelSnapshot:
        """Load a configured model; returns its snapshot when the load has finished."""
        if isinstance(body, dict):
            body = LoadRequest.model_validate(body)
        return await self.model(name).load(body)

    async def unload(self, name: str) -> ModelSnapshot:
        return await self.model(name).unload()

    def snapshot(self, name: str) -> ModelSnapshot:
        return self.model(name).snapshot()

    def snapshots(self) -> list[ModelSnapshot]:
        return [actor.snapshot() for actor in self.models.values()]

    def servable_models(self) -> list[str]:
        return [n for n, a in self.models.items() if a.state == "loaded" or a.definition.on_demand]

    # -- inference ---------------------------------------------------------------
    @asynccontextmanager
    async def admit(
        self,
        request: InferenceRequest,
        *,
        tenant: str = "default",
        priority: str = "normal",
        request_id: str | None = None,
        load_hint: dict[str, Any] | None = None,
    ) -> AsyncIterator[Admission]:
        """Validate, queue and wait for a replica slot; yields the :class:`Admission`.

        Leaving the block (normally, by error or by cancellation) removes the request
        from the queue or stops its generation, so nothing runs for a departed caller.

        Images are inlined under the media policy (``image_refused`` otherwise) after
        the capability checks and before the request is queued.

        Raises:
            PoolError: for unknown models, capability or state violations, a refused
                image, a full queue (``queue_full``) or waiting past ``queue_timeout_s``.
        """
        admitted_at = time.perf_counter()
        if self.shutting_down:
            raise PoolError("shutting_down", "the pool is shutting down", retry_after_s=5.0)
        actor = self.model(request.model)
        status = "cancelled"
        try:
            request_id = request_id or new_request_id()
            generation = build_generation_request(
                request,
                request_id=request_id,
                capabilities=actor.capabilities,
                decoding_defaults=self.settings.engine.decoding,
            )
            self.rate_limiter.admit(tenant)
            generation = await inline_images(generation, self.media)
            ticket = actor.admit(
                generation,
                tenant=tenant,
                priority=priority,
                buffer=self.settings.engine.stream_buffer_tokens,
                keep_alive=request.keep_alive,
                load_hint=load_hint,
            )
            try:
                if not ticket.ready.is_set():
                    with trio.move_on_after(actor.queue_timeout_s):
                        await ticket.ready.wait()
                    if not ticket.ready.is_set():
                        actor.scheduler.remove(ticket)
                        raise PoolError(
                            "queue_timeout",
                            f"waited {actor.queue_timeout_s:g}s in the queue of"
                            f" model {request.model!r}",
                        )
                if ticket.error is None:
                    await ticket.started.wait()
                if ticket.error is not None:
                    raise ticket.error
                admission = Admission(
                    ticket, request_id, request.model, admitted_at, self._record_finished
                )
                yield admission
                if admission.finished is not None:
                    status = "success"
                elif admission.failed is not None:
                    status = admission.failed.code
            finally:
                if not ticket.ready.is_set():
                    actor.scheduler.remove(ticket)
                ticket.abandon()
        except PoolError as exc:
            status = exc.code
            raise
        finally:
            self.metrics.requests.labels(actor.name, tenant, status).inc()

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
        """Flush prompt caches; backends without one report nothing removed."""
        actors = [self.model(model)] if scope == "model" and model else list(self.models.values())
        entries = 0
        freed_mib = 0.0
        for actor in actors:
            for replica in actor.replicas:
                flush = getattr(replica.runtime, "flush_cache", None)
                if flush is not None:
                    removed, mib = await flush(scope=scope, tenant=tenant, tag=tag)
                    entries += removed
                    freed_mib += mib
        return FlushResult(entries, freed_mib)

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
            if await self._make_room(actor):
                self._reserved.add(actor)
                await actor.load(self._hinted_load_request(actor))
        except PoolError as exc:
            log.warning("model=%s on-demand load failed: %s", actor.name, exc.message)
        finally:
            self._reserved.discard(actor)
            del self._on_demand[actor]
        # Requests that arrived after a failed load was answered wait for a new one.
        if actor.scheduler.queue_depth and actor.state in ("unloaded", "failed"):
            self._request_on_demand_load(actor, None)

    def _hinted_load_request(self, actor: ModelActor) -> LoadRequest | None:
        """The load overrides a triggering request hinted at, if they suit the backend."""
        hint = self._on_demand.get(actor)
        if not hint:
            return None
        try:
            body = LoadRequest.model_validate(hint)
            validate_load_request(body, actor.definition)
        except (ValueError, PoolError) as exc:
            log.info("model=%s ignoring load hint %s: %s", actor.name, hint, exc)
            return None
        return body

    def _loaded_count(self, exclude: ModelActor) -> int:
        # Reserved: on-demand loads that made room but have not reached `loading` yet.
        return sum(
            1
            for a in self.models.values()
            if a is not exclude and (a.state in ("loaded", "loading") or a in self._reserved)
        )

    async def _make_room(self, actor: ModelActor) -> bool:
        """Unload idle models until ``actor`` fits under ``engine.max_loaded_models``.

        Waits while every loaded model is busy; gives up (False) once no request is
        waiting for ``actor`` any more, so an abandoned load never evicts anything.
        """
        limit = self.settings.engine.max_loaded_models
        while limit and self._loaded_count(actor) >= limit:
            if actor.scheduler.queue_depth == 0:
                return False
            victims = eviction_candidates(self.models.values(), exclude=actor)
            if victims:
                log.info("model=%s evicting idle model %s", actor.name, victims[0].name)
                await victims[0].unload()
                continue
            await self._changed.wait()
        return True

    async def _startup_load(self, actor: ModelActor) -> None:
        try:
            await actor.load()
        except PoolError as exc:
            log.warning("model=%s startup load failed: %s", actor.name, exc.message)


@asynccontextmanager
async def open_pool(
    settings: Settings,
    *,
    startup_loads: bool = True,
    gpus: GpuSource | None = None,
    media: MediaLoader | None = None,
) -> AsyncIterator[Pool]:
    """Start the actor tree for ``settings`` and yield the :class:`Pool`.

    Models with ``enabled: true`` are loaded before this yields (a failed one is left
    ``failed``; the pool still opens). Leaving the block cancels every request and
    releases every runtime, each bounded by ``engine.unload_timeout_s``.

    Args:
        gpus: where GPU memory readings come from (``serve`` passes its NVML monitor).
        media: the image loader (default: one for ``settings.service``; tests inject
            one with their own resolver).
    """
    pool = Pool(settings, gpus=gpus, media=media)
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
