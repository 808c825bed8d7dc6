"""The admin API (model rows, load, unload, GPU memory) and ``GET /v1/models``."""

from __future__ import annotations

from quart import Quart, Response

from pool.config import LoadRequest
from pool.http._common import AppContext, json_response, read_body, require
from pool.http._rows import gpu_memory_body, model_row


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool

    @app.get("/v1/models")
    async def list_models() -> Response:
        """Servable model ids in the OpenAI list format (loaded, or loaded on demand)."""
        require(ctx, "inference")
        created = int(pool.started_at)
        data = [
            {"id": name, "object": "model", "created": created, "owned_by": "llm-pool"}
            for name in pool.servable_models()
        ]
        return json_response({"object": "list", "data": data})

    @app.get("/v1/admin/models")
    async def admin_models() -> Response:
        """Every configured model with its live runtime state."""
        require(ctx, "admin")
        return json_response({"models": [model_row(s) for s in pool.snapshots()]})

    @app.get("/v1/admin/models/<name>")
    async def admin_model(name: str) -> Response:
        """One model's row."""
        require(ctx, "admin")
        return json_response(model_row(pool.snapshot(name)))

    @app.post("/v1/admin/models/<name>/load")
    async def admin_load(name: str) -> Response:
        """Load a configured model, with optional replicas and live-only overrides."""
        require(ctx, "admin")
        pool.model(name)  # an unknown model is a 404 before the body is read
        body = await read_body(LoadRequest, optional=True)
        # The pool owns the load (through its VRAM gate: placement, eviction); a client
        # that disconnects does not cancel it.
        return json_response(model_row(await pool.detached(pool.load, name, body)))

    @app.post("/v1/admin/models/<name>/unload")
    async def admin_unload(name: str) -> Response:
        """Unload: queued requests are cancelled, running ones get engine.unload_drain_s."""
        require(ctx, "admin")
        actor = pool.model(name)
        return json_response(model_row(await pool.detached(actor.unload)))

    @app.get("/v1/admin/gpu-memory")
    async def gpu_memory() -> Response:
        """GPU memory in use (NVML) and each model's VRAM estimate."""
        require(ctx, "admin")
        return json_response(gpu_memory_body(pool.gpus.view(), pool.snapshots()))
