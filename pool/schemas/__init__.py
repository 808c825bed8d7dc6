"""Pydantic models of every API payload (OpenAPI is generated from these)."""

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

__all__ = [
    "ContentItem",
    "DecodingRequest",
    "ImageContent",
    "Message",
    "OutputText",
    "ResponseEnvelope",
    "ResponseMetrics",
    "ResponseRequest",
    "TextContent",
]
