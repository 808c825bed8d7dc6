"""The lease ledger against a real redis-server: budgets, expiry, renewal, all or nothing."""

from __future__ import annotations

import random

import pytest
import trio

from pool.cluster import LeaseLedger, LeaseRefused, hold_lease, open_ledger

from .conftest import RedisServer, wait_renewals

HOST = "box1"


async def test_a_lease_counts_against_the_budget_until_released(
    redis_server: RedisServer,
) -> None:
    async with open_ledger(redis_server.url) as ledger:
        first = await ledger.acquire(
            holder="trainer", host=HOST, gpus={0: 6000}, budgets={0: 10_000}, purpose="train"
        )
        with pytest.raises(LeaseRefused) as refused:
            await ledger.acquire(holder="pool", host=HOST, gpus={0: 5000}, budgets={0: 10_000})
        assert (refused.value.gpu, refused.value.reason) == (0, "budget")
        assert refused.value.leased_mib == 6000
        # Another GPU, or another host's GPU 0, is a different budget.
        await ledger.acquire(holder="pool", host=HOST, gpus={1: 5000}, budgets={1: 10_000})
        await ledger.acquire(holder="pool", host="box2", gpus={0: 5000}, budgets={0: 10_000})
        [listed] = [lease for lease in await ledger.list_leases(HOST) if lease.id == first.id]
        assert (listed.holder, listed.gpus, listed.purpose) == ("trainer", ((0, 6000),), "train")
        assert listed.expires_in_ms is not None and 0 < listed.expires_in_ms <= 15_000
        usage = await ledger.usage(HOST, [0, 1])
        assert sorted((u.gpu, u.mib, u.holder) for u in usage) == [
            (0, 6000, "trainer"),
            (1, 5000, "pool"),
        ]

        assert await ledger.release(first)
        assert not await ledger.release(first.id)
        await ledger.acquire(holder="pool", host=HOST, gpus={0: 5000}, budgets={0: 10_000})


async def test_the_stored_budget_and_the_gpu_reading_both_bind(
    redis_server: RedisServer,
) -> None:
    async with open_ledger(redis_server.url) as ledger:
        await ledger.set_budgets(HOST, {0: 8000})
        with pytest.raises(LeaseRefused):
            await ledger.acquire(holder="job", host=HOST, gpus={0: 9000})
        with pytest.raises(LeaseRefused) as refused:
            await ledger.acquire(holder="job", host=HOST, gpus={0: 3000}, free={0: 2000})
        assert refused.value.reason == "free"
        await ledger.acquire(holder="job", host=HOST, gpus={0: 3000}, free={0: 4000})
        # No budget stored or given: only the reading (if any) binds.
        await ledger.acquire(holder="job", host="elsewhere", gpus={0: 1_000_000})


async def test_a_multi_gpu_lease_is_all_or_nothing(redis_server: RedisServer) -> None:
    async with open_ledger(redis_server.url) as ledger:
        budgets = {0: 10_000, 1: 10_000}
        await ledger.acquire(holder="a", host=HOST, gpus={1: 8000}, budgets=budgets)
        with pytest.raises(LeaseRefused) as refused:
            await ledger.acquire(holder="b", host=HOST, gpus={1: 4000, 0: 4000}, budgets=budgets)
        assert refused.value.gpu == 1
        assert [u for u in await ledger.usage(HOST, [0]) if u.holder == "b"] == []
        split = await ledger.acquire(
            holder="b", host=HOST, gpus={1: 2000, 0: 4000}, budgets=budgets
        )
        assert split.gpus == ((0, 4000), (1, 2000))  # in GPU index order


async def test_an_unrenewed_lease_expires_and_a_held_one_does_not(
    redis_server: RedisServer,
) -> None:
    async with open_ledger(redis_server.url, ttl_s=0.3) as ledger:
        budgets = {0: 10_000}
        gone = await ledger.acquire(holder="gone", host=HOST, gpus={0: 9000}, budgets=budgets)
        # A held lease renews every third of its ttl: four renewals outlive it. Its ttl
        # leaves the renewals ten times the room a loaded machine's stalls take.
        async with hold_lease(ledger, holder="held", host=HOST, gpus={1: 9000}, ttl_s=1.5) as held:
            await wait_renewals(ledger, held.id, 4)
            # Meanwhile (2 s at least, over six times its 0.3 s) the unrenewed one expired.
            assert await ledger.get(gone.id) is None
            assert [lease.id for lease in await ledger.list_leases()] == [held.id]
        assert await ledger.list_leases() == []
        # The expired lease's room is free again.
        await ledger.acquire(holder="next", host=HOST, gpus={0: 9000}, budgets=budgets)


async def test_a_lost_lease_is_reasserted_by_its_holder(redis_server: RedisServer) -> None:
    async with (
        open_ledger(redis_server.url, ttl_s=0.6) as ledger,
        hold_lease(ledger, holder="job", host=HOST, gpus={0: 500}) as held,
    ):
        # Redis forgets everything (a restart without persistence).
        await ledger.client.flushall()
        with trio.fail_after(5):
            while not await ledger.list_leases():
                await trio.sleep(0.05)
        [back] = await ledger.list_leases()
        assert (back.id, back.gpus) == (held.id, ((0, 500),))


async def test_a_waiting_acquire_gets_the_room_when_it_is_released(
    redis_server: RedisServer,
) -> None:
    async with open_ledger(redis_server.url) as ledger:
        budgets = {0: 1000}
        first = await ledger.acquire(holder="a", host=HOST, gpus={0: 800}, budgets=budgets)

        async def release_once_it_waits() -> None:
            # Refused, the waiter listens for lease events: Redis counts it a subscriber.
            with trio.fail_after(30):
                while not sum((await ledger.client.pubsub_numsub(ledger.keys.events)).values()):
                    await trio.sleep(0.01)
            await ledger.release(first)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(release_once_it_waits)
            lease = await ledger.acquire_waiting(
                10.0, holder="b", host=HOST, gpus={0: 800}, budgets=budgets
            )
        assert lease.holder == "b"


async def test_concurrent_acquires_never_oversubscribe_a_gpu(redis_server: RedisServer) -> None:
    budget = 10_000
    rng = random.Random(7)
    async with open_ledger(redis_server.url) as ledger:
        for round_ in range(20):
            sizes = [rng.randrange(500, 4000) for _ in range(12)]
            taken: list[int] = []

            async def take(
                mib: int, holder: str, ledger: LeaseLedger = ledger, taken: list[int] = taken
            ) -> None:
                try:
                    await ledger.acquire(
                        holder=holder, host=HOST, gpus={0: mib}, budgets={0: budget}
                    )
                    taken.append(mib)
                except LeaseRefused:
                    pass

            async with trio.open_nursery() as nursery:
                for i, mib in enumerate(sizes):
                    nursery.start_soon(take, mib, f"h{round_}-{i}")
            assert sum(taken) <= budget
            assert sum(u.mib for u in await ledger.usage(HOST, [0])) == sum(taken)
            # Something must have fit, and a refusal must mean the next one was too big.
            assert taken
            for lease in await ledger.list_leases():
                await ledger.release(lease)
