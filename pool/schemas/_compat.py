"""Request bodies of the client-compatibility surfaces: OpenAI Chat Completions and Ollama.

These accept (and ignore) the many optional fields real clients send; the fields the
pool acts on are typed and bounded like the native API's.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from pool.schemas._responses import MAX_ITEMS, MAX_TEXT_CHARS, ImageUrl

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
Stop = Annotated[str, StringConstraints(min_length=1, max_length=1000)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChatTextPart(_Lenient):
    type: Literal["text"]
    text: Text


class ChatImagePart(_Lenient):
    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant"]
    content: (
        Text
        | Annotated[
            list[Annotated[ChatTextPart | ChatImagePart, Field(discriminator="type")]],
            Field(min_length=1, max_length=MAX_ITEMS),
        ]
        | None
    ) = None


class StreamOptions(_Lenient):
    include_usage: bool = False


class ChatCompletionRequest(_Lenient):
    """``POST /v1/chat/completions`` (OpenAI format)."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_ITEMS)]
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=100_000)] | None = None
    max_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] | None = Field(None, description="Only 1 is supported.")
    allow_remote: bool = Field(False, description="Pool extension: required for remote models.")


class OllamaOptions(_Lenient):
    temperature: Annotated[float, Field(ge=0.0, le=100.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=100_000)] | None = None
    num_predict: Annotated[int, Field(ge=-2, le=1_000_000)] | None = None
    stop: Annotated[list[Stop], Field(max_length=16)] | None = None
    repeat_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    num_ctx: Annotated[int, Field(ge=1, le=10_000_000)] | None = None


class OllamaMessage(_Lenient):
    role: Literal["system", "user", "assistant"]
    content: Text = ""
    images: (
        Annotated[
            list[Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]], Field(max_length=16)
        ]
        | None
    ) = None


class OllamaChatRequest(_Lenient):
    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    messages: Annotated[list[OllamaMessage], Field(max_length=MAX_ITEMS)] = Field(
        default_factory=list
    )
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: float | str | None = None
    format: Any = None
    think: bool | None = None


class OllamaGenerateRequest(_Lenient):
    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    prompt: Text = ""
    system: Text | None = None
    images: (
        Annotated[
            list[Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]], Field(max_length=16)
        ]
        | None
    ) = None
    stream: bool = True
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    keep_alive: float | str | None = None
    think: bool | None = None


class OllamaModelRequest(_Lenient):
    """``/api/show``, ``/api/delete``, ``/api/pull``: ``model`` (or the older ``name``)."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None
    name: Annotated[str, StringConstraints(min_length=1, max_length=512)] | None = None
    stream: bool = True
    insecure: bool = False

    @property
    def target(self) -> str:
        return self.model or self.name or ""
