"""The tool-call family parsers on text samples, fed whole and split at every boundary."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pool.backends import ToolCallDelta, ToolChoice, ToolSpec, assemble_calls
from pool.backends._grammar import load_grammar, tool_call_grammar
from pool.backends._tool_calls import ToolCallScanner, tool_call_family, vllm_tool_parser

Piece = str | ToolCallDelta


def _scan(family: Any, chunks: list[str], parallel: bool = True) -> tuple[str, list[Any]]:
    scanner = ToolCallScanner(family, parallel=parallel)
    pieces: list[Piece] = []
    for chunk in chunks:
        pieces += scanner.feed(chunk)
    pieces += scanner.finish()
    text = "".join(p for p in pieces if isinstance(p, str))
    calls = assemble_calls(p for p in pieces if isinstance(p, ToolCallDelta))
    return text, [(c.name, json.loads(c.arguments)) for c in calls]


def _splits(sample: str) -> list[list[str]]:
    """The sample whole, one character at a time, and cut in two at every position."""
    return [[sample], list(sample)] + [[sample[:i], sample[i:]] for i in range(1, len(sample))]


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)
QWEN3_XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
MISTRAL_V3 = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}'
GRANITE = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


@pytest.mark.parametrize("chunks", _splits(HERMES))
def test_hermes_calls_survive_any_split(chunks: list[str]) -> None:
    text, calls = _scan("hermes", chunks)
    assert text == "Let me check."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("chunks", _splits(QWEN3_XML))
def test_qwen3_xml_calls_survive_any_split(chunks: list[str]) -> None:
    assert _scan("qwen3", chunks) == ("", [("get_weather", {"city": "Paris", "days": 3})])


def test_qwen3_reads_json_calls_like_hermes() -> None:
    assert _scan("qwen3", [HERMES])[1][0] == ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("chunks", _splits(MISTRAL_V3))
def test_mistral_json_array_survives_any_split(chunks: list[str]) -> None:
    assert _scan("mistral", chunks) == ("", [("get_weather", {"city": "Paris"})])


@pytest.mark.parametrize("chunks", _splits(MISTRAL_V11))
def test_mistral_args_form_survives_any_split(chunks: list[str]) -> None:
    assert _scan("mistral", chunks) == (
        "",
        [("get_weather", {"city": "Paris"}), ("get_time", {})],
    )


def test_granite_call_list() -> None:
    assert _scan("granite", list(GRANITE)) == ("", [("get_weather", {"city": "Paris"})])


def test_text_without_calls_passes_through_whole() -> None:
    sample = "A < b and <tool is not a call; [TOOL not either.\n"
    for chunks in _splits(sample):
        assert _scan("hermes", chunks) == (sample, [])
        assert _scan("mistral", chunks) == (sample, [])


def test_a_block_that_is_not_a_call_stays_text() -> None:
    sample = "<tool_call>not json</tool_call> done"
    assert _scan("hermes", list(sample)) == (sample, [])


def test_an_unclosed_block_is_parsed_at_the_end() -> None:
    sample = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}'
    assert _scan("hermes", list(sample)) == ("", [("f", {"x": 1})])


def test_parallel_false_keeps_the_first_call() -> None:
    assert _scan("hermes", [HERMES], parallel=False)[1] == [("get_weather", {"city": "Paris"})]


def test_pieces_arrive_as_openai_streams_them() -> None:
    scanner = ToolCallScanner("hermes")
    pieces = scanner.feed('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert [type(p) for p in pieces] == [ToolCallDelta, ToolCallDelta]
    first, second = pieces
    assert isinstance(first, ToolCallDelta) and isinstance(second, ToolCallDelta)
    assert first.id and first.id.startswith("call_") and first.name == "f"
    assert first.arguments == "" and second.id is None and second.arguments == '{"x": 1}'


@pytest.mark.parametrize(
    ("names", "family", "parser"),
    [
        (("Qwen3-8B-Q4_K_M.gguf", "qwen3"), "qwen3", "qwen3_json"),
        (("Qwen/Qwen3-Coder-30B-A3B-Instruct",), "qwen3", "qwen3_xml"),
        (("Mistral-Small-3.2-24B",), "mistral", "mistral"),
        (("mixtral-8x7b-instruct",), "mistral", "mistral"),
        (("ibm-granite/granite-3.3-8b-instruct",), "granite", "granite"),
        (("SmolLM2-135M-Instruct.Q4_1.gguf", "llama"), "hermes", "hermes"),
    ],
)
def test_family_from_the_model_name(names: tuple[str, ...], family: str, parser: str) -> None:
    assert tool_call_family(*names) == family
    assert vllm_tool_parser(*names) == parser


WEATHER = ToolSpec(
    "get_weather",
    None,
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
TIME = ToolSpec("get_time", None, {"type": "object", "properties": {}})


@pytest.mark.parametrize("family", ["hermes", "qwen3", "mistral", "granite"])
@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "get_weather")])
def test_forced_call_grammars_compile(family: Any, choice: ToolChoice) -> None:
    gbnf = tool_call_grammar((WEATHER, TIME), choice, family, parallel=True)
    assert gbnf.startswith("root ::=") and '"\\"get_weather\\""' in gbnf
    assert ("get_time" in gbnf) == (choice.mode == "required")
    assert load_grammar(gbnf) is not None


def _request(**fields: Any) -> Any:
    from pool.backends import Decoding, GenerationRequest, TextPart, ToolCall, Turn

    turns = (
        Turn("user", (TextPart("weather?"),)),
        Turn("assistant", (TextPart(""),), (ToolCall("call_1", "get_weather", '{"city": "P"}'),)),
        Turn("tool", (TextPart("sunny"),), tool_call_id="call_1"),
    )
    return GenerationRequest("r", "m", turns, Decoding(), **fields)


def test_managed_servers_get_openai_fields() -> None:
    from pool.backends import OutputFormat
    from pool.backends._chat_client import chat_messages, tool_fields

    request = _request(
        tools=(WEATHER,),
        tool_choice=ToolChoice("function", "get_weather"),
        output_format=OutputFormat("json_schema", {"type": "object"}, "x", True),
    )
    messages = chat_messages(request)
    assert messages[1]["content"] is None
    assert messages[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "P"}',
    }
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    fields = tool_fields(request)
    assert fields["tools"][0]["function"]["name"] == "get_weather"
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert fields["response_format"]["json_schema"] == {
        "name": "x",
        "schema": {"type": "object"},
        "strict": True,
    }


def test_llama_server_forced_calls_use_the_pool_grammar() -> None:
    from pool.backends._chat_client import tool_fields
    from pool.backends._forced_calls import force_with_grammar
    from pool.backends.llama_server import LlamaServerModel, command_line

    request = _request(tools=(WEATHER,), tool_choice=ToolChoice("required"))
    body = {"chat_template_kwargs": {"enable_thinking": False}, **tool_fields(request)}
    assert force_with_grammar(body, request, "hermes")
    assert "tools" not in body and "tool_choice" not in body
    assert body["chat_template_kwargs"]["enable_thinking"] is False
    assert body["chat_template_kwargs"]["tools"][0]["function"]["name"] == "get_weather"
    assert body["grammar"].startswith('root ::= "<tool_call>')
    auto = _request(tools=(WEATHER,))
    assert not force_with_grammar(tool_fields(auto), auto, "hermes")

    model = LlamaServerModel(model_path="/m.gguf", llama_server_chat_template_file="/t.jinja")
    args = command_line(model, "llama-server", "/m.gguf", 1)
    assert "--jinja" in args and args[args.index("--chat-template-file") + 1] == "/t.jinja"
    assert "--chat-template" not in args


def test_llama_server_renders_qwen3_template_with_the_pools_template() -> None:
    """qwen3_template on llama-server: the pool's Jinja version of the format (tools in
    Qwen3's markup) as --chat-template-file, and forced calls in the qwen3 markup; a
    template of the model's own configured wins, with its own family."""
    from pathlib import Path

    from pool.backends._format_templates import FORMAT_TEMPLATES
    from pool.backends.llama_server import LlamaServerModel, command_line, tool_family

    model = LlamaServerModel(model_path="/m.gguf", prompt_format="qwen3_template")
    args = command_line(model, "llama-server", "/m.gguf", 1)
    assert "--chat-template" not in args
    path = Path(args[args.index("--chat-template-file") + 1])
    assert path.read_text("utf-8") == FORMAT_TEMPLATES["qwen3_template"]
    assert args.count("--chat-template-file") == 1
    assert tool_family(model, "Mistral-7B.gguf") == "qwen3"

    named = LlamaServerModel(
        model_path="/m.gguf", prompt_format="qwen3_template", llama_server_chat_template="chatml"
    )
    args = command_line(named, "llama-server", "/m.gguf", 1)
    assert args[args.index("--chat-template") + 1] == "chatml"
    assert "--chat-template-file" not in args
    assert tool_family(named, "Mistral-7B.gguf") == "mistral"
    own = LlamaServerModel(
        model_path="/m.gguf",
        prompt_format="qwen3_template",
        llama_server_chat_template_file="/t.jinja",
        tool_call_format="granite",
    )
    args = command_line(own, "llama-server", "/m.gguf", 1)
    assert args[args.index("--chat-template-file") + 1] == "/t.jinja"
    assert tool_family(own, "Qwen3.gguf") == "granite"


@pytest.mark.parametrize(
    ("prompt_format", "template", "tools"),
    [
        ("qwen3_template", True, True),
        ("mistral_template", True, True),
        # The pool's Gemma 4 template has no tool markup: tools are refused.
        ("gemma4_template", True, False),
        # No template of the pool's: the GGUF's own renders (and decides on tools).
        ("generic", False, True),
        ("model_template", False, True),
    ],
)
def test_llama_server_gets_the_pools_template_of_each_built_in_format(
    prompt_format: str, template: bool, tools: bool
) -> None:
    from pathlib import Path

    from pool.backends._format_templates import FORMAT_TEMPLATES
    from pool.backends.llama_server import LlamaServerBackend, LlamaServerModel, command_line

    model = LlamaServerModel(model_path="/m.gguf", prompt_format=prompt_format)
    args = command_line(model, "llama-server", "/m.gguf", 1)
    # llama-server's built-in names (mistral-v7, gemma) are never passed: with --jinja
    # it would take the name itself for the template's text.
    assert "--chat-template" not in args
    if template:
        path = Path(args[args.index("--chat-template-file") + 1])
        assert path.read_text("utf-8") == FORMAT_TEMPLATES[prompt_format]
    else:
        assert "--chat-template-file" not in args
    assert LlamaServerBackend().capabilities(model).tools == tools
