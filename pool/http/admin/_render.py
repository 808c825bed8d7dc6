"""The admin API's bodies, rendered from snapshots: model rows, GPU memory, the
``/v1/models`` list, usage rows and the state the event stream pushes."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from pool.actors import (
    AdapterView,
    CanaryStatus,
    GpuReading,
    GpuView,
    ModelDetails,
    ModelSnapshot,
    Pool,
    UsageGroupBy,
    UsageTotal,
)
from pool.backends import Capabilities
from pool.schemas import (
    GpuMemory,
    GpuModelRow,
    GpuRow,
    ModelList,
    ModelRow,
    RowCanary,
    RowCapabilities,
    RowDetails,
    UsageRow,
    renders,
)


@renders(RowCapabilities)
def capabilities_body(capabilities: Capabilities) -> dict[str, Any]:
    return {
        "modalities": list(capabilities.modalities),
        "multi_turn": capabilities.multi_turn,
        "thinking_modes": list(capabilities.thinking_modes),
    }


@renders(RowCanary | None)
def canary_body(canary: CanaryStatus | None) -> dict[str, Any] | None:
    if canary is None:
        return None
    return {
        "health": canary.health,
        "reason": canary.reason,
        "interval_s": canary.interval_s,
        "reference": canary.reference,
        "answer": canary.answer,
        "checked_at": canary.checked_at,
        "reloads_last_hour": canary.reloads_last_hour,
    }


@renders(RowDetails)
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


def vram_fields(snapshot: ModelSnapshot) -> dict[str, Any]:
    """A row's VRAM estimate in the spec's three sources (runtime-admin-api), with the
    step of the pool's six-step chain that gave it as ``vram_estimate_basis``
    (docs/vram.md).

    ``observed_load_delta`` holds the measurement an ``observed_load_delta`` source
    rests on (this load's delta or its runtime's own figure, or the footprint kept from
    the same earlier load), so a row never names a source whose figure is null; an
    estimate made before any measurement is ``model_artifact_size``.
    """
    estimate = snapshot.vram
    measured = snapshot.observed_load_delta_mib
    if estimate.source == "observed_load_delta" and measured is None:
        measured = estimate.mib
    if estimate.mib is None:
        source = "unavailable"
    elif estimate.source == "observed_load_delta":
        source = "observed_load_delta"
    else:
        source = "model_artifact_size"
    return {
        "vram_estimate_mib": estimate.mib,
        "vram_estimate_replica_count": estimate.replica_count,
        "vram_estimate_source": source,
        "vram_estimate_basis": estimate.source,
        "observed_load_delta": measured,
    }


# What the admin API never shows of a definition: a secret a managed server is started
# with (`llama_server_api_key`, `vllm_serve_api_key`); the row says one is set.
_SECRET_SUFFIX = "_api_key"
_HIDDEN = "<set>"


def definition_body(snapshot: ModelSnapshot) -> dict[str, Any]:
    body: dict[str, Any] = snapshot.definition.model_dump(mode="json")
    for field, value in body.items():
        if field.endswith(_SECRET_SUFFIX) and value is not None:
            body[field] = _HIDDEN
    return body


@renders(ModelRow)
def model_row(snapshot: ModelSnapshot) -> dict[str, Any]:
    """The admin row of one model (spec: runtime-admin-api)."""
    return _row(snapshot, full=True)


def _row(snapshot: ModelSnapshot, *, full: bool) -> dict[str, Any]:
    """A model's row; without ``full``, only the fields a GPU memory row picks from it."""
    definition = snapshot.definition
    row: dict[str, Any] = {
        "name": snapshot.name,
        "resolved_backend": definition.backend,
        "kind": snapshot.capabilities.kind,
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
        **vram_fields(snapshot),
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
        row["canary"] = canary_body(snapshot.canary)
        row["parent"] = snapshot.parent
        row["adapter"] = None if snapshot.adapter is None else adapter_body(snapshot.adapter)
        row["adapters"] = [adapter_body(a) for a in snapshot.adapters]
        row["adapter_group_wait_ms"] = snapshot.adapter_group_wait_ms
    row["definition"] = definition_body(snapshot)
    return row


def adapter_body(adapter: AdapterView) -> dict[str, Any]:
    return {
        "name": adapter.name,
        "path": adapter.path,
        "scale": adapter.scale,
        "size_mib": adapter.size_mib,
        "requests": adapter.requests,
        "evicted": adapter.evicted,
    }


# The fields of a model row that a GPU memory row repeats, in the model's order.
_GPU_MEMORY_ROW_KEYS = tuple(GpuModelRow.model_fields)


@renders(GpuRow)
def gpu_body(gpu: GpuReading) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "name": gpu.name,
        "used_mib": gpu.used_mib,
        "total_mib": gpu.total_mib,
        "used_over_total": f"{gpu.used_mib}MiB / {gpu.total_mib}MiB",
    }


@renders(GpuMemory)
def gpu_memory_body(view: GpuView, snapshots: list[ModelSnapshot]) -> dict[str, Any]:
    """``GET /v1/admin/gpu-memory``: NVML readings and each model's VRAM estimate."""
    models = []
    for snapshot in snapshots:
        row = _row(snapshot, full=False)
        models.append({key: row[key] for key in _GPU_MEMORY_ROW_KEYS})
    return {
        "gpus": [gpu_body(g) for g in view.gpus],
        "models": models,
        "error": None if view.gpus else view.error,
        "read_at": time.time(),
    }


def cluster_model_list(
    pool: Pool, local: list[dict[str, Any]], created: int
) -> list[dict[str, Any]]:
    """``/v1/models`` in a cluster (docs/cluster.md): every model servable here or on a
    peer, each with the nodes that have it loaded (``nodes``)."""
    loaded: dict[str, list[str]] = {}
    servable = [entry["id"] for entry in local]
    contexts = {entry["id"]: entry.get("context_length") for entry in local}
    kinds = {entry["id"]: entry.get("kind") for entry in local}
    for name in pool.loaded_models():
        loaded.setdefault(name, []).append(pool.node_id)
    for m in pool.peer_models():
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
            "kind": kinds.get(name),
            "context_length": contexts.get(name),
            # Loaded on some node of the cluster: a request there starts no load.
            "loaded": bool(loaded.get(name)),
            "nodes": loaded.get(name, []),
        }
        for name in servable
    ]


@renders(ModelList)
def model_list(pool: Pool) -> dict[str, Any]:
    """Servable model ids in the OpenAI list format (``/v1/models``, ``/openai/v1/models``)."""
    created = int(pool.started_at)
    servable = set(pool.servable_models())
    snapshots = [s for s in pool.snapshots(adapters=True) if (s.parent or s.name) in servable]
    data = [
        {
            "id": s.name,
            "object": "model",
            "created": created,
            "owned_by": "llm-pool",
            "kind": s.capabilities.kind,
            "context_length": s.served_context_length,
            "loaded": s.state == "loaded",
        }
        | ({"parent": s.parent} if s.parent is not None else {})
        for s in snapshots
    ]
    if pool.clustered:
        data = cluster_model_list(pool, data, created)
    return {"object": "list", "data": data}


@renders(UsageRow)
def usage_row(group_by: UsageGroupBy, total: UsageTotal) -> dict[str, Any]:
    row: dict[str, Any] = {group_by: total.group}
    if total.bucket is not None:
        row["bucket"] = datetime.fromtimestamp(total.bucket, UTC).isoformat().replace("+00:00", "Z")
    row["requests"] = total.requests
    row["prompt_tokens"] = total.prompt_tokens
    row["cached_tokens"] = total.cached_tokens
    row["output_tokens"] = total.output_tokens
    row["audio_seconds"] = total.audio_seconds
    row["characters"] = total.characters
    row["load_seconds"] = round(total.load_seconds, 3)
    return row


def admin_state(pool: Pool) -> dict[str, Any]:
    """What one ``state`` event carries.

    ``models``: the rows of ``GET /v1/admin/models``; ``gpus`` and ``gpu_error``: the
    readings of ``GET /v1/admin/gpu-memory``; ``pulls``: the current or last pull of each
    model that has one (``GET /api/pull/status/NAME``); ``shutting_down``.
    """
    snapshots = pool.snapshots(adapters=True)
    gpu = gpu_memory_body(pool.gpu_view(), [s for s in snapshots if s.parent is None])
    return {
        "models": [model_row(s) for s in snapshots],
        "gpus": gpu["gpus"],
        "gpu_error": gpu["error"],
        "pulls": pool.pull_statuses(),
        "shutting_down": pool.shutting_down,
    }
