"""Streaming responses whose headers wait for admission.

A streamed response must not send its 200 before the request has a replica slot:
until then every failure (unknown model, queue full, queue timeout, state) has to be
a plain HTTP error with its status. :func:`admitted_stream` runs admission first and
hands back the admission and an iterator over the rendered rest; leaving that iterator
early (a client that disconnects) leaves the ``admit`` block and so cancels the
generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from pool.actors import (
    Admission,
    Delta,
    Event,
    Failed,
    Finished,
    InferenceRequest,
    Pool,
    ToolCallDelta,
)
from pool.errors import PoolError

Render = Callable[[Admission, Delta | Finished], bytes | None]
RenderToolCall = Callable[[Admission, ToolCallDelta], bytes | None]
RenderError = Callable[[Admission, PoolError], bytes]
Frame = Callable[[Admission], bytes | None]


async def _events(
    pool: Pool, request: InferenceRequest, tenant: str, priority: str
) -> AsyncGenerator[Admission | Event, None]:
    async with pool.admit(request, tenant=tenant, priority=priority) as admission:
        yield admission
        async for event in admission.events():
            yield event


async def admitted_stream(
    pool: Pool,
    request: InferenceRequest,
    *,
    tenant: str,
    priority: str,
    render: Render,
    render_error: RenderError,
    opening: Frame | None = None,
    render_tool_call: RenderToolCall | None = None,
) -> tuple[Admission, AsyncIterator[bytes]]:
    """Admit ``request`` (raising its PoolError), then stream its rendered events.

    ``opening`` renders what goes first (e.g. ``response.created``), ``render`` each
    delta and the final :class:`Finished`, ``render_error`` a :class:`Failed` (the
    stream ends after it), ``render_tool_call`` each tool-call piece (a surface
    without one never offers tools, so none arrive).
    """
    events = _events(pool, request, tenant, priority)
    admission = await anext(events)
    assert isinstance(admission, Admission)

    async def chunks() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(events):
            if opening is not None and (head := opening(admission)):
                yield head
            async for event in events:
                if isinstance(event, Failed):
                    yield render_error(admission, event.error)
                    return
                assert not isinstance(event, Admission)
                if isinstance(event, ToolCallDelta):
                    chunk = render_tool_call(admission, event) if render_tool_call else None
                else:
                    chunk = render(admission, event)
                if chunk:
                    yield chunk

    return admission, chunks()
