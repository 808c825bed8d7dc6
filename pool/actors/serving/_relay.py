"""Requests that another node serves (``pool.cluster``): the router and the relay job.

A :class:`Router` may answer a request for a model with a :class:`Route` to a peer that
has it loaded (or is loading it for the cluster). The pool then runs the request as a
relay job: the same ticket, events and error handling as a local replica's job, with
the peer's streaming API as the runtime. A request that arrived relayed is served here
(:data:`RELAYED`), so two nodes never pass a request back and forth.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

import trio

from pool.actors.models._replica import _TicketSink
from pool.actors.models._ticket import JobFailed, JobFinished, Ticket
from pool.backends import GenerationRequest
from pool.errors import BackendError, PoolError

if TYPE_CHECKING:
    from pool.actors.models._model import ModelActor
    from pool.backends import GenerationStats, TokenSink

log = logging.getLogger("pool.cluster")

# The header a relaying node sets; a request that carries it is served where it lands.
RELAY_HEADER = "X-LLM-Pool-Relayed"
RELAYED: ContextVar[bool] = ContextVar("llm_pool_relayed", default=False)


class Route(Protocol):
    """A peer that serves one model."""

    node: str

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats: ...


class Router(Protocol):
    @property
    def node_id(self) -> str:
        """This node's name in the cluster."""
        ...

    async def route(
        self,
        model: str,
        local: ModelActor | None,
        prefix_keys: Callable[[], tuple[bytes, ...]] | None = None,
    ) -> Route | None:
        """Where a request for ``model`` goes: a peer, or None to serve it here
        (``local`` is this node's actor for the model, if it has one; ``prefix_keys``
        gives the request's prompt keys, pool/actors/models/_affinity.py; None: no affinity)."""
        ...

    def prompts_changed(self) -> None:
        """A model's recent prompts changed: peers should hear of them soon."""
        ...

    def peer_models(self) -> Sequence[Mapping[str, Any]]:
        """Every model of every live peer as its record says: ``node``, ``name``,
        ``state``, ``replicas``, ``in_flight``, ``queue_depth``, ``on_demand``."""
        ...


async def run_relay(route: Route, ticket: Ticket, model: str, idle_timeout_s: float) -> None:
    """Feed ``ticket`` from ``route`` as a replica's job would (see ``_replica.py``)."""
    ticket.mark_dispatched()
    ticket.started.set()
    with ticket.send_channel:
        outcome = await _relay_generate(route, ticket, model, idle_timeout_s)
        if outcome is not None:
            with (
                trio.move_on_after(5.0, shield=True),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
            ):
                await ticket.send_channel.send(outcome)


async def _relay_generate(
    route: Route, ticket: Ticket, model: str, idle_timeout_s: float
) -> JobFinished | JobFailed | None:
    idle = trio.CancelScope(deadline=trio.current_time() + idle_timeout_s)
    sink = _TicketSink(ticket, idle, idle_timeout_s)
    request = ticket.request
    assert isinstance(request, GenerationRequest), "only generations are relayed"
    with ticket.scope:
        started = ticket.started_at = time.perf_counter()
        try:
            with idle:
                stats = await route.generate(request, sink)
            if idle.cancelled_caught:
                return JobFailed(
                    PoolError(
                        "backend_timeout",
                        f"node {route.node} sent nothing for model {model!r} for"
                        f" {idle_timeout_s:g} s",
                    )
                )
        except BackendError as exc:
            # The peer died or broke off mid-stream: an error event, never a hang.
            log.warning("model=%s relay to node %s failed: %s", model, route.node, exc)
            return JobFailed(PoolError("backend_error", f"node {route.node}: {exc}"))
        except PoolError as exc:
            return JobFailed(exc)
        ended = time.perf_counter()
        first_ms = None if sink.first_at is None else (sink.first_at - started) * 1000.0
        return JobFinished(stats, (ended - started) * 1000.0, first_ms, sink.used.pieces, ended)
    return None
