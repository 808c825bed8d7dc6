"""``GET /api/status``: the pool's full status in one answer (the embedded-engine spec's
route): health with its reasons, every model's engine state and keep-alive countdown,
the pulls under way, and GPU memory."""

from __future__ import annotations

import time
from typing import Any

from quart import Quart, Response

from pool.actors import GpuView, ModelSnapshot, Pool
from pool.http._common import AppContext, json_response, require
from pool.http._runner import health_body


def _engine_row(pool: Pool, snapshot: ModelSnapshot, now: float) -> dict[str, Any]:
    actor = pool.model(snapshot.name)
    # Seconds since the last request reached a loaded model that has nothing to do.
    idle = (
        round(now - actor.last_used_at, 1)
        if snapshot.state == "loaded" and snapshot.inflight_requests == 0
        else None
    )
    expires = snapshot.expires_in_s
    # Only an on-demand model that is not pinned unloads when idle (DESIGN section 4).
    keep_alive = actor.keep_alive_s
    if keep_alive is None or not snapshot.definition.on_demand or snapshot.definition.pinned:
        keep_alive = -1.0
    return {
        "name": snapshot.name,
        "backend": snapshot.definition.backend,
        "state": snapshot.state,
        "keep_alive": keep_alive,
        "idle_seconds": idle,
        "will_unload_in": None if expires is None else round(max(0.0, expires), 1),
        "error": snapshot.last_error,
        "queue_depth": snapshot.queue_depth,
        "running": snapshot.running,
        "max_queue": snapshot.max_queue,
        "replicas": snapshot.loaded_replicas,
        "gpus": [list(gpus) for gpus in snapshot.gpus],
        "vram_mib": snapshot.vram.mib if snapshot.state == "loaded" else None,
    }


def gpu_memory_body(view: GpuView) -> dict[str, Any]:
    """Each GPU's memory in MiB; ``error`` says why there are none (no NVIDIA driver)."""
    return {
        "gpus": [
            {
                "index": gpu.index,
                "name": gpu.name,
                "used_mib": gpu.used_mib,
                "total_mib": gpu.total_mib,
                "free_mib": gpu.total_mib - gpu.used_mib,
                "pool_used_mib": gpu.pool_used_mib,
                "virtual": gpu.virtual,
            }
            for gpu in view.gpus
        ],
        "error": None if view.gpus else view.error,
    }


def status_body(pool: Pool) -> dict[str, Any]:
    health = health_body(pool.health())
    now = time.monotonic()
    return {
        "status": health["status"],
        "reason": health.get("reason"),
        "reasons": health.get("reasons", []),
        "uptime": health["uptime"],
        "engine": {"models": [_engine_row(pool, s, now) for s in pool.snapshots()]},
        "pulls": pool.pulls.running(),
        "gpu_memory": gpu_memory_body(pool.gpus.view()),
    }


def register(app: Quart, ctx: AppContext) -> None:
    @app.get("/api/status")
    async def full_status() -> Response:
        """Health, engine state per model, pulls under way and GPU memory."""
        require(ctx, "inference")
        return json_response(status_body(ctx.pool))
