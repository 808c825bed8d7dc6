"""Tool calls in a model's own words: which family a model speaks, and parsers for them.

A model that decodes in-process (llama_cpp) writes its tool calls as text in its
family's markup; :class:`ToolCallScanner` turns that text, piece by piece as it is
generated, into plain content and :class:`ToolCallDelta` values. Families:

- ``hermes`` (NousResearch Hermes 2 Pro, SmolLM-style ChatML tool templates):
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.
- ``qwen3``: the same tags (Qwen2.5/Qwen3 templates), also with the XML body of
  Qwen3-Coder: ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function>``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects
  (v3 tokenizers) or ``[TOOL_CALLS]NAME[ARGS]{...}`` (v11+), to the end of the reply.
- ``granite``: ``<|tool_call|>`` then a JSON array, to the end of the reply.

The family is picked from the model's name or architecture (:func:`tool_call_family`),
the same table the managed vLLM backend maps to its ``--tool-call-parser`` names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any, Literal

from pool.backends._tools import ToolCallDelta, new_call_id

ToolCallFamily = Literal["hermes", "qwen3", "mistral", "granite"]
TOOL_CALL_FAMILIES: tuple[ToolCallFamily, ...] = ("hermes", "qwen3", "mistral", "granite")

# vLLM 0.32's registered parser names per family (vllm/tool_parsers/__init__.py):
# Qwen3's JSON-in-tags calls are `qwen3_json` (Qwen3-Coder's XML ones `qwen3_xml`).
VLLM_TOOL_PARSERS: dict[ToolCallFamily, str] = {
    "hermes": "hermes",
    "qwen3": "qwen3_json",
    "mistral": "mistral",
    "granite": "granite",
}

Piece = str | ToolCallDelta


def tool_call_family(*names: str | None) -> ToolCallFamily:
    """The family of a model known by these names (file name, GGUF name, architecture).

    Qwen3 -> qwen3, Mistral/Mixtral (and their relatives) -> mistral, Granite ->
    granite, anything else -> hermes (the most common markup of tool-tuned models).
    """
    text = " ".join(n for n in names if n).lower()
    if "qwen3" in text or "qwen2" in text:
        return "qwen3"
    if re.search(r"m[ia]xtral|mistral|ministral|devstral|magistral|codestral", text):
        return "mistral"
    if "granite" in text:
        return "granite"
    return "hermes"


def vllm_tool_parser(*names: str | None) -> str:
    """vLLM's ``--tool-call-parser`` for a model known by these names."""
    text = " ".join(n for n in names if n).lower()
    if "qwen3" in text and "coder" in text:
        return "qwen3_xml"
    return VLLM_TOOL_PARSERS[tool_call_family(*names)]


_XML_FUNCTION = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?(?:</parameter>|$)", re.DOTALL)


def _xml_call(body: str) -> tuple[str, dict[str, Any]] | None:
    """Qwen3-Coder's ``<function=NAME><parameter=KEY>VALUE</parameter></function>``."""
    found = _XML_FUNCTION.search(body)
    if found is None:
        return None
    arguments: dict[str, Any] = {}
    for key, raw in _XML_PARAMETER.findall(found.group(2)):
        try:
            arguments[key] = json.loads(raw)
        except ValueError:
            arguments[key] = raw
    return found.group(1), arguments


def _json_call(value: Any) -> tuple[str, Any] | None:
    """``{"name": ..., "arguments": ...}`` (or ``parameters``); arguments as a JSON object."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return value["name"], arguments


def parse_call_body(body: str) -> tuple[str, Any] | None:
    """One hermes/qwen3 ``<tool_call>`` body as ``(name, arguments)``; None if it is not one."""
    text = body.strip()
    try:
        return _json_call(json.loads(text))
    except ValueError:
        return _xml_call(text)


def parse_call_list(text: str) -> list[tuple[str, Any]] | None:
    """A mistral/granite call list: a JSON array (or one object), or mistral's
    ``NAME[ARGS]{...}`` sequence; None if it is neither."""
    text = text.strip()
    if "[ARGS]" in text:
        calls = []
        for chunk in text.split("[TOOL_CALLS]"):
            name, sep, raw = chunk.partition("[ARGS]")
            if not sep:
                continue
            try:
                calls.append((name.strip(), json.loads(raw)))
            except ValueError:
                return None
        return calls or None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    parsed = [_json_call(item) for item in items]
    if not parsed or any(p is None for p in parsed):
        return None
    return [p for p in parsed if p is not None]


class ToolCallScanner:
    """Splits generated text into content and tool calls, fed piece by piece.

    Text that might be the start of a call marker is held back until it is known;
    whitespace around calls is dropped (a reply of calls only has no content). A call
    block that does not parse is passed on as the text the model wrote.

    Args:
        family: the markup the model writes.
        parallel: False keeps only the first call (``parallel_tool_calls: false``).
    """

    def __init__(self, family: ToolCallFamily, *, parallel: bool = True) -> None:
        self._family = family
        self._parallel = parallel
        self._open: str
        self._close: str | None
        if family in ("hermes", "qwen3"):
            self._open, self._close = "<tool_call>", "</tool_call>"
        elif family == "mistral":
            self._open, self._close = "[TOOL_CALLS]", None
        else:
            self._open, self._close = "<|tool_call|>", None
        self._pending = ""  # text not yet classified
        self._space = ""  # whitespace held until we know whether a call follows
        self._inside: str | None = None  # the body of an open call block
        self._calls = 0
        self._after_call = False

    @property
    def calls(self) -> int:
        return self._calls

    def feed(self, text: str) -> list[Piece]:
        """What is safe to hand on after ``text``: content strings and call pieces."""
        out: list[Piece] = []
        self._pending += text
        while self._pending:
            if self._inside is not None:
                if self._close is None:
                    # Runs to the end of the reply: parsed in finish().
                    self._inside += self._pending
                    self._pending = ""
                    break
                end = self._pending.find(self._close)
                if end < 0:
                    keep = _partial_suffix(self._pending, self._close)
                    self._inside += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                body = self._inside + self._pending[:end]
                self._pending = self._pending[end + len(self._close) :]
                self._inside = None
                out += self._call_block(body)
                continue
            start = self._pending.find(self._open)
            if start >= 0:
                out += self._content(self._pending[:start])
                self._space = ""
                self._pending = self._pending[start + len(self._open) :]
                self._inside = ""
                continue
            keep = _partial_suffix(self._pending, self._open)
            out += self._content(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            break
        return out

    def finish(self) -> list[Piece]:
        """The rest, at the end of the reply (an unclosed block is parsed if it can be)."""
        out: list[Piece] = []
        if self._inside is not None:
            body, self._inside = self._inside + self._pending, None
            self._pending = ""
            out += self._call_block(body, closed=False)
        elif self._pending:
            out += self._content(self._pending)
            self._pending = ""
        if self._space and not self._calls:
            out.append(self._space)
        self._space = ""
        return out

    def _content(self, text: str) -> list[Piece]:
        # Whitespace at either side of a call is the markup's, not content: trailing
        # whitespace waits until more content shows it belongs to the text.
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        out = body.lstrip() if self._after_call else self._space + body
        self._space = text[len(body) :]
        self._after_call = False
        return [out] if out else []

    def _call_block(self, body: str, closed: bool = True) -> list[Piece]:
        if self._close is None:
            calls = parse_call_list(body)
        else:
            one = parse_call_body(body)
            calls = None if one is None else [one]
        if calls is None:
            tail = self._close if closed and self._close else ""
            return [self._open + body + tail]
        return self.emit(calls)

    def emit(self, calls: Iterable[tuple[str, Any]]) -> list[Piece]:
        """Call pieces for parsed ``(name, arguments)`` pairs, numbered after earlier ones."""
        out: list[Piece] = []
        for name, arguments in calls:
            if self._calls and not self._parallel:
                break
            index = self._calls
            self._calls += 1
            text = (
                arguments
                if isinstance(arguments, str)
                else json.dumps(arguments, ensure_ascii=False)
            )
            # As OpenAI streams a call: id and name first, then the arguments.
            out.append(ToolCallDelta(index, new_call_id(), name, ""))
            out.append(ToolCallDelta(index, arguments=text))
            self._after_call = True
        return out


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
