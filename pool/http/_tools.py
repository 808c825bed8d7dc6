"""Tools and structured output between the wire formats and the neutral request.

Each surface spells tools its own way (Chat Completions and Ollama nest a
``function``; the Responses API does not); this module checks them (a 400 naming the
field, such as ``tools[0].function.name``) and turns them into
:class:`~pool.backends.ToolSpec`, :class:`~pool.backends.ToolChoice` and
:class:`~pool.backends.OutputFormat`, and renders the calls a model made back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pool.backends import OutputFormat, ToolCall, ToolChoice, ToolSpec
from pool.errors import PoolError
from pool.schemas import (
    ChatTool,
    ChatToolChoiceFunction,
    FunctionChoice,
    FunctionTool,
    MessagesTool,
    MessagesToolChoice,
    ResponseFormat,
    TextFormat,
)

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_MAX_SCHEMA_DEPTH = 64


def invalid(param: str, message: str, code: str = "invalid_request") -> PoolError:
    return PoolError(code, f"{param}: {message}", details={"param": param})


def _not_a_schema(param: str, message: str) -> PoolError:
    return invalid(param, message, "invalid_json_schema")


def unmatched(param: str, message: str) -> PoolError:
    """``tool_choice`` asks for a tool that ``tools`` does not offer."""
    return invalid(param, message, "tool_choice_unmatched")


def check_schema(schema: Any, where: str, depth: int = 0) -> None:
    """A 400 ``invalid_json_schema`` naming the first place where ``schema`` is not a
    JSON schema.

    It checks the structure a grammar converter and the backends rely on (types,
    ``properties``, ``required``, nested schemas), not every keyword of the standard.
    The OpenAPI document describes a schema two levels deep (a recursive description
    makes fuzzing it take minutes); deeper, this check is what holds.
    """
    if depth > _MAX_SCHEMA_DEPTH:
        raise _not_a_schema(where, "the schema is nested too deeply")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise _not_a_schema(where, "a JSON schema must be an object")
    kind = schema.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        for value in kinds:
            if not isinstance(value, str) or value not in _JSON_TYPES:
                raise _not_a_schema(f"{where}.type", f"{value!r} is not a JSON schema type")
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        raise _not_a_schema(f"{where}.required", "must be a list of property names")
    enum = schema.get("enum")
    if enum is not None and not isinstance(enum, list):
        raise _not_a_schema(f"{where}.enum", "must be a list")
    for key in _SCHEMA_MAPS:
        value = schema.get(key)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            raise _not_a_schema(f"{where}.{key}", "must be an object of schemas")
        for name, sub in value.items():
            check_schema(sub, f"{where}.{key}.{name}", depth + 1)
    for key in _SCHEMA_LISTS:
        value = schema.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not value:
            raise _not_a_schema(f"{where}.{key}", "must be a non-empty list of schemas")
        for index, sub in enumerate(value):
            check_schema(sub, f"{where}.{key}[{index}]", depth + 1)
    for key in _SCHEMA_ONE:
        if key in schema:
            check_schema(schema[key], f"{where}.{key}", depth + 1)


def _tool_spec(
    name: str | None,
    description: str | None,
    parameters: dict[str, Any] | None,
    strict: bool | None,
    where: str,
    schema_field: str = "parameters",
) -> ToolSpec:
    if not name:
        raise invalid(f"{where}.name", "a function needs a name")
    if not _NAME.match(name):
        raise invalid(
            f"{where}.name", f"{name[:80]!r} is not a function name (A-Z, a-z, 0-9, _ and -, <= 64)"
        )
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    check_schema(parameters, f"{where}.{schema_field}")
    if parameters.get("type", "object") != "object":
        raise invalid(f"{where}.{schema_field}.type", "the arguments must be an object")
    return ToolSpec(name, description, parameters, bool(strict))


def _unique(tools: list[ToolSpec], where: str) -> tuple[ToolSpec, ...]:
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if tool.name in seen:
            raise invalid(
                f"{where}[{index}].name", f"two tools are called {tool.name!r}", "duplicate_tool"
            )
        seen.add(tool.name)
    return tuple(tools)


def chat_tools(tools: Sequence[ChatTool] | None, where: str = "tools") -> tuple[ToolSpec, ...]:
    """Chat Completions (and Ollama) tools: ``{"type": "function", "function": {...}}``."""
    specs = []
    for index, tool in enumerate(tools or ()):
        at = f"{where}[{index}]"
        if tool.type != "function":
            raise invalid(f"{at}.type", f'only "function" tools are supported, not {tool.type!r}')
        f = tool.function
        specs.append(_tool_spec(f.name, f.description, f.parameters, f.strict, f"{at}.function"))
    return _unique(specs, where)


def responses_tools(tools: Sequence[FunctionTool] | None) -> tuple[ToolSpec, ...]:
    """Responses API tools: ``{"type": "function", "name": ..., "parameters": ...}``."""
    specs = [
        _tool_spec(t.name, t.description, t.parameters, t.strict, f"tools[{index}]")
        for index, t in enumerate(tools or ())
    ]
    return _unique(specs, "tools")


def messages_tools(tools: Sequence[MessagesTool] | None) -> tuple[ToolSpec, ...]:
    """Messages API tools: ``{"name", "description", "input_schema"}``; a typed server
    tool (web search, bash, ...) is a 400, as the pool runs none."""
    specs = []
    for index, tool in enumerate(tools or ()):
        at = f"tools[{index}]"
        if tool.type not in (None, "custom"):
            raise invalid(f"{at}.type", f"{tool.type!r} is a server tool; only client tools")
        schema = tool.input_schema
        specs.append(_tool_spec(tool.name, tool.description, schema, None, at, "input_schema"))
    return _unique(specs, "tools")


def messages_tool_choice(
    value: MessagesToolChoice | None, tools: tuple[ToolSpec, ...]
) -> tuple[ToolChoice, bool]:
    """The neutral choice of a Messages ``tool_choice``, and whether parallel calls
    stay allowed (``disable_parallel_tool_use``)."""
    if value is None:
        return ToolChoice("auto"), True
    parallel = not value.disable_parallel_tool_use
    if value.type in ("any", "tool") and not tools:
        raise unmatched("tool_choice", f"{value.type} needs tools")
    if value.type == "any":
        return ToolChoice("required"), parallel
    if value.type == "tool":
        if value.name not in {t.name for t in tools}:
            raise unmatched("tool_choice.name", f"tool {value.name!r} is not among the tools")
        return ToolChoice("function", value.name), parallel
    return ToolChoice(value.type), parallel


def tool_choice(
    value: str | ChatToolChoiceFunction | FunctionChoice | None, tools: tuple[ToolSpec, ...]
) -> ToolChoice:
    """The neutral choice; naming a function that is not offered is a 400."""
    if value is None:
        return ToolChoice("auto")
    if isinstance(value, str):
        if value in ("required",) and not tools:
            raise unmatched("tool_choice", "required needs tools")
        return ToolChoice(value)  # type: ignore[arg-type]
    name = value.function.name if isinstance(value, ChatToolChoiceFunction) else value.name
    if name not in {t.name for t in tools}:
        raise unmatched("tool_choice", f"function {name!r} is not among the tools")
    return ToolChoice("function", name)


def chat_output_format(value: ResponseFormat | None) -> OutputFormat | None:
    """``response_format`` of Chat Completions; ``text`` is no constraint."""
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return OutputFormat("json_object")
    spec = value.json_schema
    if spec is None or spec.schema_ is None:
        raise invalid("response_format.json_schema.schema", "json_schema needs a schema")
    check_schema(spec.schema_, "response_format.json_schema.schema")
    return OutputFormat("json_schema", spec.schema_, spec.name, bool(spec.strict))


def responses_output_format(value: TextFormat | None) -> OutputFormat | None:
    """``text.format`` of the Responses API."""
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return OutputFormat("json_object")
    if value.schema_ is None:
        raise invalid("text.format.schema", "json_schema needs a schema")
    check_schema(value.schema_, "text.format.schema")
    return OutputFormat("json_schema", value.schema_, value.name, bool(value.strict))


def ollama_output_format(value: Any) -> OutputFormat | None:
    """Ollama's ``format``: ``"json"`` or a JSON schema (``""`` and null: free text)."""
    if value is None or value == "":
        return None
    if value == "json":
        return OutputFormat("json_object")
    if isinstance(value, dict):
        check_schema(value, "format")
        return OutputFormat("json_schema", value)
    raise invalid("format", 'must be "json" or a JSON schema')


def chat_call(call: ToolCall) -> dict[str, Any]:
    """A call as a Chat Completions message carries it."""
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def arguments_object(text: str) -> dict[str, Any]:
    """A call's arguments as an object (Ollama sends them so); unparsable text is kept."""
    try:
        value = json.loads(text)
    except ValueError:
        return {"_raw": text}
    return value if isinstance(value, dict) else {"_value": value}


def ollama_call(call: ToolCall) -> dict[str, Any]:
    return {"function": {"name": call.name, "arguments": arguments_object(call.arguments)}}


def arguments_text(arguments: Mapping[str, Any]) -> str:
    return json.dumps(dict(arguments), ensure_ascii=False)
