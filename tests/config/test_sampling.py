"""The sampling fields come from one declaration (pool/config/_sampling.py).

Every schema that accepts a field checks the declared limits (a dialect may only narrow
them, where the table below says so), ``engine.decoding`` has the declared defaults, and
a field added to the declaration reaches the config, the native request and the
effective decoding without another edit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field, TypeAdapter, ValidationError, create_model

from pool.config import (
    SAMPLING_FIELDS,
    SAMPLING_NAMES,
    ClientTemperature,
    Decoding,
    DecodingDefaults,
    StopString,
    Temperature,
    build_settings,
    merge_decoding,
)
from pool.config._sampling import (
    ASKED_ONLY,
    POOL_DEFAULT,
    defaults_fields,
    request_fields,
    sampling_fields,
)
from pool.errors import ConfigError
from pool.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    DecodingRequest,
    MessagesRequest,
    OllamaOptions,
    OpenAIResponseRequest,
)

_BY_NAME = {f.name: f for f in SAMPLING_FIELDS}
_SCHEMA_NOISE = {"title", "default", "description"}


def _bounds(schema: dict[str, Any]) -> dict[str, Any]:
    """A value schema without its labels, and without the ``null`` of an optional field."""
    variants = [v for v in schema.get("anyOf", [schema]) if v.get("type") != "null"]
    (value,) = variants
    return {k: v for k, v in value.items() if k not in _SCHEMA_NOISE}


def _property(model: type[BaseModel], wire: str) -> dict[str, Any]:
    return _bounds(model.model_json_schema()["properties"][wire])


def _declared(type_: Any) -> dict[str, Any]:
    return _bounds(TypeAdapter(type_).json_schema())


# Each dialect's sampling fields: wire name -> (the declared field, the type it checks
# the value with where the dialect narrows the declared limits, else None).
_CLIENT_TEMPERATURE = ("temperature", ClientTemperature)
_OPENAI_SHARED: dict[str, tuple[str, Any]] = {
    "temperature": _CLIENT_TEMPERATURE,
    "top_p": ("top_p", None),
    "top_k": ("top_k", None),
    "max_tokens": ("max_tokens", None),
    "seed": ("seed", None),
    "presence_penalty": ("presence_penalty", None),
    "frequency_penalty": ("frequency_penalty", None),
    "logit_bias": ("logit_bias", None),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", None),
}
DIALECTS: dict[type[BaseModel], dict[str, tuple[str, Any]]] = {
    DecodingRequest: {name: (name, None) for name in SAMPLING_NAMES - {"stop"}},
    ChatCompletionRequest: {**_OPENAI_SHARED, "max_completion_tokens": ("max_tokens", None)},
    CompletionRequest: _OPENAI_SHARED,
    # Ollama's num_predict is not max_tokens' range: -1 and -2 mean "no limit" there
    # (its mapper keeps the pool's cap for them), so it is Ollama's own field.
    OllamaOptions: {
        "temperature": ("temperature", None),
        "top_p": ("top_p", None),
        "top_k": ("top_k", None),
        "repeat_penalty": ("repetition_penalty", None),
        "min_p": ("min_p", None),
        "seed": ("seed", None),
        "presence_penalty": ("presence_penalty", None),
        "frequency_penalty": ("frequency_penalty", None),
    },
    OpenAIResponseRequest: {
        "temperature": _CLIENT_TEMPERATURE,
        "top_p": ("top_p", None),
        "top_k": ("top_k", None),
        "max_output_tokens": ("max_tokens", None),
        "seed": ("seed", None),
    },
    MessagesRequest: {
        "temperature": _CLIENT_TEMPERATURE,
        "top_p": ("top_p", None),
        "top_k": ("top_k", None),
        "max_tokens": ("max_tokens", None),
    },
}
# Stop strings: each dialect says how many it takes; every one checks each string alike.
STOP_LISTS = {
    DecodingRequest: "stop",
    ChatCompletionRequest: "stop",
    CompletionRequest: "stop",
    OllamaOptions: "stop",
    MessagesRequest: "stop_sequences",
}


@pytest.mark.parametrize(
    ("model", "wire", "name", "narrowed"),
    [
        (model, wire, name, narrowed)
        for model, fields in DIALECTS.items()
        for wire, (name, narrowed) in fields.items()
    ],
    ids=lambda value: getattr(value, "__name__", str(value)),
)
def test_every_schema_checks_a_field_with_its_declared_limits(
    model: type[BaseModel], wire: str, name: str, narrowed: Any
) -> None:
    assert _property(model, wire) == _declared(narrowed or _BY_NAME[name].request_type)


def test_a_dialect_only_narrows_the_declared_temperature() -> None:
    declared, client = _declared(Temperature), _declared(ClientTemperature)
    assert client["minimum"] == declared["minimum"]
    assert client["maximum"] == 2.0 < declared["maximum"]


@pytest.mark.parametrize(("model", "wire"), STOP_LISTS.items())
def test_every_stop_list_checks_each_string_with_the_declared_limits(
    model: type[BaseModel], wire: str
) -> None:
    schema = model.model_json_schema()["properties"][wire]
    lists = [v for v in schema.get("anyOf", [schema]) if v.get("type") == "array"]
    assert lists, f"{model.__name__}.{wire} takes no list"
    for stop_list in lists:
        assert _bounds(stop_list["items"]) == _declared(StopString)


def test_the_native_request_takes_every_declared_field_in_order() -> None:
    assert list(DecodingRequest.model_fields) == [f.name for f in SAMPLING_FIELDS]
    assert _property(DecodingRequest, "stop") == _declared(_BY_NAME["stop"].request_type)


def test_engine_decoding_has_the_declared_defaults_and_limits() -> None:
    pool_defaults = [f for f in SAMPLING_FIELDS if f.pool_default]
    assert list(DecodingDefaults.model_fields) == [f.name for f in pool_defaults]
    defaults = DecodingDefaults()
    for f in pool_defaults:
        expected = list(f.default) if isinstance(f.default, tuple) else f.default
        assert getattr(defaults, f.name) == expected
        assert _property(DecodingDefaults, f.name) == _declared(f.request_type)
    assert merge_decoding({}, defaults) == Decoding()
    # The settings file is checked with the same limits.
    with pytest.raises(ConfigError, match=r"engine\.decoding\.top_p"):
        build_settings({"engine": {"decoding": {"top_p": 1.5}}})


def test_an_asked_value_replaces_its_default_and_stop_strings_join() -> None:
    defaults = DecodingDefaults(temperature=0.1, stop=["</s>", "END"])
    merged = merge_decoding({"temperature": 0.7, "stop": ("END", "STOP"), "seed": 4}, defaults)
    assert merged.temperature == 0.7
    assert merged.stop == ("</s>", "END", "STOP")
    assert merged.seed == 4 and merged.asked_extras() == ("seed",)
    assert merge_decoding({}, defaults).stop == ("</s>", "END")
    assert merge_decoding({}, defaults).asked_extras() == ()


# -- a field added to the declaration -----------------------------------------------------
Mirostat = Annotated[int, Field(ge=0, le=2)]
TypicalP = Annotated[float, Field(gt=0.0, le=1.0)]


@dataclass(frozen=True, slots=True)
class _Extended(Decoding):
    mirostat: Mirostat = field(default=0, metadata=POOL_DEFAULT)
    typical_p: TypicalP | None = field(default=None, metadata=ASKED_ONLY)


def test_a_field_added_to_the_declaration_reaches_config_request_and_decoding() -> None:
    config = create_model("Defaults", **defaults_fields(_Extended))
    request = create_model("Request", **request_fields(_Extended))
    assert "mirostat" in config.model_fields and "typical_p" not in config.model_fields
    assert config().mirostat == 0  # type: ignore[attr-defined]
    assert _property(config, "mirostat") == _declared(Mirostat)
    assert _property(request, "typical_p") == _declared(TypicalP)
    with pytest.raises(ValidationError):
        request(mirostat=3)

    asked = request(mirostat=2, typical_p=0.5, top_k=3)
    merged = merge_decoding(
        {name: getattr(asked, name) for name in request.model_fields},
        config(mirostat=1),
        _Extended,
    )
    assert isinstance(merged, _Extended)
    assert (merged.mirostat, merged.typical_p, merged.top_k) == (2, 0.5, 3)
    assert merged.asked_extras() == ("typical_p",)
    assert merge_decoding({}, config(mirostat=1), _Extended).mirostat == 1


def test_a_field_without_a_rule_is_refused() -> None:
    @dataclass(frozen=True)
    class Ruleless(Decoding):
        beam_width: int = 1

    with pytest.raises(TypeError, match="beam_width"):
        sampling_fields(Ruleless)
