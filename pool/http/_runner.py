"""The runner API: capabilities, async load tasks, unload, cache flush, health, metrics."""

from __future__ import annotations

from typing import Any

from quart import Quart, Response

from pool.backends import context_field
from pool.errors import PoolError
from pool.http._common import AppContext, json_response, read_body, require
from pool.schemas import CacheFlushRequest, RunnerLoadRequest, RunnerUnloadRequest

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def authorize_lifecycle(ctx: AppContext, token: Any, operation: str, model: str | None) -> None:
    """A valid ``verifiedOpToken``, or the admin bearer token where one is configured."""
    if token is not None:
        ctx.auth.verify_op_token(token, operation=operation, model=model)
        return
    if ctx.auth.op_tokens_enabled and not ctx.auth.has_admin_token:
        raise PoolError("unauthorized", f"{operation} needs a verifiedOpToken")
    require(ctx, "admin")


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool

    @app.get("/v1/capabilities")
    async def capabilities() -> Response:
        """What this runner serves and how busy it is."""
        require(ctx, "inference")
        body = pool.capabilities()
        return json_response(body, 200 if body["health"] == "healthy" else 503)

    @app.post("/v1/models/load")
    async def runner_load() -> Response:
        """Start loading a model in the background (202 with a task id)."""
        body = await read_body(RunnerLoadRequest)
        authorize_lifecycle(ctx, body.verifiedOpToken, "model-load", body.modelId)
        actor = pool.model(body.modelId)
        if body.quantization is not None:
            raise PoolError(
                "invalid_load_request",
                "a model id has one quantization; configure another model id for another",
            )
        overrides = dict(body.overrides)
        if body.maxContextLength is not None:
            field = context_field(actor.definition.backend)
            if field is None:
                raise PoolError(
                    "invalid_load_request",
                    f"backend {actor.definition.backend!r} has no context-length override",
                )
            overrides[field] = body.maxContextLength
        if body.gpuMemoryBudgetMB is not None:
            estimate, _, _ = actor.vram_estimate()
            if estimate is not None and estimate > body.gpuMemoryBudgetMB:
                raise PoolError(
                    "invalid_load_request",
                    f"model {body.modelId!r} needs about {estimate} MiB, over the budget of"
                    f" {body.gpuMemoryBudgetMB} MiB",
                )
        task = pool.start_load_task(body.modelId, overrides, body.evictModel)
        return json_response(task.as_dict() | {"eta": None}, 202)

    @app.get("/v1/models/load/<task_id>")
    async def runner_load_status(task_id: str) -> Response:
        """The state of a load task: loading, completed or failed, with timings."""
        require(ctx, "admin")
        return json_response(pool.load_tasks.get(task_id).as_dict())

    @app.post("/v1/models/unload")
    async def runner_unload() -> Response:
        """Unload a model gracefully and say how much memory it held."""
        body = await read_body(RunnerUnloadRequest)
        authorize_lifecycle(ctx, body.verifiedOpToken, "model-unload", body.modelId)
        actor = pool.model(body.modelId)
        freed, _, source = actor.vram_estimate()
        was_loaded = actor.state == "loaded"
        await pool.detached(actor.unload)
        return json_response(
            {
                "modelId": body.modelId,
                "gpuMemoryFreedMB": freed if was_loaded else 0,
                "gpuMemoryFreedSource": source,
                "kvCacheFlushed": was_loaded,
            }
        )

    @app.post("/v1/cache/flush")
    async def cache_flush() -> Response:
        """Flush prompt caches by scope (backends without one report nothing removed)."""
        body = await read_body(CacheFlushRequest)
        authorize_lifecycle(ctx, body.verifiedOpToken, "cache-flush", body.modelId)
        if body.scope == "model" and not body.modelId:
            raise PoolError("invalid_request", "scope model needs modelId")
        if body.scope == "tenant" and not body.tenantId:
            raise PoolError("invalid_request", "scope tenant needs tenantId")
        if body.scope == "tag" and not body.tag:
            raise PoolError("invalid_request", "scope tag needs tag")
        result = await pool.flush_cache(
            body.scope, model=body.modelId, tenant=body.tenantId, tag=body.tag
        )
        return json_response(result)

    @app.get("/health")
    async def health() -> Response:
        """200 while serving; 503 with the reason when every model failed or on shutdown."""
        healthy, body = pool.health()
        return json_response(body, 200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text exposition."""
        require(ctx, "admin")
        return Response(pool.metrics.render(), content_type=PROMETHEUS_TYPE)
