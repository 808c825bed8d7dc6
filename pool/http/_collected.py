"""The answer of a request without ``stream``, the same on every dialect: admit it for
the tenant and priority the route read, run it to its end, and the runner API's headers.

A failure (an error before or during the generation) is raised, so the client gets the
dialect's HTTP error and never a half-built reply.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

from pool.actors import Admission, Finished, InferenceRequest, Pool
from pool.http._common import Opened, inference_headers
from pool.http._streaming import StreamRenderer


@dataclass(frozen=True, slots=True)
class Collected:
    """A request run to its end: its admission (queue wait, id) and how it finished."""

    admission: Admission
    finished: Finished

    def headers(self, *, cache: bool = True) -> dict[str, str]:
        """``X-Queue-Wait-Ms``, ``X-GPU-Time-Ms`` and the cache headers (``cache``: with
        the prompt tokens the runtime reused; else they say nothing was)."""
        return inference_headers(
            self.admission.queue_wait_ms,
            self.finished.timings.backend_ms,
            self.finished.usage.cached_tokens if cache else None,
        )


async def collected(
    pool: Pool,
    opened: Opened[Any],
    request: InferenceRequest,
    *,
    renderer: StreamRenderer[Any] | None = None,
    load_hint: dict[str, Any] | None = None,
) -> Collected:
    """Run ``request`` to its end (raising its PoolError).

    Args:
        renderer: a dialect that builds its reply from the events as they come (OpenAI's
            Responses API builds the same items streamed or not) is fed every event;
            what it renders is not sent (a failure is raised all the same).
        load_hint: load overrides for the load this request may start (Ollama's
            ``num_ctx``), as :meth:`Pool.admit` takes them.
    """
    async with pool.admit(
        request, tenant=opened.tenant, priority=opened.priority, load_hint=load_hint
    ) as admission:
        if renderer is None:
            return Collected(admission, await admission.collect())
        # Closed here, not left to the garbage collector (Admission.collect says why).
        async with contextlib.aclosing(admission.events()) as events:
            async for event in events:
                renderer.render(admission, event)
        if admission.failed is not None:
            raise admission.failed  # what the renderer made of it is dropped
        assert admission.finished is not None, "events() ends with Finished or Failed"
        return Collected(admission, admission.finished)
