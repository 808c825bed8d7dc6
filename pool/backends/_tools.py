"""Tools and structured output in neutral form: what a request offers, what comes back.

Every API surface (Chat Completions, Responses, Ollama) parses its own spelling of
tools, ``tool_choice`` and response formats into these values; every backend reads
them and reports the calls a model made as :class:`ToolCallDelta` pieces, in the order
OpenAI streams them (a call's id and name first, then its arguments in fragments).
JSON schemas travel as plain mappings: they are the client's data, not a wire body.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

ToolChoiceMode = Literal["auto", "none", "required", "function"]
OutputFormatKind = Literal["json_object", "json_schema"]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call: its name, what it does, its JSON-schema parameters."""

    name: str
    description: str | None = None
    parameters: Mapping[str, Any] = field(
        default_factory=lambda: {"type": "object", "properties": {}}
    )
    strict: bool = False


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """Whether the model may (auto), must not (none) or must (required) call a tool;
    ``function`` forces the call of the tool called ``name``."""

    mode: ToolChoiceMode = "auto"
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call the model made (or made earlier, in a conversation's history).

    ``arguments`` is the JSON text of the arguments object, as OpenAI carries it.
    """

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of a tool call as it is generated.

    The first piece of call ``index`` has its ``id`` and ``name``; later pieces carry
    only more ``arguments`` text. Joining every piece of an index gives the call.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """Structured output: any JSON object, or JSON that validates against ``schema``."""

    kind: OutputFormatKind
    schema: Mapping[str, Any] | None = None
    name: str | None = None
    strict: bool = False


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def assemble_calls(deltas: Iterable[ToolCallDelta]) -> tuple[ToolCall, ...]:
    """The whole calls of a stream of pieces, in index order."""
    calls: dict[int, list[str]] = {}
    for delta in deltas:
        entry = calls.setdefault(delta.index, ["", "", ""])
        if delta.id:
            entry[0] = delta.id
        if delta.name:
            entry[1] += delta.name
        entry[2] += delta.arguments
    return tuple(
        ToolCall(call_id or new_call_id(), name, arguments or "{}")
        for _, (call_id, name, arguments) in sorted(calls.items())
    )
