"""What the document says of a request field beyond its pydantic type.

Some request fields stay loose in their models on purpose: a wrong value there deserves
a 400 that names the field with a sentence of its own (pool/http/_tools.py) rather than
a bare schema failure. The OpenAPI document must still say what the server accepts, so
that a request it calls valid is served (tests/http/test_schemathesis.py fuzzes the pool
with such requests): these ``json_schema_extra`` hooks write the server's rules into
the schema, and change nothing of what the models validate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

JsonSchema = dict[str, Any]

# OpenAI's rule for function names, as pool/http/_tools.py checks it.
FUNCTION_NAME: JsonSchema = {
    "type": "string",
    "pattern": "^[A-Za-z0-9_-]{1,64}$",
    "description": "Required: letters, digits, `_` and `-`, at most 64.",
}
# The keywords whose values the document describes (pool/http/_tools.py check_schema
# looks into more: `definitions`, `dependentSchemas`, `not`, `if`, `then`, `else`,
# `contains`). The document leaves those free, so a schema-valid request may still get
# 400 `invalid_json_schema` for them, as it may below the depth described: the operations
# list that code among their valid-input refusals. Why not all: schemathesis' negative
# mode must complement this object, and it gives up on one of more than 15 properties.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties")
_TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]


def _json_schema(depth: int) -> JsonSchema:
    """A JSON schema as pool/http/_tools.py (check_schema) takes it: the keywords named
    above, well formed, ``depth`` levels down (below that, any object or boolean: the
    document stays finite, and generating from it cheap)."""
    if depth == 0:
        return {"type": ["object", "boolean"]}
    sub: JsonSchema = {"anyOf": [_json_schema(depth - 1), {"type": "boolean"}]}
    # (null stands for an absent keyword, except where a schema is the value)
    return {
        "type": "object",
        "properties": {
            "type": {"enum": [*_TYPES, None]},
            "required": {"type": ["array", "null"], "items": {"type": "string"}},
            "enum": {"type": ["array", "null"]},
            **{
                key: {"type": ["object", "null"], "additionalProperties": sub}
                for key in _SCHEMA_MAPS
            },
            **{
                key: {"type": ["array", "null"], "minItems": 1, "items": sub}
                for key in _SCHEMA_LISTS
            },
            **dict.fromkeys(_SCHEMA_ONE, sub),
        },
    }


# In the document once, as a component: the use sites refer to it. A model's own JSON
# schema (model_json_schema, as an embedded user reads it) has no components to refer
# to, so a use site is an object marked with the component's name there, and the
# document (with_components) makes each mark a reference.
JSON_SCHEMA_COMPONENT = "ToolJsonSchema"
_COMPONENT_MARK = "x-component"
_COMPONENTS = {JSON_SCHEMA_COMPONENT: _json_schema(2)}
JSON_SCHEMA: JsonSchema = {"type": "object", _COMPONENT_MARK: JSON_SCHEMA_COMPONENT}


def with_components(schemas: dict[str, JsonSchema]) -> dict[str, JsonSchema]:
    """The document's ``schemas`` with each marked use site a ``$ref`` to its component,
    and those components."""

    def linked(node: Any) -> Any:
        if isinstance(node, dict):
            if _COMPONENT_MARK in node:
                return {"$ref": f"#/components/schemas/{node[_COMPONENT_MARK]}"}
            return {key: linked(value) for key, value in node.items()}
        if isinstance(node, list):
            return [linked(value) for value in node]
        return node

    return {name: linked(schema) for name, schema in schemas.items()} | _COMPONENTS


# A function's arguments: a JSON schema of an object.
ARGUMENTS_SCHEMA: JsonSchema = {
    "anyOf": [
        {
            "allOf": [JSON_SCHEMA, {"properties": {"type": {"const": "object"}}}],
            "description": "A JSON schema of the arguments object (default: no arguments).",
        },
        {"type": "null"},
    ]
}
# Ollama's `format`: "json", a JSON schema, or nothing ("" or null).
OLLAMA_FORMAT: JsonSchema = {
    "anyOf": [{"enum": ["json", "", None]}, JSON_SCHEMA],
}


def fields(
    required: dict[str, JsonSchema] | None = None, **optional: JsonSchema
) -> Callable[[JsonSchema], None]:
    """A ``json_schema_extra`` that gives each named property its schema, and makes those
    of ``required`` required."""

    def patch(schema: JsonSchema) -> None:
        properties = schema.setdefault("properties", {})
        for name, sub in {**(required or {}), **optional}.items():
            properties[name] = {**sub, "title": properties.get(name, {}).get("title", name)}
        if required:
            schema["required"] = sorted({*schema.get("required", ()), *required})

    return patch


def nothing(schema: JsonSchema) -> None:
    """A ``json_schema_extra`` of a shape the server refuses whatever it holds: no value
    is valid."""
    schema.clear()
    schema["not"] = {}


def any_of_given(*names: str) -> Callable[[JsonSchema], None]:
    """A ``json_schema_extra`` that asks for at least one of ``names``, not null."""

    def patch(schema: JsonSchema) -> None:
        schema["anyOf"] = [
            {"required": [name], "properties": {name: {"not": {"type": "null"}}}} for name in names
        ]

    return patch


def both(*patches: Callable[[JsonSchema], None]) -> Callable[[JsonSchema], None]:
    """One ``json_schema_extra`` of several."""

    def patch(schema: JsonSchema) -> None:
        for each in patches:
            each(schema)

    return patch


def with_format(kind: str, schema_field: str) -> Callable[[JsonSchema], None]:
    """A ``json_schema_extra`` of a structured-output format object: ``json_schema``
    needs ``schema_field`` to hold a JSON schema (an object)."""

    def patch(schema: JsonSchema) -> None:
        schema["anyOf"] = [
            {"properties": {"type": {"enum": ["text", "json_object"]}}},
            {
                "properties": {"type": {"const": "json_schema"}, schema_field: kind_schema},
                "required": [schema_field],
            },
        ]

    kind_schema: JsonSchema = (
        {"type": "object", "required": ["schema"], "properties": {"schema": {"type": "object"}}}
        if kind == "nested"
        else {"type": "object"}
    )
    return patch
