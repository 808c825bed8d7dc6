"""Request fields of function calling and structured output, in each API's spelling.

The shapes are loose on purpose where a wrong value deserves a 400 naming the field
(a tool without a name, a schema that is not one) rather than a bare 422: the HTTP
layer checks them (``pool/http/_tools.py``) and says what is wrong where.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from pool.schemas._documented import ARGUMENTS_SCHEMA, FUNCTION_NAME, fields, with_format

MAX_TEXT_CHARS = 4_000_000  # as every other text of a request
MAX_TOOLS = 128
ToolName = Annotated[str, StringConstraints(max_length=256)]
# Ollama's keep_alive: seconds, or a Go duration (`5m`, `1h30m`, `-1`), as
# pool/actors/residency/_keep_alive.py reads it.
KeepAlive = (
    float
    | Annotated[
        str,
        StringConstraints(
            pattern=r"^[+-]?([0-9]+(\.[0-9]+)?|([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+)$"
        ),
    ]
    | None
)
Arguments = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Lenient):
    """A function the model may call (Chat Completions and Ollama spell it so)."""

    model_config = ConfigDict(
        json_schema_extra=fields({"name": FUNCTION_NAME}, parameters=ARGUMENTS_SCHEMA)
    )

    name: ToolName | None = Field(
        None, description="Required: letters, digits, `_` and `-`, at most 64."
    )
    description: str | None = None
    parameters: dict[str, Any] | None = Field(
        None, description="A JSON schema of the arguments object (default: no arguments)."
    )
    strict: bool | None = None


class ChatTool(_Lenient):
    """``{"type": "function", "function": {...}}``."""

    model_config = ConfigDict(
        json_schema_extra=fields(type={"const": "function", "default": "function"})
    )

    type: str = Field("function", description='Only "function" tools.')
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: ToolName


class ChatToolChoiceFunction(_Lenient):
    """Forces a call of the named function."""

    type: Literal["function"] = "function"
    function: NamedFunction


ChatToolChoice = Literal["auto", "none", "required"] | ChatToolChoiceFunction


class ChatToolCallFunction(_Lenient):
    name: ToolName
    arguments: Arguments = Field("{}", description="The arguments as JSON text.")


class ChatToolCall(_Lenient):
    """A call an assistant message made (in the conversation's history)."""

    id: Annotated[str, StringConstraints(max_length=256)]
    type: Literal["function"] = "function"
    function: ChatToolCallFunction


class JsonSchemaFormat(_Lenient):
    name: Annotated[str, StringConstraints(max_length=256)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema the reply must validate against."
    )
    strict: bool | None = None


class ResponseFormat(_Lenient):
    """``response_format``: free text, any JSON object, or JSON of a schema."""

    model_config = ConfigDict(json_schema_extra=with_format("nested", "json_schema"))

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class OllamaToolCallFunction(_Lenient):
    name: ToolName
    arguments: dict[str, Any] = Field(default_factory=dict)


class OllamaToolCall(_Lenient):
    function: OllamaToolCallFunction


class FunctionTool(_Strict):
    """A Responses API function tool: ``{"type": "function", "name", "parameters"}``."""

    model_config = ConfigDict(
        json_schema_extra=fields({"name": FUNCTION_NAME}, parameters=ARGUMENTS_SCHEMA),
    )

    type: Literal["function"]
    name: ToolName | None = Field(
        None, description="Required: letters, digits, `_` and `-`, at most 64."
    )
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Strict):
    type: Literal["function"]
    name: ToolName


ResponsesToolChoice = Literal["auto", "none", "required"] | FunctionChoice


class FunctionCallItem(_Strict):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    name: ToolName
    arguments: Arguments = "{}"
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """The result of call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    output: Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
    id: str | None = None
    status: str | None = None


class TextFormat(_Strict):
    """``text.format`` of the Responses API."""

    model_config = ConfigDict(json_schema_extra=with_format("flat", "schema"))

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, StringConstraints(max_length=256)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None


class FunctionCallOutput(BaseModel):
    """An output item of a reply that calls a function."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["completed"] = "completed"
