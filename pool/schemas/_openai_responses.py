"""OpenAI's Responses API as ``/openai/v1/responses`` serves it: request and reply shapes.

This is OpenAI's own dialect (``message`` items with ``output_text`` parts, ``reasoning``
and ``function_call`` items, ``usage`` with ``input_tokens``), apart from the pool's
``/v1/responses`` (``pool/schemas/_responses.py``). Requests accept and ignore the many
optional fields OpenAI's SDKs send; the fields the pool acts on are typed and bounded.
The reply models describe the bodies the routes build, for the OpenAPI document.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, RootModel, StringConstraints, Tag

from pool.config import ClientTemperature, MaxTokens, TopK, TopP
from pool.schemas._documented import ARGUMENTS_SCHEMA, FUNCTION_NAME, any_of_given, both, fields
from pool.schemas._responses import MAX_ITEMS, MAX_TEXT_CHARS
from pool.schemas._tools import MAX_TOOLS, KeepAlive, TextFormat

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
Id = Annotated[str, StringConstraints(min_length=1, max_length=256)]
ToolName = Annotated[str, StringConstraints(max_length=256)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


# -- input items ---------------------------------------------------------------------------
class InputTextPart(_Lenient):
    type: Literal["input_text"]
    text: Text


class OutputTextPart(_Lenient):
    """An earlier answer's text, sent back in an assistant ``message`` item."""

    type: Literal["output_text"]
    text: Text


class RefusalPart(_Lenient):
    type: Literal["refusal"]
    refusal: Text


class InputImagePart(_Lenient):
    type: Literal["input_image"]
    image_url: Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT_CHARS)] = Field(
        description="A base64 `data:` URL; `file://` and `http(s)` under the pool's media"
        " policy. Uploaded files (`file_id`) are not supported."
    )
    detail: Literal["auto", "low", "high"] | None = None


ContentPart = Annotated[
    InputTextPart | OutputTextPart | RefusalPart | InputImagePart, Field(discriminator="type")
]
Parts = Annotated[list[ContentPart], Field(max_length=MAX_ITEMS)]


class MessageInput(_Lenient):
    """A message: ``type`` may be left out (OpenAI's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"] = Field(
        description="`system` and `developer` messages join `instructions`."
    )
    content: Text | Parts
    id: Id | None = None
    status: str | None = None


class FunctionCallInput(_Lenient):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: Id
    name: ToolName
    arguments: Text = "{}"
    id: Id | None = None
    status: str | None = None


class FunctionCallOutputInput(_Lenient):
    """The result of call ``call_id``: text, or text and image parts."""

    type: Literal["function_call_output"]
    call_id: Id
    output: Text | Parts
    id: Id | None = None
    status: str | None = None


class ReasoningInput(_Lenient):
    """An earlier ``reasoning`` item sent back: accepted and left out of the prompt, as
    the chat templates of thinking models leave out earlier reasoning."""

    type: Literal["reasoning"]
    id: Id | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


InputItem = Annotated[
    Annotated[MessageInput, Tag("message")]
    | Annotated[FunctionCallInput, Tag("function_call")]
    | Annotated[FunctionCallOutputInput, Tag("function_call_output")]
    | Annotated[ReasoningInput, Tag("reasoning")],
    Discriminator(_item_type),
]


# -- request -------------------------------------------------------------------------------
class ResponsesTool(_Lenient):
    """A function tool, ``{"type": "function", "name", "description", "parameters",
    "strict"}``; other tool types (hosted tools) are a 400 naming ``tools[i].type``."""

    model_config = ConfigDict(
        json_schema_extra=fields(
            {"name": FUNCTION_NAME, "type": {"const": "function"}}, parameters=ARGUMENTS_SCHEMA
        ),
    )

    type: Annotated[str, StringConstraints(max_length=64)]
    name: ToolName | None = None
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(_Lenient):
    """``{"type": "function", "name": ...}`` forces that function."""

    model_config = ConfigDict(
        json_schema_extra=fields({"type": {"const": "function"}, "name": FUNCTION_NAME})
    )

    type: Annotated[str, StringConstraints(max_length=64)]
    name: ToolName | None = None


class TextConfig(_Lenient):
    format: TextFormat | None = Field(
        None,
        description='`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema",'
        ' "name", "schema", "strict"}`.',
    )


class ReasoningConfig(_Lenient):
    effort: str | None = None
    summary: str | None = None


Metadata = Annotated[
    dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=512)],
    ],
    Field(max_length=16),
]


class OpenAIResponseRequest(_Lenient):
    """Body of ``POST /openai/v1/responses``: OpenAI's fields, plus a few of the pool's."""

    # Refused with a sentence of their own (pool/http/openai_responses/_parse.py): no
    # background runs, no conversations, and something to answer.
    model_config = ConfigDict(
        json_schema_extra=both(
            fields(
                background={"enum": [False, None], "description": "Only false."},
                conversation={"type": "null", "description": "Use `previous_response_id`."},
            ),
            any_of_given("input", "previous_response_id"),
        ),
    )

    model: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_ITEMS)] | None = Field(
        None,
        description="Text, or a list of items: messages, `function_call`,"
        " `function_call_output` and `reasoning` items.",
    )
    instructions: Text | None = Field(None, description="The system prompt (not carried over).")
    previous_response_id: Id | None = Field(
        None, description="Continue a stored response of the same tenant."
    )
    store: bool = Field(True, description="Keep the response for retrieval and continuation.")
    stream: bool = False
    max_output_tokens: MaxTokens | None = None
    temperature: ClientTemperature | None = None
    top_p: TopP | None = None
    tools: Annotated[list[ResponsesTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["auto", "none", "required"] | ToolChoiceObject | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    metadata: Metadata | None = None
    reasoning: ReasoningConfig | None = Field(
        None, description="Echoed; the pool's `thinking` switches thinking where a model can."
    )
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = Field(None, description="Only false: no background responses.")
    conversation: Any = Field(None, description="Not supported: use `previous_response_id`.")
    user: Annotated[str, StringConstraints(max_length=512)] | None = None
    # The pool's own fields, beside OpenAI's (extra_body in OpenAI's SDKs).
    top_k: TopK | None = None
    seed: int | None = None
    thinking: Literal["default", "enabled", "disabled"] = "default"
    keep_alive: KeepAlive = Field(
        None, description="On-demand models: idle time before unload (seconds or '5m')."
    )
    allow_remote: bool = Field(False, description="Must be true to use a remote backend.")


# -- replies -------------------------------------------------------------------------------
class OutputTextContent(_Reply):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningTextContent(_Reply):
    type: Literal["reasoning_text"]
    text: str


class OutputMessage(_Reply):
    type: Literal["message"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputTextContent]


class OutputReasoning(_Reply):
    type: Literal["reasoning"]
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any]
    content: list[ReasoningTextContent]


class OutputFunctionCall(_Reply):
    type: Literal["function_call"]
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[
    OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")
]


class InputTokensDetails(_Reply):
    cached_tokens: int


class OutputTokensDetails(_Reply):
    reasoning_tokens: int


class ResponseUsage(_Reply):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseErrorBody(_Reply):
    code: str
    message: str


class IncompleteDetails(_Reply):
    reason: Literal["max_output_tokens"] | None


class OpenAIResponse(_Reply):
    """A response object; the payload of the stream's lifecycle events too."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: ResponseErrorBody | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    temperature: float | None
    top_p: float | None
    tool_choice: Any
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    metadata: dict[str, str]
    usage: ResponseUsage | None


class InputItemList(_Reply):
    """``GET /openai/v1/responses/{id}/input_items``."""

    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class ResponseDeleted(_Reply):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


# -- stream events -------------------------------------------------------------------------
class _StreamEvent(_Reply):
    sequence_number: int = Field(description="0, 1, 2, ... in the order the events are sent.")


class OpenAIResponseLifecycleEvent(_StreamEvent):
    """The response as it stands: ``created`` and ``in_progress`` open the stream; one of
    ``completed``, ``incomplete`` (cut at ``max_output_tokens``) or ``failed`` (an error
    after the stream started, in ``response.error``) ends it."""

    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: OpenAIResponse


class OpenAIOutputItemEvent(_StreamEvent):
    """An output item opens (``added``, with nothing in it yet) or closes (``done``)."""

    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class _ItemEvent(_StreamEvent):
    item_id: str
    output_index: int


class _PartEvent(_ItemEvent):
    content_index: int


class OpenAIContentPartEvent(_PartEvent):
    type: Literal["response.content_part.added", "response.content_part.done"]
    part: Annotated[OutputTextContent | ReasoningTextContent, Field(discriminator="type")]


class OpenAIOutputTextDeltaEvent(_PartEvent):
    type: Literal["response.output_text.delta"]
    delta: str
    logprobs: list[Any]


class OpenAIOutputTextDoneEvent(_PartEvent):
    type: Literal["response.output_text.done"]
    text: str
    logprobs: list[Any]


class OpenAIReasoningTextDeltaEvent(_PartEvent):
    type: Literal["response.reasoning_text.delta"]
    delta: str


class OpenAIReasoningTextDoneEvent(_PartEvent):
    type: Literal["response.reasoning_text.done"]
    text: str


class OpenAIArgumentsDeltaEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.delta"]
    delta: str


class OpenAIArgumentsDoneEvent(_ItemEvent):
    type: Literal["response.function_call_arguments.done"]
    name: str
    arguments: str


class OpenAIResponseStreamEvent(
    RootModel[
        Annotated[
            OpenAIResponseLifecycleEvent
            | OpenAIOutputItemEvent
            | OpenAIContentPartEvent
            | OpenAIOutputTextDeltaEvent
            | OpenAIOutputTextDoneEvent
            | OpenAIReasoningTextDeltaEvent
            | OpenAIReasoningTextDoneEvent
            | OpenAIArgumentsDeltaEvent
            | OpenAIArgumentsDoneEvent,
            Field(discriminator="type"),
        ]
    ]
):
    """The data of each event of ``stream: true`` on ``/openai/v1/responses`` (the SSE
    ``event:`` name is its ``type``), each numbered by ``sequence_number``."""
