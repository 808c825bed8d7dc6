"""The pool's state taken together: health, queues and the prompt caches of every
loaded replica (what ``/health``, ``/metrics`` and the runner API show)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator

import trio

from pool.actors.models._model import ModelActor
from pool.actors.models._stats import percentile
from pool.actors.values._snapshots import FlushResult, HealthIssue, PoolHealth, QueueStats
from pool.backends import CacheUsage
from pool.errors import PoolError

# A queue this full of its max_queue is saturated: the next few requests get queue_full.
SATURATED_SHARE = 0.9


def health(
    actors: Iterable[ModelActor],
    *,
    started_at: float,
    shutting_down: bool,
    oom_window_s: float,
) -> PoolHealth:
    """Whether the pool serves, and why not; what degrades it while it serves
    (:func:`issues`)."""
    actors = list(actors)
    reason = None
    if shutting_down:
        reason = "the pool is shutting down"
    elif actors and all(a.state == "failed" for a in actors):
        reason = "every model failed to load"
    found = tuple(issues(actors, oom_window_s))
    return PoolHealth(
        serving=reason is None,
        uptime_s=time.time() - started_at,
        models_loaded=sum(1 for a in actors if a.state == "loaded"),
        queue_depth=sum(a.queue_depth for a in actors),
        reason=reason or unavailable_reason(found),
        issues=found,
    )


def unavailable_reason(found: Iterable[HealthIssue]) -> str | None:
    """Why a serving pool answers 503 (its GPU out-of-memories and saturated queues, by
    model), or None when nothing does."""
    said = []
    for issue in found:
        if issue.code == "gpu_oom":
            gpu = issue.details.get("gpu")
            where = f" on GPU {gpu}" if gpu is not None else ""
            said.append(f"model {issue.model!r} ran out of GPU memory{where}")
        elif issue.code == "queue_saturated":
            said.append(
                f"the queue of model {issue.model!r} is saturated"
                f" ({issue.details['queueDepth']}/{issue.details['maxQueue']})"
            )
    return "; ".join(dict.fromkeys(said)) or None


def issues(actors: Iterable[ModelActor], oom_window_s: float) -> Iterator[HealthIssue]:
    """Per model: a queue at or near its ``max_queue``, a GPU out-of-memory its runtime
    reported within ``oom_window_s`` (one per GPU), a ``failed`` state."""
    now = trio.current_time()
    for actor in actors:
        limit = actor.scheduler.max_queue
        depth = actor.queue_depth
        if limit > 0 and depth >= max(1, math.ceil(SATURATED_SHARE * limit)):
            yield HealthIssue(
                "queue_saturated", actor.name, {"queueDepth": depth, "maxQueue": limit}
            )
        oom = actor.out_of_memory
        if oom is not None and now - oom.clock <= oom_window_s:
            for gpu in oom.gpus or (None,):
                yield HealthIssue(
                    "gpu_oom",
                    actor.name,
                    {"gpu": gpu, "at": round(oom.at), "message": oom.message},
                )
        if actor.state == "failed":
            yield HealthIssue("model_failed", actor.name, {"error": actor.last_error})


def queue_stats(actors: Iterable[ModelActor], limit: int | None = None) -> QueueStats:
    """Every model's queue together; ``max_depth`` counts loaded models only, and is at
    most ``limit`` (``engine.max_queue_total``)."""
    actors = list(actors)
    waits = [w for a in actors for w in a.scheduler.stats.waits_ms]
    max_depth = sum(a.scheduler.max_queue for a in actors if a.state == "loaded")
    return QueueStats(
        depth=sum(a.queue_depth for a in actors),
        max_depth=max_depth if limit is None else min(max_depth, limit),
        avg_wait_ms=sum(waits) / len(waits) if waits else 0.0,
        p95_wait_ms=percentile(waits, 0.95),
    )


def check_runner_queue(actors: Iterable[ModelActor], limit: int | None, actor: ModelActor) -> None:
    """Refuse a request to ``actor`` that would wait while the queues of all models
    together hold ``limit`` requests (``engine.max_queue_total``, the runner spec's
    ``MAX_QUEUE_DEPTH``): a runner-wide bound beside each model's ``max_queue``.

    Raises:
        PoolError: ``queue_full`` (503) with the runner's figures.
    """
    if limit is None or actor.scheduler.next_position == 0:
        return
    stats = queue_stats(actors, limit)
    if stats.depth >= limit:
        raise PoolError(
            "queue_full",
            f"queue depth {stats.depth}/{limit} (MAX_QUEUE_DEPTH, all models together)",
            retry_after_s=actor.scheduler.stats.retry_after_s(trio.current_time()),
            details={
                "queue_depth": stats.depth,
                "max_depth": limit,
                "avg_wait_ms": round(stats.avg_wait_ms, 1),
            },
        )


async def flush_caches(
    actors: Iterable[ModelActor], scope: str, *, tenant: str | None, tag: str | None
) -> FlushResult:
    """Flush the prompt caches of ``actors``' replicas by scope (see Pool.flush_cache),
    and what a model without replicas keeps of its cache on disk."""
    entries = 0
    freed_mib = 0.0
    for actor in actors:
        if not actor.replicas:
            stored = await actor.backend.flush_stored(
                actor.definition, actor.settings.base_dir, scope, tenant, tag
            )
            entries += stored.entries
        for replica in actor.replicas:
            flush = getattr(replica.runtime, "flush_cache", None)
            if flush is not None:
                flushed = await flush(scope=scope, tenant=tenant, tag=tag)
                entries += flushed.entries
                freed_mib += flushed.memory_mib
        actor.forget_prefixes()  # (all of them: routing only loses a hint)
    return FlushResult(entries, freed_mib)


def prefix_caching(actors: Iterable[ModelActor]) -> bool:
    """Whether any loaded replica keeps a prefix cache (one the pool can flush)."""
    return any(
        hasattr(replica.runtime, "flush_cache") for actor in actors for replica in actor.replicas
    )


def cache_usage(actors: Iterable[ModelActor]) -> CacheUsage | None:
    """The prompt caches of every loaded replica together (None: no runtime has one)."""
    size = used = 0.0
    found = False
    for actor in actors:
        for replica in actor.replicas:
            usage_of = getattr(replica.runtime, "cache_usage", None)
            usage = usage_of() if usage_of is not None else None
            if usage is not None:
                found = True
                size += usage.size_mib
                used += usage.used_mib
    return CacheUsage(size, used) if found else None
