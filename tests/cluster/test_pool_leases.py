"""The pool's VRAM gate with the shared lease ledger: other holders' leases count, and
pools that share a GPU never oversubscribe it (in-process pools, a real redis-server)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import trio

from pool import Pool, PoolError, open_pool
from pool.actors import Queued
from pool.cluster import ClusterNode, LeaseLedger, open_cluster, open_ledger
from pool.config import Settings

from ..actors.helpers import ask, stub_settings, wait_until
from .conftest import RedisServer

HOST = "box1"
BUDGET = 10_000


def cluster_settings(
    redis_url: str, models: dict[str, dict[str, Any]], node: str, **engine: Any
) -> Settings:
    cluster = {
        "redis_url": redis_url,
        "node_id": node,
        "gpu_host": HOST,
        "lease_ttl_s": 3.0,
        "lease_renew_s": 0.3,
        "heartbeat_s": 0.3,
        "node_ttl_s": 1.5,
        **engine.pop("cluster", {}),
    }
    return stub_settings(
        models,
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
        warm_wait_s=0,
        cluster=cluster,
        **engine,
    )


def on_demand(mib: int, **fields: Any) -> dict[str, Any]:
    return {"on_demand": True, "keep_alive": -1, "stub_vram_mib": mib, **fields}


@asynccontextmanager
async def clustered_pool(settings: Settings) -> AsyncIterator[tuple[Pool, ClusterNode]]:
    async with open_cluster(settings) as node:
        assert node is not None
        async with open_pool(settings, ledger=node) as pool:
            yield pool, node


async def pool_leases(ledger: LeaseLedger, node: ClusterNode) -> dict[str, tuple[Any, ...]]:
    return {
        lease.purpose: lease.gpus
        for lease in await ledger.list_leases(HOST)
        if lease.holder == node.holder
    }


async def test_an_external_lease_makes_an_on_demand_load_wait_until_released(
    redis_server: RedisServer,
) -> None:
    settings = cluster_settings(redis_server.url, {"a": on_demand(4000)}, "n1")
    async with (
        open_ledger(redis_server.url) as ledger,
        clustered_pool(settings) as (pool, node),
    ):
        trainer = await ledger.acquire(
            holder="trainer", host=HOST, gpus={0: 8000}, budgets={0: BUDGET}, purpose="train"
        )
        async with pool.admit(ask("a"), report_waits=True) as admission:
            waits = []
            async for wait in admission.waits():
                waits.append(wait)
                if len(waits) == 1:
                    # Reported as it queued: it waits for room that the trainer holds.
                    assert wait == Queued(1, "vram")
                    assert pool.model("a").state == "unloaded"
                    assert pool.model("a").scheduler.queue_depth == 1
                    assert node.leases.others_mib() == {0: 8000}
                    await ledger.release(trainer)
            assert (await admission.collect()).text == "hello world"
        assert waits  # it did wait (the checks above ran)
        assert await pool_leases(ledger, node) == {"model a": ((0, 4000),)}
        # The trainer cannot take its room back while the model holds it...
        await wait_until(lambda: node.leases.others_mib() == {}, 5)
        refused = None
        try:
            await ledger.acquire(holder="trainer", host=HOST, gpus={0: 8000})  # stored budget
        except Exception as exc:  # noqa: BLE001
            refused = exc
        assert refused is not None and "budget" in str(refused)
        # ...and the unload hands it back.
        await pool.unload("a")
        with trio.fail_after(5):
            while await pool_leases(ledger, node):
                await trio.sleep(0.05)
        await ledger.acquire(holder="trainer", host=HOST, gpus={0: 8000})


async def test_an_external_lease_makes_the_pool_evict_an_idle_model(
    redis_server: RedisServer,
) -> None:
    models = {"a": on_demand(4000), "b": on_demand(4000)}
    settings = cluster_settings(redis_server.url, models, "n1")
    async with (
        open_ledger(redis_server.url) as ledger,
        clustered_pool(settings) as (pool, node),
    ):
        await pool.respond(ask("b"))
        await ledger.acquire(holder="trainer", host=HOST, gpus={0: 4000}, budgets={0: BUDGET})
        await wait_until(lambda: node.leases.others_mib() == {0: 4000}, 5)
        await pool.respond(ask("a"))
        assert pool.model("b").state == "unloaded"
        assert pool.evictions == 1
        assert await pool_leases(ledger, node) == {"model a": ((0, 4000),)}


async def test_an_admin_load_that_a_lease_leaves_no_room_for_fails(
    redis_server: RedisServer,
) -> None:
    settings = cluster_settings(redis_server.url, {"a": {"stub_vram_mib": 4000}}, "n1")
    async with (
        open_ledger(redis_server.url) as ledger,
        clustered_pool(settings) as (pool, node),
    ):
        await ledger.acquire(holder="trainer", host=HOST, gpus={0: 7000}, budgets={0: BUDGET})
        # Even before the pool has heard of the lease, the ledger's script refuses.
        try:
            await pool.load("a")
            raise AssertionError("loaded past the lease")
        except PoolError as exc:
            assert exc.code == "load_failed"
        assert await pool_leases(ledger, node) == {}


async def test_pools_sharing_a_gpu_never_oversubscribe_it(redis_server: RedisServer) -> None:
    """Three pools, each free to fill the whole virtual GPU by itself, on one shared GPU:
    at every change of any model, the three together hold no more than the budget.

    test_shared_gpu.py runs the same with three serve processes but can only sample the
    ledger's leases; in one process the pools' own memory accounting (what they would
    allocate) is read at every change, so a load that ran ahead of its lease shows."""
    models = {
        name: on_demand(3000, keep_alive=0.2, stub_load_seconds=0.05, stub_reply="ok")
        for name in ("m0", "m1", "m2")
    }
    rng = random.Random(20)
    peaks: list[int] = []
    async with AsyncExitStack() as stack:
        pools: list[Pool] = []
        for n in range(3):
            settings = cluster_settings(redis_server.url, models, f"n{n}", queue_timeout_s=60)
            pool, _ = await stack.enter_async_context(clustered_pool(settings))
            pools.append(pool)

        def check() -> None:
            held = sum(p.gpu_view().gpus[0].used_mib for p in pools)
            peaks.append(held)
            assert held <= BUDGET, f"the pools hold {held} MiB of a {BUDGET} MiB GPU"

        for pool in pools:
            for actor in pool.parts_for_tests().models.values():
                inner = actor._on_change

                def hooked(inner: Callable[[], None] | None = inner) -> None:
                    check()
                    if inner is not None:
                        inner()

                actor._on_change = hooked

        errors: list[str] = []

        async def one(pool: Pool, model: str) -> None:
            try:
                assert (await pool.respond(ask(model))).text == "ok"
            except PoolError as exc:
                errors.append(exc.code)

        for _ in range(6):
            async with trio.open_nursery() as nursery:
                for _ in range(9):
                    nursery.start_soon(one, rng.choice(pools), rng.choice(list(models)))
        assert errors == []
    # The GPU was shared: more than one pool's worth was loaded at some point.
    assert max(peaks) == 9000
