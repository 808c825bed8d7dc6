"""Streaming responses whose headers wait for admission.

A streamed response must not send its 200 before the request has a replica slot:
until then every failure (unknown model, queue full, queue timeout, state) has to be
a plain HTTP error with its status. :func:`admitted_stream` runs admission first and
hands back the admission and an iterator over the rest; leaving that iterator early
(a client that disconnects) leaves the ``admit`` block and so cancels the generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

from pool.actors import Admission, Pool
from pool.errors import PoolError
from pool.schemas import ResponseRequest

Render = Callable[[Admission, dict[str, Any]], bytes | None]
RenderError = Callable[[Admission, PoolError], bytes]


async def _events(
    pool: Pool, body: ResponseRequest, tenant: str, priority: str
) -> AsyncGenerator[Admission | dict[str, Any], None]:
    async with pool.admit(body, tenant=tenant, priority=priority) as admission:
        yield admission
        async for event in admission.events():
            yield event


async def admitted_stream(
    pool: Pool,
    body: ResponseRequest,
    *,
    tenant: str,
    priority: str,
    render: Render,
    render_error: RenderError,
    closing: Callable[[Admission], bytes | None] | None = None,
) -> tuple[Admission, AsyncIterator[bytes]]:
    """Admit ``body`` (raising its PoolError), then stream ``render``-ed events as bytes."""
    events = _events(pool, body, tenant, priority)
    admission = await anext(events)
    assert isinstance(admission, Admission)

    async def chunks() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(events):
            try:
                async for event in events:
                    assert isinstance(event, dict)
                    chunk = render(admission, event)
                    if chunk:
                        yield chunk
            except PoolError as exc:
                yield render_error(admission, exc)
                return
            if closing is not None and (tail := closing(admission)):
                yield tail

    return admission, chunks()
