"""Prompt formats render exactly, and the model_template sandbox holds."""

from __future__ import annotations

import pytest

from pool.backends import Decoding, GenerationRequest, ImagePart, TextPart, Turn
from pool.backends._format_templates import FORMAT_TEMPLATES
from pool.backends._tool_calls import ToolCallScanner
from pool.backends._tools import ToolCall, ToolCallDelta, ToolChoice, ToolSpec, assemble_calls
from pool.backends.prompt_formats import (
    PROMPT_FORMAT_NAMES,
    ModelTemplate,
    ModelTemplateFormat,
    PromptFormat,
    RenderedPrompt,
    format_renders_tools,
    format_tool_family,
    format_traits,
    get_prompt_format,
    thinking_modes,
)
from pool.errors import PoolError

CHATML_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    "{% if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
)


def _request(*texts: str, instructions: str | None = None, **fields: object) -> GenerationRequest:
    """A conversation alternating user/assistant, starting (and ending) with the user."""
    turns = tuple(
        Turn("user" if i % 2 == 0 else "assistant", (TextPart(t),)) for i, t in enumerate(texts)
    )
    return GenerationRequest(
        request_id="r", model="m", turns=turns, decoding=Decoding(), instructions=instructions,
        **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def _render(name: str, request: GenerationRequest, **kwargs: bool | None) -> RenderedPrompt:
    return get_prompt_format(name).render(request, **kwargs)


def _refused(fmt: PromptFormat, request: GenerationRequest) -> PoolError:
    with pytest.raises(PoolError) as info:
        fmt.render(request)
    return info.value


# --- generic ------------------------------------------------------------------------


def test_generic_single_turn() -> None:
    rendered = _render("generic", _request("What is the capital of France?"))
    assert rendered == RenderedPrompt(
        "User: What is the capital of France?\nAssistant:", ("\nUser:",)
    )


def test_generic_multi_turn_with_instructions() -> None:
    rendered = _render("generic", _request("Hi", "Hello!", "Bye", instructions="Be brief."))
    assert rendered.text == "Be brief.\n\nUser: Hi\nAssistant: Hello!\nUser: Bye\nAssistant:"


# --- mistral_template ---------------------------------------------------------------


def test_mistral_single_turn() -> None:
    rendered = _render("mistral_template", _request("Hi"))
    assert rendered == RenderedPrompt("[INST] Hi [/INST]", ("</s>", "[INST]"))


def test_mistral_folds_instructions_into_the_first_user_turn() -> None:
    rendered = _render("mistral_template", _request("Hi", "Hello!", "Bye", instructions="Sys"))
    assert rendered.text == "[INST] Sys\n\nHi [/INST]Hello!</s>[INST] Bye [/INST]"


# --- qwen3_template -----------------------------------------------------------------


def test_qwen3_plain_chatml_without_a_system_turn() -> None:
    rendered = _render("qwen3_template", _request("What is the capital of France?"))
    assert rendered == RenderedPrompt(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
        ("<|im_end|>", "<|im_start|>"),
    )


def test_qwen3_multi_turn_with_instructions() -> None:
    rendered = _render("qwen3_template", _request("Hi", "Hello!", "Bye", instructions="Be brief."))
    assert rendered.text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_qwen3_drops_earlier_reasoning_from_past_replies() -> None:
    rendered = _render("qwen3_template", _request("Hi", "<think>\nhmm\n</think>\n\nHello!", "Bye"))
    assert "<|im_start|>assistant\nHello!<|im_end|>\n" in rendered.text
    assert "hmm" not in rendered.text


@pytest.mark.parametrize(
    ("thinking", "enable_thinking", "empty_think_block"),
    [
        ("disabled", None, True),
        ("disabled", True, True),
        ("default", False, True),
        ("enabled", None, False),
        ("enabled", False, False),
        ("default", True, False),
        ("default", None, False),
    ],
)
def test_qwen3_thinking(
    thinking: str, enable_thinking: bool | None, empty_think_block: bool
) -> None:
    rendered = _render(
        "qwen3_template", _request("Hi", thinking=thinking), enable_thinking=enable_thinking
    )
    base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered.text == base + ("<think>\n\n</think>\n\n" if empty_think_block else "")


# --- gemma4_template ----------------------------------------------------------------


def test_gemma4_single_turn() -> None:
    rendered = _render("gemma4_template", _request("Hi"))
    assert rendered == RenderedPrompt(
        "<|turn>user\nHi<turn|>\n<|turn>model\n", ("<turn|>", "<|turn>")
    )


def test_gemma4_multi_turn_with_instructions() -> None:
    rendered = _render("gemma4_template", _request("Hi ", "Hello!", "Bye", instructions="Sys"))
    assert rendered.text == (
        "<|turn>system\nSys<turn|>\n"
        "<|turn>user\nHi<turn|>\n"
        "<|turn>model\nHello!<turn|>\n"
        "<|turn>user\nBye<turn|>\n"
        "<|turn>model\n"
    )


def test_gemma4_drops_earlier_reasoning_from_past_replies() -> None:
    reply = "<|channel>thought\nhmm<channel|>Hello!"
    rendered = _render("gemma4_template", _request("Hi", reply, "Bye"))
    assert "<|turn>model\nHello!<turn|>\n" in rendered.text


def test_gemma4_thinking_on_puts_the_think_token_in_the_system_turn() -> None:
    enabled = _render("gemma4_template", _request("Hi", thinking="enabled"))
    assert enabled.text == (
        "<|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    )
    with_instructions = _render(
        "gemma4_template", _request("Hi", instructions="Sys"), enable_thinking=True
    )
    assert with_instructions.text.startswith("<|turn>system\n<|think|>\nSys<turn|>\n")


def test_gemma4_thinking_off_closes_an_empty_thought_channel() -> None:
    expected = "<|turn>user\nHi<turn|>\n<|turn>model\n<|channel>thought\n<channel|>"
    assert _render("gemma4_template", _request("Hi", thinking="disabled")).text == expected
    by_config = _render("gemma4_template", _request("Hi"), enable_thinking=False)
    assert by_config.text == expected
    # The request wins over the model's configured default.
    overridden = _render(
        "gemma4_template", _request("Hi", thinking="enabled"), enable_thinking=False
    )
    assert "<|think|>" in overridden.text and "<|channel>" not in overridden.text


# --- translategemma_template --------------------------------------------------------


def test_translategemma_known_source() -> None:
    rendered = _render(
        "translategemma_template",
        _request("Goedemorgen", source_lang_code="nl", target_lang_code="en"),
    )
    assert rendered.text == (
        "<start_of_turn>user\n"
        "You are a professional Dutch (nl) to English (en) translator. Your goal is to"
        " accurately convey the meaning and nuances of the original Dutch text while"
        " adhering to English grammar, vocabulary, and cultural sensitivities.\n"
        "Produce only the English translation, without any additional explanations or"
        " commentary. Please translate the following Dutch text into English:\n\n\n"
        "Goedemorgen<end_of_turn>\n<start_of_turn>model\n"
    )
    assert rendered.stop == ("<end_of_turn>", "<start_of_turn>")


def test_translategemma_regional_codes_keep_the_code_and_name_the_language() -> None:
    rendered = _render(
        "translategemma_template",
        _request("Olá", source_lang_code="pt_BR", target_lang_code="de-DE"),
    )
    assert "professional Portuguese (pt-BR) to German (de-DE) translator" in rendered.text


@pytest.mark.parametrize("source", [None, "", "auto", "mixed", "MIXED"])
def test_translategemma_mixed_source_keeps_the_structured_request(source: str | None) -> None:
    rendered = _render(
        "translategemma_template",
        _request("Hallo. Bonjour.", source_lang_code=source, target_lang_code="de"),
    )
    text = rendered.text
    assert text.startswith(
        "<start_of_turn>user\nYou are a professional English (en) to German (de)"
    )
    assert "Please translate the following English text into German:\n\n\n[" in text
    note, _, source_text = text.partition("]\n\n")
    assert "language of each part" in note and "into German" in note
    assert source_text == "Hallo. Bonjour.<end_of_turn>\n<start_of_turn>model\n"


def test_translategemma_refusals() -> None:
    fmt = get_prompt_format("translategemma_template")
    missing_target = _refused(fmt, _request("x", source_lang_code="nl"))
    assert missing_target.code == "invalid_request"
    assert "target_lang_code" in missing_target.message
    bad_code = _refused(fmt, _request("x", target_lang_code="en) to French (fr"))
    assert bad_code.code == "invalid_request"
    with_instructions = _refused(fmt, _request("x", instructions="Sys", target_lang_code="en"))
    assert with_instructions.code == "invalid_request"
    multi = _refused(fmt, _request("a", "b", "c", target_lang_code="en"))
    assert multi.code == "multi_turn_unsupported"


# --- model_template -----------------------------------------------------------------


def test_model_template_renders_a_chatml_template() -> None:
    template = ModelTemplate(CHATML_TEMPLATE, bos_token="<s>", eos_token="<|im_end|>")
    fmt = get_prompt_format("model_template", model_template=template)
    rendered = fmt.render(_request("Hi", "Hello!", "Bye", instructions="Sys"))
    assert rendered == RenderedPrompt(
        "<s><|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n",
        ("<|im_end|>",),
    )
    assert fmt.multi_turn and fmt.supports_thinking_control


def test_model_template_passes_enable_thinking_only_when_set() -> None:
    fmt = get_prompt_format("model_template", model_template=ModelTemplate(CHATML_TEMPLATE))
    assert fmt.render(_request("Hi")).text.endswith("assistant\n")
    assert fmt.render(_request("Hi", thinking="disabled")).text.endswith("</think>\n\n")
    assert fmt.render(_request("Hi"), enable_thinking=False).text.endswith("</think>\n\n")
    assert fmt.render(_request("Hi", thinking="enabled"), enable_thinking=False).text.endswith(
        "assistant\n"
    )


def test_model_template_drops_its_bos_when_the_tokenizer_adds_one() -> None:
    template = ModelTemplate(CHATML_TEMPLATE, bos_token="<s>", add_bos=True)
    rendered = get_prompt_format("model_template", model_template=template).render(_request("Hi"))
    assert rendered.text.startswith("<|im_start|>user\n")


def test_model_template_without_enable_thinking_has_no_thinking_control() -> None:
    fmt = get_prompt_format(
        "model_template", model_template=ModelTemplate("{{ messages[0]['content'] }}")
    )
    assert not fmt.supports_thinking_control
    assert fmt.render(_request("Hi")) == RenderedPrompt("Hi", ())


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("{{ ''.__class__.__mro__[1].__subclasses__() }}", id="mro"),
        pytest.param("{{ messages.__class__.__init__.__globals__ }}", id="globals"),
        pytest.param("{{ ''.__class__ }}", id="bare-dunder"),
        pytest.param("{{ raise_exception.__globals__ }}", id="function-globals"),
        pytest.param("{% set _ = messages.append(1) %}", id="mutation"),
        pytest.param("{{ cycler.__init__.__globals__['os'] }}", id="cycler-globals"),
    ],
)
def test_sandbox_escapes_are_refused(source: str) -> None:
    fmt = get_prompt_format("model_template", model_template=ModelTemplate(source))
    refusal = _refused(fmt, _request("Hi"))
    assert refusal.code == "invalid_request"


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("{% for i in range(2000) %}{{ 'x' * 999 }}{% endfor %}", id="output"),
        pytest.param("{{ 'x' * 10**9 }}", id="repeat"),
        pytest.param("{{ 10 ** 1000000 }}", id="power"),
        pytest.param(
            "{% set ns = namespace(s='x') %}"
            "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            id="doubling",
        ),
        pytest.param(
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
            id="nested-loops",
        ),
        pytest.param("{% set s = 'x' * 900000 %}{{ s | replace('', s) }}", id="replace"),
        pytest.param("{% set s = 'x' * 900000 %}{{ s.join(['a', 'b', 'c']) }}", id="join"),
        pytest.param("{{ '' | center(10**8) }}", id="center"),
        pytest.param("{{ ''.ljust(100) }}", id="padding-method"),
        pytest.param("{{ '%999999999d' % 1 }}", id="format-width"),
        pytest.param(
            "{% macro m() %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}"
            "{% endmacro %}{% set x = m() %}",
            id="captured-output",
        ),
        pytest.param("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", id="recursion"),
        pytest.param("{{ lipsum(100000) }}", id="lipsum"),
    ],
)
def test_templates_past_the_limits_are_refused(source: str) -> None:
    fmt = get_prompt_format("model_template", model_template=ModelTemplate(source))
    assert _refused(fmt, _request("Hi")).code == "invalid_request"


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("{% if %}", id="syntax"),
        pytest.param("{{ raise_exception('roles must alternate') }}", id="raise_exception"),
        pytest.param("{{ messages[5]['content'].strip() }}", id="undefined"),
    ],
)
def test_broken_templates_are_refused(source: str) -> None:
    with pytest.raises(PoolError) as info:
        fmt = get_prompt_format("model_template", model_template=ModelTemplate(source))
        fmt.render(_request("Hi"))
    assert info.value.code == "invalid_request"


def test_model_template_filters_and_methods_real_templates_use() -> None:
    source = (
        "{%- set ns = namespace(n=0) -%}"
        "{%- for m in messages if m.role == 'user' -%}{%- set ns.n = ns.n + 1 -%}{%- endfor -%}"
        "{{ ns.n }}|{{ messages | length }}|{{ messages[-1].content | trim | upper }}|"
        "{{ messages[-1].content.split(',')[0].strip() }}|{{ {'a': 'é'} | tojson }}|"
        "{{ messages | map(attribute='role') | join(',') }}|{{ 'a' ~ 1 }}"
    )
    fmt = get_prompt_format("model_template", model_template=ModelTemplate(source))
    assert (
        fmt.render(_request(" x, y ", "ok", "z")).text
        == '2|3|Z|z|{"a": "é"}|user,assistant,user|a1'
    )


def test_template_from_gguf_metadata() -> None:
    metadata = {
        "tokenizer.chat_template": "{{ bos_token }}x",
        "tokenizer.ggml.bos_token_id": "1",
        "tokenizer.ggml.eos_token_id": "2",
        "tokenizer.ggml.add_bos_token": "false",
    }
    tokens = {1: "<s>", 2: "</s>"}
    template = ModelTemplate.from_gguf_metadata(metadata, tokens.__getitem__)
    assert template == ModelTemplate("{{ bos_token }}x", "<s>", "</s>", add_bos=False)
    assert ModelTemplate.from_gguf_metadata({}) is None
    without_tokens = ModelTemplate.from_gguf_metadata(
        {**metadata, "tokenizer.ggml.add_bos_token": "true"}
    )
    assert without_tokens == ModelTemplate("{{ bos_token }}x", "", "", add_bos=True)
    spm = ModelTemplate.from_gguf_metadata(
        {"tokenizer.chat_template": "x", "tokenizer.ggml.model": "llama"}
    )
    assert spm is not None and spm.add_bos


# --- tools on the built-in formats --------------------------------------------------

WEATHER = ToolSpec(
    "get_weather",
    "Get the weather",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = ToolSpec("get_time")  # no description, the default parameters
WEATHER_JSON = (
    '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather",'
    ' "parameters": {"type": "object", "properties": {"city": {"type": "string"}},'
    ' "required": ["city"]}}}'
)
TIME_JSON = (
    '{"type": "function", "function": {"name": "get_time", "description": "", "parameters":'
    ' {"type": "object", "properties": {}}}}'
)
QWEN3_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{WEATHER_JSON}\n{TIME_JSON}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within"
    " <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _tool_conversation(**fields: object) -> GenerationRequest:
    """A question, two calls (one with text before it), their results, a follow-up."""
    turns = (
        Turn("user", (TextPart("Weather and time in Paris?"),)),
        Turn(
            "assistant",
            (TextPart("Let me check."),),
            (
                ToolCall("call_abc", "get_weather", '{"city":"Paris"}'),
                ToolCall("call_def", "get_time", "{}"),
            ),
        ),
        Turn("tool", (TextPart('{"temperature": 22}'),), tool_call_id="call_abc"),
        Turn("tool", (TextPart("noon"),), tool_call_id="call_def"),
        Turn("assistant", (TextPart("22 degrees at noon."),)),
        Turn("user", (TextPart("And tomorrow?"),)),
    )
    return GenerationRequest(
        request_id="r", model="m", turns=turns, decoding=Decoding(), tools=(WEATHER, TIME),
        **fields,  # type: ignore[arg-type]
    )  # fmt: skip


def test_qwen3_renders_tools_calls_and_results_as_qwen3_does() -> None:
    rendered = _render("qwen3_template", _tool_conversation(instructions="Be brief."))
    assert rendered.text == (
        f"<|im_start|>system\nBe brief.\n\n{QWEN3_TOOLS}<|im_end|>\n"
        "<|im_start|>user\nWeather and time in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nLet me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temperature": 22}\n</tool_response>\n'
        "<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n22 degrees at noon.<|im_end|>\n"
        "<|im_start|>user\nAnd tomorrow?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert rendered.stop == ("<|im_end|>", "<|im_start|>")


def test_qwen3_tools_without_instructions_and_a_trailing_result() -> None:
    turns = (
        Turn("user", (TextPart("Time?"),)),
        Turn("assistant", (), (ToolCall("call_1", "get_time", "{}"),)),
        Turn("tool", (TextPart("noon"),), tool_call_id="call_1"),
    )
    request = GenerationRequest(
        request_id="r", model="m", turns=turns, decoding=Decoding(), tools=(WEATHER, TIME),
        thinking="disabled",
    )  # fmt: skip
    assert _render("qwen3_template", request).text == (
        f"<|im_start|>system\n{QWEN3_TOOLS}<|im_end|>\n"
        "<|im_start|>user\nTime?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nnoon\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )


def test_qwen3_tool_choice_none_keeps_the_history_but_offers_no_tools() -> None:
    rendered = _render("qwen3_template", _tool_conversation(tool_choice=ToolChoice("none"))).text
    assert "<tools>" not in rendered and not rendered.startswith("<|im_start|>system")
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in rendered
    assert "<tool_response>\nnoon\n</tool_response>" in rendered


def test_mistral_renders_tools_calls_and_results_as_mistral_v3_does() -> None:
    rendered = _render("mistral_template", _tool_conversation(instructions="Be brief."))
    # Mistral's ids are nine characters: the last nine of longer ones ("call_abc" has 8).
    assert rendered.text == (
        "[INST] Be brief.\n\nWeather and time in Paris? [/INST]"
        "Let me check.[TOOL_CALLS] "
        '[{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_abc"},'
        ' {"name": "get_time", "arguments": {}, "id": "call_def"}]</s>'
        '[TOOL_RESULTS] {"content": {"temperature": 22}, "call_id": "call_abc"}[/TOOL_RESULTS]'
        '[TOOL_RESULTS] {"content": "noon", "call_id": "call_def"}[/TOOL_RESULTS]'
        "22 degrees at noon.</s>"
        f"[AVAILABLE_TOOLS] [{WEATHER_JSON}, {TIME_JSON}][/AVAILABLE_TOOLS]"
        "[INST] And tomorrow? [/INST]"
    )


def test_mistral_shows_the_last_nine_characters_of_a_call_id() -> None:
    turns = (
        Turn("user", (TextPart("Time?"),)),
        Turn("assistant", (), (ToolCall("call_0123456789abcdef", "get_time", "{}"),)),
        Turn("tool", (TextPart(' ["noon", 12]'),), tool_call_id="call_0123456789abcdef"),
    )
    request = GenerationRequest(
        request_id="r", model="m", turns=turns, decoding=Decoding(), tools=(TIME,)
    )
    assert _render("mistral_template", request).text == (
        f"[AVAILABLE_TOOLS] [{TIME_JSON}][/AVAILABLE_TOOLS][INST] Time? [/INST]"
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}, "id": "789abcdef"}]</s>'
        '[TOOL_RESULTS] {"content":  ["noon", 12], "call_id": "789abcdef"}[/TOOL_RESULTS]'
    )


@pytest.mark.parametrize(
    ("name", "reply"),
    [
        (
            "qwen3_template",
            'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
            "</tool_call>",
        ),
        (
            "mistral_template",
            'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]',
        ),
    ],
)
def test_a_reply_in_the_formats_markup_parses_back_into_calls(name: str, reply: str) -> None:
    """The markup a format shows the model is the markup its family parser reads."""
    family = format_tool_family(name)
    assert family is not None
    scanner = ToolCallScanner(family)
    pieces = [piece for char in reply for piece in scanner.feed(char)] + scanner.finish()
    assert "".join(p for p in pieces if isinstance(p, str)) == "Sure."
    (call,) = assemble_calls(p for p in pieces if isinstance(p, ToolCallDelta))
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Rome"}')


@pytest.mark.parametrize("name", ["generic", "gemma4_template", "translategemma_template"])
def test_formats_without_a_tool_convention_refuse_tools(name: str) -> None:
    fmt = get_prompt_format(name)
    offered = GenerationRequest(
        request_id="r", model="m", turns=(Turn("user", (TextPart("Hi"),)),),
        decoding=Decoding(), tools=(WEATHER,), target_lang_code="fr",
    )  # fmt: skip
    error = _refused(fmt, offered)
    assert error.code == "tools_unsupported" and error.details == {"param": "tools"}
    assert _refused(fmt, _tool_conversation(target_lang_code="fr")).code == "tools_unsupported"
    assert format_tool_family(name) is None and not format_renders_tools(name)


def test_tool_families_of_the_formats() -> None:
    assert {name: format_tool_family(name) for name in PROMPT_FORMAT_NAMES} == {
        "generic": None, "mistral_template": "mistral", "qwen3_template": "qwen3",
        "gemma4_template": None, "translategemma_template": None, "model_template": None,
    }  # fmt: skip
    assert [n for n in PROMPT_FORMAT_NAMES if format_renders_tools(n)] == [
        "mistral_template", "qwen3_template", "model_template",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="unknown prompt_format"):
        format_tool_family("alpaca")


# --- every format -------------------------------------------------------------------


def test_names_traits_and_unknown_format() -> None:
    assert set(PROMPT_FORMAT_NAMES) == {
        "generic", "mistral_template", "qwen3_template", "gemma4_template",
        "translategemma_template", "model_template",
    }  # fmt: skip
    traits = {
        name: (fmt.multi_turn, fmt.supports_thinking_control)
        for name in PROMPT_FORMAT_NAMES
        if name != "model_template"
        for fmt in [get_prompt_format(name)]
    }
    assert traits == {
        "generic": (True, False),
        "mistral_template": (True, False),
        "qwen3_template": (True, True),
        "gemma4_template": (True, True),
        "translategemma_template": (False, False),
    }
    assert all(format_traits(name) == value for name, value in traits.items())
    assert format_traits("model_template") == (True, False)
    assert {name: thinking_modes(name) for name in PROMPT_FORMAT_NAMES} == {
        name: ("default", "enabled", "disabled") if thinking else ("default",)
        for name, (_, thinking) in {**traits, "model_template": (True, False)}.items()
    }
    with pytest.raises(ValueError, match="unknown prompt_format 'alpaca'"):
        get_prompt_format("alpaca")
    with pytest.raises(ValueError, match="needs the chat template"):
        get_prompt_format("model_template")


@pytest.mark.parametrize("name", [n for n in PROMPT_FORMAT_NAMES if n != "model_template"])
def test_every_format_refuses_images_and_a_trailing_reply(name: str) -> None:
    fmt = get_prompt_format(name)
    with_image = GenerationRequest(
        request_id="r",
        model="m",
        turns=(Turn("user", (TextPart("What is this?"), ImagePart("data:image/png;base64,"))),),
        decoding=Decoding(),
        target_lang_code="en",
    )
    assert _refused(fmt, with_image).code == "modality_unsupported"
    assert _refused(fmt, _request("Hi", "Hello!", target_lang_code="en")).code == "invalid_request"


# --- the formats as llama-server's chat templates ------------------------------------


_JINJA_CASES = [
    _tool_conversation(instructions="Be brief."),
    _tool_conversation(),
    _tool_conversation(thinking="disabled", tool_choice=ToolChoice("required")),
    _request("Hi", "<think>\nhm\n</think>\n\nHello!", "Bye", instructions="Sys"),
    _request("Hi", "<|channel>thought\nhm<channel|>Hello!", "Bye", instructions=" Sys "),
    _request("Hi", thinking="disabled"),
    _request("Hi", thinking="enabled", instructions="Sys"),
]


@pytest.mark.parametrize("name", sorted(FORMAT_TEMPLATES))
@pytest.mark.parametrize("request_", _JINJA_CASES)
def test_the_jinja_templates_render_as_the_formats_do(
    name: str, request_: GenerationRequest
) -> None:
    """The template llama-server gets for a built-in format lays a conversation out
    exactly as the in-process format does (rendered here by the model-template sandbox;
    llama-server's own Jinja engine gave the same text for these cases)."""
    template = ModelTemplateFormat(ModelTemplate(FORMAT_TEMPLATES[name]))
    try:
        expected = _render(name, request_).text
    except PoolError as refused:
        assert refused.code == "tools_unsupported" and format_tool_family(name) is None
        return
    assert template.render(request_).text == expected
