"""Routes answered by a model's own server (backend ``server``), forwarded as they came.

A route handler that a forwarding server may answer calls :func:`forwarded` first, once
it has its caller, tenant and model name::

    opened = await open_model_route(ctx, RerankRequest)
    reply = await forwarded(ctx, "/v1/rerank", opened.body.model, opened.tenant, opened.priority)
    if reply is not None:
        return reply
    ...  # the pool's own way of serving the route

It answers None unless the model is a server whose ``routes`` include ``route`` (the
pool's path, without the ``/openai`` base URL). Otherwise the client's body (JSON, or a
multipart form with its content type) goes to the server through the pool's queue as a
:class:`~pool.backends.ForwardJob`: keys, tenant scopes, rate limits, budgets, the VRAM
gate, metrics, usage rows and traces apply as to any request. The reply comes back as
the server sent it (status, content type, body); an event stream is relayed piece by
piece. A route that only a server can answer (images) calls :func:`forward_route`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator

from quart import Response

from pool.actors import Admission, Completed, Delta, Failed, Pool, TaskRequest
from pool.backends import Forwarded, ForwardJob, ModelKind, forward_job
from pool.http._common import AppContext, error_body, headers, inference_headers, raw_body
from pool.http._streaming import SSE, streamed_answer

_TaskEvent = Delta | bytes | Completed | Failed


async def forwarded(
    ctx: AppContext, route: str, model: str, tenant: str, priority: str
) -> Response | None:
    """The server's reply to the current request where ``model`` forwards ``route``
    (a server model serving it); None where the route's own handler should serve it.

    Raises:
        PoolError: ``unknown_model`` (404), and what admission or the server refuses.
    """
    capabilities = ctx.pool.model(model).capabilities
    if route not in capabilities.forwards:
        return None
    return await forward_route(ctx, route, model, tenant, priority, capabilities.kind)


async def forward_route(
    ctx: AppContext, route: str, model: str, tenant: str, priority: str, kind: ModelKind
) -> Response:
    """Forward the current request for ``route`` to ``model``, a model of ``kind``; a
    model of another kind is refused by the pool's intake (400 ``wrong_model_kind``)."""
    body = await raw_body()
    job = forward_job(
        kind,
        model=model,
        route=route,
        body=body.encode() if isinstance(body, str) else body,
        content_type=headers().get("content-type") or "application/json",
    )
    return await _relay(ctx.pool, TaskRequest(model, job), tenant, priority)


async def _task_events(
    pool: Pool, request: TaskRequest, tenant: str, priority: str
) -> AsyncGenerator[Admission | _TaskEvent, None]:
    async with pool.admit(request, tenant=tenant, priority=priority) as admission:
        yield admission
        async with contextlib.aclosing(admission.task_events()) as events:
            async for event in events:
                yield event


async def _relay(pool: Pool, request: TaskRequest, tenant: str, priority: str) -> Response:
    """Admit ``request`` (its refusals raised), then answer with the server's reply:
    whole, or streamed where the server streams (the head goes out with its first piece)."""
    assert isinstance(request.job, ForwardJob)
    head = request.job.head
    events = _task_events(pool, request, tenant, priority)
    admission = await anext(events)
    assert isinstance(admission, Admission)
    try:
        first = await anext(events)
    except BaseException:
        await events.aclose()
        raise
    if isinstance(first, Failed | Completed):
        # Its last event: read on to the end, so the admit block ends as the request
        # did (closing it early would record the request as cancelled).
        async for _ in events:
            pass
        if isinstance(first, Failed):
            raise first.error
        reply = first.value
        assert isinstance(reply, Forwarded)
        return Response(
            reply.body,
            status=reply.status,
            content_type=reply.content_type,
            headers=inference_headers(first.timings.queue_wait_ms or 0.0, first.timings.backend_ms),
        )
    assert not isinstance(first, Admission)
    media_type = head.content_type or SSE

    async def pieces() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(events):
            yield first if isinstance(first, bytes) else first.text.encode()
            async for event in events:
                if isinstance(event, bytes):
                    yield event
                elif isinstance(event, Delta):
                    yield event.text.encode()
                elif isinstance(event, Failed) and media_type.startswith(SSE):
                    # The head is gone: an event stream ends with an error event, as
                    # the pool's own streams do; anything else just ends short.
                    yield b"data: " + json.dumps(error_body(event.error)).encode() + b"\n\n"

    response = streamed_answer(pieces(), admission, media_type=media_type)
    response.status_code = head.status or 200
    return response
