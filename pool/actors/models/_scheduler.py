"""Per-model admission queue and dispatch to replicas.

The scheduler is owned by its model actor and runs entirely in the Trio thread, so its
bookkeeping needs no locks. Dispatch is a synchronous step taken whenever something
changes (a request arrives, a slot frees, replicas appear): a request that fits is
handed to a replica in the same tick, without a hop through another task, which keeps
the pool's per-request overhead to a few microseconds.

Order: priority first (``high`` > ``normal`` > ``low``), then the least recently served
tenant within a priority (round-robin among busy tenants, with a newcomer first), then
arrival order within a tenant. Loads count beside requests served: a tenant whose
request made the model load is charged one turn per ``LOAD_SECONDS_PER_TURN`` of that
load (:meth:`Scheduler.charge_load`), so a tenant that keeps swapping models in waits
behind the others for as many turns. The request next in that order goes to the free replica
holding the longest part of its prompt (pool/actors/models/_affinity.py) when that is more
than half of it, else to the least loaded (and least filled) free replica: affinity chooses
among free slots only, so it never makes a request wait.

Where a backend applies one LoRA adapter set at a time per replica (llama.cpp's context),
a free replica takes a queued request for the adapter it applies before the request next
in that order, if that one has waited less than ``adapter_group_wait_s``: switching
costs a fresh prompt evaluation, and this bound caps what grouping adds to any wait. A
replica is never left idle for it; with the bound at 0 the order above is strict.

In a cluster (``recent_prompts`` above 0) the scheduler also keeps the model's
:class:`RecentPrompts`, which the node's registry record carries to its peers; it hashes
every prompt then, with one replica too.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, Protocol

import trio

from pool.actors.models._affinity import (
    AFFINITY_MIN_SHARE,
    PrefixSummary,
    RecentPrompts,
    ReplyRecorder,
    prefix_keys,
)
from pool.actors.models._stats import RecentStats
from pool.backends import GenerationRequest
from pool.errors import PoolError

if TYPE_CHECKING:
    from pool.actors.models._ticket import Ticket

Priority = Literal["high", "normal", "low"]
PRIORITIES: tuple[Priority, ...] = ("high", "normal", "low")
# Tenants whose last service is remembered; a forgotten one counts as never served.
_SERVED_MEMORY = 4096
# Seconds of loading a tenant caused that count as one turn served (a request is one
# turn, whatever its tokens: the round-robin is by requests). One second, about what a
# short answer takes: a 10 s swap puts the tenant behind ten requests of the others.
LOAD_SECONDS_PER_TURN = 1.0


class Slots(Protocol):
    """What the scheduler needs of a replica: its capacity and a way to start a job."""

    capacity: int
    inflight: int

    def start_job(self, ticket: Ticket) -> None: ...


class Scheduler:
    """Bounded per-model queue with priorities and tenant fairness.

    Args:
        max_queue: requests that may wait beyond the running ones; past it, ``queue_full``.
        on_idle: called when nothing is queued or running any more (drain waits on it).
        affinity: send a request to the free replica that was given most of its prompt
            (``engine.prefix_affinity``); otherwise to the least loaded one.
        recent_prompts: with ``affinity``, how many recent prompts to keep for the
            cluster's registry (``engine.cluster.affinity_keys``; 0: none).
        on_recent_prompts: called when those changed.
    """

    def __init__(
        self,
        max_queue: int,
        on_idle: Callable[[], None] | None = None,
        stats: RecentStats | None = None,
        affinity: bool = True,
        recent_prompts: int = 0,
        on_recent_prompts: Callable[[], None] | None = None,
        adapter_group_wait_s: float = 0.0,
    ) -> None:
        self.max_queue = max_queue
        self.adapter_group_wait_s = adapter_group_wait_s
        # The adapter each replica ran its last generation with (None: the base), where
        # grouping is on; how many requests grouping moved ahead.
        self._applied: dict[Slots, str | None] = {}
        self.grouped_total = 0
        self.affinity = affinity
        self.recent_prompts: RecentPrompts | None = (
            RecentPrompts(recent_prompts, on_recent_prompts)
            if affinity and recent_prompts > 0
            else None
        )
        self._prefixes: dict[Slots, PrefixSummary] = {}
        self.stats = stats or RecentStats(1024)
        self._queues: dict[Priority, OrderedDict[str, deque[Ticket]]] = {
            p: OrderedDict() for p in PRIORITIES
        }
        self._depth = 0
        self._replicas: Sequence[Slots] = ()
        self._on_idle = on_idle
        self._sequence = itertools.count()
        self._last_served: OrderedDict[str, int] = OrderedDict()
        self._served = itertools.count()
        self.dispatched_total = 0

    # -- state -------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        return self._depth

    @property
    def running(self) -> int:
        return sum(r.inflight for r in self._replicas)

    @property
    def capacity(self) -> int:
        return sum(r.capacity for r in self._replicas)

    def set_replicas(self, replicas: Sequence[Slots]) -> None:
        self._replicas = tuple(replicas)
        self._applied = {r: a for r, a in self._applied.items() if r in self._replicas}
        # A replica that stays keeps what it was given; a new one starts empty.
        self._prefixes = {
            r: self._prefixes.get(r) or PrefixSummary(recent=self.recent_prompts)
            for r in self._replicas
        }
        if not self._replicas and self.recent_prompts is not None:
            self.recent_prompts.clear()  # unloaded: its caches are gone with it
        self.dispatch()

    def forget_prefixes(self) -> None:
        """The replicas' caches were flushed: no replica holds any prompt now."""
        for summary in self._prefixes.values():
            summary.clear()
        if self.recent_prompts is not None:
            self.recent_prompts.clear()

    def prefix_held(self, keys: tuple[bytes, ...]) -> int:
        """The most leading blocks of ``keys`` one replica was given (0 without affinity)."""
        if not self.affinity:
            return 0
        return max((s.match(keys) for s in self._prefixes.values()), default=0)

    @property
    def next_position(self) -> int:
        """The place in the queue a request that came now would take: 0 when a slot is
        free (it would start at once), 1 first in line, and so on."""
        if self._depth == 0 and any(r.inflight < r.capacity for r in self._replicas):
            return 0
        return self._depth + 1

    # -- admission ---------------------------------------------------------------
    def enqueue(self, ticket: Ticket) -> None:
        """Queue ``ticket`` and dispatch at once if a slot is free.

        Raises:
            PoolError: ``queue_full`` when no slot is free and the queue is at ``max_queue``.
        """
        free_now = any(r.inflight < r.capacity for r in self._replicas)
        if not free_now and self._depth >= self.max_queue:
            raise PoolError(
                "queue_full",
                f"model {ticket.request.model!r} has {self._depth} requests queued"
                f" (max_queue {self.max_queue})",
                retry_after_s=self.stats.retry_after_s(trio.current_time()),
                details={
                    "queue_depth": self._depth,
                    "max_depth": self.max_queue,
                    "avg_wait_ms": round(self.stats.avg_wait_ms, 1),
                },
            )
        ticket.sequence = next(self._sequence)
        self._queues[ticket.priority].setdefault(ticket.tenant, deque()).append(ticket)
        self._depth += 1
        self.dispatch()

    def remove(self, ticket: Ticket) -> bool:
        """Take a still-queued ticket out; False if it was not queued (already dispatched)."""
        tenants = self._queues[ticket.priority]
        queue = tenants.get(ticket.tenant)
        if queue is None:
            return False
        try:
            queue.remove(ticket)
        except ValueError:
            return False
        if not queue:
            del tenants[ticket.tenant]
        self._depth -= 1
        self._check_idle()
        return True

    def position(self, ticket: Ticket) -> int:
        """Where a queued ticket stands (1: next): those of higher priority and those of
        its own that came first are ahead. Tenant fairness may still reorder its own
        priority, so this is an estimate; for the client's progress display only."""
        ahead = 0
        for priority in PRIORITIES:
            for queue in self._queues[priority].values():
                if priority != ticket.priority:
                    ahead += len(queue)
                else:
                    ahead += sum(1 for other in queue if other.sequence < ticket.sequence)
            if priority == ticket.priority:
                break
        return ahead + 1

    def fail_queued(self, error: PoolError) -> int:
        """Reject every queued ticket with ``error`` (unload, shutdown); returns how many."""
        failed = 0
        for tenants in self._queues.values():
            for queue in tenants.values():
                for ticket in queue:
                    ticket.reject(error)
                    failed += 1
            tenants.clear()
        self._depth = 0
        self._check_idle()
        return failed

    def queued_above(self, priority: Priority) -> bool:
        """Whether a request of a higher priority than ``priority`` waits here."""
        rank = PRIORITIES.index(priority)
        return any(self._queues[p] for p in PRIORITIES[:rank])

    def charge_load(self, tenant: str, seconds: float) -> None:
        """``tenant``'s request made the model load for ``seconds``: it counts as served
        that many turns (``LOAD_SECONDS_PER_TURN``) past everyone served so far."""
        turns = int(seconds // LOAD_SECONDS_PER_TURN)
        if turns > 0:
            self._mark_served(tenant, ahead=turns)

    def _mark_served(self, tenant: str, ahead: int = 0) -> None:
        # The serial counts every turn served; a charged tenant's mark lies ``ahead`` of
        # it, so the others are served first until their marks pass it.
        serial = next(self._served)
        self._last_served[tenant] = max(self._last_served.get(tenant, -1), serial) + ahead
        self._last_served.move_to_end(tenant)
        while len(self._last_served) > _SERVED_MEMORY:
            self._last_served.popitem(last=False)

    # -- dispatch ----------------------------------------------------------------
    def _pop_next(self, free: Sequence[Slots] = ()) -> Ticket | None:
        for priority in PRIORITIES:
            tenants = self._queues[priority]
            if not tenants:
                continue
            # The least recently served tenant goes first, so a tenant that just
            # arrived does not wait behind a flood from one that was served a moment ago.
            tenant = min(tenants, key=lambda t: self._tenant_turn(tenants, t))
            ticket = tenants[tenant][0]
            grouped = self._same_adapter(ticket, tenants, free)
            if grouped is not None:
                ticket = grouped
                self.grouped_total += 1
            tenant = ticket.tenant
            queue = tenants[tenant]
            queue.remove(ticket)
            if not queue:
                del tenants[tenant]
            self._mark_served(tenant)
            self._depth -= 1
            return ticket
        return None

    def _tenant_turn(
        self, tenants: OrderedDict[str, deque[Ticket]], tenant: str
    ) -> tuple[int, int]:
        return self._last_served.get(tenant, -1), tenants[tenant][0].sequence

    def _same_adapter(
        self, head: Ticket, tenants: OrderedDict[str, deque[Ticket]], free: Sequence[Slots]
    ) -> Ticket | None:
        """A queued ticket (in tenant order) for an adapter a free replica applies, to
        run before ``head``; None where ``head`` may run without a switch, or has waited
        its bound out."""
        if self.adapter_group_wait_s <= 0 or not free:
            return None
        applied = {self._applied.get(r) for r in free}
        if adapter_of(head) in applied:
            return None
        if time.perf_counter() - head.enqueued_at >= self.adapter_group_wait_s:
            return None
        for tenant in sorted(tenants, key=lambda t: self._tenant_turn(tenants, t)):
            for ticket in tenants[tenant]:
                if adapter_of(ticket) in applied:
                    return ticket
        return None

    def _choose(self, ticket: Ticket, free: list[Slots]) -> Slots:
        """The free replica for ``ticket``: most of its prompt held, then least loaded
        (the first of equals). With one replica nothing is hashed or remembered, unless
        the cluster is told of the model's recent prompts. Where adapters are grouped,
        only free replicas applying the ticket's adapter are considered, if any is."""
        if self.adapter_group_wait_s > 0:
            wanted = adapter_of(ticket)
            free = [r for r in free if self._applied.get(r) == wanted] or free
        request = ticket.request
        if (
            not self.affinity
            or (len(self._replicas) < 2 and self.recent_prompts is None)
            or not isinstance(request, GenerationRequest)
        ):
            return min(free, key=lambda r: r.inflight)
        if ticket.prefix_keys is None:
            ticket.prefix_keys = prefix_keys(request)
        keys = ticket.prefix_keys
        held = {r: self._prefixes[r].match(keys) for r in free}
        chosen = max(free, key=lambda r: (held[r], -r.inflight))
        if held[chosen] <= len(keys) * AFFINITY_MIN_SHARE:
            # Little to gain (a shared system prompt, say): balance instead, the replica
            # that holds the fewest prompts first, so conversations spread over replicas.
            chosen = min(free, key=lambda r: (r.inflight, len(self._prefixes[r])))
        self._prefixes[chosen].record(keys)
        if request.cache.enabled:
            # Even a prompt shorter than a block: with its answer it may fill one, and
            # the next turn then finds its way back.
            ticket.reply = ReplyRecorder(request, self._prefixes[chosen])
        return chosen

    def dispatch(self) -> None:
        while self._depth:
            free = [r for r in self._replicas if r.inflight < r.capacity]
            if not free:
                return
            ticket = self._pop_next(free)
            assert ticket is not None
            replica = self._choose(ticket, free)
            if self.adapter_group_wait_s > 0:
                self._applied[replica] = adapter_of(ticket)
            self.dispatched_total += 1
            ticket.mark_dispatched()
            self.stats.record_wait(ticket.queue_wait_ms)
            replica.start_job(ticket)

    def job_finished(self) -> None:
        """A replica freed a slot."""
        self.stats.record_completion(trio.current_time())
        self.dispatch()
        self._check_idle()

    def _check_idle(self) -> None:
        if self._on_idle is not None and self._depth == 0 and self.running == 0:
            self._on_idle()


def adapter_of(ticket: Ticket) -> str | None:
    """The LoRA adapter ``ticket`` runs with (None: the base model, or not a generation)."""
    request = ticket.request
    if isinstance(request, GenerationRequest) and request.adapter is not None:
        return request.adapter.name
    return None
