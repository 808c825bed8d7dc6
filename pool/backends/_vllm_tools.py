"""Tools and structured output for the in-process vLLM engine, the way ``vllm serve`` does them.

``vllm serve`` turns a Chat Completions body into vLLM's ``ChatCompletionRequest``; its
``Parser`` (the tool parser named by ``--tool-call-parser``, composed by
``ParserManager``) adjusts that request (a forced call becomes a JSON schema or a
structural tag of the call markup), the request's ``response_format`` and adjustments
become ``SamplingParams.structured_outputs`` (guided decoding), and every output delta
goes through ``Parser.parse_delta``, which splits it into content and tool-call pieces.

The ``vllm`` backend does the same with the same classes (vLLM 0.32), on the engine's
own thread, where vLLM is imported. The one difference: the prompt is the pool's, rendered
by the model's ``prompt_format`` (which shows the model the tools), not vLLM's chat
template. :func:`chat_spec` is the Trio side's part (plain data, no vLLM);
:class:`ChatSide` is the engine thread's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pool.backends._chat_client import chat_messages, tool_fields
from pool.backends._protocol import GenerationRequest
from pool.backends._tools import ToolCallDelta, new_call_id

__all__ = ["ChatSide", "ChatSpec", "chat_spec"]

_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")


@dataclass(frozen=True)
class ChatSpec:
    """What the engine thread needs for one request's tools and output format.

    Attributes:
        body: the request as a Chat Completions body (messages, and OpenAI's fields for
            tools, ``tool_choice``, ``parallel_tool_calls``, ``response_format``).
        tool_parser: vLLM's tool parser name; None when no tools are in play.
        parallel: whether more than one call may come back.
        strict_level: vLLM's tool strict level (``auto``, ``function``, ``parameter``).
    """

    body: dict[str, Any]
    tool_parser: str | None
    parallel: bool
    strict_level: str = "auto"


def chat_spec(
    request: GenerationRequest, tool_parser: str, strict_level: str | None = None
) -> ChatSpec | None:
    """The chat side of ``request``; None when it offers no tools and wants no format.

    With ``tool_choice: "none"`` the tools stay out (nothing to parse); the output
    format still applies.
    """
    tools = request.offers_tools
    if not tools and request.output_format is None:
        return None
    fields = tool_fields(request)
    if not tools:
        for name in _TOOL_FIELDS:
            fields.pop(name, None)
    body = {"model": request.model, "messages": chat_messages(request), **fields}
    return ChatSpec(
        body, tool_parser if tools else None, request.parallel_tool_calls, strict_level or "auto"
    )


class ChatSide:
    """vLLM's chat request and parser for one job; built and used on the engine thread.

    Args:
        spec: what the Trio side asked for.
        engine: the ``AsyncLLM`` (for its model config and tokenizer).
        parser_classes: a per-engine cache of composed parser classes by tool parser
            name and strict level (``ParserManager.get_parser`` checks each against the
            tokenizer).

    Raises:
        ValueError: vLLM refused the body (pydantic's ValidationError is one), or the
            parser could not be built for this model.
    """

    def __init__(self, spec: ChatSpec, engine: Any, parser_classes: dict[str, Any]) -> None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest.model_validate(spec.body)
        self._parser: Any = None
        if spec.tool_parser is not None:
            key = f"{spec.tool_parser}/{spec.strict_level}"
            parser_class = parser_classes.get(key)
            tokenizer = engine.get_tokenizer()
            if parser_class is None:
                from vllm.parser import ParserManager

                try:
                    parser_class = ParserManager.get_parser(
                        tool_parser_name=spec.tool_parser,
                        enable_auto_tools=True,
                        model_name=engine.model_config.model,
                        tool_strict_level=spec.strict_level,
                        tokenizer=tokenizer,
                    )
                except KeyError as exc:
                    raise ValueError(f"vLLM has no tool parser {spec.tool_parser!r}") from exc
                parser_classes[key] = parser_class
            self._parser = parser_class(tokenizer, request.tools, model_config=engine.model_config)
            request = self._parser.adjust_request(request)
        self._request = request
        self._parallel = spec.parallel
        self._ids: dict[int, str] = {}

    def sampling(self) -> dict[str, Any]:
        """``SamplingParams`` arguments for the request: its structured output (from
        ``response_format`` or a forced call) and, with tools, the detokenizing the
        parser asked for (markup tokens that are special must reach it)."""
        arguments: dict[str, Any] = {}
        structured = self._request.extract_structured_outputs()
        if structured is not None:
            arguments["structured_outputs"] = structured
        if self._parser is not None:
            arguments["skip_special_tokens"] = self._request.skip_special_tokens
        return arguments

    def pieces(
        self,
        text: str,
        token_ids: list[int],
        prompt_token_ids: list[int] | None,
        *,
        finished: bool,
    ) -> list[str | ToolCallDelta]:
        """One output delta as content and tool-call pieces (the text as it is when no
        tools are in play)."""
        if self._parser is None:
            return [text] if text else []
        message = self._parser.parse_delta(
            text, token_ids, self._request, prompt_token_ids, finished=finished
        )
        if message is None:
            return []
        out: list[str | ToolCallDelta] = []
        if message.content:
            out.append(message.content)
        for call in message.tool_calls or ():
            if call.index > 0 and not self._parallel:
                continue
            function = call.function
            name = function.name if function is not None else None
            arguments = (function.arguments if function is not None else None) or ""
            first = call.index not in self._ids
            if first:
                # The pool's call ids on every backend (vLLM's own are chatcmpl-tool-...).
                self._ids[call.index] = new_call_id()
            out.append(
                ToolCallDelta(call.index, self._ids[call.index] if first else None, name, arguments)
            )
        return out
