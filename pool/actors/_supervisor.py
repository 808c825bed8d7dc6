"""The pool supervisor: the root of the actor tree and the embedded API.

``open_pool`` holds the root nursery; every model actor lives in it for the life of
the pool, beside the residency owner (``_residency.py``), the only way a model is
loaded, reloaded or evicted. Requests are served in the caller's task (an HTTP handler
or an embedded caller): admission and queueing happen there, generation happens in
the replica that the scheduler picked, and the two meet through the request's
:class:`Ticket`; a request that waits for its model waits as ``_waits.py`` says.

The pool speaks typed values only: an :class:`InferenceRequest` in, :class:`Delta`,
:class:`Finished` and :class:`Failed` events out, snapshots for state. Every wire
format is rendered from these in ``pool/http``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from pool.actors.accounting._budgets import BudgetCounters, Budgets, Spent, Subject
from pool.actors.accounting._rate_limit import RateLimiter
from pool.actors.accounting._usage import UsageRecorder, UsageSink
from pool.actors.accounting._usage_store import FILE_NAME as USAGE_FILE_NAME
from pool.actors.accounting._usage_store import Bucket, GroupBy, UsageStore, UsageTotal
from pool.actors.models._metrics import PoolMetrics
from pool.actors.models._model import ModelActor
from pool.actors.residency._decisions import Decision
from pool.actors.residency._footprints import FootprintStore, default_path
from pool.actors.residency._gpu import GpuSource, NoGpus, VirtualGpus
from pool.actors.residency._ledger import LedgerBinding, SharedLedger
from pool.actors.residency._plan import LoadPlan
from pool.actors.residency._residence import Residence
from pool.actors.residency._residency import Residency
from pool.actors.residency._tasks import LoadTask, LoadTasks
from pool.actors.residency._vram import CudaContexts, LoadMeter
from pool.actors.serving import _health
from pool.actors.serving._admission import Admission
from pool.actors.serving._relay import Router
from pool.actors.serving._request import (
    EmbeddingRequest,
    InferenceRequest,
    PoolRequest,
    TaskRequest,
)
from pool.actors.serving._serving import Serving
from pool.actors.values._events import Completed, Embedded, Event, Finished
from pool.actors.values._snapshots import (
    FlushResult,
    GpuView,
    ModelSnapshot,
    PoolHealth,
    QueueStats,
    adapter_rows,
)
from pool.backends import CacheUsage, LoadRequest
from pool.config import LoraAdapter, Settings, state_dir
from pool.errors import PoolError
from pool.media import MediaLoader
from pool.pulls import PullEvents, PullHandle, PullManager

if TYPE_CHECKING:
    from pool.actors.serving._trace_protocol import Tracing

log = logging.getLogger("pool")

# How long a shutdown waits for the last spans to reach the collector.
TRACE_FLUSH_S = 10.0

T = TypeVar("T")

LoadBody = LoadPlan | LoadRequest | Mapping[str, Any] | None


@dataclass(frozen=True)
class PoolParts:
    """What :meth:`Pool.parts_for_tests` shows of a pool's inside."""

    residency: Residency
    models: Mapping[str, ModelActor]
    gpus: GpuSource
    footprints: FootprintStore
    contexts: CudaContexts
    usage: UsageRecorder | None
    router: Router | None
    tracing: Tracing | None
    metrics: PoolMetrics


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
        budget_counters: BudgetCounters | None = None,
        usage_sink: UsageSink | None = None,
        clock: Callable[[], float] = time.time,
        tracing: Tracing | None = None,
    ) -> None:
        self.settings = settings
        # Where the spans of requests go (pool/tracing); None: the pool does not trace.
        self._tracing = tracing
        # Sends requests for models that peers serve to them (pool.cluster).
        self._router = router
        # Leases shared with other GPU users (pool.cluster); None: this pool alone.
        self._ledger = ledger
        self.started_at = time.time()
        self.shutting_down = False
        self._nursery: trio.Nursery | None = None
        self._models: dict[str, ModelActor] = {}
        self._wire_residency(gpus)
        self._metrics = PoolMetrics(lambda: self._models.values(), lambda: self._gpus.view().gpus)
        self._wire_models()
        self._wire_accounting(budget_counters, usage_sink, clock)
        # Images named by URL become inline data here, once, for every surface.
        self._media = media or MediaLoader(settings.service)
        self._serving = Serving(
            settings,
            self._residency,
            router=router,
            rate_limiter=self._rate_limiter,
            media=self._media,
            metrics=self._metrics,
            shutting_down=lambda: self.shutting_down,
            nursery=lambda: self._nursery,
            budgets=self._budgets,
            usage=self._usage,
            tracing=tracing,
        )
        self._pulls = PullManager(settings, self._models)
        self._load_tasks = LoadTasks(
            self._residency, self._pulls, settings.base_dir, settings.service.max_load_tasks
        )

    def _wire_residency(self, gpus: GpuSource | None) -> None:
        """The GPUs, what was measured on them, and the residency owner over them."""
        budgets = self.settings.engine.gpu_budget_mib
        if gpus is None and budgets:
            # No GPU source given and budgets declared: virtual GPUs (see VirtualGpus).
            gpus = VirtualGpus(budgets)
        self._gpus: GpuSource = gpus or NoGpus()
        # Footprints are kept only where there is a GPU to measure them on.
        measurable = isinstance(gpus, VirtualGpus) or bool(self._gpus.view().gpus)
        self._footprints = FootprintStore(default_path() if measurable else None)
        meter = LoadMeter(self._gpus)
        self._contexts = CudaContexts(
            self._footprints, lambda actor: self._residency.charges(exclude=[actor])[0]
        )
        self._residency = residency = Residency(
            self.settings,
            self._models,
            self._gpus,
            contexts=self._contexts,
            meter=meter,
            footprints=self._footprints,
            ledger=self._ledger,
        )
        if isinstance(gpus, VirtualGpus):
            gpus.bind(residency.runtime_holdings)
        if self._ledger is not None:
            self._ledger.bind(
                LedgerBinding(residency.notify_change, residency.lease_holdings, residency.budgets)
            )

    def _wire_models(self) -> None:
        """One actor per configured model, loaded and unloaded by the residency owner."""
        router = self._router
        for name, definition in self.settings.engine.models.items():
            self._models[name] = ModelActor(
                name,
                definition,
                self.settings,
                metrics=self._metrics,
                on_change=self._residency.notify_change,
                loader=self._residency,
                residence=self._residency.residence_for,
                on_recent_prompts=router.prompts_changed if router is not None else None,
            )

    def _wire_accounting(
        self,
        budget_counters: BudgetCounters | None,
        usage_sink: UsageSink | None,
        clock: Callable[[], float],
    ) -> None:
        """Rate limits, budgets and the usage record of what requests spent."""
        service = self.settings.service
        self._rate_limiter = RateLimiter(service.tenancy)
        self._metrics.max_tenant_labels = service.usage.metrics_max_tenants
        self._budgets = Budgets(service.budgets, budget_counters, clock)
        # The usage database (None: service.usage.enabled is off); the recorder writes
        # to it, or to the sink a test gives.
        self._usage_store: UsageStore | None = None
        self._usage: UsageRecorder | None = None
        if service.usage.enabled:
            self._usage_store = UsageStore(state_dir() / USAGE_FILE_NAME)
            self._usage = UsageRecorder(
                service.usage,
                usage_sink or self._usage_store,
                self._metrics,
                clock,
                limiter=None if usage_sink else self._usage_store.write_limiter,
            )

    def model(self, name: str) -> ModelActor:
        return self._residency.model(name)

    @property
    def evictions(self) -> int:
        """How many models the pool evicted to make room since it started."""
        return self._residency.evictions

    # -- lifecycle: every load goes through the residency owner -------------------------
    async def load(self, name: str, body: LoadBody = None) -> ModelSnapshot:
        """Load a configured model; returns its snapshot when the load has finished.

        On GPUs (real or virtual) the load must fit: idle models that may be evicted
        for it are unloaded first (docs/vram.md); if it still does not fit it fails
        with ``load_failed`` at once rather than waiting.
        """
        return await self._residency.load(name, body)

    def preview_load(self, name: str, body: LoadBody = None) -> dict[str, Any]:
        """What :meth:`load` would do now, changing nothing (see Residency.preview)."""
        return self._residency.preview(name, body)

    async def unload(self, name: str) -> ModelSnapshot:
        return await self._residency.unload(name)

    async def preload(self, name: str, hint: dict[str, Any] | None = None) -> ModelSnapshot:
        """Load ``name`` as a request to it would (Ollama's empty request): through the
        VRAM gate as :meth:`load`, with ``hint`` (load overrides, e.g. the context
        length a client asked for) applied if this call starts the load and the backend
        accepts it; an unsuitable hint is ignored, as on an on-demand load.
        """
        return await self._residency.preload(name, hint)

    def decisions(self, model: str | None = None, limit: int | None = None) -> list[Decision]:
        """The latest residency decisions, newest first (about ``model`` if given)."""
        if model is not None:
            self.model(model)
        return self._residency.decisions.recent(model, limit)

    def snapshot(self, name: str) -> ModelSnapshot:
        """The row of model ``name``, or of the LoRA adapter of that name (its base's
        state, with ``parent`` and ``adapter``).

        Raises:
            PoolError: ``unknown_model``.
        """
        actor, adapter = self._residency.serving(name)
        row = actor.snapshot()
        if adapter is None:
            return row
        return next(r for r in adapter_rows(row) if r.name == name)

    def snapshots(self, *, adapters: bool = False) -> list[ModelSnapshot]:
        """Every model's row; with ``adapters``, each LoRA adapter's row after its
        base's (the base's state and numbers, with ``parent`` and ``adapter`` set): what
        model lists show. Sums over models (queues, memory) take the bases alone."""
        rows = []
        for actor in self._models.values():
            row = actor.snapshot()
            rows.append(row)
            if adapters:
                rows.extend(adapter_rows(row))
        return rows

    def serving_model(self, name: str) -> ModelActor:
        """The model that serves requests for ``name``: itself, or an adapter's base.

        Raises:
            PoolError: ``unknown_model``.
        """
        return self._residency.serving(name)[0]

    async def add_adapter(
        self, base: str, adapter: LoraAdapter | Mapping[str, Any]
    ) -> ModelSnapshot:
        """Serve LoRA ``adapter`` on model ``base`` (docs/backends.md, "LoRA adapters"),
        without reloading it; the base's row.

        Raises:
            PoolError: ``unknown_model`` for ``base``; ``invalid_request`` for a name
                that another model or adapter has, or a file that cannot be loaded;
                ``invalid_load_request`` where the backend takes no adapter now;
                ``load_failed`` where its file does not fit on the base's GPUs.
            pydantic.ValidationError: ``adapter`` is a dict that fails its schema.
        """
        actor, spec = self._adapter_for(base, adapter)
        fits, reason = self._residency.adapter_room(actor, actor.check_adapter(spec))
        if not fits:
            self._residency.decisions.record("refuse", spec.name, reason, for_model=base)
            raise PoolError("load_failed", f"adapter {spec.name!r}: {reason}")
        return await actor.add_adapter(spec)

    def preview_adapter(
        self, base: str, adapter: LoraAdapter | Mapping[str, Any]
    ) -> dict[str, Any]:
        """What :meth:`add_adapter` would do now, changing nothing (a load preview's
        shape: ``fits``, the base's ``gpus`` and the adapter's MiB on each, ``error``)."""
        actor, spec = self._adapter_for(base, adapter)
        return self._residency.preview_adapter(actor.name, spec)

    def _adapter_for(
        self, base: str, adapter: LoraAdapter | Mapping[str, Any]
    ) -> tuple[ModelActor, LoraAdapter]:
        actor = self.model(base)
        spec = adapter if isinstance(adapter, LoraAdapter) else LoraAdapter.model_validate(adapter)
        if spec.name in self._models:
            raise PoolError("invalid_request", f"adapter name {spec.name!r} is a model's name")
        for other in self._models.values():
            if other is not actor and spec.name in other.adapters:
                raise PoolError(
                    "invalid_request", f"adapter {spec.name!r} is already on model {other.name!r}"
                )
        return actor, spec

    async def remove_adapter(self, base: str, name: str) -> ModelSnapshot:
        """Stop serving adapter ``name`` of ``base``; its running requests finish first.

        Raises:
            PoolError: ``unknown_model`` for ``base`` or an adapter it does not have.
        """
        return await self.model(base).remove_adapter(name)

    async def wait_change(self) -> None:
        """Wait until a model changes state or goes idle (for whoever pushes state out)."""
        await self._residency.changed.wait()

    def servable_models(self) -> list[str]:
        return [n for n, a in self._models.items() if a.state == "loaded" or a.loads_on_request]

    # -- inference ---------------------------------------------------------------
    def admit(
        self,
        request: PoolRequest,
        *,
        tenant: str = "default",
        priority: str = "normal",
        request_id: str | None = None,
        load_hint: dict[str, Any] | None = None,
        report_waits: bool = False,
        heartbeat_s: float | None = None,
    ) -> AbstractAsyncContextManager[Admission]:
        """Validate, queue and wait for a replica slot; yields the :class:`Admission`
        (see :meth:`Serving.admit`: waits, errors, leaving the block)."""
        return self._serving.admit(
            request,
            tenant=tenant,
            priority=priority,
            request_id=request_id,
            load_hint=load_hint,
            report_waits=report_waits,
            heartbeat_s=heartbeat_s,
        )

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
        self._metrics.prompt_tokens.labels(request.model).inc(tokens)
        self._rate_limiter.charge_tokens(admission.ticket.tenant, tokens)
        return done

    async def run_task(self, request: TaskRequest, **kwargs: Any) -> Completed:
        """Run a task request to its answer: the :class:`Completed` event, or its error
        raised. A streamed task is read from :meth:`admit` with
        :meth:`Admission.task_events` instead."""
        async with self.admit(request, **kwargs) as admission:
            done = await admission.task_result()
        # Counted in the metrics and the tenant's token rate as an embedding's tokens are.
        tokens = done.usage.prompt_tokens or 0
        self._metrics.prompt_tokens.labels(request.model).inc(tokens)
        self._rate_limiter.charge_tokens(
            admission.ticket.tenant, tokens + (done.usage.output_tokens or 0)
        )
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

    async def usage_totals(
        self,
        group_by: GroupBy,
        *,
        since: float | None = None,
        until: float | None = None,
        bucket: Bucket | None = None,
    ) -> list[UsageTotal]:
        """Recorded usage summed by key, tenant or model over ``[since, until)`` (epoch
        seconds), per UTC hour or day with ``bucket``. Records still queued for the
        writer (at most ``service.usage.flush_ms`` old) are not in it yet.

        Raises:
            PoolError: ``usage_disabled`` when ``service.usage.enabled`` is off.
        """
        if self._usage_store is None:
            raise PoolError(
                "usage_disabled", "usage recording is off (service.usage.enabled is false)"
            )
        return await self._usage_store.query(group_by, since=since, until=until, bucket=bucket)

    async def restore_budgets(self) -> None:
        """Start this pool's budget counters from the usage database: what keys and
        tenants spent in the current windows before a restart still counts."""
        if self._usage_store is None or not self._budgets.enabled:
            return
        spent: dict[tuple[Subject, float], dict[str, Spent]] = {}
        for subject, since in self._budgets.current_windows():
            totals = await self._usage_store.query(subject, since=since)
            named = [t for t in totals if t.group is not None]
            spent[(subject, since)] = {
                str(t.group): Spent(
                    tokens=t.prompt_tokens + t.output_tokens,
                    requests=t.requests,
                    audio_seconds=math.ceil(t.audio_seconds),
                    characters=t.characters,
                    load_ms=round(t.load_seconds * 1000),
                )
                for t in named
            }
        self._budgets.restore(spent)

    # -- runner API -------------------------------------------------------------------
    def start_load_task(
        self, name: str, body: LoadBody = None, evict: str | None = None
    ) -> LoadTask:
        """Start loading ``name`` in the background (after unloading ``evict``).

        Raises:
            PoolError: at once, for an unknown model or ``evict``, or a body that does not
                suit the backend (``invalid_load_request``).
            pydantic.ValidationError: ``body`` is a dict that fails the load schema.
        """
        if self._nursery is None or self.shutting_down:
            raise PoolError("shutting_down", "the pool is shutting down", retry_after_s=5.0)
        return self._load_tasks.start(self._nursery, name, body, evict)

    def load_task(self, task_id: str) -> LoadTask:
        """The load task ``task_id`` (``not_found`` once forgotten or never started)."""
        return self._load_tasks.get(task_id)

    def latest_load_task(self, name: str) -> LoadTask | None:
        """The most recent load task of ``name`` still remembered, if any."""
        return self._load_tasks.latest(name)

    def residence(self, name: str) -> Residence:
        """What the residency owner keeps about ``name``: its estimates, details and
        measured loads (``not_found`` for an unknown model)."""
        return self._residency.residence(name)

    def expected_load_s(self, name: str) -> float | None:
        """How long a whole load of ``name`` like the last measured one takes (None
        before a first)."""
        return self._residency.expected_load_s(name)

    def load_eta_s(self, name: str) -> float | None:
        """Seconds until the running load of ``name`` should end (None: not loading, or
        never measured)."""
        return self._residency.load_eta_s(name)

    def gpu_view(self) -> GpuView:
        """The GPUs' memory as last read (an empty view where the pool has none)."""
        return self._gpus.view()

    def lease_status(self) -> Mapping[str, Any] | None:
        """The shared lease ledger's state (None: this pool leases alone)."""
        return None if self._ledger is None else self._ledger.status()

    # -- pulls (pool/pulls) ------------------------------------------------------------
    def pull(self, name: str, source: str | None = None, sha256: str | None = None) -> PullHandle:
        """Start pulling ``name`` into the model store, or join its running pull (see
        :meth:`PullManager.pull`)."""
        return self._pulls.pull(name, source, sha256)

    def watch_pull(
        self, name: str, heartbeat_s: float | None = None
    ) -> AbstractAsyncContextManager[PullEvents]:
        """Follow the current or last pull of ``name`` (see :meth:`PullManager.watch`)."""
        return self._pulls.watch(name, heartbeat_s)

    def pull_handle(self, name: str) -> PullHandle | None:
        """The current or last pull of ``name``, if any."""
        return self._pulls.get(name)

    def pull_status(self, name: str) -> dict[str, Any] | None:
        """The state of the current or last pull of ``name`` (None: never pulled)."""
        return self._pulls.status(name)

    def pull_statuses(self) -> list[dict[str, Any]]:
        """The current or last pull of each configured model that has one."""
        return [status for name in self._models if (status := self._pulls.status(name)) is not None]

    def running_pulls(self) -> dict[str, dict[str, Any]]:
        """The state of each pull still running, by model."""
        return self._pulls.running()

    async def cancel_pull(self, name: str) -> bool:
        """Cancel the running pull of ``name``; False if none runs."""
        return await self._pulls.cancel(name)

    async def delete_pulled(self, name: str) -> bool:
        """Remove ``name`` from the model store; False if it is not there (see
        :meth:`PullManager.delete`)."""
        return await self._pulls.delete(name)

    async def stored_models(self) -> list[str]:
        """The models pulled into the store."""
        return await self._pulls.stored_models()

    # -- the HTTP server and the cluster -----------------------------------------------
    @property
    def traced(self) -> bool:
        """Whether requests' spans are recorded (pool/tracing)."""
        return self._tracing is not None

    def rate_limit_headers(self, tenant: str) -> dict[str, str]:
        """The ``X-RateLimit-*`` figures of ``tenant`` (none where it has no limit)."""
        return self._rate_limiter.headers(tenant)

    def render_metrics(self) -> bytes:
        """The Prometheus exposition of the pool's metrics."""
        return self._metrics.render()

    def begin_shutdown(self) -> None:
        """Admit nothing more (``shutting_down``); running requests go on."""
        self.shutting_down = True

    def end_running(self, error: PoolError) -> int:
        """End every running request with ``error``; how many there were."""
        return sum(actor.end_running(error) for actor in self._models.values())

    def model_state(self, name: str) -> str | None:
        """The state of ``name`` on this node (None: not configured here)."""
        actor = self._models.get(name)
        return None if actor is None else actor.state

    def loaded_models(self) -> list[str]:
        """The models loaded on this node."""
        return [name for name, actor in self._models.items() if actor.state == "loaded"]

    def relays_chat(self, name: str) -> bool:
        """Whether a Chat Completions request for ``name`` may be relayed on the
        pass-through path: its backend relays a Chat Completions upstream, or a cluster
        peer (reached over Chat Completions) may serve it."""
        if self._router is not None:
            return True
        try:
            return self.model(name).capabilities.relays_chat
        except PoolError:
            return False

    @property
    def clustered(self) -> bool:
        """Whether this pool is one node of a cluster (pool.cluster)."""
        return self._router is not None

    @property
    def node_id(self) -> str:
        """This node's id in its cluster (only where :attr:`clustered`)."""
        assert self._router is not None
        return self._router.node_id

    def peer_models(self) -> list[Mapping[str, Any]]:
        """The models of the cluster's other nodes (none outside a cluster)."""
        return [] if self._router is None else list(self._router.peer_models())

    def parts_for_tests(self) -> PoolParts:
        """The pool's parts, for tests that check one from inside; code uses the
        operations above."""
        return PoolParts(
            residency=self._residency,
            models=self._models,
            gpus=self._gpus,
            footprints=self._footprints,
            contexts=self._contexts,
            usage=self._usage,
            router=self._router,
            tracing=self._tracing,
            metrics=self._metrics,
        )

    # -- state taken together (pool/actors/serving/_health.py) -----------------------------------
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
        actors = [self.model(model)] if model else list(self._models.values())
        return await _health.flush_caches(actors, scope, tenant=tenant, tag=tag)

    def prefix_caching(self) -> bool:
        """Whether any loaded replica keeps a prefix cache (one the pool can flush)."""
        return _health.prefix_caching(self._models.values())

    def cache_usage(self) -> CacheUsage | None:
        """The prompt caches of every loaded replica together (None: no runtime has one)."""
        return _health.cache_usage(self._models.values())

    def health(self) -> PoolHealth:
        """Whether the pool serves, and why not."""
        return _health.health(
            self._models.values(),
            started_at=self.started_at,
            shutting_down=self.shutting_down,
            oom_window_s=self.settings.service.health_oom_window_s,
        )

    def queue_stats(self) -> QueueStats:
        """Every model's queue together; ``max_depth`` counts loaded models only (at
        most ``engine.max_queue_total``)."""
        return _health.queue_stats(self._models.values(), self.settings.engine.max_queue_total)


@asynccontextmanager
async def open_pool(
    settings: Settings,
    *,
    startup_loads: bool = True,
    gpus: GpuSource | None = None,
    media: MediaLoader | None = None,
    ledger: SharedLedger | None = None,
    router: Router | None = None,
    budget_counters: BudgetCounters | None = None,
    usage_sink: UsageSink | None = None,
    clock: Callable[[], float] = time.time,
    tracing: Tracing | None = None,
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
        budget_counters: where budgets count (``pool.cluster`` shares them through
            Redis); by default in this process.
        usage_sink: where usage batches are written instead of ``usage.sqlite3``
            (tests give one that fails or stalls).
        clock: seconds since the epoch, for budget windows and usage retention.
        tracing: where the requests' spans go (``pool.tracing.open_tracing``, which
            ``pool.open_pool`` and ``serve`` call with the settings); None: no spans. The
            pool flushes it when it closes.
    """
    pool = Pool(
        settings,
        gpus=gpus,
        media=media,
        ledger=ledger,
        router=router,
        budget_counters=budget_counters,
        usage_sink=usage_sink,
        clock=clock,
        tracing=tracing,
    )
    try:
        await trio.to_thread.run_sync(pool._footprints.read)
        if budget_counters is None:
            await pool.restore_budgets()
        async with trio.open_nursery() as nursery:
            pool._nursery = nursery
            if pool._usage is not None:
                await nursery.start(pool._usage.run)
            for actor in pool._models.values():
                await nursery.start(actor.run)
            await nursery.start(pool._residency.run)
            await nursery.start(pool._pulls.run)
            if startup_loads:
                await pool._residency.startup()
            try:
                yield pool
            finally:
                pool.shutting_down = True
                nursery.cancel_scope.cancel()
    finally:
        if pool._usage_store is not None:
            # Bounded: behind a stalled disk the close is skipped rather than waited for.
            with trio.move_on_after(2.0, shield=True):
                await pool._usage_store.aclose()
        if tracing is not None:
            # Every request has ended, so has its span: export what is queued. Bounded
            # (a collector that is down must not hold the shutdown), as the exporter's
            # own timeout is; a thread left behind then is the SDK's daemon thread.
            with trio.move_on_after(TRACE_FLUSH_S, shield=True):
                await trio.to_thread.run_sync(tracing.shutdown, abandon_on_cancel=True)
