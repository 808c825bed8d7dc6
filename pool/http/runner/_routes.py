"""The runner API's routes: capabilities, async load tasks, unload, cache flush, health,
metrics, and ``GET /api/status``."""

from __future__ import annotations

import math
import socket
from typing import Any, TypeVar

from pydantic import BaseModel
from quart import Blueprint, Quart, Response

from pool.actors import fit_memory_budget
from pool.errors import PoolError
from pool.http._common import (
    POOL_ERRORS,
    AppContext,
    json_response,
    parse_json,
    raw_body,
    require,
    validate,
)
from pool.http._route import LOAD_REFUSALS, PLAIN_TEXT, Route, serves
from pool.http.runner._parse import check_flush_scope, load_request
from pool.http.runner._render import (
    capabilities_body,
    cluster_status,
    health_body,
    load_eta,
    load_task_body,
    status_body,
)
from pool.schemas import (
    CacheFlushed,
    CacheFlushRequest,
    Health,
    LoadTaskState,
    PoolStatus,
    RunnerDescriptor,
    RunnerLoadRequest,
    RunnerUnloaded,
    RunnerUnloadRequest,
)

T = TypeVar("T", bound=BaseModel)

PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# -- the documented routes (pool/http/_route.py) ----------------------------------------
CAPABILITIES = Route(
    "get",
    "/v1/capabilities",
    "runner",
    "Runner descriptor",
    "Loaded, loading and available models, resources, queue figures (average and p95 wait"
    " over a recent window), capability flags (`embeddings`: some configured model serves"
    " them) and health; 503 with the same body while unhealthy, and 503 `starting`"
    " (`Retry-After`) on every route while the pool starts. In a cluster, `cluster`"
    " as in /health.",
    reply=RunnerDescriptor,
    unavailable_reply=True,
)
RUNNER_LOAD = Route(
    "post",
    "/v1/models/load",
    "runner",
    "Start an asynchronous load",
    "202 with a task id; `evictModel` is unloaded first. Needs the admin token or a"
    " `verifiedOpToken` where configured. A model with a `source` that is not in the store"
    " yet is pulled first (the task's `phase` is `fetching`, its progress follows the"
    " bytes).",
    RunnerLoadRequest,
    202,
    reply=LoadTaskState,
    refusals=(400, 404, 409),
    valid_input_codes=LOAD_REFUSALS,
)
RUNNER_LOAD_STATUS = Route(
    "get",
    "/v1/models/load/{task_id}",
    "runner",
    "Load task status",
    "`loading`, `completed` or `failed`, with `loadTimeMs`.",
    reply=LoadTaskState,
    refusals=(404,),
)
RUNNER_UNLOAD = Route(
    "post",
    "/v1/models/unload",
    "runner",
    "Unload (runner API)",
    "Graceful unload; says how much memory the model held.",
    RunnerUnloadRequest,
    reply=RunnerUnloaded,
    refusals=(404,),
)
CACHE_FLUSH = Route(
    "post",
    "/v1/cache/flush",
    "runner",
    "Flush prompt caches",
    "Scopes `all`, `model` (`modelId`), `tenant` (`tenantId`, narrowed by `tag`) and `tag`"
    " (`tag`, narrowed by `tenantId`); `modelId` narrows any scope. Answers the entries"
    " removed (saved states, llama-server slots, vLLM salt scopes) and the memory freed;"
    " backends without a prompt cache report 0.",
    CacheFlushRequest,
    reply=CacheFlushed,
    refusals=(404,),
)
HEALTH = Route(
    "get",
    "/health",
    "operations",
    "Health",
    "200 while serving: `healthy`, or `degraded` with `reasons` (a queue at or near its"
    " max_queue, a GPU out of memory within `service.health_oom_window_s`, a failed"
    " model); 503 `degraded` with `reason` while a queue is saturated or a GPU ran out of"
    " memory; 503 `unhealthy` with `reason` when every model failed or on shutdown. In a"
    " cluster, `cluster`: `node_id`, `epoch`, `gpu_host`, `redis` (`ok` or `unreachable`:"
    " the node serves on by itself), `error`, `peers`.",
    reply=Health,
    unavailable_reply=True,
)
FULL_STATUS = Route(
    "get",
    "/api/status",
    "operations",
    "Full status",
    "Health with its `reasons` (as /health), each model's engine state (`keep_alive`,"
    " `idle_seconds`, `will_unload_in`, `error`, queue), `engine.gpu_memory` (the"
    " embedded-engine spec's `allocated_gb`, `reserved_gb`, `total_gb`), the pulls under"
    " way (with the spec's `state`, `progress` in percent, `total_bytes`), `cache` (the"
    " models the model store holds, and their `count`) and each GPU's memory in MiB."
    " Always 200: `status` says whether the pool serves.",
    reply=PoolStatus,
)
METRICS = Route(
    "get",
    "/metrics",
    "operations",
    "Prometheus metrics",
    "Text exposition format; 404 while `service.metrics` is off (ENABLE_METRICS)."
    " `service.metrics_port` serves it alone on a port of its own too. Each loaded model's"
    " GPU memory is `llm_pool_model_gpu_memory_bytes{model,part}`: `weights` and"
    " `kv_cache` where the runtime reports its split (llama.cpp, vllm serve), else"
    " `unknown` (the measured total, NaN when unmeasured).",
    text=PLAIN_TEXT,
)
ROUTES = (
    CAPABILITIES,
    RUNNER_LOAD,
    RUNNER_LOAD_STATUS,
    RUNNER_UNLOAD,
    CACHE_FLUSH,
    HEALTH,
    FULL_STATUS,
    METRICS,
)


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    runner_id = ctx.settings.service.runner_id or socket.gethostname()
    blueprint = Blueprint("runner", __name__)
    ctx.error_shapes[blueprint.name] = POOL_ERRORS

    @serves(blueprint, CAPABILITIES)
    async def capabilities() -> Response:
        """What this runner serves and how busy it is."""
        require(ctx, "inference")
        body = capabilities_body(pool, runner_id)
        return json_response(body, 503 if body["health"] == "unhealthy" else 200)

    @serves(blueprint, RUNNER_LOAD)
    async def runner_load() -> Response:
        """Start loading a model in the background (202 with a task id)."""
        body = await authorized_body(ctx, RunnerLoadRequest, "model-load")
        actor = pool.model(body.modelId)
        residence = pool.residence(body.modelId)
        load = load_request(body, actor.definition, residence.details.quantization_level)
        if body.gpuMemoryBudgetMB is not None:
            load = fit_memory_budget(residence, load, body.gpuMemoryBudgetMB)
        task = pool.start_load_task(body.modelId, load, body.evictModel)
        # The whole of the last measured load like this one (None before a first).
        expected = pool.expected_load_s(body.modelId)
        eta = None if expected is None or task.phase == "fetching" else math.ceil(expected)
        return json_response(load_task_body(task) | {"eta": eta}, 202)

    @serves(blueprint, RUNNER_LOAD_STATUS)
    async def runner_load_status(task_id: str) -> Response:
        """The state of a load task: loading, completed or failed, with timings."""
        require(ctx, "admin")
        task = pool.load_task(task_id)
        body = load_task_body(task)
        if task.status == "loading":
            body["eta"] = load_eta(pool, task.model)
        return json_response(body)

    @serves(blueprint, RUNNER_UNLOAD)
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

    @serves(blueprint, CACHE_FLUSH)
    async def cache_flush() -> Response:
        """Flush prompt caches by scope (backends without one report nothing removed)."""
        body = await authorized_body(ctx, CacheFlushRequest, "cache-flush")
        check_flush_scope(body)
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

    @serves(blueprint, HEALTH)
    async def health() -> Response:
        """200 while serving (``healthy``, or ``degraded`` with its ``reasons``); 503 with
        the reason on a GPU out of memory or a saturated queue (still ``degraded``), when
        every model failed, or on shutdown."""
        health = pool.health()
        body = health_body(health, cluster_status(pool))
        return json_response(body, 200 if health.available else 503)

    @serves(blueprint, FULL_STATUS)
    async def full_status() -> Response:
        """Health, engine state per model, pulls under way, the model store and GPU memory."""
        require(ctx, "inference")
        return json_response(status_body(pool, await pool.stored_models()))

    @serves(blueprint, METRICS)
    async def metrics() -> Response:
        """Prometheus text exposition."""
        require(ctx, "admin")
        if not ctx.settings.service.metrics:
            raise PoolError("not_found", "metrics are off (service.metrics, ENABLE_METRICS)")
        return Response(pool.render_metrics(), content_type=PROMETHEUS_TYPE)

    app.register_blueprint(blueprint)


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
