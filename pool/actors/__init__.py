"""The actor tree: supervisor, model actors, schedulers and replicas.

The actors speak typed values only: an :class:`InferenceRequest` in, :class:`Delta`,
:class:`Finished` and :class:`Failed` events out, snapshots for state. Wire formats are
rendered from these in ``pool.http``.
"""

from pool.actors._admission import Admission, new_request_id
from pool.actors._affinity import AFFINITY_MIN_SHARE, longest_held
from pool.actors._details import ModelDetails
from pool.actors._events import (
    Delta,
    Embedded,
    Event,
    Failed,
    Finished,
    Loading,
    Queued,
    Timings,
    Usage,
    Waiting,
    WaitReason,
)
from pool.actors._gpu import GpuMonitor, GpuSource, NoGpus, VirtualGpus
from pool.actors._keep_alive import parse_keep_alive
from pool.actors._ledger import LedgerBinding, SharedLedger
from pool.actors._metrics import trio_task_count
from pool.actors._model import STATE_DESCRIPTIONS, ModelActor
from pool.actors._relay import RELAY_HEADER, RELAYED, Route, Router
from pool.actors._request import (
    CacheMode,
    DecodingOverrides,
    EmbeddingRequest,
    InferenceRequest,
)
from pool.actors._snapshots import (
    FlushResult,
    GpuReading,
    GpuView,
    ModelSnapshot,
    PoolHealth,
    QueueStats,
    RuntimeState,
    UnloadReason,
    VramEstimate,
)
from pool.actors._supervisor import Pool, open_pool
from pool.actors._tasks import LoadTask
from pool.backends import ToolCallDelta

__all__ = [
    "AFFINITY_MIN_SHARE",
    "RELAYED",
    "RELAY_HEADER",
    "STATE_DESCRIPTIONS",
    "Admission",
    "CacheMode",
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
    "InferenceRequest",
    "LedgerBinding",
    "LoadTask",
    "Loading",
    "ModelActor",
    "ModelDetails",
    "ModelSnapshot",
    "NoGpus",
    "Pool",
    "PoolHealth",
    "QueueStats",
    "Queued",
    "Route",
    "Router",
    "RuntimeState",
    "SharedLedger",
    "Timings",
    "ToolCallDelta",
    "UnloadReason",
    "Usage",
    "VirtualGpus",
    "VramEstimate",
    "WaitReason",
    "Waiting",
    "longest_held",
    "new_request_id",
    "open_pool",
    "parse_keep_alive",
    "trio_task_count",
]
