"""The admin API's model rows and GPU memory view, rendered from snapshots."""

from __future__ import annotations

import time
from typing import Any

from pool.actors import GpuReading, GpuView, ModelDetails, ModelSnapshot
from pool.backends import Capabilities


def capabilities_body(capabilities: Capabilities) -> dict[str, Any]:
    return {
        "modalities": list(capabilities.modalities),
        "multi_turn": capabilities.multi_turn,
        "thinking_modes": list(capabilities.thinking_modes),
    }


def details_body(details: ModelDetails, served_context: int | None) -> dict[str, Any]:
    return {
        "format": details.format,
        "family": details.family,
        "parameter_size": details.parameter_size,
        "parameter_count": details.parameter_count,
        "quantization_level": details.quantization_level,
        "context_length": details.context_length,
        "served_context_length": served_context,
    }


def definition_body(snapshot: ModelSnapshot) -> dict[str, Any]:
    body: dict[str, Any] = snapshot.definition.model_dump(mode="json")
    return body


def model_row(snapshot: ModelSnapshot, *, full: bool = True) -> dict[str, Any]:
    """The admin row of one model (spec: runtime-admin-api)."""
    definition = snapshot.definition
    row: dict[str, Any] = {
        "name": snapshot.name,
        "resolved_backend": definition.backend,
        "configured_enabled": definition.enabled,
        "runtime_state": snapshot.state,
        "is_loaded": snapshot.state == "loaded",
        "replicas": snapshot.replicas,
        "replica_max": definition.effective_replica_max,
        "loaded_replicas": snapshot.loaded_replicas,
        "inflight_requests": snapshot.inflight_requests,
        "queue_depth": snapshot.queue_depth,
        "runtime_inflight": snapshot.running,
        "configured_target_inflight": definition.target_inflight,
        "effective_target_inflight": snapshot.effective_target_inflight,
        "last_error": snapshot.last_error,
        # Why it is unloaded: evicted (its next request loads it), requested, keep_alive.
        "unload_reason": snapshot.unload_reason,
        "asleep_ram_mib": snapshot.asleep_ram_mib,
        "vram_estimate_mib": snapshot.vram.mib,
        "vram_estimate_replica_count": snapshot.vram.replica_count,
        "vram_estimate_source": snapshot.vram.source,
        "observed_load_delta": snapshot.observed_load_delta_mib,
        # Per replica: its GPUs, and the MiB planned on each (a split names several).
        "gpus": [list(gpus) for gpus in snapshot.gpus],
        "gpu_split_mib": [list(p.mib) for p in snapshot.placement],
    }
    if full:
        row["load_constraints"] = {k: dict(v) for k, v in snapshot.load_constraints.items()}
        row["load_recommendations"] = {k: dict(v) for k, v in snapshot.load_recommendations.items()}
        row["load_override"] = dict(snapshot.load_override)
        row["capabilities"] = capabilities_body(snapshot.capabilities)
        row["details"] = details_body(snapshot.details, snapshot.served_context_length)
    row["definition"] = definition_body(snapshot)
    return row


_GPU_MEMORY_ROW_KEYS = (
    "name",
    "runtime_state",
    "is_loaded",
    "configured_target_inflight",
    "effective_target_inflight",
    "vram_estimate_mib",
    "vram_estimate_replica_count",
    "vram_estimate_source",
    "observed_load_delta",
    "gpus",
    "gpu_split_mib",
)


def gpu_body(gpu: GpuReading) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "name": gpu.name,
        "used_mib": gpu.used_mib,
        "total_mib": gpu.total_mib,
        "used_over_total": f"{gpu.used_mib}MiB / {gpu.total_mib}MiB",
    }


def gpu_memory_body(view: GpuView, snapshots: list[ModelSnapshot]) -> dict[str, Any]:
    """``GET /v1/admin/gpu-memory``: NVML readings and each model's VRAM estimate."""
    models = []
    for snapshot in snapshots:
        row = model_row(snapshot, full=False)
        models.append({key: row[key] for key in _GPU_MEMORY_ROW_KEYS})
    return {
        "gpus": [gpu_body(g) for g in view.gpus],
        "models": models,
        "error": None if view.gpus else view.error,
        "read_at": time.time(),
    }
