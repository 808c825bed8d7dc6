"""The runner API's bodies: health, load tasks, the runner descriptor, and
``/api/status`` (the embedded-engine spec's whole status in one answer)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

from pool._version import __version__
from pool.actors import GpuView, LoadTask, ModelSnapshot, Pool, PoolHealth, quantization_name
from pool.schemas import (
    EngineGpuMemory,
    EngineModelStatus,
    GpuMemoryStatus,
    Health,
    HealthReason,
    LoadedModel,
    LoadTaskState,
    PoolStatus,
    RunnerDescriptor,
    renders,
)


@renders(Health)
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


@renders(list[HealthReason])
def issue_bodies(health: PoolHealth) -> list[dict[str, Any]]:
    """What degrades the pool, one ``{"code", "model", ...}`` per issue (docs/api.md)."""
    return [{"code": issue.code, "model": issue.model, **issue.details} for issue in health.issues]


def cluster_status(pool: Pool) -> Mapping[str, Any] | None:
    """The cluster membership (docs/cluster.md), or None for a pool on its own."""
    return pool.lease_status()


@renders(LoadTaskState)
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


@renders(LoadedModel)
def _loaded_model(snapshot: ModelSnapshot) -> dict[str, Any]:
    return {
        "id": snapshot.name,
        "backend": snapshot.definition.backend,
        # From the artifact's own metadata; null where it has none (stub, remote).
        "quantization": quantization_name(snapshot.details.quantization_level),
        "contextLength": snapshot.context_length,
        "loadedAt": round(snapshot.loaded_at_wall or 0),
        "gpuMemoryMB": snapshot.vram.mib,
        "replicas": snapshot.loaded_replicas,
    }


def _fetching(pool: Pool, model: str) -> bool:
    task = pool.latest_load_task(model)
    return task is not None and task.status == "loading" and task.phase == "fetching"


def _load_progress(pool: Pool, model: str) -> float | None:
    """The progress of the model's running load task, else what its runtime reports
    (None where neither says)."""
    task = pool.latest_load_task(model)
    if task is not None and task.status == "loading":
        return task.progress
    return pool.model(model).load_progress


def load_eta(pool: Pool, model: str) -> int | None:
    """Whole seconds the model's load still needs, by its last measured load like it;
    None before a first measured load (or while it is fetched)."""
    if _fetching(pool, model):
        return None
    eta = pool.load_eta_s(model)
    return None if eta is None else math.ceil(eta)


@renders(RunnerDescriptor)
def capabilities_body(pool: Pool, runner_id: str) -> dict[str, Any]:
    """The runner descriptor of ``GET /v1/capabilities``."""
    snapshots = pool.snapshots()
    view = pool.gpu_view()
    gpus = view.gpus
    queue = pool.queue_stats()
    health = pool.health()
    cache = pool.cache_usage()
    readings = [g.utilization for g in gpus if g.utilization is not None]
    body: dict[str, Any] = {
        "runnerType": f"llm-pool-{__version__}",
        "runnerId": runner_id,
        "models": {
            "loaded": [_loaded_model(s) for s in snapshots if s.state == "loaded"],
            "loading": [
                {
                    "id": s.name,
                    "progress": _load_progress(pool, s.name),
                    "eta": load_eta(pool, s.name),
                }
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
            "multiTenant": pool.settings.service.tenancy.multi_tenant,
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


@renders(EngineModelStatus)
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


@renders(GpuMemoryStatus)
def gpu_readings_body(view: GpuView) -> dict[str, Any]:
    """``/api/status``'s ``gpu_memory``: each GPU's memory in MiB; ``error`` says why
    there are none (no NVIDIA driver)."""
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


def _gigabytes(mib: float) -> float:
    return round(mib * 1024 * 1024 / 1e9, 2)


@renders(EngineGpuMemory | None)
def engine_gpu_memory(view: GpuView) -> dict[str, Any] | None:
    """The embedded-engine spec's ``engine.gpu_memory``, in GB (10^9 bytes) summed over
    the GPUs; None without any. ``allocated_gb``: what the pool's own runtimes hold (null
    where no GPU can tell); ``reserved_gb``: all memory in use on the GPUs, the pool's
    and others' (what no load can have); ``total_gb``: their size."""
    if not view.gpus:
        return None
    held = [g.pool_used_mib for g in view.gpus if g.pool_used_mib is not None]
    return {
        "allocated_gb": _gigabytes(sum(held)) if held else None,
        "reserved_gb": _gigabytes(sum(g.used_mib for g in view.gpus)),
        "total_gb": _gigabytes(sum(g.total_mib for g in view.gpus)),
    }


@renders(PoolStatus)
def status_body(pool: Pool, stored: list[str]) -> dict[str, Any]:
    """``/api/status``; ``stored``: the models the model store holds (its ``cache``)."""
    health = health_body(pool.health())
    now = time.monotonic()
    view = pool.gpu_view()
    return {
        "status": health["status"],
        "reason": health.get("reason"),
        "reasons": health.get("reasons", []),
        "uptime": health["uptime"],
        "engine": {
            "models": [_engine_row(pool, s, now) for s in pool.snapshots()],
            "gpu_memory": engine_gpu_memory(view),
        },
        "pulls": pool.running_pulls(),
        "cache": {"models": stored, "count": len(stored)},
        "gpu_memory": gpu_readings_body(view),
    }
