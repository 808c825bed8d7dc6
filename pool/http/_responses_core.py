"""What the two Responses APIs share: ``/v1/responses``, the pool's own form
(pool/http/responses/), and ``/openai/v1/responses``, OpenAI's (pool/http/openai_responses/).

Both read messages, ``function_call`` and ``function_call_output`` items into the same
turns (:class:`Conversation`), take tools and ``text.format`` the same way
(:func:`tool_fields`), build each reply as a :class:`~pool.http._streaming.StreamRenderer`
of event objects, and send those as Server-Sent Events the same way (:class:`SseEvents`);
a body without ``stream`` runs through :func:`~pool.http._collected.collected`.

What stays apart are the wire differences, each in its own package:

- the request: ``input`` (one user turn) or ``messages``, a ``decoding`` object, a
  ``system`` role refused (``instructions`` is the system prompt); against OpenAI's
  ``input`` items, with system and developer messages joining ``instructions``,
  ``previous_response_id`` and its stored history;
- the events: the pool's (``response.queued``/``.loading`` while it waits, call items
  done at the end, ``response.metrics``) against OpenAI's (``sequence_number``, each
  item closed as the next opens, reasoning items, the last event held until stored);
- the reply object (the envelope with ``metrics``, or OpenAI's response) and the errors
  (the pool's shape, or OpenAI's error object); the WebSocket is the native form's only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pool.actors import Admission, Delta, Finished, Paused, ToolCallDelta, Waiting
from pool.backends import ImagePart, TextPart, ToolCall, Turn
from pool.errors import PoolError
from pool.http._common import dumps
from pool.http._streaming import SSE_KEEP_ALIVE, StreamRenderer
from pool.http._tools import responses_output_format, responses_tools, tool_choice
from pool.schemas import FunctionChoice, FunctionTool, TextFormat

Parts = tuple[TextPart | ImagePart, ...]
EventObjects = list[dict[str, Any]]


class Conversation:
    """The turns of a Responses conversation, in order: consecutive ``function_call``
    items join the assistant turn before them (or open one of their own), and each
    ``function_call_output`` is a ``tool`` turn."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    def message(self, role: str, parts: Parts) -> None:
        self.turns.append(Turn(role, parts))  # type: ignore[arg-type]

    def call(self, call: ToolCall) -> None:
        last = self.turns[-1] if self.turns else None
        if last is not None and last.role == "assistant":
            self.turns[-1] = Turn("assistant", last.parts, (*last.tool_calls, call))
        else:
            self.turns.append(Turn("assistant", (TextPart(""),), (call,)))

    def output(self, call_id: str, parts: Parts) -> None:
        self.turns.append(Turn("tool", parts, tool_call_id=call_id))


def tool_fields(
    tools: Sequence[FunctionTool] | None,
    choice: str | FunctionChoice | None,
    parallel_tool_calls: bool,
    text_format: TextFormat | None,
) -> dict[str, Any]:
    """The neutral request's ``tools``, ``tool_choice``, ``parallel_tool_calls`` and
    ``output_format`` (of ``text.format``), as both Responses APIs take them."""
    specs = responses_tools(tools)
    return {
        "tools": specs,
        "tool_choice": tool_choice(choice, specs),
        "parallel_tool_calls": parallel_tool_calls,
        "output_format": responses_output_format(text_format),
    }


def function_call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    """A ``function_call`` output item as both APIs show it (its id is the call's with
    ``fc_`` before it); ``arguments`` are empty while it is ``in_progress``."""
    return {
        "type": "function_call",
        "id": "fc_" + call_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


# -- as Server-Sent Events ---------------------------------------------------------------------
def sse(event: dict[str, Any]) -> bytes:
    """One event object as SSE: its ``type`` is the ``event:`` name."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"


def sse_all(events: EventObjects | None) -> bytes:
    return b"".join(sse(e) for e in events or ())


class SseEvents(StreamRenderer[bytes]):
    """A Responses wire's renderer of event objects (``events``), as SSE: what
    :func:`~pool.http._streaming.admitted_stream` takes. Each wire's stream subclasses it
    for what it does besides (a faster delta, a log line, an ending held back)."""

    def __init__(self, events: StreamRenderer[EventObjects]) -> None:
        self.events = events

    def opening(self, admission: Admission) -> bytes:
        return sse_all(self.events.opening(admission))

    def render_wait(self, admission: Admission, waiting: Waiting) -> bytes:
        return sse_all(self.events.render_wait(admission, waiting))

    def render_delta(self, admission: Admission, delta: Delta) -> bytes:
        return sse_all(self.events.render_delta(admission, delta))

    def render_tool_call(self, admission: Admission, piece: ToolCallDelta) -> bytes:
        return sse_all(self.events.render_tool_call(admission, piece))

    def render_finished(self, admission: Admission, finished: Finished) -> bytes:
        return sse_all(self.events.render_finished(admission, finished))

    def render_error(self, admission: Admission, exc: PoolError) -> bytes:
        return sse_all(self.events.render_error(admission, exc))

    def render_pause(self, admission: Admission, paused: Paused) -> bytes:
        return SSE_KEEP_ALIVE
