"""Pydantic models of every API payload (OpenAPI is generated from these)."""

from pool.schemas._compat import (
    ChatCompletionRequest,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
)
from pool.schemas._responses import (
    ContentItem,
    DecodingRequest,
    ImageContent,
    Message,
    OutputText,
    ResponseEnvelope,
    ResponseMetrics,
    ResponseRequest,
    TextContent,
)
from pool.schemas._runner import CacheFlushRequest, RunnerLoadRequest, RunnerUnloadRequest

__all__ = [
    "CacheFlushRequest",
    "ChatCompletionRequest",
    "ContentItem",
    "DecodingRequest",
    "ImageContent",
    "Message",
    "OllamaChatRequest",
    "OllamaGenerateRequest",
    "OllamaModelRequest",
    "OutputText",
    "ResponseEnvelope",
    "ResponseMetrics",
    "ResponseRequest",
    "RunnerLoadRequest",
    "RunnerUnloadRequest",
    "TextContent",
]
