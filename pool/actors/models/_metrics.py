"""Prometheus metrics of one pool (its own registry, so several pools never collide).

Counters and histograms are updated where things happen; gauges that describe live
state (queue depth, in-flight, model state, GPU memory) are read from the actors at
scrape time by a collector, so they can never drift from the truth.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pool.backends import SplitReportingRuntime

if TYPE_CHECKING:
    from pool.actors.models._model import ModelActor
    from pool.actors.values._snapshots import GpuReading

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
_MIB = 1024 * 1024
_STATES = ("unloaded", "loading", "loaded", "unloading", "failed")
_CANARY = ("pending", "ok", "degraded", "failed")


class _LiveState(Collector):
    def __init__(
        self,
        models: Callable[[], Iterable[ModelActor]],
        gpus: Callable[[], Iterable[GpuReading]],
    ) -> None:
        self._models = models
        self._gpus = gpus

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "llm_pool_queue_depth", "Requests waiting in the queue", labels=["model"]
        )
        inflight = GaugeMetricFamily(
            "llm_pool_inflight_requests", "Requests running on replicas", labels=["model"]
        )
        replicas = GaugeMetricFamily(
            "llm_pool_loaded_replicas", "Loaded replicas", labels=["model"]
        )
        state = GaugeMetricFamily(
            "llm_pool_model_state",
            "1 for the model's current runtime state",
            labels=["model", "state"],
        )
        split = GaugeMetricFamily(
            "llm_pool_model_gpu_memory_bytes",
            "GPU memory of a model's loaded replicas by part: weights and kv_cache where"
            " the runtime reports the split (llama.cpp, vllm serve), else unknown (the"
            " measured total;"
            " NaN when not measured)",
            labels=["model", "part"],
        )
        canary = GaugeMetricFamily(
            "llm_pool_model_canary",
            "1 for what the model's output canary last found (pending, ok, degraded;"
            " failed: degraded past engine.canary_reloads_per_hour and marked failed);"
            " models without a canary have no sample",
            labels=["model", "status"],
        )
        for actor in self._models():
            _add_memory_split(split, actor)
            status = actor.residence.canary_status
            if status is not None:
                for health in _CANARY:
                    canary.add_metric([actor.name, health], 1.0 if status.health == health else 0.0)
            depth.add_metric([actor.name], actor.scheduler.queue_depth)
            inflight.add_metric([actor.name], actor.scheduler.running)
            replicas.add_metric([actor.name], len(actor.replicas))
            for name in _STATES:
                state.add_metric([actor.name, name], 1.0 if actor.state == name else 0.0)
        yield from (depth, inflight, replicas, state, split, canary)
        used = GaugeMetricFamily(
            "llm_pool_gpu_memory_used_bytes", "GPU memory in use", labels=["gpu"]
        )
        total = GaugeMetricFamily(
            "llm_pool_gpu_memory_total_bytes", "GPU memory in all", labels=["gpu"]
        )
        for gpu in self._gpus():
            used.add_metric([str(gpu.index)], gpu.used_mib * 1024 * 1024)
            total.add_metric([str(gpu.index)], gpu.total_mib * 1024 * 1024)
        yield from (used, total)
        yield from _runtime_figures()


def _add_memory_split(family: GaugeMetricFamily, actor: ModelActor) -> None:
    """The model's GPU memory as weights and KV cache where every replica's runtime
    reports them; otherwise one ``unknown`` part, never a split made up here."""
    runtimes = [r.runtime for r in actor.replicas if r.runtime is not None]
    if not runtimes:
        return
    splits = [
        rt.memory_split() if isinstance(rt, SplitReportingRuntime) else None for rt in runtimes
    ]
    known = [s for s in splits if s is not None]
    if len(known) == len(runtimes):
        family.add_metric([actor.name, "weights"], sum(s.weights_mib for s in known) * _MIB)
        family.add_metric([actor.name, "kv_cache"], sum(s.kv_cache_mib for s in known) * _MIB)
        return
    measured = actor.residence.observed_load_delta_mib
    family.add_metric([actor.name, "unknown"], math.nan if measured is None else measured * _MIB)


def trio_task_count() -> int | None:
    """Tasks alive in the current Trio run (walked from the root task), or None outside one."""
    try:
        root = trio.lowlevel.current_root_task()
    except RuntimeError:
        return None
    if root is None:
        return None
    count, stack = 0, [root]
    while stack:
        task = stack.pop()
        count += 1
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return count


def _runtime_figures() -> Iterator[Metric]:
    # Debug figures for leak hunting (the soak benchmark samples them): counted at scrape
    # time, so a task or thread that outlives its work shows as a rising line.
    tasks = trio_task_count()
    if tasks is not None:
        yield GaugeMetricFamily("llm_pool_trio_tasks", "Trio tasks alive in the pool", tasks)
    yield GaugeMetricFamily(
        "llm_pool_threads", "Threads alive in the pool process", threading.active_count()
    )


class _CacheHitRate(Collector):
    """Each model's prefix-cache hit rate, from the requests whose runtime could tell."""

    def __init__(self) -> None:
        self.seen: dict[str, list[int]] = {}  # model -> [lookups, hits]

    def record(self, model: str, cached_tokens: int) -> None:
        counts = self.seen.setdefault(model, [0, 0])
        counts[0] += 1
        counts[1] += cached_tokens > 0

    def collect(self) -> Iterator[Metric]:
        rate = GaugeMetricFamily(
            "llm_pool_cache_hit_rate",
            "Share of requests that reused a cached prompt prefix",
            labels=["model"],
        )
        for model, (lookups, hits) in sorted(self.seen.items()):
            rate.add_metric([model], hits / lookups if lookups else 0.0)
        yield rate


class PoolMetrics:
    """Every metric the pool exports, in one registry."""

    def __init__(
        self,
        models: Callable[[], Iterable[ModelActor]],
        gpus: Callable[[], Iterable[GpuReading]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "llm_pool_requests",
            "Inference requests by outcome",
            ["model", "tenant", "status"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "llm_pool_queue_wait_seconds",
            "Time from admission to a replica",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "llm_pool_inference_duration_seconds",
            "Time inside the backend",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.first_token = Histogram(
            "llm_pool_time_to_first_token_seconds",
            "Time to the first generated text",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter(
            "llm_pool_generated_tokens", "Output tokens generated", ["model"], registry=r
        )
        self.prompt_tokens = Counter(
            "llm_pool_prompt_tokens", "Prompt tokens processed", ["model"], registry=r
        )
        self.audio_seconds = Counter(
            "llm_pool_audio_seconds",
            "Seconds of audio in transcription requests that finished",
            ["model"],
            registry=r,
        )
        self.characters = Counter(
            "llm_pool_speech_characters",
            "Characters of text said by speech models (/v1/audio/speech)",
            ["model"],
            registry=r,
        )
        self.cache_lookups = Counter(
            "llm_pool_cache_lookups",
            "Requests to a runtime with a prefix cache, by outcome (hit or miss)",
            ["model", "outcome"],
            registry=r,
        )
        self.cache_reused_tokens = Counter(
            "llm_pool_cache_reused_tokens",
            "Prompt tokens served from a prefix cache",
            ["model"],
            registry=r,
        )
        self._hit_rate = _CacheHitRate()
        r.register(self._hit_rate)
        self.loads = Counter(
            "llm_pool_model_loads", "Model loads by outcome", ["model", "outcome"], registry=r
        )
        self.unloads = Counter("llm_pool_model_unloads", "Model unloads", ["model"], registry=r)
        self.load_duration = Histogram(
            "llm_pool_model_load_duration_seconds",
            "Time to load a model",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.unload_duration = Histogram(
            "llm_pool_model_unload_duration_seconds",
            "Time to unload a model (drain included)",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_prompt_tokens = Counter(
            "llm_pool_tenant_prompt_tokens",
            "Prompt tokens of ended requests by tenant, a cut one's included (see tenant_label)",
            ["tenant"],
            registry=r,
        )
        self.preemptions = Counter(
            "llm_pool_preempted_streams",
            "Low-priority streams stopped for a swap (how: pause, or cut with"
            " engine.preemption: cut)",
            ["model", "how"],
            registry=r,
        )
        self.pause_duration = Histogram(
            "llm_pool_pause_seconds",
            "How long paused streams stayed paused (outcome: resumed, or expired past"
            " engine.preempt_max_pause_s, or left: the client went or the model was"
            " unloaded)",
            ["model", "outcome"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_load_seconds = Counter(
            "llm_pool_tenant_load_seconds",
            "Seconds of model loading caused by a tenant's requests (each load a request"
            " started; see tenant_label)",
            ["tenant"],
            registry=r,
        )
        self.tenant_output_tokens = Counter(
            "llm_pool_tenant_output_tokens",
            "Output tokens of ended requests by tenant, a cut one's included (see tenant_label)",
            ["tenant"],
            registry=r,
        )
        self.max_tenant_labels = 100
        self._tenant_labels: set[str] = set()
        self.usage_written = Counter(
            "llm_pool_usage_records_written",
            "Usage records written to the usage database",
            registry=r,
        )
        self.usage_dropped = Counter(
            "llm_pool_usage_records_dropped",
            "Usage records dropped (queue_full: the writer fell behind; hold_full: more"
            " refused records than service.usage.hold_records waited for a retry;"
            " write_failed: the database refused the last try at shutdown; closed, shutdown:"
            " the pool was stopping)",
            ["reason"],
            registry=r,
        )
        self.usage_held = Gauge(
            "llm_pool_usage_records_held",
            "Usage records the database refused (a full disk), held in memory for a retry",
            registry=r,
        )
        self.canary_probes = Counter(
            "llm_pool_canary_probes",
            "Output canaries by outcome (ok, degraded, skipped: the model was busy or a"
            " request came); never counted as requests",
            ["model", "outcome"],
            registry=r,
        )
        self.canary_reloads = Counter(
            "llm_pool_canary_reloads",
            "Reloads of a model its output canary found degraded",
            ["model"],
            registry=r,
        )
        self.watchdog_recycles = Counter(
            "llm_pool_watchdog_recycles",
            "Replicas the watchdog recycled, by fault (hang: no token within"
            " engine.generation_idle_timeout_s; exit: the runtime's process exited)",
            ["model", "fault"],
            registry=r,
        )
        self.budget_refusals = Counter(
            "llm_pool_budget_refusals",
            "Requests refused because a budget was spent, by the budget's subject",
            ["subject"],
            registry=r,
        )
        r.register(_LiveState(models, gpus or list))

    def record_cache(self, model: str, cached_tokens: int | None) -> None:
        """Count one request's prefix-cache outcome (nothing when the runtime cannot tell)."""
        if cached_tokens is None:
            return
        self.cache_lookups.labels(model, "hit" if cached_tokens > 0 else "miss").inc()
        self.cache_reused_tokens.labels(model).inc(cached_tokens)
        self._hit_rate.record(model, cached_tokens)

    def tenant_label(self, tenant: str) -> str:
        """The label of ``tenant`` in the per-tenant counters: its name for the first
        ``max_tenant_labels`` tenants seen, ``other`` after that, so a client that makes
        up tenant ids cannot grow the metrics without bound."""
        if tenant in self._tenant_labels:
            return tenant
        if len(self._tenant_labels) < self.max_tenant_labels:
            self._tenant_labels.add(tenant)
            return tenant
        return "other"

    def record_tenant_tokens(self, tenant: str, prompt: int, output: int) -> None:
        label = self.tenant_label(tenant)
        if prompt:
            self.tenant_prompt_tokens.labels(label).inc(prompt)
        if output:
            self.tenant_output_tokens.labels(label).inc(output)

    def record_tenant_load(self, tenant: str, seconds: float) -> None:
        if seconds > 0:
            self.tenant_load_seconds.labels(self.tenant_label(tenant)).inc(seconds)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
