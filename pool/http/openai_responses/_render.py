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
events as SSE for a streamed answer, as ``/v1/responses`` frames its own
(pool/http/_responses_core.py has what the two share).

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
from pool.http._responses_core import (
    EventObjects,
    SseEvents,
    function_call_item,
    sse,
    sse_all,
)
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
        if self.kind == "function_call":
            arguments = self.text if status != "in_progress" else ""
            return function_call_item(self.call_id, self.name, arguments, status)
        content = [_part(self.kind, self.text)] if status != "in_progress" else []
        if self.kind == "message":
            return {
                "type": "message",
                "id": self.id,
                "status": status,
                "role": "assistant",
                "content": content,
            }
        return {
            "type": "reasoning",
            "id": self.id,
            "status": status,
            "summary": [],
            "content": content,
        }


def output_text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


# A text item's part and its events, as OpenAI names them: a message's ``output_text``
# events carry ``logprobs``, a reasoning item's ``reasoning_text`` events none.
_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}
_LOGPROBS: dict[str, dict[str, Any]] = {"message": {"logprobs": []}, "reasoning": {}}


def _part(kind: str, text: str) -> dict[str, Any]:
    return output_text_part(text) if kind == "message" else {"type": "reasoning_text", "text": text}


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


class OutputBuilder(StreamRenderer[EventObjects]):
    """The items and stream events of one response (the module's doc).

    Feed it :meth:`opening`, then every event in order (:meth:`render`), up to the
    :class:`Finished` or the error; each returns the stream events it caused.
    :attr:`response` is the final response object.
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

    def _item_event(self, kind: str, item: _Item, **fields: Any) -> dict[str, Any]:
        return self._event(kind, item_id=item.id, output_index=self._index(item), **fields)

    def _part_event(self, kind: str, item: _Item, **fields: Any) -> dict[str, Any]:
        """An event of an item's one content part (its text)."""
        return self._item_event(kind, item, content_index=0, **fields)

    def opening(self, admission: Admission | None = None) -> EventObjects:
        """``response.created`` and ``response.in_progress``."""
        body = self.frame.body("in_progress", [])
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def _index(self, item: _Item) -> int:
        # Nearly always the open, last item (every delta's): no search then.
        last = len(self._items) - 1
        return last if self._items[last] is item else self._items.index(item)

    def _close(self, status: str = "completed") -> EventObjects:
        item, self._open = self._open, None
        if item is None or item.done:
            return []
        item.done, item.status = True, status
        events: EventObjects = []
        if item.kind == "function_call":
            events.append(
                self._item_event(
                    "response.function_call_arguments.done",
                    item,
                    name=item.name,
                    arguments=item.text,
                )
            )
        else:
            done = _TEXT_EVENTS[item.kind] + ".done"
            events.append(self._part_event(done, item, text=item.text, **_LOGPROBS[item.kind]))
            part = _part(item.kind, item.text)
            events.append(self._part_event("response.content_part.done", item, part=part))
        index = self._index(item)
        events.append(
            self._event("response.output_item.done", output_index=index, item=item.render(status))
        )
        return events

    def _start(self, item: _Item) -> EventObjects:
        events = self._close()
        self._items.append(item)
        self._open = item
        index = len(self._items) - 1
        events.append(
            self._event(
                "response.output_item.added", output_index=index, item=item.render("in_progress")
            )
        )
        if item.kind != "function_call":
            part = _part(item.kind, "")
            events.append(self._part_event("response.content_part.added", item, part=part))
        return events

    def _text(self, kind: Kind, text: str) -> EventObjects:
        events: EventObjects = []
        wanted: Literal["message", "reasoning"] = "message" if kind == "text" else "reasoning"
        item = self._open
        if item is None or item.kind != wanted:
            item = _Item(wanted, self._new_id("msg" if kind == "text" else "rs"))
            events += self._start(item)
        item.text += text
        if wanted == "reasoning":
            self._reasoning_pieces += 1
        delta = _TEXT_EVENTS[wanted] + ".delta"
        events.append(self._part_event(delta, item, delta=text, **_LOGPROBS[wanted]))
        return events

    def render_delta(self, admission: Admission | None, delta: Delta) -> EventObjects:
        events: EventObjects = []
        for kind, text in self._think.feed(delta.text):
            events += self._text(kind, text)
        return events

    def render_tool_call(self, admission: Admission | None, piece: ToolCallDelta) -> EventObjects:
        events: EventObjects = []
        item = self._calls.get(piece.index)
        if item is None:
            events += self._flush()
            call_id = piece.id or self._new_id("call")
            item = _Item("function_call", "fc_" + call_id, call_id=call_id, name=piece.name or "")
            self._calls[piece.index] = item
            events += self._start(item)
        elif item is not self._open:
            return events  # a late piece of a call already closed: the end corrects it
        if piece.arguments:
            item.text += piece.arguments
            events.append(
                self._item_event(
                    "response.function_call_arguments.delta", item, delta=piece.arguments
                )
            )
        return events

    def _flush(self) -> EventObjects:
        events: EventObjects = []
        for kind, text in self._think.flush():
            events += self._text(kind, text)
        return events

    def render_finished(self, admission: Admission | None, finished: Finished) -> EventObjects:
        """The closing events and ``response.completed`` (``.incomplete`` when the reply
        was cut at ``max_output_tokens``)."""
        events = self._flush()
        # The end is authoritative: a call the stream did not show is added now.
        for index, call in enumerate(finished.tool_calls):
            item = self._calls.get(index)
            if item is None:
                piece = ToolCallDelta(index, call.id, call.name, call.arguments)
                events += self.render_tool_call(admission, piece)
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

    def render_error(self, admission: Admission | None, exc: PoolError) -> EventObjects:
        """The open item closed as incomplete, then ``response.failed``."""
        events = self._flush()
        events += self._close("incomplete")
        output = [item.render(item.status) for item in self._items]
        self.response = self.frame.body(
            "failed", output, error={"code": exc.code, "message": exc.message}
        )
        events.append(self._event("response.failed", response=self.response))
        return events

    def error_event(self, exc: PoolError) -> dict[str, Any]:
        """A stream's ``error`` event, numbered after everything rendered so far: what
        follows a completed response that could not be stored."""
        return self._event("error", code=exc.code, message=exc.message, param=None)

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
class ResponseStream(SseEvents):
    """One streamed response's events as SSE, all made by one :class:`OutputBuilder`:
    what its view hands to :func:`~pool.http._streaming.admitted_stream`.

    The last event (``response.completed``, ``.incomplete`` or ``.failed``) is held in
    :attr:`ending` rather than rendered, so the view sends it only once the response is
    stored: a client that reads the end can retrieve or continue the response at once.
    """

    def __init__(self, builder: OutputBuilder) -> None:
        super().__init__(builder)
        self.builder = builder
        self.ending: list[bytes] = []

    def _held(self, events: EventObjects) -> bytes:
        *rest, last = events
        self.ending.append(sse(last))
        return sse_all(rest)

    def render_finished(self, admission: Admission, finished: Finished) -> bytes:
        return self._held(self.builder.render_finished(admission, finished))

    def render_error(self, admission: Admission, exc: PoolError) -> bytes:
        return self._held(self.builder.render_error(admission, exc))


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
