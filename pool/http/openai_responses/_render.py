"""A response's output as OpenAI's Responses API shapes it, built from the pool's events.

:class:`OutputBuilder` turns the neutral events of one generation (text deltas, tool-call
pieces, the end) into output items (``reasoning``, ``message`` with an ``output_text``
part, ``function_call``) and, as it goes, into the stream events OpenAI sends, each
with its ``sequence_number``: ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta``/``.done``,
``response.content_part.done``, ``response.output_item.done``, the reasoning and
function-call argument events, and the ending ``response.completed`` (or
``.incomplete``, ``.failed``). The JSON answer is the same builder's final response,
so streamed and plain answers agree item for item; :class:`ResponseStream` frames its
events as SSE for a streamed answer.

Thinking models write their reasoning between ``<think>`` and ``</think>`` at the start
of the reply (Qwen3, DeepSeek-R1 and their templates); :class:`~pool.http._thinking.ThinkSplitter`
moves it into a ``reasoning`` item.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pool.actors import Admission, Delta, Finished
from pool.backends import ToolCallDelta
from pool.errors import PoolError
from pool.http._common import dumps
from pool.http._streaming import StreamRenderer
from pool.http._thinking import Kind, ThinkSplitter


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _Item:
    """An output item being built; ``done`` once its closing events went out."""

    kind: Literal["reasoning", "message", "function_call"]
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    done: bool = False
    status: str = "in_progress"

    def render(self, status: str) -> dict[str, Any]:
        if self.kind == "message":
            content = [output_text_part(self.text)] if status != "in_progress" else []
            return {
                "type": "message",
                "id": self.id,
                "status": status,
                "role": "assistant",
                "content": content,
            }
        if self.kind == "reasoning":
            return {
                "type": "reasoning",
                "id": self.id,
                "status": status,
                "summary": [],
                "content": (
                    [{"type": "reasoning_text", "text": self.text}]
                    if status != "in_progress"
                    else []
                ),
            }
        return {
            "type": "function_call",
            "id": self.id,
            "call_id": self.call_id,
            "name": self.name,
            "arguments": self.text if status != "in_progress" else "",
            "status": status,
        }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class ResponseFrame:
    """What the response object carries besides its output: the request's settings."""

    id: str
    model: str
    created_at: int
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    text: dict[str, Any]
    metadata: dict[str, str]
    previous_response_id: str | None
    store: bool
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
        incomplete: str | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": None if incomplete is None else {"reason": incomplete},
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "reasoning": self.reasoning or {"effort": None, "summary": None},
            "store": self.store,
            "temperature": self.temperature,
            "text": self.text,
            "tool_choice": self.tool_choice,
            "tools": self.tools,
            "top_p": self.top_p,
            "truncation": self.truncation or "disabled",
            "usage": usage,
            "user": self.user,
            "metadata": self.metadata,
        }
        if status not in ("in_progress", "queued"):
            body["completed_at"] = int(time.time())
        return body


class OutputBuilder:
    """The items and stream events of one response (the module's doc).

    Feed it :meth:`opening`, then every event in order (:meth:`delta`,
    :meth:`tool_call`), then :meth:`finish` or :meth:`fail`; each returns the stream
    events it caused. :attr:`response` is the final response object.
    """

    def __init__(self, frame: ResponseFrame, new_item_id: Callable[[str], str] = new_id) -> None:
        self.frame = frame
        self._new_id = new_item_id
        self._items: list[_Item] = []
        self._calls: dict[int, _Item] = {}  # by the pool's call index
        self._open: _Item | None = None
        self._sequence = 0
        self._think = ThinkSplitter()
        self._reasoning_pieces = 0
        self.response: dict[str, Any] | None = None

    # -- events ----------------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def opening(self) -> list[dict[str, Any]]:
        """``response.created`` and ``response.in_progress``."""
        body = self.frame.body("in_progress", [])
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def _index(self, item: _Item) -> int:
        return self._items.index(item)

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None or item.done:
            return []
        item.done, item.status = True, status
        index = self._index(item)
        events: list[dict[str, Any]] = []
        if item.kind == "message":
            part = output_text_part(item.text)
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=item.text,
                    logprobs=[],
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
        elif item.kind == "reasoning":
            events.append(
                self._event(
                    "response.reasoning_text.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    text=item.text,
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    part={"type": "reasoning_text", "text": item.text},
                )
            )
        else:
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=index,
                    name=item.name,
                    arguments=item.text,
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=index, item=item.render(status))
        )
        return events

    def _start(self, item: _Item) -> list[dict[str, Any]]:
        events = self._close()
        self._items.append(item)
        self._open = item
        index = len(self._items) - 1
        events.append(
            self._event(
                "response.output_item.added", output_index=index, item=item.render("in_progress")
            )
        )
        if item.kind == "message":
            part: dict[str, Any] = output_text_part("")
        elif item.kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
        else:
            return events
        events.append(
            self._event(
                "response.content_part.added",
                item_id=item.id,
                output_index=index,
                content_index=0,
                part=part,
            )
        )
        return events

    def _text(self, kind: Kind, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        wanted: Literal["message", "reasoning"] = "message" if kind == "text" else "reasoning"
        item = self._open
        if item is None or item.kind != wanted:
            item = _Item(wanted, self._new_id("msg" if kind == "text" else "rs"))
            events += self._start(item)
        item.text += text
        index = len(self._items) - 1
        if kind == "text":
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        else:
            self._reasoning_pieces += 1
            events.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=item.id,
                    output_index=index,
                    content_index=0,
                    delta=text,
                )
            )
        return events

    def delta(self, delta: Delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, text in self._think.feed(delta.text):
            events += self._text(kind, text)
        return events

    def tool_call(self, piece: ToolCallDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._calls.get(piece.index)
        if item is None:
            for kind, text in self._think.flush():
                events += self._text(kind, text)
            call_id = piece.id or self._new_id("call")
            item = _Item("function_call", "fc_" + call_id, call_id=call_id, name=piece.name or "")
            self._calls[piece.index] = item
            events += self._start(item)
        elif item is not self._open:
            return events  # a late piece of a call already closed: the end corrects it
        if piece.arguments:
            item.text += piece.arguments
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=self._index(item),
                    delta=piece.arguments,
                )
            )
        return events

    def _flush(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, text in self._think.flush():
            events += self._text(kind, text)
        return events

    def finish(self, finished: Finished) -> list[dict[str, Any]]:
        """The closing events and ``response.completed`` (``.incomplete`` when the reply
        was cut at ``max_output_tokens``)."""
        events = self._flush()
        # The end is authoritative: a call the stream did not show is added now.
        for index, call in enumerate(finished.tool_calls):
            item = self._calls.get(index)
            if item is None:
                events += self.tool_call(ToolCallDelta(index, call.id, call.name, call.arguments))
            else:
                item.text, item.name = call.arguments, call.name
        # Cut short: at max_output_tokens ("length"), or stopped by the pool ("cancelled").
        status = "completed" if finished.finish_reason in ("stop", "tool_calls") else "incomplete"
        events += self._close(status)
        output = [item.render(item.status) for item in self._items]
        self.response = self.frame.body(
            status,
            output,
            usage=self._usage(finished),
            incomplete="max_output_tokens" if finished.finish_reason == "length" else None,
        )
        events.append(self._event(f"response.{status}", response=self.response))
        return events

    def fail(self, error: PoolError) -> list[dict[str, Any]]:
        """The open item closed as incomplete, then ``response.failed``."""
        events = self._flush()
        events += self._close("incomplete")
        output = [item.render(item.status) for item in self._items]
        self.response = self.frame.body(
            "failed", output, error={"code": error.code, "message": error.message}
        )
        events.append(self._event("response.failed", response=self.response))
        return events

    def _usage(self, finished: Finished) -> dict[str, Any]:
        usage = finished.usage
        prompt, output = usage.prompt_tokens or 0, usage.output_tokens or 0
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens or 0},
            "output_tokens": output,
            # The text pieces that went to the reasoning item (a token each, on the
            # pool's streaming backends), never more than the whole output.
            "output_tokens_details": {"reasoning_tokens": min(self._reasoning_pieces, output)},
            "total_tokens": prompt + output,
        }


# -- the wire ------------------------------------------------------------------------------
def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"


def _sse_all(events: list[dict[str, Any]]) -> bytes:
    return b"".join(sse(e) for e in events)


class ResponseStream(StreamRenderer):
    """One streamed response's events as SSE: the renderers its view hands to
    :func:`~pool.http._streaming.admitted_stream`, all fed to one :class:`OutputBuilder`.

    The last event (``response.completed``, ``.incomplete`` or ``.failed``) is held in
    :attr:`ending` rather than rendered, so the view sends it only once the response is
    stored: a client that reads the end can retrieve or continue the response at once.
    """

    def __init__(self, builder: OutputBuilder) -> None:
        self.builder = builder
        self.ending: list[bytes] = []

    def opening(self, admission: Admission) -> bytes:
        return _sse_all(self.builder.opening())

    def render(self, admission: Admission, event: Delta | Finished) -> bytes | None:
        if type(event) is Delta:
            return _sse_all(self.builder.delta(event))
        assert isinstance(event, Finished)
        *events, last = self.builder.finish(event)
        self.ending.append(sse(last))
        return _sse_all(events)

    def render_error(self, admission: Admission, exc: PoolError) -> bytes:
        *events, last = self.builder.fail(exc)
        self.ending.append(sse(last))
        return _sse_all(events)

    def render_tool_call(self, admission: Admission, piece: ToolCallDelta) -> bytes:
        return _sse_all(self.builder.tool_call(piece))


def deleted_body(response_id: str) -> dict[str, Any]:
    return {"id": response_id, "object": "response", "deleted": True}


def input_items_page(page: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A page of a stored response's input items, as OpenAI lists them."""
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": has_more,
    }
