"""Each dialect's sampling fields reach the effective decoding under the pool's names.

The native request names every declared field (a field added to the declaration is
accepted there without an edit: the sample below must cover it); the other dialects map
their wire names (Ollama's ``repeat_penalty``, OpenAI's ``max_completion_tokens``, ...).
"""

from __future__ import annotations

from typing import Any

from pool.actors import InferenceRequest
from pool.backends import Decoding
from pool.config import SAMPLING_NAMES, DecodingDefaults, merge_decoding
from pool.http import request_from_chat_completions, request_from_responses
from pool.http.anthropic._parse import inference_request as messages_request
from pool.http.ollama._parse import generate_inference_request
from pool.http.openai._parse import completion_requests
from pool.http.openai_responses._parse import inference_request as openai_responses_request
from pool.schemas import (
    CompletionRequest,
    MessagesRequest,
    OllamaGenerateRequest,
    OpenAIResponseRequest,
)

# A value other than the default for every declared field, as the wire spells it, and
# as the effective decoding holds it.
_WIRE: dict[str, Any] = {
    "beam_size": 2,
    "top_k": 7,
    "top_p": 0.5,
    "temperature": 0.3,
    "repetition_penalty": 1.2,
    "max_tokens": 9,
    "stop": ["END"],
    "min_p": 0.1,
    "seed": 5,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.25,
    "logit_bias": {"3": 1.5},
}
_HELD = {**_WIRE, "stop": ("END",), "logit_bias": ((3, 1.5),)}


def _decoding(request: InferenceRequest) -> Decoding:
    return merge_decoding(request.decoding.asked, DecodingDefaults())


def test_the_native_request_takes_every_declared_field() -> None:
    assert set(_WIRE) == SAMPLING_NAMES
    request = request_from_responses({"model": "m", "input": "x", "decoding": _WIRE})
    assert _decoding(request) == Decoding(**_HELD)


def _held(*names: str) -> Decoding:
    return Decoding(**{name: _HELD[name] for name in names})


def test_chat_completions_map_their_names() -> None:
    openai = {k: v for k, v in _WIRE.items() if k not in ("beam_size", "max_tokens")}
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], **openai}
    request = request_from_chat_completions({**body, "max_completion_tokens": 9})
    assert _decoding(request) == _held(*openai, "max_tokens")
    (completion,) = completion_requests(
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **openai, "max_tokens": 9})
    )
    assert _decoding(completion) == _held(*openai, "max_tokens")


def test_ollama_maps_its_names() -> None:
    names = ["temperature", "top_p", "top_k", "stop", "min_p", "seed"]
    names += ["presence_penalty", "frequency_penalty"]
    options = {name: _WIRE[name] for name in names}
    options |= {"repeat_penalty": 1.2, "num_predict": 9}
    body = OllamaGenerateRequest.model_validate({"model": "m", "prompt": "x", "options": options})
    decoding = _decoding(generate_inference_request(body))
    assert decoding == _held(*names, "repetition_penalty", "max_tokens")
    # -1 and -2 (no limit) keep the pool's cap.
    body.options.num_predict = -1
    assert _decoding(generate_inference_request(body)).max_tokens == Decoding().max_tokens


def test_openai_responses_and_messages_map_their_names() -> None:
    body = OpenAIResponseRequest.model_validate(
        {"model": "m", "input": "x", "temperature": 0.3, "top_p": 0.5, "top_k": 7, "seed": 5}
        | {"max_output_tokens": 9}
    )
    request = openai_responses_request(body, [], [{"role": "user", "content": "x"}])
    assert _decoding(request) == _held("temperature", "top_p", "top_k", "seed", "max_tokens")
    messages = MessagesRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 9}
        | {"temperature": 0.3, "top_p": 0.5, "top_k": 7, "stop_sequences": ["END"]}
    )
    assert _decoding(messages_request(messages)) == _held(
        "temperature", "top_p", "top_k", "stop", "max_tokens"
    )
