"""Prompt formats render exactly, and the model_template sandbox holds."""

from __future__ import annotations

import pytest

from pool.backends import Decoding, GenerationRequest, TextPart, Turn
from pool.backends.prompt_formats import (
    PROMPT_FORMAT_NAMES,
    ModelTemplate,
    format_traits,
    get_prompt_format,
)
from pool.errors import PoolError


def _request(*texts: str, instructions: str | None = None, **fields: object) -> GenerationRequest:
    turns = tuple(
        Turn("user" if i % 2 == 0 else "assistant", (TextPart(t),)) for i, t in enumerate(texts)
    )
    return GenerationRequest(
        request_id="r", model="m", turns=turns, decoding=Decoding(), instructions=instructions,
        **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_qwen3_plain_chatml_without_system_turn() -> None:
    rendered = get_prompt_format("qwen3_template").render(
        _request("What is the capital of France?")
    )
    assert rendered.text == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered.stop == ("<|im_end|>", "<|im_start|>")


def test_qwen3_multi_turn_instructions_and_thinking() -> None:
    fmt = get_prompt_format("qwen3_template")
    rendered = fmt.render(
        _request("Hi", "Hello!", "Bye", instructions="Be brief.", thinking="disabled")
    )
    assert rendered.text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    enabled = fmt.render(_request("Hi", thinking="enabled"), enable_thinking=False)
    assert not enabled.text.endswith("</think>\n\n")
    by_config = fmt.render(_request("Hi"), enable_thinking=False)
    assert by_config.text.endswith("<think>\n\n</think>\n\n")


def test_generic_and_mistral() -> None:
    generic = get_prompt_format("generic").render(
        _request("Hi", "Hey", "Again", instructions="Sys")
    )
    assert generic.text == "Sys\nUser: Hi\nAssistant: Hey\nUser: Again\nAssistant:"
    mistral = get_prompt_format("mistral_template").render(
        _request("Hi", "Hey", "Again", instructions="Sys")
    )
    assert mistral.text == "<s>[INST] Sys\n\nHi [/INST] Hey</s>[INST] Again [/INST]"


def test_gemma4_turns_and_thinking_token() -> None:
    fmt = get_prompt_format("gemma4_template")
    plain = fmt.render(_request("Hi", "Hey", "Again"))
    assert plain.text == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHey<end_of_turn>\n"
        "<start_of_turn>user\nAgain<end_of_turn>\n<start_of_turn>model\n"
    )
    thinking = fmt.render(_request("Hi", instructions="Sys", thinking="enabled"))
    assert "<start_of_turn>user\n<|think|>Sys\n\nHi<end_of_turn>" in thinking.text


def test_translategemma_known_and_mixed_source() -> None:
    fmt = get_prompt_format("translategemma_template")
    known = fmt.render(_request("Goedemorgen", source_lang_code="nl", target_lang_code="en"))
    assert "Dutch (nl) to English (en)" in known.text and known.text.endswith(
        "Goedemorgen<end_of_turn>\n<start_of_turn>model\n"
    )
    for source in (None, "auto", "mixed"):
        mixed = fmt.render(
            _request("Hallo. Bonjour.", source_lang_code=source, target_lang_code="de")
        )
        assert "Detect the language of each segment" in mixed.text
        assert "(en) to German (de)" in mixed.text
    with pytest.raises(PoolError) as info:
        fmt.render(_request("x"))
    assert info.value.code == "invalid_request"
    assert format_traits("translategemma_template") == (False, False)


def test_model_template_renders_in_a_sandbox() -> None:
    template = ModelTemplate(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
        eos_token="</s>",
    )
    rendered = get_prompt_format("model_template", model_template=template).render(
        _request("Hi", instructions="Sys")
    )
    assert rendered.text == "<|system|>Sys</s><|user|>Hi</s><|assistant|>"
    assert rendered.stop == ("</s>",)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__ }}",
        "{% for i in range(10**7) %}xxxxxxxxxx{% endfor %}",
        "{{ raise_exception('nope') }}",
        "{% if %}",
    ],
)
def test_hostile_templates_are_refused(source: str) -> None:
    with pytest.raises(PoolError) as info:
        fmt = get_prompt_format("model_template", model_template=ModelTemplate(source))
        fmt.render(_request("Hi"))
    assert info.value.code == "invalid_request"


def test_template_from_gguf_metadata() -> None:
    metadata = {
        "tokenizer.chat_template": "{{ bos_token }}x",
        "tokenizer.ggml.bos_token_id": "1",
        "tokenizer.ggml.eos_token_id": "2",
    }
    template = ModelTemplate.from_gguf_metadata(metadata, {1: "<s>", 2: "</s>"}.__getitem__)
    assert template == ModelTemplate("{{ bos_token }}x", "<s>", "</s>")
    assert ModelTemplate.from_gguf_metadata({}) is None


def test_names_and_unknown_format() -> None:
    assert set(PROMPT_FORMAT_NAMES) == {
        "generic", "mistral_template", "qwen3_template", "gemma4_template",
        "translategemma_template", "model_template",
    }  # fmt: skip
    with pytest.raises(ValueError, match="unknown prompt_format"):
        get_prompt_format("alpaca")
    with pytest.raises(ValueError):
        get_prompt_format("model_template")
