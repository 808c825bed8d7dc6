"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API.

Requests are lenient about fields the pool does not act on (``cache_control``,
``citations``, ``service_tier``, ...), as Anthropic's clients send them freely; the
fields it acts on are typed and bounded like the other surfaces'. Content blocks are
a union on ``type``; a block type the pool cannot serve (documents, server tools) is a
400 from the HTTP layer naming the block, not a bare 422.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, StringConstraints, Tag

from pool.config import ClientTemperature, MaxTokens, StopString, TopK, TopP
from pool.schemas._documented import ARGUMENTS_SCHEMA, FUNCTION_NAME, fields, nothing
from pool.schemas._responses import MAX_ITEMS, MAX_TEXT_CHARS
from pool.schemas._tools import MAX_TOOLS, KeepAlive, ToolName

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, StringConstraints(max_length=256)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Reply(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessagesTextBlock(_Lenient):
    type: Literal["text"]
    text: Text


class MessagesImageSource(_Lenient):
    """``base64`` (``media_type`` and ``data``) or ``url``; the URL follows the pool's
    media policy (``service.media_fetch``, ``service.media_dirs``) as on every surface."""

    # What each type needs is refused with a sentence of its own (pool/http/anthropic).
    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {
                    "properties": {
                        "type": {"const": "url"},
                        "url": {"type": "string", "minLength": 1},
                    },
                    "required": ["url"],
                },
                {
                    "properties": {
                        "type": {"const": "base64"},
                        "media_type": {"type": "string", "minLength": 1},
                        "data": {"type": "string", "minLength": 1},
                    },
                    "required": ["media_type", "data"],
                },
            ]
        }
    )

    type: Literal["base64", "url"]
    media_type: Name | None = None
    data: Text | None = None
    url: Text | None = None


class MessagesImageBlock(_Lenient):
    type: Literal["image"]
    source: MessagesImageSource


class MessagesToolUseBlock(_Lenient):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: Name
    name: ToolName
    input: dict[str, Any] = Field(default_factory=dict)


class MessagesToolResultBlock(_Lenient):
    """The result of a call, in a user message: text (or text and image blocks)."""

    type: Literal["tool_result"]
    tool_use_id: Name
    content: (
        Text
        | Annotated[
            list[Annotated[MessagesTextBlock | MessagesImageBlock, Field(discriminator="type")]],
            Field(max_length=MAX_ITEMS),
        ]
        | None
    ) = None
    is_error: bool | None = None


class MessagesThinkingBlock(_Lenient):
    """Earlier reasoning sent back by a client; the model is not shown it again."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: Text | None = None
    signature: Text | None = None
    data: Text | None = None


class MessagesOtherBlock(_Lenient):
    """Any other block type (documents, search results, server tool blocks): refused
    with a 400 naming it, so the document has no such block."""

    model_config = ConfigDict(json_schema_extra=nothing)

    type: Name


_KNOWN_BLOCKS = frozenset(
    {"text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"}
)


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    if not isinstance(kind, str):  # (a type that is no string: the "other" block refuses it)
        return "other"
    if kind in ("thinking", "redacted_thinking"):
        return "thinking"
    return kind if kind in _KNOWN_BLOCKS else "other"


# A known type is validated as its block (a malformed one is a 422 naming the field);
# any other type is kept as such, for a 400 naming it.
MessagesBlock = Annotated[
    Annotated[MessagesTextBlock, Tag("text")]
    | Annotated[MessagesImageBlock, Tag("image")]
    | Annotated[MessagesToolUseBlock, Tag("tool_use")]
    | Annotated[MessagesToolResultBlock, Tag("tool_result")]
    | Annotated[MessagesThinkingBlock, Tag("thinking")]
    | Annotated[MessagesOtherBlock, Tag("other")],
    Discriminator(_block_kind),
]


class MessagesMessage(_Lenient):
    role: Literal["user", "assistant"]
    content: Text | Annotated[list[MessagesBlock], Field(max_length=MAX_ITEMS)]


class MessagesTool(_Lenient):
    """A client tool: ``name``, ``description`` and the ``input_schema`` of its input.

    A typed server tool (``web_search_...``, ``bash_...``) is a 400: the pool runs none.
    """

    model_config = ConfigDict(
        json_schema_extra=fields(
            {"name": FUNCTION_NAME},
            type={"enum": ["custom", None], "description": 'Absent or "custom".'},
            input_schema=ARGUMENTS_SCHEMA,
        )
    )

    type: Name | None = Field(None, description='Absent or "custom"; server tools are refused.')
    name: ToolName | None = None
    description: Text | None = None
    input_schema: dict[str, Any] | None = None


class MessagesToolChoice(_Lenient):
    """``auto`` (the model decides), ``any`` (it must call one of the tools), ``tool``
    (it must call ``name``), ``none`` (it must not call any)."""

    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesThinking(_Lenient):
    """``enabled`` asks a model that can think to reason first (``budget_tokens`` is
    accepted; the reply's ``max_tokens`` bounds both); ``disabled`` asks it not to."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, Field(ge=0, le=1_000_000)] | None = None


class MessagesOutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="The JSON schema of the reply.")


class MessagesOutputConfig(_Lenient):
    """``format`` constrains the reply to JSON of a schema where the backend can;
    ``effort`` is accepted and has no effect."""

    format: MessagesOutputFormat | None = None
    effort: Name | None = None


class MessagesMetadata(_Lenient):
    user_id: Name | None = None


class MessagesTokensRequest(_Lenient):
    """What ``count_tokens`` counts: the prompt of a Messages request."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    messages: Annotated[list[MessagesMessage], Field(min_length=1, max_length=MAX_ITEMS)]
    system: Text | Annotated[list[MessagesTextBlock], Field(max_length=MAX_ITEMS)] | None = None
    tools: Annotated[list[MessagesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: MessagesThinking | None = None


class MessagesRequest(MessagesTokensRequest):
    """A Messages API request. ``max_tokens`` is required, as in Anthropic's API."""

    max_tokens: MaxTokens
    stop_sequences: (
        Annotated[
            list[StopString],
            Field(max_length=16),
        ]
        | None
    ) = None
    temperature: ClientTemperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    metadata: MessagesMetadata | None = None
    output_config: MessagesOutputConfig | None = None
    stream: bool = False
    keep_alive: KeepAlive = Field(
        None, description="Pool extension, as on Ollama's routes (an on-demand model's idle time)."
    )
    allow_remote: bool = Field(False, description="Pool extension: required for remote models.")


# -- replies -----------------------------------------------------------------------------


class MessagesUsage(_Reply):
    input_tokens: int = Field(description="Prompt tokens not served from the prefix cache.")
    output_tokens: int
    cache_creation_input_tokens: int | None = None
    cache_read_input_tokens: int | None = Field(
        None, description="Prompt tokens the runtime's prefix cache served (null: unknown)."
    )


class MessagesTextReply(_Reply):
    type: Literal["text"]
    text: str


class MessagesThinkingReply(_Reply):
    type: Literal["thinking"]
    thinking: str
    signature: str


class MessagesToolUseReply(_Reply):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessagesReply(_Reply):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[
        Annotated[
            MessagesTextReply | MessagesThinkingReply | MessagesToolUseReply,
            Field(discriminator="type"),
        ]
    ]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"] | None
    stop_sequence: str | None
    usage: MessagesUsage


class MessagesTokenCount(_Reply):
    input_tokens: int


class MessagesErrorDetail(_Reply):
    type: str = Field(
        description="invalid_request_error, authentication_error, permission_error,"
        " not_found_error, request_too_large, rate_limit_error, api_error, overloaded_error"
        " or timeout_error."
    )
    message: str


class MessagesError(_Reply):
    type: Literal["error"]
    error: MessagesErrorDetail


# -- stream events -----------------------------------------------------------------------


class MessageStartEvent(_Reply):
    """Opens the stream: the message with no content yet, no stop reason, usage 0."""

    type: Literal["message_start"]
    message: MessagesReply


class MessagesPingEvent(_Reply):
    """After ``message_start``, and at least every 5 s while the request waits."""

    type: Literal["ping"]


class ContentBlockStartEvent(_Reply):
    type: Literal["content_block_start"]
    index: int
    content_block: Annotated[
        MessagesTextReply | MessagesThinkingReply | MessagesToolUseReply,
        Field(discriminator="type", description="The block, empty: its deltas fill it."),
    ]


class MessagesTextDelta(_Reply):
    type: Literal["text_delta"]
    text: str


class MessagesThinkingDelta(_Reply):
    type: Literal["thinking_delta"]
    thinking: str


class MessagesInputJsonDelta(_Reply):
    type: Literal["input_json_delta"]
    partial_json: str = Field(description="The next piece of the tool input's JSON text.")


class ContentBlockDeltaEvent(_Reply):
    type: Literal["content_block_delta"]
    index: int
    delta: Annotated[
        MessagesTextDelta | MessagesThinkingDelta | MessagesInputJsonDelta,
        Field(discriminator="type"),
    ]


class ContentBlockStopEvent(_Reply):
    type: Literal["content_block_stop"]
    index: int


class MessageDeltaBody(_Reply):
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None


class MessageDeltaEvent(_Reply):
    """The end of the message: why it stopped and the final usage."""

    type: Literal["message_delta"]
    delta: MessageDeltaBody
    usage: MessagesUsage


class MessageStopEvent(_Reply):
    type: Literal["message_stop"]


class MessagesStreamEvent(
    RootModel[
        Annotated[
            MessageStartEvent
            | MessagesPingEvent
            | ContentBlockStartEvent
            | ContentBlockDeltaEvent
            | ContentBlockStopEvent
            | MessageDeltaEvent
            | MessageStopEvent
            | MessagesError,
            Field(discriminator="type"),
        ]
    ]
):
    """The data of each event of ``stream: true`` on ``/v1/messages`` (the SSE
    ``event:`` name is its ``type``); an error after the stream started is an ``error``
    event, Anthropic's error body."""
