"""Read-only views of the pool's state, for whoever renders them (admin rows, the
runner API, Ollama's lists, the dashboard).

A snapshot is taken in one step between awaits, so its fields agree with each other;
the actors keep no JSON of their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pool.actors.values._details import ModelDetails
from pool.backends import Capabilities, GpuPlacement
from pool.config import ModelDefinition

RuntimeState = Literal["unloaded", "loading", "loaded", "unloading", "failed"]
# Why an unloaded model is unloaded (docs/vram.md, "Eviction"): the pool made room for
# another model (its next request loads it again), an unload was asked for (admin,
# runner or Ollama API: it stays unloaded), it sat idle past its keep_alive, or its
# output canary found it degraded (docs/reliability.md, "Output canaries").
UnloadReason = Literal["evicted", "requested", "keep_alive", "canary"]
# What a model's output canary last found: no answer yet since the load (pending), an
# answer like the reference (ok), an answer that is not (degraded: a reload follows),
# degraded past engine.canary_reloads_per_hour (failed: the model was marked failed).
CanaryHealth = Literal["pending", "ok", "degraded", "failed"]
# The estimate chain, best first (pool/actors/residency/_estimate.py, docs/vram.md).
VramSource = Literal[
    "configured_vram_mb",
    "observed_load_delta",
    "artifact_metadata",
    "model_artifact_size",
    "name_heuristic",
    "unavailable",
]


@dataclass(frozen=True, slots=True)
class VramEstimate:
    """What a model's loaded replicas take (or its next load will take), and whence."""

    mib: int | None
    replica_count: int
    source: VramSource

    @property
    def per_replica_mib(self) -> int | None:
        return None if self.mib is None else -(-self.mib // max(1, self.replica_count))


@dataclass(frozen=True, slots=True)
class AdapterView:
    """A LoRA adapter served on a base model (docs/backends.md, "LoRA adapters")."""

    name: str
    path: str
    scale: float
    # Its file's size: what it adds to the base's memory on each replica's GPUs.
    size_mib: float
    # Requests it served since it was added (the pool's count), and when it last served
    # one (monotonic seconds; None: never): the LRU order of adapter eviction.
    requests: int = 0
    last_used_at: float | None = None
    # The pool evicted it alone (its memory given back); its next request loads it again.
    evicted: bool = False


@dataclass(frozen=True, slots=True)
class CanaryStatus:
    """A model's output canary (docs/reliability.md, "Output canaries")."""

    health: CanaryHealth
    interval_s: float
    # Why the last answer was found degraded (None while ok or pending).
    reason: str | None = None
    # The answer later ones are held to (the operator's, else the first after a load of
    # the current definition), and the last answer; None before there is one.
    reference: str | None = None
    answer: str | None = None
    checked_at: float | None = None  # wall clock of the last answer
    reloads_last_hour: int = 0


@dataclass(frozen=True, slots=True)
class ModelSnapshot:
    """One model's configuration and live runtime state."""

    name: str
    state: RuntimeState
    definition: ModelDefinition
    # The definition the running replicas were loaded with (overrides applied).
    active_definition: ModelDefinition
    replicas: int  # loaded replicas, or the count the next load will start
    loaded_replicas: int
    queue_depth: int
    running: int
    max_queue: int
    effective_target_inflight: int
    last_error: str | None
    vram: VramEstimate
    load_override: Mapping[str, Any]
    load_constraints: Mapping[str, Mapping[str, Any]]
    load_recommendations: Mapping[str, Mapping[str, Any]]
    capabilities: Capabilities
    context_length: int | None
    artifact_mib: int | None
    loaded_at_wall: float | None
    # Seconds until an idle on-demand model unloads; None when not counting down.
    expires_in_s: float | None
    # MiB the current load was measured to take on the GPUs; None when not measured.
    observed_load_delta_mib: int | None = None
    # The GPUs of each replica, while placed (loading, loaded, unloading).
    placement: tuple[GpuPlacement, ...] = ()
    # Why the model was last unloaded, until it loads again; None if it never was.
    unload_reason: UnloadReason | None = None
    # Host RAM its sleeping replicas hold (an eviction put them to sleep); None: none.
    asleep_ram_mib: int | None = None
    # Family, size, quantization and trained context from the artifact's metadata.
    details: ModelDetails = field(default_factory=ModelDetails)
    # Its output canary; None where canaries are off for it.
    canary: CanaryStatus | None = None
    # The LoRA adapters served on this model (a base's row).
    adapters: tuple[AdapterView, ...] = ()
    # An adapter's own row: its base's name and the adapter; the rest is the base's.
    parent: str | None = None
    adapter: AdapterView | None = None
    # The longest extra wait (ms) grouping requests by adapter may add; None: no grouping.
    adapter_group_wait_ms: float | None = None

    @property
    def served_context_length(self) -> int | None:
        """The context a request gets: the configured one, else the model's own."""
        return self.context_length or self.details.context_length

    @property
    def gpus(self) -> tuple[tuple[int, ...], ...]:
        """The GPUs of each replica, while placed; empty otherwise."""
        return tuple(p.gpus for p in self.placement)

    @property
    def inflight_requests(self) -> int:
        """Queued plus running requests."""
        return self.queue_depth + self.running


def adapter_rows(base: ModelSnapshot) -> list[ModelSnapshot]:
    """The rows of ``base``'s LoRA adapters: each a model of its own name, served by
    ``base`` (its state and placement are the base's)."""
    return [
        replace(base, name=view.name, parent=base.name, adapter=view, adapters=())
        for view in base.adapters
    ]


@dataclass(frozen=True, slots=True)
class QueueStats:
    """Queues of every model together (the runner API's ``queue``)."""

    depth: int
    max_depth: int
    avg_wait_ms: float
    p95_wait_ms: float


@dataclass(frozen=True, slots=True)
class OutOfMemory:
    """A GPU out-of-memory that a model's runtime reported (on a load or a request)."""

    gpus: tuple[int, ...]  # the GPUs the model was placed on; () where it was not placed
    at: float  # Unix time, for people
    clock: float  # Trio clock, for how long /health keeps reporting it
    message: str


# Why a serving pool is degraded (docs/api.md, "Health"): a model's queue is at or near
# its max_queue, a GPU ran out of memory lately, a model failed.
HealthCode = Literal["queue_saturated", "gpu_oom", "model_failed"]
# The issues that make /health answer 503 though the pool serves (spec: model-runner-api,
# "Health Check": GPU OOM, queue saturated); a failed model among others does not.
UNAVAILABLE_CODES: frozenset[HealthCode] = frozenset({"queue_saturated", "gpu_oom"})


@dataclass(frozen=True, slots=True)
class HealthIssue:
    code: HealthCode
    model: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class PoolHealth:
    serving: bool
    uptime_s: float
    models_loaded: int
    queue_depth: int
    reason: str | None
    issues: tuple[HealthIssue, ...] = ()

    @property
    def status(self) -> Literal["healthy", "degraded", "unhealthy"]:
        """``unhealthy`` while not serving; ``degraded``: serving, with issues."""
        if not self.serving:
            return "unhealthy"
        return "degraded" if self.issues else "healthy"

    @property
    def available(self) -> bool:
        """Whether ``/health`` answers 200: serving, with no GPU out of memory and no
        saturated queue (those are ``degraded`` with a 503, and ``reason`` says which)."""
        return self.serving and not any(i.code in UNAVAILABLE_CODES for i in self.issues)


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One reading of one GPU (NVML, or a virtual GPU of ``engine.gpu_budget_mib``)."""

    index: int
    name: str
    used_mib: int
    total_mib: int
    utilization: float | None = None
    # MiB held by this pool's own processes, where the source can tell (NVML per process).
    pool_used_mib: int | None = None
    virtual: bool = False


@dataclass(frozen=True, slots=True)
class GpuView:
    """What the GPU source knows now: readings, or why there are none."""

    gpus: tuple[GpuReading, ...]
    error: str | None


@dataclass(frozen=True, slots=True)
class FlushResult:
    entries_removed: int
    memory_freed_mib: float
