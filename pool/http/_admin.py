"""The admin API (model rows, load, unload, GPU memory) and ``GET /v1/models``."""

from __future__ import annotations

import time

from quart import Quart, Response

from pool.config import LoadRequest
from pool.http._common import AppContext, json_response, read_body, require


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
        return json_response({"models": pool.rows()})

    @app.get("/v1/admin/models/<name>")
    async def admin_model(name: str) -> Response:
        """One model's row."""
        require(ctx, "admin")
        return json_response(pool.status(name))

    @app.post("/v1/admin/models/<name>/load")
    async def admin_load(name: str) -> Response:
        """Load a configured model, with optional replicas and live-only overrides."""
        require(ctx, "admin")
        actor = pool.model(name)
        body = await read_body(LoadRequest, optional=True)
        # The model actor owns the load: a client that disconnects does not cancel it.
        return json_response(await pool.detached(actor.load, body))

    @app.post("/v1/admin/models/<name>/unload")
    async def admin_unload(name: str) -> Response:
        """Unload gracefully: queued requests are cancelled, running ones finish."""
        require(ctx, "admin")
        actor = pool.model(name)
        return json_response(await pool.detached(actor.unload))

    @app.get("/v1/admin/gpu-memory")
    async def gpu_memory() -> Response:
        """GPU memory in use (NVML) and each model's VRAM estimate."""
        require(ctx, "admin")
        gpus = pool.gpu_snapshot()
        models = []
        for actor in pool.models.values():
            row = actor.row(full=False)
            models.append(
                {
                    key: row[key]
                    for key in (
                        "name",
                        "runtime_state",
                        "is_loaded",
                        "configured_target_inflight",
                        "effective_target_inflight",
                        "vram_estimate_mib",
                        "vram_estimate_replica_count",
                        "vram_estimate_source",
                    )
                }
            )
        return json_response(
            {
                "gpus": [
                    {k: g[k] for k in ("index", "name", "used_mib", "total_mib", "used_over_total")}
                    for g in gpus
                ],
                "models": models,
                "error": None if gpus else pool.gpu_error(),
                "read_at": time.time(),
            }
        )
