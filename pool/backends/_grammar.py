"""GBNF grammars for constrained decoding: JSON output and forced tool calls.

llama-cpp-python converts JSON schemas to llama.cpp's GBNF itself
(``llama_grammar.json_schema_to_gbnf``); this module only wraps that converter: a
schema for structured output as is, and for a forced tool call a schema of the call
object (``{"name": <const>, "arguments": <the tool's parameters>}``) inside the
family's call markup. llama_cpp is imported on first use, as everywhere in backends.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pool.backends._tool_calls import ToolCallFamily
from pool.backends._tools import OutputFormat, ToolChoice, ToolSpec
from pool.errors import PoolError

_ROOT = re.compile(r"^root\s*::=", re.MULTILINE)
_CALL_RULE = "pool-tool-call"


def _gbnf(schema: Mapping[str, Any], what: str) -> str:
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        return str(json_schema_to_gbnf(json.dumps(schema)))
    except (ValueError, KeyError, TypeError, NotImplementedError, RecursionError) as exc:
        raise PoolError(
            "invalid_request",
            f"{what}: the JSON schema cannot be turned into a grammar: {exc}",
            details={"param": what},
        ) from exc


def output_grammar(output: OutputFormat) -> str:
    """The grammar of a structured reply: any JSON object, or the schema's JSON."""
    if output.kind == "json_object" or output.schema is None:
        from llama_cpp.llama_grammar import JSON_GBNF

        return str(JSON_GBNF)
    return _gbnf(output.schema, "response_format")


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON object a model writes to call ``tool``."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": dict(tool.parameters)},
        "required": ["name", "arguments"],
    }


def tool_call_grammar(
    tools: tuple[ToolSpec, ...],
    choice: ToolChoice,
    family: ToolCallFamily,
    *,
    parallel: bool,
) -> str:
    """The grammar of a reply that must be tool calls (``tool_choice`` required or named).

    Returns:
        GBNF whose root is one call (or, with ``parallel``, one or more) of the
        offered tools (or only the named one) in ``family``'s markup.
    """
    offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
    schemas = [call_schema(t) for t in offered]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    body = _ROOT.sub(f"{_CALL_RULE} ::=", _gbnf(schema, "tools"), count=1)
    if family in ("hermes", "qwen3"):
        block = f'"<tool_call>\\n" {_CALL_RULE} "\\n</tool_call>"'
        more = f' ("\\n" {block})*' if parallel else ""
        root = f"root ::= {block}{more}"
    else:
        marker = "[TOOL_CALLS]" if family == "mistral" else "<|tool_call|>"
        more = f'("," {_CALL_RULE})* ' if parallel else ""
        root = f'root ::= "{marker}[" {_CALL_RULE} {more}"]"'
    return f"{root}\n{body}"


def load_grammar(gbnf: str) -> Any:
    """A ``LlamaGrammar`` of ``gbnf`` (a malformed grammar is a 400, not a crash)."""
    from llama_cpp.llama_grammar import LlamaGrammar

    try:
        return LlamaGrammar.from_string(gbnf, verbose=False)
    except (ValueError, RuntimeError) as exc:
        raise PoolError("invalid_request", f"the output grammar is invalid: {exc}") from exc
