"""How a request waits for its model (docs/vram.md, "The client sees the wait").

A request for a model that is not loaded, or that makes way for another, waits here:
at the model's door while it makes way, in its queue while it loads or while its load
waits for room. The residency owner says what it waits for; this module turns that
into ``Queued``/``Loading`` reports and the ``queue_timeout`` error at the deadline.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

import trio

from pool.actors.models._model import ModelActor
from pool.actors.models._ticket import Ticket
from pool.actors.residency._residency import Residency
from pool.actors.values._events import Loading, Queued, Waiting, WaitReason
from pool.errors import PoolError

# A request that reports its wait looks at its place in the queue at least this often
# (it moves as others are dispatched, which wakes nobody).
WAIT_TICK_S = 1.0


def queue_timeout(actor: ModelActor, reason: WaitReason | None) -> PoolError:
    reason = reason or "load"
    waited = f"waited {actor.queue_timeout_s:g}s"
    message = {
        "replica": f"{waited} in the queue of model {actor.name!r}",
        "load": f"{waited} for model {actor.name!r} to load",
        "vram": f"{waited} for room on the GPUs for model {actor.name!r}",
    }[reason]
    return PoolError("queue_timeout", message, details={"waiting_for": reason})


async def started(ticket: Ticket) -> None:
    """Once a ticket is ready: wait until its replica starts it, or raise its error."""
    if ticket.error is None:
        await ticket.started.wait()
    if ticket.error is not None:
        raise ticket.error


class RequestWaits:
    def __init__(self, residency: Residency) -> None:
        self._residency = residency

    async def ready(self, actor: ModelActor, ticket: Ticket, deadline: float) -> None:
        """Wait until ``ticket`` runs (or is refused); ``queue_timeout`` at ``deadline``."""
        if not ticket.ready.is_set():
            with trio.move_on_at(deadline):
                await ticket.ready.wait()
            if not ticket.ready.is_set():
                reason = self._residency.wait_reason(actor)
                actor.withdraw(ticket)
                raise queue_timeout(actor, reason)
        await started(ticket)

    async def steps(
        self,
        actor: ModelActor,
        ticket: Ticket | None,
        enqueue: Callable[[], Ticket],
        deadline: float,
        heartbeat_s: float | None = None,
    ) -> AsyncGenerator[Waiting | Ticket, None]:
        """The wait of a request that reports it: :class:`Queued` whenever its place or
        what it waits for changes, :class:`Loading` while its model loads (again as the
        progress moves), and the ticket once it is queued (``ticket`` None: a door holds
        it first). Ends when the request runs; raises its error otherwise.

        With ``heartbeat_s``, the latest of them is repeated when nothing was reported
        for that long (to within ``WAIT_TICK_S``)."""
        residency = self._residency
        queued: Queued | None = None
        loading: Loading | None = None
        reported = trio.current_time()

        def beat(latest: Waiting | None) -> Waiting | None:
            nonlocal reported
            now = trio.current_time()
            if heartbeat_s is None or now - reported < heartbeat_s:
                return None
            reported = now
            return latest or Queued(actor.queue_depth, "load")

        if ticket is None:
            while residency.door_closed(actor):
                now = Queued(actor.queue_depth + 1, "vram")
                if now != queued:
                    queued = now
                    reported = trio.current_time()
                    yield now
                elif (again := beat(queued)) is not None:
                    yield again
                await self._change(None, min(deadline, trio.current_time() + WAIT_TICK_S))
                if trio.current_time() >= deadline and residency.door_closed(actor):
                    raise queue_timeout(actor, "vram")
            ticket = enqueue()
            yield ticket
        while not ticket.ready.is_set():
            reason = residency.wait_reason(actor)
            status = None if reason is None else Queued(actor.scheduler.position(ticket), reason)
            latest: Waiting | None = None
            if status is not None and status != queued:
                queued = latest = status
                yield status
            if actor.state == "loading":
                progress = Loading(actor.load_progress)
                if progress != loading:
                    loading = latest = progress
                    yield progress
            if latest is not None:
                reported = trio.current_time()
            elif (again := beat(loading if actor.state == "loading" else queued)) is not None:
                yield again
            await self._change(ticket.ready, min(deadline, trio.current_time() + WAIT_TICK_S))
            if not ticket.ready.is_set() and trio.current_time() >= deadline:
                reason = residency.wait_reason(actor)
                actor.withdraw(ticket)
                raise queue_timeout(actor, reason)
        await started(ticket)

    async def _change(self, ready: trio.Event | None, until: float) -> None:
        """Until ``ready`` is set, any model changes, or ``until``."""
        changed = self._residency.changed
        with trio.move_on_at(until):
            if ready is None:
                await changed.wait()
                return
            async with trio.open_nursery() as nursery:

                async def wake(event: trio.Event) -> None:
                    await event.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(wake, ready)
                nursery.start_soon(wake, changed)

    async def at_door(self, actor: ModelActor, deadline: float) -> None:
        """Hold a request for a model that makes way for another (or an on-demand model
        that is unloading) until that is over; it then queues (and reloads the model)."""
        while self._residency.door_closed(actor):
            door = self._residency.door(actor)
            with trio.move_on_at(deadline) as scope:
                if door is not None:
                    await door.wait()
                else:
                    await actor.wait_state_change()
            if scope.cancelled_caught:
                raise PoolError(
                    "queue_timeout",
                    f"waited {actor.queue_timeout_s:g}s for model {actor.name!r} to make way"
                    " for another model and load again",
                    details={"waiting_for": "vram"},
                )
