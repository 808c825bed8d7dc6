"""The admin API (model rows, load, unload, GPU memory) and ``GET /v1/models``."""

from __future__ import annotations

from typing import Any

from quart import Quart, Response, request

from pool.actors import Pool
from pool.backends import LoadRequest
from pool.errors import PoolError
from pool.http._common import AppContext, json_response, read_body, require
from pool.http._rows import gpu_memory_body, model_row


def cluster_model_list(
    pool: Pool, local: list[dict[str, Any]], created: int
) -> list[dict[str, Any]]:
    """``/v1/models`` in a cluster (docs/cluster.md): every model servable here or on a
    peer, each with the nodes that have it loaded (``nodes``)."""
    assert pool.router is not None
    loaded: dict[str, list[str]] = {}
    servable = [entry["id"] for entry in local]
    contexts = {entry["id"]: entry.get("context_length") for entry in local}
    for name, actor in pool.models.items():
        if actor.state == "loaded":
            loaded.setdefault(name, []).append(pool.router.node_id)
    for m in pool.router.peer_models():
        servable_there = m["state"] == "loaded" or m.get("on_demand")
        if servable_there and m["name"] not in servable:
            servable.append(m["name"])
        if m["state"] == "loaded":
            loaded.setdefault(m["name"], []).append(m["node"])
    return [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "llm-pool",
            "context_length": contexts.get(name),
            "nodes": loaded.get(name, []),
        }
        for name in servable
    ]


def model_list(pool: Pool) -> dict[str, Any]:
    """Servable model ids in the OpenAI list format (``/v1/models``, ``/openai/v1/models``)."""
    created = int(pool.started_at)
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "llm-pool",
            "context_length": pool.snapshot(name).served_context_length,
        }
        for name in pool.servable_models()
    ]
    if pool.router is not None:
        data = cluster_model_list(pool, data, created)
    return {"object": "list", "data": data}


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool

    @app.get("/v1/models")
    async def list_models() -> Response:
        """Servable model ids in the OpenAI list format (loaded, or loaded on demand)."""
        require(ctx, "inference")
        return json_response(model_list(pool))

    @app.get("/v1/admin/models")
    async def admin_models() -> Response:
        """Every configured model with its live runtime state (and, in a cluster, every
        peer's models under ``cluster``)."""
        require(ctx, "admin")
        body: dict[str, Any] = {"models": [model_row(s) for s in pool.snapshots()]}
        if pool.router is not None:
            body["cluster"] = list(pool.router.peer_models())
        return json_response(body)

    @app.get("/v1/admin/models/<name>")
    async def admin_model(name: str) -> Response:
        """One model's row."""
        require(ctx, "admin")
        return json_response(model_row(pool.snapshot(name)))

    @app.post("/v1/admin/models/<name>/load")
    async def admin_load(name: str) -> Response:
        """Load a configured model, with optional replicas and live-only overrides;
        ``?dry_run=true``: what the load would do now, changing nothing."""
        require(ctx, "admin")
        pool.model(name)  # an unknown model is a 404 before the body is read
        dry_run = _flag(request.args.get("dry_run"), "dry_run")
        body = await read_body(LoadRequest, optional=True)
        if dry_run:
            return json_response(pool.preview_load(name, body))
        # The pool owns the load (through its residency owner: placement, eviction); a
        # client that disconnects does not cancel it.
        return json_response(model_row(await pool.detached(pool.load, name, body)))

    @app.post("/v1/admin/models/<name>/unload")
    async def admin_unload(name: str) -> Response:
        """Unload: queued requests are cancelled, running ones get engine.unload_drain_s."""
        require(ctx, "admin")
        pool.model(name)
        return json_response(model_row(await pool.detached(pool.unload, name)))

    @app.get("/v1/admin/decisions")
    async def admin_decisions() -> Response:
        """The latest residency decisions (placements, evictions, waits, refusals) with
        their reasons, newest first; ``?model=`` those about one model, ``?limit=``."""
        require(ctx, "admin")
        model = request.args.get("model") or None
        limit = request.args.get("limit")
        if limit is not None and not (limit.isdigit() and int(limit) > 0):
            raise PoolError("invalid_request", "limit must be a positive integer")
        decisions = pool.decisions(model, int(limit) if limit else None)
        return json_response({"decisions": [d.as_json() for d in decisions]})

    @app.get("/v1/admin/gpu-memory")
    async def gpu_memory() -> Response:
        """GPU memory in use (NVML) and each model's VRAM estimate."""
        require(ctx, "admin")
        return json_response(gpu_memory_body(pool.gpus.view(), pool.snapshots()))


def _flag(value: str | None, name: str) -> bool:
    """A boolean query parameter: absent, ``false`` or ``0`` is off; ``true`` or ``1`` on."""
    if value is None or value.lower() in ("false", "0", ""):
        return False
    if value.lower() in ("true", "1"):
        return True
    raise PoolError("invalid_request", f"{name} must be true or false (got {value!r})")
