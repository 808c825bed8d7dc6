"""Backends: the shape every backend module has, and the registry of them by name.

Backend modules are imported on first use, and none imports its runtime library at
module level, so a pool that serves only stub models never imports llama-cpp-python,
CTranslate2 or vLLM.
"""

from __future__ import annotations

from pool.backends._file_identity import file_identity
from pool.backends._gguf import GgufHeader, read_gguf_header
from pool.backends._kinds import KindFields
from pool.backends._load_hints import capacity_fields, unmet_load_hint
from pool.backends._load_request import (
    LoadRequest,
    apply_override,
    load_constraints,
    load_recommendations,
    load_request_schema,
    validate_load_request,
)
from pool.backends._oom import out_of_memory
from pool.backends._placement import GpuPlacement
from pool.backends._process import free_port
from pool.backends._protocol import (
    ALL_THINKING_MODES,
    MODEL_KINDS,
    Backend,
    CacheFlushed,
    CacheScope,
    CacheUsage,
    Capabilities,
    EmbeddingJob,
    EmbeddingResult,
    EmbeddingRuntime,
    FinishReason,
    GenerationRequest,
    GenerationStats,
    ImagePart,
    LoadContext,
    LoadOverrides,
    MemoryProfile,
    MemorySplit,
    ModelKind,
    PrefixCachingRuntime,
    Runtime,
    SleepingRuntime,
    SplitReportingRuntime,
    TextPart,
    ThinkingMode,
    TokenSink,
    TokensUsed,
    Turn,
)
from pool.backends._registry import (
    backend_names,
    context_field,
    definition_class,
    get_backend,
    load_override_models,
    register_backend,
    unregister_backend,
)
from pool.backends._sentence_pooling import SentenceConfig, read_sentence_config
from pool.backends._tasks import TaskJob, TaskResult, TaskSink, TaskUsage
from pool.backends._tools import (
    OutputFormat,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
    assemble_calls,
    new_call_id,
)
from pool.config import Decoding

__all__ = [
    "ALL_THINKING_MODES",
    "MODEL_KINDS",
    "Backend",
    "CacheFlushed",
    "CacheScope",
    "CacheUsage",
    "Capabilities",
    "Decoding",
    "EmbeddingJob",
    "EmbeddingResult",
    "EmbeddingRuntime",
    "FinishReason",
    "GenerationRequest",
    "GenerationStats",
    "GgufHeader",
    "GpuPlacement",
    "ImagePart",
    "KindFields",
    "LoadContext",
    "LoadOverrides",
    "LoadRequest",
    "MemoryProfile",
    "MemorySplit",
    "ModelKind",
    "OutputFormat",
    "PrefixCachingRuntime",
    "Runtime",
    "SentenceConfig",
    "SleepingRuntime",
    "SplitReportingRuntime",
    "TaskJob",
    "TaskResult",
    "TaskSink",
    "TaskUsage",
    "TextPart",
    "ThinkingMode",
    "TokenSink",
    "TokensUsed",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolSpec",
    "Turn",
    "apply_override",
    "assemble_calls",
    "backend_names",
    "capacity_fields",
    "context_field",
    "definition_class",
    "file_identity",
    "free_port",
    "get_backend",
    "load_constraints",
    "load_override_models",
    "load_recommendations",
    "load_request_schema",
    "new_call_id",
    "out_of_memory",
    "read_gguf_header",
    "read_sentence_config",
    "register_backend",
    "unmet_load_hint",
    "unregister_backend",
    "validate_load_request",
]
