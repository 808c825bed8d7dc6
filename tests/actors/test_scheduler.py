"""Queueing, dispatch order, limits and cancellation of the per-model scheduler."""

from __future__ import annotations

import pytest
import trio

from pool import Delta, PoolError, open_pool
from pool.actors.models._scheduler import Scheduler
from pool.actors.models._ticket import Ticket
from pool.backends import Decoding, GenerationRequest, TextPart, Turn

from .helpers import Outcome, ask, run_request, stub_settings, wait_until


class _FakeReplica:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.inflight = 0
        self.started: list[Ticket] = []

    def start_job(self, ticket: Ticket) -> None:
        self.inflight += 1
        self.started.append(ticket)


def _ticket(tenant: str = "default", priority: str = "normal", tag: str = "") -> Ticket:
    request = GenerationRequest(
        request_id=tag, model="m", turns=(Turn("user", (TextPart(tag),)),), decoding=Decoding()
    )
    return Ticket(request, tenant=tenant, priority=priority)  # type: ignore[arg-type]


async def test_priority_then_round_robin_across_tenants() -> None:
    scheduler = Scheduler(max_queue=100)
    replica = _FakeReplica(capacity=1)
    scheduler.set_replicas([replica])
    scheduler.enqueue(_ticket(tag="blocker"))
    for tag, tenant, priority in [
        ("a1", "a", "normal"),
        ("a2", "a", "normal"),
        ("a3", "a", "normal"),
        ("b1", "b", "normal"),
        ("l1", "c", "low"),
        ("h1", "a", "high"),
        ("c1", "c", "normal"),
        ("h2", "b", "high"),
    ]:
        scheduler.enqueue(_ticket(tenant, priority, tag))
    assert scheduler.queue_depth == 8
    order = []
    while scheduler.queue_depth:
        replica.inflight -= 1
        scheduler.job_finished()
        order.append(replica.started[-1].request.request_id)
    # Tenant "a" was served at high priority, so the never-served "c" comes first.
    assert order == ["h1", "h2", "c1", "a1", "b1", "a2", "a3", "l1"]


async def test_dispatch_goes_to_least_loaded_replica() -> None:
    scheduler = Scheduler(max_queue=10)
    replicas = [_FakeReplica(2), _FakeReplica(2)]
    scheduler.set_replicas(replicas)
    for i in range(4):
        scheduler.enqueue(_ticket(tag=str(i)))
    assert [r.inflight for r in replicas] == [2, 2]
    assert [t.request.request_id for t in replicas[0].started] == ["0", "2"]
    scheduler.enqueue(_ticket(tag="4"))
    assert scheduler.queue_depth == 1 and scheduler.running == 4
    replicas[1].inflight -= 1
    scheduler.job_finished()
    assert replicas[1].started[-1].request.request_id == "4"
    assert scheduler.queue_depth == 0


async def test_queue_full_counts_only_waiting_requests() -> None:
    scheduler = Scheduler(max_queue=2)
    scheduler.set_replicas([_FakeReplica(1)])
    for _ in range(3):  # one runs, two wait
        scheduler.enqueue(_ticket())
    with pytest.raises(PoolError) as info:
        scheduler.enqueue(_ticket())
    assert info.value.code == "queue_full" and info.value.status == 503
    assert scheduler.queue_depth == 2 and scheduler.running == 1


async def test_removed_ticket_is_never_dispatched() -> None:
    scheduler = Scheduler(max_queue=5)
    replica = _FakeReplica(1)
    scheduler.set_replicas([replica])
    scheduler.enqueue(_ticket(tag="run"))
    gone = _ticket(tag="gone")
    scheduler.enqueue(gone)
    scheduler.enqueue(_ticket(tag="next"))
    assert scheduler.remove(gone) and not scheduler.remove(gone)
    replica.inflight -= 1
    scheduler.job_finished()
    assert [t.request.request_id for t in replica.started] == ["run", "next"]


async def test_priority_and_tenant_order_through_the_pool(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"stub_reply": "one two", "stub_tokens_per_second": 1}})
    async with open_pool(settings) as pool:
        await pool.load("m")
        finished: list[str] = []

        async def request(tag: str, tenant: str, priority: str) -> None:
            await pool.respond(ask("m"), tenant=tenant, priority=priority)
            finished.append(tag)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(request, "first", "x", "normal")
            await wait_until(lambda: pool.snapshot("m").running == 1)
            for tag, tenant, priority in [
                ("a1", "a", "normal"),
                ("a2", "a", "normal"),
                ("b1", "b", "normal"),
                ("low", "b", "low"),
                ("high", "c", "high"),
            ]:
                nursery.start_soon(request, tag, tenant, priority)
                await trio.testing.wait_all_tasks_blocked()
        assert finished == ["first", "high", "a1", "b1", "a2", "low"]


async def test_queue_full_and_exact_counts(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"m": {"stub_reply": "a b", "stub_tokens_per_second": 1, "max_queue": 2}}
    )
    async with open_pool(settings) as pool:
        await pool.load("m")
        outcomes = [Outcome() for _ in range(3)]
        async with trio.open_nursery() as nursery:
            for outcome in outcomes:
                nursery.start_soon(run_request, pool, ask("m"), outcome)
            await wait_until(lambda: pool.snapshot("m").inflight_requests == 3)
            row = pool.snapshot("m")
            assert (row.running, row.queue_depth) == (1, 2)
            with pytest.raises(PoolError) as info:
                await pool.respond(ask("m"))
            assert info.value.code == "queue_full"
        assert all(o.text == "a b" for o in outcomes)
        row = pool.snapshot("m")
        assert (row.running, row.queue_depth, row.inflight_requests) == (0, 0, 0)


async def test_queue_timeout(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"m": {"stub_reply": "a b c", "stub_tokens_per_second": 0.1, "queue_timeout_s": 5}}
    )
    async with open_pool(settings) as pool:
        await pool.load("m")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.respond, ask("m"))
            await wait_until(lambda: pool.snapshot("m").running == 1)
            started = trio.current_time()
            with pytest.raises(PoolError) as info:
                await pool.respond(ask("m"))
            assert info.value.code == "queue_timeout" and info.value.status == 504
            assert trio.current_time() - started == pytest.approx(5, abs=0.01)
            assert pool.snapshot("m").queue_depth == 0
            nursery.cancel_scope.cancel()


async def test_request_cancelled_while_queued_never_runs(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"stub_reply": "a b", "stub_tokens_per_second": 1}})
    async with open_pool(settings) as pool:
        await pool.load("m")
        scheduler = pool.model("m").scheduler
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.respond, ask("m"))
            await wait_until(lambda: pool.snapshot("m").running == 1)
            nursery.start_soon(pool.respond, ask("m"))  # stays queued to the end
            waiting = trio.CancelScope()
            cancelled_one = Outcome()

            async def doomed() -> None:
                with waiting:
                    await run_request(pool, ask("m", "doomed"), cancelled_one)

            nursery.start_soon(doomed)
            await wait_until(lambda: pool.snapshot("m").queue_depth == 2)
            waiting.cancel()
            await wait_until(lambda: pool.snapshot("m").queue_depth == 1)
        # Only the two surviving requests were ever dispatched to the replica.
        assert scheduler.dispatched_total == 2
        assert cancelled_one.text is None and cancelled_one.error is None


async def test_cancelling_a_running_request_frees_its_slot(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"stub_reply": "x " * 50, "stub_tokens_per_second": 1}})
    async with open_pool(settings) as pool:
        await pool.load("m")
        deltas = 0
        with trio.move_on_after(3.5):
            async for event in pool.stream(ask("m")):
                deltas += isinstance(event, Delta)
        assert deltas == 3
        await trio.testing.wait_all_tasks_blocked()
        assert pool.snapshot("m").running == 0
        assert (await pool.respond(ask("m", "next one"))).text == "x " * 50
