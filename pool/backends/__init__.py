"""Backends: the shape every backend module has, and the registry of them by name.

Backend modules are imported on first use, and none imports its runtime library at
module level, so a pool that serves only stub models never imports llama-cpp-python,
CTranslate2 or vLLM.
"""

from __future__ import annotations

from pool.backends._gguf import GgufHeader, read_gguf_header
from pool.backends._placement import GpuPlacement
from pool.backends._process import free_port
from pool.backends._protocol import (
    ALL_THINKING_MODES,
    Backend,
    CacheFlushed,
    CacheScope,
    CacheUsage,
    Capabilities,
    Decoding,
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
    PrefixCachingRuntime,
    Runtime,
    TextPart,
    ThinkingMode,
    TokenSink,
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
from pool.backends._tools import (
    OutputFormat,
    ToolCall,
    ToolCallDelta,
    ToolChoice,
    ToolSpec,
    assemble_calls,
    new_call_id,
)

__all__ = [
    "ALL_THINKING_MODES",
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
    "LoadContext",
    "LoadOverrides",
    "MemoryProfile",
    "OutputFormat",
    "PrefixCachingRuntime",
    "Runtime",
    "TextPart",
    "ThinkingMode",
    "TokenSink",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "ToolSpec",
    "Turn",
    "assemble_calls",
    "backend_names",
    "context_field",
    "definition_class",
    "free_port",
    "get_backend",
    "load_override_models",
    "new_call_id",
    "read_gguf_header",
    "register_backend",
    "unregister_backend",
]
