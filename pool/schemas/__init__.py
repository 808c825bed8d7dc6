"""Pydantic models of every API payload (OpenAPI is generated from these)."""

from pool.schemas._compat import (
    ChatCompletionRequest,
    ChatImagePart,
    ChatTextPart,
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
    OllamaOptions,
)
from pool.schemas._responses import (
    Content,
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
    "ChatImagePart",
    "ChatTextPart",
    "Content",
    "ContentItem",
    "DecodingRequest",
    "ImageContent",
    "Message",
    "OllamaChatRequest",
    "OllamaGenerateRequest",
    "OllamaModelRequest",
    "OllamaOptions",
    "OutputText",
    "ResponseEnvelope",
    "ResponseMetrics",
    "ResponseRequest",
    "RunnerLoadRequest",
    "RunnerUnloadRequest",
    "TextContent",
]
