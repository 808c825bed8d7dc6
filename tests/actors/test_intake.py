"""Intake builds the runtime's request from the neutral one without re-listing fields.

Every field both request types name is handed on as it is; the decoding is the asked
values over ``engine.decoding``, field by field of the one declaration.
"""

from __future__ import annotations

import dataclasses

import pytest

from pool.actors import DecodingOverrides, InferenceRequest
from pool.actors.serving._intake import HANDED_ON, build_generation_request, effective_decoding
from pool.backends import (
    Capabilities,
    Decoding,
    GenerationRequest,
    OutputFormat,
    PassThrough,
    TextPart,
    ToolChoice,
    ToolSpec,
    Turn,
)
from pool.config import SAMPLING_FIELDS, DecodingDefaults

# A value other than the default for every field a runtime receives from the client.
_ASKED = {
    "model": "m",
    "turns": (Turn("user", (TextPart("hi"),)), Turn("assistant", (TextPart("yo"),))),
    "instructions": "be brief",
    "multi_turn": True,
    "thinking": "enabled",
    "source_lang_code": "en",
    "target_lang_code": "fr",
    "tools": (ToolSpec("f", "a function", {"type": "object"}),),
    "tool_choice": ToolChoice("required"),
    "parallel_tool_calls": False,
    "output_format": OutputFormat("json_object"),
    "pass_through": PassThrough("m", stream=False),
}
_CAPABLE = Capabilities(
    multi_turn=True,
    thinking_modes=("default", "enabled", "disabled"),
    tools=True,
    structured_output=True,
    sampling=frozenset(f.name for f in SAMPLING_FIELDS),
)


def test_every_field_both_requests_name_is_handed_on_as_it_is() -> None:
    assert set(_ASKED) == set(HANDED_ON)
    request = InferenceRequest(**_ASKED, decoding=DecodingOverrides(top_k=3))  # type: ignore[arg-type]
    built = build_generation_request(
        request,
        request_id="r1",
        capabilities=_CAPABLE,
        decoding_defaults=DecodingDefaults(),
        tenant="t",
        trace_parent="00-abc-def-01",
    )
    for name, value in _ASKED.items():
        assert getattr(built, name) == value, name
    assert built.decoding == Decoding(top_k=3)
    assert (built.request_id, built.trace_parent, built.cache.tenant) == (
        "r1",
        "00-abc-def-01",
        "t",
    )
    # A field the runtime's request gains is either handed on or built here on purpose.
    built_here = {"request_id", "decoding", "cache", "trace_parent"}
    # Set after intake: the adapter a model name resolved to (Serving._with_adapter) and a
    # paused stream's reply so far (its resume).
    set_later = {"adapter", "continue_text"}
    fields = {f.name for f in dataclasses.fields(GenerationRequest)}
    assert fields == set(HANDED_ON) | built_here | set_later


def test_overrides_take_any_declared_field_and_nothing_else() -> None:
    asked = DecodingOverrides(top_p=0.5, stop=["a"], seed=None)
    assert dict(asked.asked) == {"top_p": 0.5, "stop": ("a",)}
    assert asked == DecodingOverrides(stop=("a",), top_p=0.5)
    assert hash(asked) == hash(DecodingOverrides(stop=("a",), top_p=0.5))
    with pytest.raises(TypeError, match="top_q"):
        DecodingOverrides(top_q=0.5)


def test_effective_decoding_takes_each_asked_value_over_its_default() -> None:
    defaults = DecodingDefaults(temperature=0.2, max_tokens=64, stop=["</s>"])
    assert effective_decoding(DecodingOverrides(), defaults) == Decoding(
        temperature=0.2, max_tokens=64, stop=("</s>",)
    )
    asked = DecodingOverrides(temperature=0.9, stop=("END",), min_p=0.1)
    assert effective_decoding(asked, defaults) == Decoding(
        temperature=0.9, max_tokens=64, stop=("</s>", "END"), min_p=0.1
    )
