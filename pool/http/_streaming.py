"""Streaming responses whose headers wait for admission.

A streamed response must not send its 200 before the request has a replica slot:
until then every failure (unknown model, queue full, queue timeout, state) has to be
a plain HTTP error with its status. :func:`admitted_stream` runs admission first and
hands back the admission and an iterator over the rendered rest; leaving that iterator
early (a client that disconnects) leaves the ``admit`` block and so cancels the
generation.

Events that are already waiting when the writer comes round are rendered together and
leave as one chunk (one ASGI message, one socket write): a client that keeps up still
gets each token as soon as it exists, and one that falls behind (or a busy server) no
longer pays a write per token. Each token stays its own SSE event.

With ``render_wait``, a request that has to wait for VRAM or a load is the exception:
its 200 goes out at once and the wait is rendered before the first delta (a timeout
then ends the stream as an error event). A request that does not wait for either
streams exactly as without it. With ``heartbeat_s`` too, so is a request that waits
for a busy replica, and a wait that reports nothing new is rendered again every
``heartbeat_s``: the keep-alive of a stream (a Messages ``ping``, an SSE comment),
so that no proxy with an idle timeout cuts a client that waits.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, ClassVar, Generic, TypeVar

from quart import Response

from pool.actors import (
    Admission,
    Delta,
    Event,
    Failed,
    Finished,
    InferenceRequest,
    Paused,
    Pool,
    ToolCallDelta,
    Waiting,
)
from pool.errors import PoolError
from pool.http._common import Opened, inference_headers

# How often a waiting stream shows its client it is alive: well inside the idle timeouts
# of the proxies in front of clients (nginx's proxy_read_timeout and most load
# balancers: 60 s; some 30 s), and what Anthropic's API spaces its pings by.
HEARTBEAT_S = 5.0

# An SSE comment line: every SSE parser skips it (OpenAI's clients included), and it is
# bytes on the wire for the proxies in between.
SSE_KEEP_ALIVE = b": keep-alive\n\n"


SSE = "text/event-stream"

Out = TypeVar("Out")


class StreamRenderer(Generic[Out]):
    """One stream's renderer, as each dialect's ``_render.py`` defines it: what
    :func:`admitted_stream` calls (``Out`` is ``bytes`` there), and what the WebSocket
    of ``/v1/responses`` and :func:`~pool.http._collected.collected` feed (``Out`` the
    event objects of a Responses wire).

    :meth:`render` is the one place that tells the events apart: a dialect defines
    ``render_delta``, ``render_finished`` and ``render_error``; the others send nothing
    unless the dialect overrides them.

    ``reports_waits``: a request that waits for VRAM or a load (and, with a heartbeat,
    for a busy replica) streams at once, its wait rendered by ``render_wait``.
    """

    reports_waits: ClassVar[bool] = False

    def opening(self, admission: Admission) -> Out | None:
        """What goes first (e.g. ``response.created``)."""
        return None

    def render(self, admission: Admission, event: Event) -> Out | None:
        """Any event of :meth:`Admission.events`, by its kind (a delta first: nearly
        every event is one)."""
        if type(event) is Delta:
            return self.render_delta(admission, event)
        if isinstance(event, ToolCallDelta):
            return self.render_tool_call(admission, event)
        if isinstance(event, bytes):
            return self.render_raw(admission, event)
        if isinstance(event, Finished):
            return self.render_finished(admission, event)
        if isinstance(event, Paused):
            return self.render_pause(admission, event)
        assert isinstance(event, Failed)
        return self.render_error(admission, event.error)

    def render_delta(self, admission: Admission, delta: Delta) -> Out | None:
        """A piece of the reply's text."""
        raise NotImplementedError

    def render_finished(self, admission: Admission, finished: Finished) -> Out | None:
        """The end of a generation."""
        raise NotImplementedError

    def render_error(self, admission: Admission, exc: PoolError) -> Out:
        """A :class:`Failed`; the stream ends after it."""
        raise NotImplementedError

    def render_tool_call(self, admission: Admission, piece: ToolCallDelta) -> Out | None:
        """A tool-call piece (a dialect without tools is never offered any)."""
        return None

    def render_raw(self, admission: Admission, events: bytes) -> Out | None:
        """An upstream's own events, already in the client's dialect (the pass-through
        relay: only a dialect that asks for it, with ``PassThrough``, is offered any)."""
        raise AssertionError(f"{type(self).__name__} asked for no pass-through")

    def render_pause(self, admission: Admission, paused: Paused) -> Out | None:
        """The stream is paused for a swap (repeated while it lasts): the dialect's
        keep-alive (an SSE comment, a ``ping``); nothing where it has none (Ollama's
        NDJSON stalls, its clients wait)."""
        return None

    def render_wait(self, admission: Admission, waiting: Waiting) -> Out:
        """A ``Queued``/``Loading`` report (only with ``reports_waits``)."""
        raise NotImplementedError


def streamed_answer(
    chunks: AsyncIterator[bytes],
    admission: Admission | None,
    media_type: str = SSE,
    headers: dict[str, str] | None = None,
) -> Response:
    """The response that sends ``chunks`` as they come, with the same head on every
    dialect: an admitted request's ``X-Queue-Wait-Ms`` family (its ``X-GPU-Time-Ms`` is 0:
    the head leaves before the generation), and for SSE no caching and no buffering by
    a proxy (nginx honours ``X-Accel-Buffering``). No response timeout: the pool's own
    timeouts bound a generation.
    """
    head = inference_headers(admission.queue_wait_ms, None) if admission is not None else {}
    if media_type == SSE:
        head.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    response = Response(chunks, content_type=media_type, headers=head | (headers or {}))
    response.timeout = None
    return response


async def _batches(
    pool: Pool,
    request: InferenceRequest,
    tenant: str,
    priority: str,
    report_waits: bool,
    heartbeat_s: float | None,
    load_hint: dict[str, Any] | None,
) -> AsyncGenerator[Admission | list[Event], None]:
    async with pool.admit(
        request,
        tenant=tenant,
        priority=priority,
        report_waits=report_waits,
        heartbeat_s=heartbeat_s,
        load_hint=load_hint,
    ) as admission:
        yield admission
        async for batch in admission.batches():
            yield batch


async def admitted_stream(
    pool: Pool,
    opened: Opened[Any],
    request: InferenceRequest,
    stream: StreamRenderer[bytes],
    *,
    heartbeat_s: float | None = None,
    load_hint: dict[str, Any] | None = None,
) -> tuple[Admission, AsyncIterator[bytes]]:
    """Admit ``request`` for the tenant and priority ``opened`` read (raising its
    PoolError), then stream its events as ``stream`` renders them.

    With ``heartbeat_s`` (and ``stream.reports_waits``), a request that waits for a busy
    replica streams at once too, and its wait is rendered at least every ``heartbeat_s``
    (:meth:`Pool.admit`). ``load_hint``: load overrides for the load this request may
    start (Ollama's ``num_ctx``), as :meth:`Pool.admit` takes them.
    """
    batches = _batches(
        pool,
        request,
        opened.tenant,
        opened.priority,
        stream.reports_waits,
        heartbeat_s,
        load_hint,
    )
    admission = await anext(batches)
    assert isinstance(admission, Admission)

    async def chunks() -> AsyncIterator[bytes]:
        render = stream.render  # bound once: it is called for every token
        async with contextlib.aclosing(batches):
            if head := stream.opening(admission):
                yield head
            if stream.reports_waits and admission.waiting:
                async with contextlib.aclosing(admission.waits()) as waits:
                    async for waiting in waits:
                        yield stream.render_wait(admission, waiting)
            async for batch in batches:
                assert not isinstance(batch, Admission)
                out = []
                for event in batch:
                    # A Failed ends the events (and so the batch): nothing follows it.
                    if chunk := render(admission, event):
                        out.append(chunk)
                if out:
                    yield b"".join(out)

    return admission, chunks()
