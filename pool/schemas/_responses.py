"""``POST /v1/responses``: the request, the response envelope, metrics and stream events."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    RootModel,
    StringConstraints,
    create_model,
    model_validator,
)

from pool.config import request_fields
from pool.schemas._tools import (
    MAX_TOOLS,
    FunctionCallItem,
    FunctionCallOutput,
    FunctionCallOutputItem,
    FunctionTool,
    KeepAlive,
    ResponsesToolChoice,
    TextOptions,
)

# Bounds that keep a single request from exhausting the pool; anything past them is a
# 422 before it reaches a model.
MAX_TEXT_CHARS = 4_000_000
MAX_ITEMS = 1024

# What a waiting request waits for, as the wire names it: room on the GPUs, its model's
# load, or a free replica slot. The actors have their own name for the same values
# (pool.actors.WaitReason, which a test holds this to): a wire shape knows no actor.
WaitingFor = Literal["vram", "load", "replica"]

BoundedText = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
LangCode = Annotated[str, StringConstraints(min_length=1, max_length=35)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextContent(_Strict):
    type: Literal["text", "input_text"] = Field(description="A text part.")
    text: BoundedText


class ImageUrl(_Strict):
    url: Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)]
    detail: Literal["auto", "low", "high"] | None = None


class ImageContent(_Strict):
    type: Literal["image_url"] = Field(
        description="An image part: a base64 `data:` URL; `file://` only under"
        " service.media_dirs; `http(s)` only with service.media_fetch, from public"
        " addresses. Others are 400 `image_refused`."
    )
    image_url: ImageUrl


ContentItem = Annotated[TextContent | ImageContent, Field(discriminator="type")]
Content = BoundedText | Annotated[list[ContentItem], Field(min_length=1, max_length=MAX_ITEMS)]


class Message(_Strict):
    role: Literal["user", "assistant"] = Field(
        description="Only user and assistant turns; `instructions` carries the system prompt."
    )
    content: Content


# Dynamic base: every sampling field of the one declaration (pool/config/_sampling.py),
# with its limits, each optional.
class DecodingRequest(
    create_model("DecodingRequest", __base__=_Strict, **request_fields())  # type: ignore[misc]
):
    """Decoding fields; each omitted one falls back to ``engine.decoding``."""


ConversationItem = Message | FunctionCallItem | FunctionCallOutputItem


class ResponseRequest(_Strict):
    """Body of ``POST /v1/responses``: give either ``input`` or ``messages``."""

    model_config = ConfigDict(
        extra="forbid",
        # What the validator below says, for schema readers: exactly one of the two.
        json_schema_extra={
            "oneOf": [
                {"required": [name], "properties": {name: {"not": {"type": "null"}}}}
                for name in ("input", "messages")
            ]
        },
    )

    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    input: Content | None = Field(None, description="Single-turn input: text or content items.")
    messages: (
        Annotated[list[ConversationItem], Field(min_length=1, max_length=MAX_ITEMS)] | None
    ) = Field(
        None,
        description="Multi-turn conversation ending with a user message (or a"
        " `function_call_output` item answering a `function_call` item).",
    )
    instructions: BoundedText | None = Field(None, description="System prompt.")
    source_lang_code: LangCode | None = None
    target_lang_code: LangCode | None = None
    allow_remote: bool = Field(False, description="Must be true to use a remote backend.")
    stream: bool = Field(False, description="true: Server-Sent Events; false: one JSON body.")
    thinking: Literal["default", "enabled", "disabled"] = "default"
    decoding: DecodingRequest = Field(default_factory=DecodingRequest)
    keep_alive: KeepAlive = Field(
        None, description="On-demand models: idle time before unload (seconds or '5m')."
    )
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = Field(
        None,
        description='Function tools, `{"type": "function", "name", "parameters"}`; a model'
        " that cannot call tools answers 400 `tools_unsupported`.",
    )
    tool_choice: ResponsesToolChoice | None = Field(
        None,
        description='"auto", "none", "required", or {"type": "function", "name": ...}.',
    )
    parallel_tool_calls: bool = True
    text: TextOptions | None = Field(
        None, description="`text.format`: json_object or json_schema (structured output)."
    )

    @model_validator(mode="after")
    def _one_input(self) -> ResponseRequest:
        if (self.input is None) == (self.messages is None):
            raise ValueError("give exactly one of `input` or `messages`")
        # Which item ends the conversation is no shape a schema can state: the route
        # refuses a conversation that does not end with the user's turn with a 400.
        return self


class ResponseMetrics(BaseModel):
    """Nested timers of one request (ms) and token counts; null where unknown."""

    backend_inference_wall_ms: float | None = Field(None, description="Inside the backend call.")
    engine_total_wall_ms: float | None = Field(
        None, description="Backend plus scheduler and engine work (queue wait excluded)."
    )
    engine_outside_backend_wall_ms: float | None = None
    pool_total_wall_ms: float | None = Field(None, description="The whole request in the pool.")
    engine_queue_wait_ms: float | None = None
    engine_tokenize_ms: float | None = None
    gpu_time_to_first_token_ms: float | None = None
    gpu_generate_total_ms: float | None = None
    gpu_decode_after_first_token_ms: float | None = None
    engine_prompt_tokens: int | None = None
    engine_cached_prompt_tokens: int | None = Field(
        None,
        description="Prompt tokens served from the runtime's prefix cache (null: it keeps"
        " none or cannot tell); a streamed answer's headers precede it, so it is here.",
    )
    engine_output_tokens: int | None = None
    engine_tokens_per_second: float | None = None


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str


class ResponseEnvelope(BaseModel):
    """The JSON answer of a non-streamed request (and the payload of ``response.completed``)."""

    id: str
    object: Literal["response"] = "response"
    model: str
    output: list[OutputText | FunctionCallOutput]
    output_text: str
    finish_reason: Literal["stop", "length", "cancelled", "tool_calls"] = "stop"
    metrics: ResponseMetrics


# -- stream events (SSE, and the same objects as WebSocket frames) ------------------------
class ResponseCreatedEvent(BaseModel):
    """The first event: the request was admitted (it may still wait for a load)."""

    type: Literal["response.created"]
    id: str
    model: str


class ResponseQueuedEvent(BaseModel):
    """Before the first delta, while the request waits (again when either field changes)."""

    type: Literal["response.queued"]
    position: int = Field(description="Its place among the model's waiting requests (1: next).")
    waiting_for: WaitingFor


class ResponseLoadingEvent(BaseModel):
    """Before the first delta, while the model the request waits for loads."""

    type: Literal["response.loading"]
    progress: float | None = Field(description="0..1 where the backend reports it, else null.")


class ResponseTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"]
    delta: str = Field(description="The text generated since the previous delta.")


class StreamedFunctionCall(BaseModel):
    """A ``function_call`` item as its first piece opens it (arguments still to come)."""

    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: Literal[""]
    status: Literal["in_progress"]


class ResponseItemAddedEvent(BaseModel):
    type: Literal["response.output_item.added"]
    output_index: int
    item: StreamedFunctionCall


class ResponseArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"]
    item_id: str
    output_index: int
    delta: str = Field(description="The next piece of the arguments' JSON text.")


class ResponseArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"]
    item_id: str
    output_index: int
    arguments: str


class ResponseItemDoneEvent(BaseModel):
    type: Literal["response.output_item.done"]
    output_index: int
    item: FunctionCallOutput


class ResponseMetricsEvent(BaseModel):
    type: Literal["response.metrics"]
    metrics: ResponseMetrics


class ResponseCompletedEvent(BaseModel):
    type: Literal["response.completed"]
    response: ResponseEnvelope


class StreamErrorDetail(BaseModel):
    """The pool's error object: its ``code`` (one of the error table's) and ``message``,
    with the details the code has (``waiting_for`` of a ``queue_timeout``, ...)."""

    model_config = ConfigDict(extra="allow")

    code: str
    message: str


class ResponseErrorEvent(BaseModel):
    """A failure after the stream started (the stream ends with it)."""

    type: Literal["error"]
    error: StreamErrorDetail


class ResponseStreamEvent(
    RootModel[
        Annotated[
            ResponseCreatedEvent
            | ResponseQueuedEvent
            | ResponseLoadingEvent
            | ResponseTextDeltaEvent
            | ResponseItemAddedEvent
            | ResponseArgumentsDeltaEvent
            | ResponseArgumentsDoneEvent
            | ResponseItemDoneEvent
            | ResponseMetricsEvent
            | ResponseCompletedEvent
            | ResponseErrorEvent,
            Field(discriminator="type"),
        ]
    ]
):
    """The data of each event of ``stream: true`` on ``/v1/responses`` (the SSE
    ``event:`` name is its ``type``)."""
