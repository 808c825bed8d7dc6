"""The runner API: capabilities, async load tasks, unload, cache flush, health, metrics."""

from __future__ import annotations

import math
import socket
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel
from quart import Quart, Response

from pool._version import __version__
from pool.actors import LoadTask, ModelSnapshot, Pool, PoolHealth
from pool.backends import LoadRequest, context_field
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    json_response,
    parse_json,
    raw_body,
    require,
    validate,
)
from pool.schemas import CacheFlushRequest, RunnerLoadRequest, RunnerUnloadRequest

T = TypeVar("T", bound=BaseModel)

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def authorized_body(ctx: AppContext, model: type[T], operation: str) -> T:
    """The body of a lifecycle route, read as ``model`` once the caller is authorized.

    The ``verifiedOpToken`` travels in the body, so the body is parsed first, but only
    for the token and the model it names: a caller without a valid token or admin bearer
    gets 401 whatever else the body holds (not a 400 or 422 about its shape).
    """
    raw = await raw_body()
    try:
        data = parse_json(raw)
    except PoolError:
        data = None
    fields = data if isinstance(data, dict) else {}
    named = fields.get("modelId")
    authorize_lifecycle(
        ctx,
        fields.get("verifiedOpToken"),
        operation,
        named if isinstance(named, str) else None,
    )
    return validate(model, parse_json(raw))


def authorize_lifecycle(ctx: AppContext, token: Any, operation: str, model: str | None) -> None:
    """A valid ``verifiedOpToken``, or the admin bearer token where one is configured."""
    if token is not None:
        ctx.auth.verify_op_token(token, operation=operation, model=model)
        return
    if ctx.auth.op_tokens_enabled and not ctx.auth.has_admin_token:
        raise PoolError("unauthorized", f"{operation} needs a verifiedOpToken")
    require(ctx, "admin")


def health_body(health: PoolHealth, cluster: Mapping[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "status": health.status,
        "uptime": round(health.uptime_s),
        "modelsLoaded": health.models_loaded,
        "queueDepth": health.queue_depth,
    }
    if health.reason is not None:
        body["reason"] = health.reason
    if health.issues:
        body["reasons"] = issue_bodies(health)
    if cluster is not None:
        # A node that cannot reach Redis still serves its own models: it says so here.
        body["cluster"] = dict(cluster)
    return body


def issue_bodies(health: PoolHealth) -> list[dict[str, Any]]:
    """What degrades the pool, one ``{"code", "model", ...}`` per issue (docs/api.md)."""
    return [{"code": issue.code, "model": issue.model, **issue.details} for issue in health.issues]


def cluster_status(pool: Pool) -> Mapping[str, Any] | None:
    """The cluster membership (docs/cluster.md), or None for a pool on its own."""
    return pool.ledger.status() if pool.ledger is not None else None


def load_task_body(task: LoadTask) -> dict[str, Any]:
    body: dict[str, Any] = {
        "taskId": task.task_id,
        "status": task.status,
        "modelId": task.model,
        "createdAt": math.floor(task.created_at),
        "progress": task.progress,
    }
    if task.status == "loading":
        # "fetching": the model is being pulled into the store first.
        body["phase"] = task.phase
    if task.evict:
        body["evictModel"] = task.evict
    if task.load_time_ms is not None:
        body["loadTimeMs"] = round(task.load_time_ms)
    if task.status == "completed":
        body["gpuMemoryUsedMB"] = task.gpu_memory_used_mb
    if task.error is not None:
        body["error"] = task.error
        body["errorCode"] = task.error_code
    return body


def _loaded_model(snapshot: ModelSnapshot) -> dict[str, Any]:
    return {
        "id": snapshot.name,
        "backend": snapshot.definition.backend,
        "contextLength": snapshot.context_length,
        "loadedAt": round(snapshot.loaded_at_wall or 0),
        "gpuMemoryMB": snapshot.vram.mib,
        "replicas": snapshot.loaded_replicas,
    }


def _fetching(pool: Pool, model: str) -> bool:
    task = pool.load_tasks.latest(model)
    return task is not None and task.status == "loading" and task.phase == "fetching"


def _load_progress(pool: Pool, model: str) -> float | None:
    """The progress of the model's running load task (None: loaded another way)."""
    task = pool.load_tasks.latest(model)
    return task.progress if task is not None and task.status == "loading" else None


def capabilities_body(ctx: AppContext) -> dict[str, Any]:
    """The runner descriptor of ``GET /v1/capabilities``."""
    pool = ctx.pool
    snapshots = pool.snapshots()
    view = pool.gpus.view()
    gpus = view.gpus
    queue = pool.queue_stats()
    health = pool.health()
    cache = pool.cache_usage()
    readings = [g.utilization for g in gpus if g.utilization is not None]
    body: dict[str, Any] = {
        "runnerType": f"llm-pool-{__version__}",
        "runnerId": ctx.settings.service.runner_id or socket.gethostname(),
        "models": {
            "loaded": [_loaded_model(s) for s in snapshots if s.state == "loaded"],
            "loading": [
                {"id": s.name, "progress": _load_progress(pool, s.name), "eta": None}
                for s in snapshots
                if s.state == "loading" or _fetching(pool, s.name)
            ],
            "available": [s.name for s in snapshots if s.state in ("unloaded", "failed")],
        },
        "resources": {
            "gpuIds": [g.index for g in gpus],
            "gpuMemoryTotalMB": sum(g.total_mib for g in gpus),
            "gpuMemoryUsedMB": sum(g.used_mib for g in gpus),
            "gpuMemoryFreeMB": sum(g.total_mib - g.used_mib for g in gpus),
            # NVML's busy share over its last sample period, averaged over the GPUs.
            "gpuUtilization": round(sum(readings) / len(readings), 3) if readings else None,
            # The prompt caches the pool manages (llama_cpp's saved states); null where
            # no loaded runtime can tell.
            "kvCacheSizeMB": None if cache is None else round(cache.size_mib),
            "kvCacheUtilization": (
                round(cache.used_mib / cache.size_mib, 3) if cache and cache.size_mib else None
            ),
            "error": None if gpus else view.error,
        },
        "queue": {
            "depth": queue.depth,
            "maxDepth": queue.max_depth,
            "avgWaitMs": round(queue.avg_wait_ms, 1),
            "p95WaitMs": round(queue.p95_wait_ms, 1),
        },
        "capabilities": {
            "streaming": True,
            "prefixCaching": pool.prefix_caching(),
            "multiTenant": True,
            "visionInput": any("image" in s.capabilities.modalities for s in snapshots),
            "audioInput": False,
            "functionCalling": any(s.capabilities.tools for s in snapshots),
            "structuredOutput": any(s.capabilities.structured_output for s in snapshots),
            "embeddings": any(s.capabilities.embeddings for s in snapshots),
        },
        "health": health.status,
        "healthReason": health.reason,
    }
    cluster = cluster_status(pool)
    if cluster is not None:
        body["cluster"] = dict(cluster)
    return body


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool

    @app.get("/v1/capabilities")
    async def capabilities() -> Response:
        """What this runner serves and how busy it is."""
        require(ctx, "inference")
        body = capabilities_body(ctx)
        return json_response(body, 503 if body["health"] == "unhealthy" else 200)

    @app.post("/v1/models/load")
    async def runner_load() -> Response:
        """Start loading a model in the background (202 with a task id)."""
        body = await authorized_body(ctx, RunnerLoadRequest, "model-load")
        actor = pool.model(body.modelId)
        if body.quantization is not None:
            raise PoolError(
                "invalid_load_request",
                "a model id has one quantization; configure another model id for another",
            )
        # The admin load body's schema: a bad shape is 422 here, as on the admin route,
        # before any rule of the backend (400, checked when the task starts).
        load = validate(LoadRequest, body.overrides, at=("overrides",))
        if body.maxContextLength is not None:
            field = context_field(actor.definition.backend)
            if field is None:
                raise PoolError(
                    "invalid_load_request",
                    f"backend {actor.definition.backend!r} has no context-length override",
                )
            load = validate(LoadRequest, {**body.overrides, field: body.maxContextLength})
        if body.gpuMemoryBudgetMB is not None:
            estimate = actor.vram_estimate().mib
            if estimate is not None and estimate > body.gpuMemoryBudgetMB:
                raise PoolError(
                    "invalid_load_request",
                    f"model {body.modelId!r} needs about {estimate} MiB, over the budget of"
                    f" {body.gpuMemoryBudgetMB} MiB",
                )
        task = pool.start_load_task(body.modelId, load, body.evictModel)
        return json_response(load_task_body(task) | {"eta": None}, 202)

    @app.get("/v1/models/load/<task_id>")
    async def runner_load_status(task_id: str) -> Response:
        """The state of a load task: loading, completed or failed, with timings."""
        require(ctx, "admin")
        return json_response(load_task_body(pool.load_tasks.get(task_id)))

    @app.post("/v1/models/unload")
    async def runner_unload() -> Response:
        """Unload a model gracefully and say how much memory it held."""
        body = await authorized_body(ctx, RunnerUnloadRequest, "model-unload")
        actor = pool.model(body.modelId)
        before = actor.snapshot()
        was_loaded = before.state == "loaded"
        await pool.detached(pool.unload, body.modelId)
        return json_response(
            {
                "modelId": body.modelId,
                "gpuMemoryFreedMB": before.vram.mib if was_loaded else 0,
                "gpuMemoryFreedSource": before.vram.source,
                "kvCacheFlushed": was_loaded,
            }
        )

    @app.post("/v1/cache/flush")
    async def cache_flush() -> Response:
        """Flush prompt caches by scope (backends without one report nothing removed)."""
        body = await authorized_body(ctx, CacheFlushRequest, "cache-flush")
        if body.scope == "model" and not body.modelId:
            raise PoolError("invalid_request", "scope model needs modelId")
        if body.scope == "tenant" and not body.tenantId:
            raise PoolError("invalid_request", "scope tenant needs tenantId")
        if body.scope == "tag" and not body.tag:
            raise PoolError("invalid_request", "scope tag needs tag")
        result = await pool.flush_cache(
            body.scope, model=body.modelId, tenant=body.tenantId, tag=body.tag
        )
        return json_response(
            {
                "flushed": True,
                "entriesRemoved": result.entries_removed,
                "memoryFreedMB": round(result.memory_freed_mib),
            }
        )

    @app.get("/health")
    async def health() -> Response:
        """200 while serving (``healthy``, or ``degraded`` with its ``reasons``); 503 with
        the reason when every model failed or on shutdown."""
        health = pool.health()
        body = health_body(health, cluster_status(pool))
        return json_response(body, 200 if health.serving else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition."""
        require(ctx, "admin")
        return Response(pool.metrics.render(), content_type=PROMETHEUS_TYPE)
