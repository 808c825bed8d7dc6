"""The scheduler's grouping of requests by LoRA adapter, where a replica applies one
adapter at a time: requests of the applied adapter go first, within a bound on what
that adds to another request's wait, and never at the cost of an idle replica."""

from __future__ import annotations

import time

from pool.actors.models._scheduler import Scheduler
from pool.actors.models._ticket import Ticket
from pool.backends import AdapterUse, Decoding, GenerationRequest, TextPart, Turn


class _FakeReplica:
    def __init__(self) -> None:
        self.capacity = 1
        self.inflight = 0
        self.started: list[Ticket] = []

    def start_job(self, ticket: Ticket) -> None:
        self.inflight += 1
        self.started.append(ticket)


def _ticket(tag: str, adapter: str | None, tenant: str = "default") -> Ticket:
    request = GenerationRequest(
        request_id=tag,
        model=adapter or "base",
        turns=(Turn("user", (TextPart(tag),)),),
        decoding=Decoding(),
        adapter=None if adapter is None else AdapterUse(adapter),
    )
    return Ticket(request, tenant=tenant)


def _drain(scheduler: Scheduler, replica: _FakeReplica) -> list[str]:
    order = []
    while scheduler.queue_depth:
        replica.inflight -= 1
        scheduler.job_finished()
        order.append(replica.started[-1].request.request_id)
    return order


def _queue(scheduler: Scheduler, replica: _FakeReplica) -> None:
    scheduler.set_replicas([replica])
    scheduler.enqueue(_ticket("first", "a"))  # runs at once: the replica applies "a"
    for tag, adapter in [("b1", "b"), ("a1", "a"), ("b2", "b"), ("a2", "a"), ("base", None)]:
        scheduler.enqueue(_ticket(tag, adapter))


async def test_requests_of_the_applied_adapter_go_first_within_the_bound() -> None:
    scheduler = Scheduler(max_queue=10, adapter_group_wait_s=60.0)
    replica = _FakeReplica()
    _queue(scheduler, replica)
    assert _drain(scheduler, replica) == ["a1", "a2", "b1", "b2", "base"]
    assert scheduler.grouped_total == 2


async def test_without_a_bound_the_queue_order_is_strict() -> None:
    scheduler = Scheduler(max_queue=10, adapter_group_wait_s=0.0)
    replica = _FakeReplica()
    _queue(scheduler, replica)
    assert _drain(scheduler, replica) == ["b1", "a1", "b2", "a2", "base"]
    assert scheduler.grouped_total == 0


async def test_a_request_that_waited_its_bound_out_goes_first() -> None:
    scheduler = Scheduler(max_queue=10, adapter_group_wait_s=0.05)
    replica = _FakeReplica()
    _queue(scheduler, replica)
    time.sleep(0.06)  # noqa: ASYNC251 - the bound is measured on perf_counter
    assert _drain(scheduler, replica) == ["b1", "a1", "b2", "a2", "base"]


async def test_tenant_fairness_holds_between_adapters() -> None:
    scheduler = Scheduler(max_queue=10, adapter_group_wait_s=60.0)
    replica = _FakeReplica()
    scheduler.set_replicas([replica])
    scheduler.enqueue(_ticket("first", "a", tenant="t1"))
    for tag, adapter, tenant in [("t1-a", "a", "t1"), ("t2-b", "b", "t2"), ("t2-a", "a", "t2")]:
        scheduler.enqueue(_ticket(tag, adapter, tenant))
    # t2 was never served: its request of the applied adapter comes before t1's.
    assert _drain(scheduler, replica) == ["t2-a", "t1-a", "t2-b"]
