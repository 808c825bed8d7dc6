"""The sampling fields, declared once: name, type, limits and the pool's default.

:class:`Decoding` below is the declaration. Every other place that knows the sampling
fields derives them from it, so adding a field means adding one line here (and its
limits' alias where the value is bounded):

- ``engine.decoding`` (:class:`pool.config.DecodingDefaults`) takes the fields that have a
  pool default (``POOL_DEFAULT``), with these limits and defaults;
- the native request's ``decoding`` object (``pool.schemas.DecodingRequest``) takes every
  field, with these limits, each one optional;
- the neutral request's overrides (``pool.actors.DecodingOverrides``) accept any field by
  name, and intake merges them over ``engine.decoding`` in one loop (:func:`merge_decoding`);
- the other dialects' schemas (Chat Completions, Ollama, OpenAI Responses, Messages) take
  their bounded types from the aliases here and map their own wire names onto these;
  where a dialect's API is stricter (OpenAI's and Anthropic's temperature stops at 2) it
  narrows the alias, never widens it.

This module sits in ``pool.config`` because that is the lowest layer every user of the
fields imports (schemas, backends and actors all import ``pool.config``; it imports none
of them).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, WithJsonSchema

# -- the limits of each field's value, as every schema that accepts it checks them ----------
BeamSize = Annotated[int, Field(ge=1, le=64)]
TopK = Annotated[int, Field(ge=0, le=100_000)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Temperature = Annotated[float, Field(ge=0.0, le=100.0)]
# OpenAI's and Anthropic's APIs take a temperature up to 2 only: their dialects say so.
ClientTemperature = Annotated[Temperature, Field(le=2.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=100.0)]
MaxTokens = Annotated[int, Field(ge=1, le=1_000_000)]
StopString = Annotated[str, StringConstraints(min_length=1, max_length=1000)]
# A dialect's own list of stop strings may be shorter (OpenAI's and Ollama's take 16).
StopList = Annotated[list[StopString], Field(max_length=64)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# The keys are token ids; pool/http/_common.py refuses another key with a 400 naming
# the field, and the document says so.
LogitBias = Annotated[
    dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
    WithJsonSchema(
        {
            "type": "object",
            "propertyNames": {"pattern": "^[0-9]{1,9}$"},
            "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
        }
    ),
]

LOGIT_BIAS_DESCRIPTION = "Token id (as a string) to a bias from -100 to 100."

Merge = Literal["replace", "union"]


@dataclass(frozen=True, slots=True)
class _Rule:
    pool_default: bool
    merge: Merge
    request: Any
    description: str | None


_RULE = "sampling"


def rule(
    *,
    pool_default: bool,
    merge: Merge = "replace",
    request: Any = None,
    description: str | None = None,
) -> Mapping[str, Any]:
    """A sampling field's metadata (its dataclass field's ``metadata``).

    Args:
        pool_default: ``engine.decoding`` holds a default for the field, which a request's
            value replaces; false: the field is set only when the client asks (the
            backend's own default applies, and a backend that cannot honour it answers
            400 ``sampling_unsupported``).
        merge: ``union``: a request's values join the defaults (defaults first) instead
            of replacing them.
        request: the type a request body gives the value in, where it differs from the
            field's own (a list for a tuple).
        description: the schemas' description of the field.
    """
    return {_RULE: _Rule(pool_default, merge, request, description)}


POOL_DEFAULT = rule(pool_default=True)
ASKED_ONLY = rule(pool_default=False)


@dataclass(frozen=True, slots=True)
class Decoding:
    """Effective decoding settings: request values over ``engine.decoding`` defaults.

    The one declaration of the sampling fields (see the module docstring): each field's
    type (with its limits), default and rule.
    """

    beam_size: BeamSize = field(default=1, metadata=POOL_DEFAULT)
    top_k: TopK = field(default=40, metadata=POOL_DEFAULT)
    top_p: TopP = field(default=0.95, metadata=POOL_DEFAULT)
    temperature: Temperature = field(default=0.8, metadata=POOL_DEFAULT)
    repetition_penalty: RepetitionPenalty = field(default=1.0, metadata=POOL_DEFAULT)
    max_tokens: MaxTokens = field(default=256, metadata=POOL_DEFAULT)
    stop: tuple[str, ...] = field(
        default=(), metadata=rule(pool_default=True, merge="union", request=StopList)
    )
    min_p: MinP | None = field(default=None, metadata=ASKED_ONLY)
    seed: int | None = field(default=None, metadata=ASKED_ONLY)
    presence_penalty: Penalty | None = field(default=None, metadata=ASKED_ONLY)
    frequency_penalty: Penalty | None = field(default=None, metadata=ASKED_ONLY)
    logit_bias: tuple[tuple[int, float], ...] = field(
        default=(),
        metadata=rule(pool_default=False, request=LogitBias, description=LOGIT_BIAS_DESCRIPTION),
    )

    def asked_extras(self) -> tuple[str, ...]:
        """The asked-only fields this request sets (checked against the backend)."""
        return tuple(
            f.name
            for f in sampling_fields(type(self))
            if not f.pool_default and getattr(self, f.name) != f.default
        )


@dataclass(frozen=True, slots=True)
class SamplingField:
    """One sampling field as its users see it.

    ``request_type`` is the bounded type a request body gives it in (never optional:
    schemas add ``| None``); ``default`` is :class:`Decoding`'s (the pool default's
    initial value for a :attr:`pool_default` field, else "not asked").
    """

    name: str
    request_type: Any
    default: Any
    pool_default: bool
    merge: Merge
    description: str | None


def _without_none(hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (kept,) = (arg for arg in typing.get_args(hint) if arg is not type(None))
        return kept
    return hint


# Derived once per declaration: asked_extras() runs for every request.
_CACHE: dict[type[Decoding], tuple[SamplingField, ...]] = {}


def sampling_fields(declaration: type[Decoding] = Decoding) -> tuple[SamplingField, ...]:
    """The fields of ``declaration`` in order (a subclass adds its own after these)."""
    cached = _CACHE.get(declaration)
    if cached is not None:
        return cached
    hints = typing.get_type_hints(declaration, include_extras=True)
    declared = []
    for f in dataclasses.fields(declaration):
        found = f.metadata.get(_RULE)
        if not isinstance(found, _Rule):
            raise TypeError(f"{declaration.__name__}.{f.name}: give it a rule() as metadata")
        declared.append(
            SamplingField(
                name=f.name,
                request_type=found.request
                if found.request is not None
                else _without_none(hints[f.name]),
                default=f.default,
                pool_default=found.pool_default,
                merge=found.merge,
                description=found.description,
            )
        )
    result = tuple(declared)
    _CACHE[declaration] = result
    return result


SAMPLING_FIELDS = sampling_fields()
SAMPLING_NAMES = frozenset(f.name for f in SAMPLING_FIELDS)


def defaults_fields(declaration: type[Decoding] = Decoding) -> dict[str, Any]:
    """``engine.decoding``'s fields, for ``pydantic.create_model``: each pool-default
    field with its limits and default."""
    return {
        f.name: (
            f.request_type,
            # A settings file gives a list where Decoding holds a tuple.
            Field(default_factory=functools.partial(list, f.default), description=f.description)
            if isinstance(f.default, tuple)
            else Field(f.default, description=f.description),
        )
        for f in sampling_fields(declaration)
        if f.pool_default
    }


def request_fields(declaration: type[Decoding] = Decoding) -> dict[str, Any]:
    """A request's ``decoding`` fields, for ``pydantic.create_model``: every field with
    its limits, each optional (left out: the pool's default, or not asked)."""
    return {
        f.name: (f.request_type | None, Field(None, description=f.description))
        for f in sampling_fields(declaration)
    }


def merge_decoding(
    asked: Mapping[str, Any],
    defaults: object,
    declaration: type[Decoding] = Decoding,
) -> Decoding:
    """The effective decoding: each asked value over its pool default, field by field
    of the declaration (``defaults``: ``engine.decoding``, read by field name).

    Lists become tuples (``Decoding`` is immutable); a ``union`` field keeps its
    defaults first, then the asked values, without repeats.
    """
    values: dict[str, Any] = {}
    for f in sampling_fields(declaration):
        value = asked.get(f.name)
        if f.pool_default:
            default = getattr(defaults, f.name)
            if f.merge == "union":
                value = tuple(dict.fromkeys([*default, *(value or ())]))
            elif value is None:
                value = default
        if value is None:
            continue
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return declaration(**values)
