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
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from pool.actors import Admission, Delta, Event, Failed, Finished, InferenceRequest, Pool
from pool.errors import PoolError

Render = Callable[[Admission, Delta | Finished], bytes | None]
RenderError = Callable[[Admission, PoolError], bytes]
Frame = Callable[[Admission], bytes | None]


async def _batches(
    pool: Pool, request: InferenceRequest, tenant: str, priority: str
) -> AsyncGenerator[Admission | list[Event], None]:
    async with pool.admit(request, tenant=tenant, priority=priority) as admission:
        yield admission
        async for batch in admission.batches():
            yield batch


async def admitted_stream(
    pool: Pool,
    request: InferenceRequest,
    *,
    tenant: str,
    priority: str,
    render: Render,
    render_error: RenderError,
    opening: Frame | None = None,
) -> tuple[Admission, AsyncIterator[bytes]]:
    """Admit ``request`` (raising its PoolError), then stream its rendered events.

    ``opening`` renders what goes first (e.g. ``response.created``), ``render`` each
    delta and the final :class:`Finished`, ``render_error`` a :class:`Failed` (the
    stream ends after it).
    """
    batches = _batches(pool, request, tenant, priority)
    admission = await anext(batches)
    assert isinstance(admission, Admission)

    async def chunks() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(batches):
            if opening is not None and (head := opening(admission)):
                yield head
            async for batch in batches:
                assert not isinstance(batch, Admission)
                out = []
                for event in batch:
                    if isinstance(event, Failed):
                        out.append(render_error(admission, event.error))
                        break
                    chunk = render(admission, event)
                    if chunk:
                        out.append(chunk)
                if out:
                    yield b"".join(out)

    return admission, chunks()
