"""The actor tree: supervisor, model actors, schedulers and replicas.

The actors speak typed values only: an :class:`InferenceRequest` in, :class:`Delta`,
:class:`Finished` and :class:`Failed` events out, snapshots for state. Wire formats are
rendered from these in ``pool.http``.
"""

from pool.actors._supervisor import Pool, open_pool
from pool.actors.accounting._budgets import BudgetCounters, Budgets, LocalCounters
from pool.actors.accounting._rate_limit import RateLimiter
from pool.actors.accounting._usage import UsageRecorder, UsageSink
from pool.actors.accounting._usage_store import BUCKETS as USAGE_BUCKETS
from pool.actors.accounting._usage_store import FILE_NAME as USAGE_FILE_NAME
from pool.actors.accounting._usage_store import GROUPS as USAGE_GROUPS
from pool.actors.accounting._usage_store import Bucket as UsageBucket
from pool.actors.accounting._usage_store import GroupBy as UsageGroupBy
from pool.actors.accounting._usage_store import UsageRecord, UsageStore, UsageTotal
from pool.actors.models._affinity import AFFINITY_MIN_SHARE, longest_held
from pool.actors.models._metrics import trio_task_count
from pool.actors.models._model import STATE_DESCRIPTIONS, ModelActor
from pool.actors.residency._gpu import GpuMonitor, GpuSource, NoGpus, VirtualGpus
from pool.actors.residency._keep_alive import parse_keep_alive
from pool.actors.residency._ledger import LedgerBinding, SharedLedger
from pool.actors.residency._memory_budget import fit_memory_budget
from pool.actors.residency._tasks import LoadTask
from pool.actors.serving._admission import Admission, new_request_id
from pool.actors.serving._caller import CALLER, Caller
from pool.actors.serving._relay import RELAY_HEADER, RELAYED, Route, Router
from pool.actors.serving._request import (
    CacheMode,
    DecodingOverrides,
    EmbeddingRequest,
    InferenceRequest,
    PoolRequest,
    TaskRequest,
)
from pool.actors.serving._trace_protocol import (
    FIRST_TOKEN_EVENT,
    GENERATION_SPAN,
    LOAD_SPAN,
    QUEUE_SPAN,
    RequestTrace,
    Tracing,
)
from pool.actors.values._details import ModelDetails, quantization_name, same_quantization
from pool.actors.values._events import (
    Completed,
    Delta,
    Embedded,
    Event,
    Failed,
    Finished,
    Loading,
    Paused,
    Queued,
    Timings,
    Usage,
    Waiting,
    WaitReason,
)
from pool.actors.values._snapshots import (
    AdapterView,
    CanaryHealth,
    CanaryStatus,
    FlushResult,
    GpuReading,
    GpuView,
    HealthIssue,
    ModelSnapshot,
    OutOfMemory,
    PoolHealth,
    QueueStats,
    RuntimeState,
    UnloadReason,
    VramEstimate,
)
from pool.backends import ToolCallDelta

__all__ = [
    "AFFINITY_MIN_SHARE",
    "CALLER",
    "FIRST_TOKEN_EVENT",
    "GENERATION_SPAN",
    "LOAD_SPAN",
    "QUEUE_SPAN",
    "RELAYED",
    "RELAY_HEADER",
    "STATE_DESCRIPTIONS",
    "USAGE_BUCKETS",
    "USAGE_FILE_NAME",
    "USAGE_GROUPS",
    "AdapterView",
    "Admission",
    "BudgetCounters",
    "Budgets",
    "CacheMode",
    "Caller",
    "CanaryHealth",
    "CanaryStatus",
    "Completed",
    "DecodingOverrides",
    "Delta",
    "Embedded",
    "EmbeddingRequest",
    "Event",
    "Failed",
    "Finished",
    "FlushResult",
    "GpuMonitor",
    "GpuReading",
    "GpuSource",
    "GpuView",
    "HealthIssue",
    "InferenceRequest",
    "LedgerBinding",
    "LoadTask",
    "Loading",
    "LocalCounters",
    "ModelActor",
    "ModelDetails",
    "ModelSnapshot",
    "NoGpus",
    "OutOfMemory",
    "Paused",
    "Pool",
    "PoolHealth",
    "PoolRequest",
    "QueueStats",
    "Queued",
    "RateLimiter",
    "RequestTrace",
    "Route",
    "Router",
    "RuntimeState",
    "SharedLedger",
    "TaskRequest",
    "Timings",
    "ToolCallDelta",
    "Tracing",
    "UnloadReason",
    "Usage",
    "UsageBucket",
    "UsageGroupBy",
    "UsageRecord",
    "UsageRecorder",
    "UsageSink",
    "UsageStore",
    "UsageTotal",
    "VirtualGpus",
    "VramEstimate",
    "WaitReason",
    "Waiting",
    "fit_memory_budget",
    "longest_held",
    "new_request_id",
    "open_pool",
    "parse_keep_alive",
    "quantization_name",
    "same_quantization",
    "trio_task_count",
]
