"""The pool supervisor: the root of the actor tree and the embedded API.

``open_pool`` holds the root nursery; every model actor lives in it for the life of
the pool. Requests are served in the caller's task (an HTTP handler or an embedded
caller): admission and queueing happen there, generation happens in the replica that
the scheduler picked, and the two meet through the request's :class:`Ticket`.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import trio

from pool._version import __version__
from pool.actors._intake import build_generation_request
from pool.actors._keep_alive import eviction_candidates
from pool.actors._metrics import PoolMetrics
from pool.actors._model import ModelActor
from pool.actors._pulls import PullManager
from pool.actors._rate_limit import RateLimiter
from pool.actors._stats import percentile
from pool.actors._tasks import LoadTask, LoadTasks
from pool.actors._ticket import Delta, Failed, Finished, Ticket
from pool.config import LoadRequest, Settings, validate_load_request
from pool.errors import PoolError
from pool.schemas import OutputText, ResponseEnvelope, ResponseMetrics, ResponseRequest

log = logging.getLogger("pool")

T = TypeVar("T")


def new_request_id() -> str:
    return "resp_" + uuid.uuid4().hex


def build_metrics(ticket: Ticket, finished: Finished, admitted_at: float) -> ResponseMetrics:
    """The nested timers of one request, from what the replica and the ticket saw."""
    stats = finished.stats
    assert ticket.dispatched_at is not None
    engine_ms = (finished.finished_at - ticket.dispatched_at) * 1000.0
    backend_ms = finished.backend_wall_ms
    first_ms = stats.time_to_first_token_ms
    if first_ms is None:
        first_ms = finished.first_token_ms
    generate_ms = stats.generate_total_ms if stats.generate_total_ms is not None else backend_ms
    output_tokens = stats.output_tokens if stats.output_tokens is not None else finished.sent_chunks
    return ResponseMetrics(
        backend_inference_wall_ms=round(backend_ms, 3),
        engine_total_wall_ms=round(engine_ms, 3),
        engine_outside_backend_wall_ms=round(max(0.0, engine_ms - backend_ms), 3),
        pool_total_wall_ms=round((finished.finished_at - admitted_at) * 1000.0, 3),
        engine_queue_wait_ms=round(ticket.queue_wait_ms, 3),
        engine_tokenize_ms=stats.tokenize_ms,
        gpu_time_to_first_token_ms=None if first_ms is None else round(first_ms, 3),
        gpu_generate_total_ms=round(generate_ms, 3),
        gpu_decode_after_first_token_ms=(
            None if first_ms is None else round(max(0.0, generate_ms - first_ms), 3)
        ),
        engine_prompt_tokens=stats.prompt_tokens,
        engine_output_tokens=output_tokens,
        engine_tokens_per_second=(
            round(output_tokens / (generate_ms / 1000.0), 3)
            if generate_ms > 0 and output_tokens
            else None
        ),
    )


class Admission:
    """A request that has a replica slot: read its events, then close it.

    ``events()`` yields the stream events as dicts (``response.created``,
    ``response.output_text.delta``, ``response.metrics``, ``response.completed``) and
    raises :class:`PoolError` if the generation fails.
    """

    def __init__(
        self,
        ticket: Ticket,
        request_id: str,
        model: str,
        admitted_at: float,
        on_finished: Callable[[Admission, Finished], None] | None = None,
    ) -> None:
        self.ticket = ticket
        self.id = request_id
        self.model = model
        self.admitted_at = admitted_at
        self.output_text = ""
        self.metrics: ResponseMetrics | None = None
        self.finish_reason = "stop"
        self.finished: Finished | None = None
        self._on_finished = on_finished

    @property
    def queue_wait_ms(self) -> float:
        return self.ticket.queue_wait_ms

    def envelope(self) -> ResponseEnvelope:
        return ResponseEnvelope(
            id=self.id,
            model=self.model,
            output=[OutputText(text=self.output_text)],
            output_text=self.output_text,
            finish_reason=self.finish_reason,  # type: ignore[arg-type]
            metrics=self.metrics or ResponseMetrics(),
        )

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        yield {"type": "response.created", "id": self.id, "model": self.model}
        pieces: list[str] = []
        async for item in self.ticket.receive_channel:
            if type(item) is Delta:
                pieces.append(item.text)
                yield {"type": "response.output_text.delta", "delta": item.text}
            elif isinstance(item, Finished):
                self.output_text = "".join(pieces)
                self.finish_reason = item.stats.finish_reason
                self.metrics = build_metrics(self.ticket, item, self.admitted_at)
                self.finished = item
                if self._on_finished is not None:
                    self._on_finished(self, item)
                yield {"type": "response.metrics", "metrics": self.metrics.model_dump()}
                yield {"type": "response.completed", "response": self.envelope().model_dump()}
                return
            elif isinstance(item, Failed):
                raise item.error
        # The channel closed without a result: the replica was stopped under us.
        if self.ticket.error is not None:
            raise self.ticket.error
        raise PoolError("shutting_down", "the model stopped before the response completed")

    async def collect(self) -> ResponseEnvelope:
        async for _ in self.events():
            pass
        return self.envelope()


class Pool:
    """The embedded API: lifecycle commands, status rows and inference.

    Create it with :func:`open_pool`; every method is safe to call from any task.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models: dict[str, ModelActor] = {
            name: ModelActor(
                name,
                definition,
                settings,
                on_change=self._notify_change,
                request_load=self._request_on_demand_load,
            )
            for name, definition in settings.engine.models.items()
        }
        self.started_at = time.time()
        self.shutting_down = False
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self._reserved: set[ModelActor] = set()
        self.rate_limiter = RateLimiter(settings.service.tenancy)
        # Set by whoever runs a GPU monitor; read at scrape time.
        self.gpu_snapshot: Callable[[], list[dict[str, Any]]] = list
        self.gpu_error: Callable[[], str | None] = lambda: "no GPU monitor is running"
        self.load_tasks = LoadTasks(self, settings.service.max_load_tasks)
        self.pulls = PullManager(self)
        self.metrics = PoolMetrics(lambda: self.models.values(), lambda: self.gpu_snapshot())
        for actor in self.models.values():
            actor.metrics = self.metrics

    def model(self, name: str) -> ModelActor:
        try:
            return self.models[name]
        except KeyError:
            raise PoolError("unknown_model", f"model {name!r} is not configured") from None

    # -- lifecycle ---------------------------------------------------------------
    async def load(
        self, name: str, body: LoadRequest | dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Load a configured model; returns its admin row when the load has finished."""
        if isinstance(body, dict):
            body = LoadRequest.model_validate(body)
        return await self.model(name).load(body)

    async def unload(self, name: str) -> dict[str, Any]:
        return await self.model(name).unload()

    def status(self, name: str) -> dict[str, Any]:
        return self.model(name).row()

    def rows(self) -> list[dict[str, Any]]:
        return [actor.row() for actor in self.models.values()]

    def servable_models(self) -> list[str]:
        return [n for n, a in self.models.items() if a.state == "loaded" or a.definition.on_demand]

    # -- inference ---------------------------------------------------------------
    @asynccontextmanager
    async def admit(
        self,
        request: ResponseRequest,
        *,
        tenant: str = "default",
        priority: str = "normal",
        request_id: str | None = None,
        load_hint: dict[str, Any] | None = None,
    ) -> AsyncIterator[Admission]:
        """Validate, queue and wait for a replica slot; yields the :class:`Admission`.

        Leaving the block (normally, by error or by cancellation) removes the request
        from the queue or stops its generation, so nothing runs for a departed caller.

        Raises:
            PoolError: for unknown models, capability or state violations, a full
                queue (``queue_full``) or waiting past ``queue_timeout_s``.
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
                definition=actor.active_definition,
                capabilities=actor.capabilities,
                decoding_defaults=self.settings.engine.decoding,
            )
            self.rate_limiter.admit(tenant)
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
            finally:
                if not ticket.ready.is_set():
                    actor.scheduler.remove(ticket)
                ticket.abandon()
        except PoolError as exc:
            status = exc.code
            raise
        finally:
            self.metrics.requests.labels(actor.name, tenant, status).inc()

    def _record_finished(self, admission: Admission, finished: Finished) -> None:
        model = admission.model
        stats = finished.stats
        metrics = admission.metrics
        self.metrics.queue_wait.labels(model).observe(admission.queue_wait_ms / 1000.0)
        self.metrics.inference.labels(model).observe(finished.backend_wall_ms / 1000.0)
        if metrics is not None and metrics.gpu_time_to_first_token_ms is not None:
            self.metrics.first_token.labels(model).observe(
                metrics.gpu_time_to_first_token_ms / 1000.0
            )
        output = metrics.engine_output_tokens if metrics is not None else None
        self.metrics.tokens.labels(model).inc(output or 0)
        self.metrics.prompt_tokens.labels(model).inc(stats.prompt_tokens or 0)
        self.rate_limiter.charge_tokens(
            admission.ticket.tenant, (output or 0) + (stats.prompt_tokens or 0)
        )

    async def stream(
        self, request: ResponseRequest, **kwargs: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Run ``request`` and yield its stream events (see :meth:`Admission.events`).

        Close the iterator (``contextlib.aclosing``) if you stop reading early.
        """
        async with self.admit(request, **kwargs) as admission:
            async for event in admission.events():
                yield event

    async def respond(self, request: ResponseRequest, **kwargs: Any) -> ResponseEnvelope:
        """Run ``request`` to completion and return the response envelope."""
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
        self, name: str, overrides: dict[str, Any] | None = None, evict: str | None = None
    ) -> LoadTask:
        """Start loading ``name`` in the background (after unloading ``evict``)."""
        if self._nursery is None or self.shutting_down:
            raise PoolError("shutting_down", "the pool is shutting down", retry_after_s=5.0)
        return self.load_tasks.start(self._nursery, name, overrides or {}, evict)

    async def flush_cache(
        self,
        scope: str,
        *,
        model: str | None = None,
        tenant: str | None = None,
        tag: str | None = None,
    ) -> dict[str, Any]:
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
        return {"flushed": True, "entriesRemoved": entries, "memoryFreedMB": round(freed_mib)}

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(serving?, body) for ``GET /health``."""
        loaded = sum(1 for a in self.models.values() if a.state == "loaded")
        body: dict[str, Any] = {
            "status": "healthy",
            "uptime": round(time.time() - self.started_at),
            "modelsLoaded": loaded,
            "queueDepth": sum(a.scheduler.queue_depth for a in self.models.values()),
        }
        reason = None
        if self.shutting_down:
            reason = "the pool is shutting down"
        elif self.models and all(a.state == "failed" for a in self.models.values()):
            reason = "every model failed to load"
        if reason is not None:
            body["status"] = "unhealthy"
            body["reason"] = reason
        return reason is None, body

    def capabilities(self) -> dict[str, Any]:
        """The runner descriptor of ``GET /v1/capabilities``."""
        actors = list(self.models.values())
        loaded = []
        for a in actors:
            if a.state != "loaded":
                continue
            context_field = a.backend.context_field
            vram, _, _ = a.vram_estimate()
            loaded.append(
                {
                    "id": a.name,
                    "backend": a.definition.backend,
                    "contextLength": getattr(a.active_definition, context_field, None)
                    if context_field
                    else None,
                    "loadedAt": round(a.loaded_at_wall or 0),
                    "gpuMemoryMB": vram,
                    "replicas": len(a.replicas),
                }
            )
        waits = [w for a in actors for w in a.scheduler.stats.waits_ms]
        gpus = self.gpu_snapshot()
        healthy, health = self.health()
        return {
            "runnerType": f"llm-pool-{__version__}",
            "runnerId": self.settings.service.runner_id or socket.gethostname(),
            "models": {
                "loaded": loaded,
                "loading": [
                    {"id": a.name, "progress": None, "eta": None}
                    for a in actors
                    if a.state == "loading"
                ],
                "available": [a.name for a in actors if a.state in ("unloaded", "failed")],
            },
            "resources": {
                "gpuIds": [g["index"] for g in gpus],
                "gpuMemoryTotalMB": sum(g["total_mib"] for g in gpus),
                "gpuMemoryUsedMB": sum(g["used_mib"] for g in gpus),
                "gpuMemoryFreeMB": sum(g["total_mib"] - g["used_mib"] for g in gpus),
                "error": None if gpus else self.gpu_error(),
            },
            "queue": {
                "depth": sum(a.scheduler.queue_depth for a in actors),
                "maxDepth": sum(a.scheduler.max_queue for a in actors if a.state == "loaded"),
                "avgWaitMs": round(sum(waits) / len(waits), 1) if waits else 0.0,
                "p95WaitMs": round(percentile(waits, 0.95), 1),
            },
            "capabilities": {
                "streaming": True,
                "prefixCaching": False,
                "multiTenant": True,
                "visionInput": any("image" in a.capabilities.modalities for a in actors),
                "audioInput": False,
                "functionCalling": False,
            },
            "health": "healthy" if healthy else "unhealthy",
            "healthReason": health.get("reason"),
        }

    # -- on-demand loading and eviction ----------------------------------------------
    def _notify_change(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _request_on_demand_load(self, actor: ModelActor) -> None:
        # The load belongs to the pool, not to the request that triggered it: a client
        # that leaves does not cancel a load other requests may be waiting for.
        if self._nursery is None:
            actor.load_pending = False
            return
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
            actor.load_pending = False

    def _hinted_load_request(self, actor: ModelActor) -> LoadRequest | None:
        """The load overrides a triggering request hinted at, if they suit the backend."""
        if not actor.load_hint:
            return None
        try:
            body = LoadRequest.model_validate(actor.load_hint)
            validate_load_request(body, actor.definition)
        except (ValueError, PoolError) as exc:
            log.info("model=%s ignoring load hint %s: %s", actor.name, actor.load_hint, exc)
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
async def open_pool(settings: Settings, *, startup_loads: bool = True) -> AsyncIterator[Pool]:
    """Start the actor tree for ``settings`` and yield the :class:`Pool`.

    Models with ``enabled: true`` are loaded before this yields (a failed one is left
    ``failed``; the pool still opens). Leaving the block cancels every request and
    releases every runtime, each bounded by ``engine.unload_timeout_s``.
    """
    pool = Pool(settings)
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
