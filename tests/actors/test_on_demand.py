"""On-demand models: load on first request, keep_alive, eviction (Ollama semantics)."""

from __future__ import annotations

import threading

import pytest
import trio

from pool import PoolError, open_pool
from pool.actors.residency import _residency
from pool.actors.residency._keep_alive import parse_keep_alive
from pool.actors.residency._residence import Residence
from pool.actors.residency._sleep import HostRam

from .helpers import Outcome, ask, run_request, stub_settings, wait_until


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (300, 300.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("250ms", 0.25),
        ("0", 0.0),
        (0, 0.0),
        (-1, None),
        ("-1", None),
        ("-5m", None),
        (None, None),
        ("2.5s", 2.5),
    ],
)
def test_keep_alive_durations(value: object, seconds: float | None) -> None:
    assert parse_keep_alive(value) == seconds  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["soon", "5 minutes", "", "m5", True])
def test_bad_keep_alive_is_invalid_request(value: object) -> None:
    with pytest.raises(PoolError) as info:
        parse_keep_alive(value)  # type: ignore[arg-type]
    assert info.value.code == "invalid_request"


async def test_first_request_loads_once_and_waits(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"on_demand": True, "stub_load_seconds": 3}})
    async with open_pool(settings) as pool:
        assert pool.snapshot("m").state == "unloaded"
        assert "m" in pool.servable_models()
        outcomes = [Outcome() for _ in range(3)]
        async with trio.open_nursery() as nursery:
            for i, outcome in enumerate(outcomes):
                nursery.start_soon(run_request, pool, ask("m", f"hi {i}"), outcome)
        assert [o.text for o in outcomes] == ["hi 0", "hi 1", "hi 2"]
        assert pool.model("m").load_count == 1
        assert pool.snapshot("m").state == "loaded"


async def test_keep_alive_from_config_unloads_after_idle(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"on_demand": True, "keep_alive": "5m"}})
    async with open_pool(settings) as pool:
        await pool.respond(ask("m"))
        done_at = trio.current_time()
        await trio.testing.wait_all_tasks_blocked()  # the replica's job has wrapped up
        assert pool.snapshot("m").expires_in_s == pytest.approx(300)
        await trio.sleep(299)
        assert pool.snapshot("m").state == "loaded"
        await pool.model("m").wait_state_change()  # unloading
        await wait_until(lambda: pool.snapshot("m").state == "unloaded")
        assert trio.current_time() - done_at == pytest.approx(300, abs=0.1)
        # The next request loads it again.
        assert (await pool.respond(ask("m", "again"))).text == "again"
        assert pool.model("m").load_count == 2


async def test_a_request_that_comes_in_as_the_keep_alive_unload_starts_is_served(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The keep-alive timer found the model idle and asked it to unload; a request came
    in before the model ran that command (seen in CI on three serving processes: a 409
    ``model_unloading``). The unload is called off and the request served."""
    slow = {"on_demand": True, "keep_alive": "5m", "stub_tokens_per_second": 2}
    settings = stub_settings({"m": {**slow, "target_inflight": 1}})
    async with open_pool(settings) as pool:
        await pool.respond(ask("m", "warm"))
        outcomes = [Outcome(), Outcome()]
        async with trio.open_nursery() as nursery:
            for outcome in outcomes:
                nursery.start_soon(run_request, pool, ask("m", "one two"), outcome)
            await wait_until(lambda: pool.model("m").queue_depth == 1)  # one runs, one waits
            snapshot = await pool.model("m").unload("keep_alive")
            assert snapshot.state == "loaded"
        assert [(o.text, o.error) for o in outcomes] == [("one two", None)] * 2
        assert pool.model("m").load_count == 1
        # Idle again: the timer starts over, and unloads it in the end.
        assert pool.snapshot("m").expires_in_s == pytest.approx(300, abs=1)


async def test_activity_restarts_the_idle_timer(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"on_demand": True, "keep_alive": 100}})
    async with open_pool(settings) as pool:
        for _ in range(5):
            await pool.respond(ask("m"))
            await trio.sleep(60)
        assert pool.snapshot("m").state == "loaded"
        await trio.sleep(41)
        assert pool.snapshot("m").state == "unloaded"
        assert pool.model("m").load_count == 1


async def test_request_keep_alive_overrides(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"on_demand": True, "keep_alive": "5m"}})
    async with open_pool(settings) as pool:
        await pool.respond(ask("m", keep_alive=0))
        await wait_until(lambda: pool.snapshot("m").state == "unloaded")
        await pool.respond(ask("m", keep_alive=-1))
        await trio.sleep(7 * 24 * 3600)
        assert pool.snapshot("m").state == "loaded"
        assert pool.snapshot("m").expires_in_s is None


async def test_pinned_keep_alive_ignores_client(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"m": {"on_demand": True, "keep_alive": 60, "keep_alive_pinned": True}}
    )
    async with open_pool(settings) as pool:
        await pool.respond(ask("m", keep_alive=-1))
        await trio.sleep(61)
        assert pool.snapshot("m").state == "unloaded"


async def test_failed_on_demand_load_fails_waiting_requests(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": {"on_demand": True, "stub_fail_load": True}})
    async with open_pool(settings) as pool:
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("m"))
        assert info.value.code == "model_failed"
        assert pool.snapshot("m").state == "failed"


async def test_eviction_takes_idle_models_only(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {
            "a": {
                "on_demand": True,
                "keep_alive": -1,
                "stub_reply": "a a a a",
                "stub_tokens_per_second": 1,
            },
            "b": {"on_demand": True, "keep_alive": -1},
            "pinned": {"enabled": True, "pinned": True},
        },
        max_loaded_models=2,
    )
    async with open_pool(settings) as pool:
        running = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_request, pool, ask("a"), running)
            await wait_until(lambda: pool.snapshot("a").running == 1)
            # b does not fit: `pinned` may not go and `a` is busy, so b waits for a.
            reply = await pool.respond(ask("b", "bee"))
            assert reply.text == "bee"
            assert running.text == "a a a a"  # a's request was never cut
        assert pool.snapshot("a").state == "unloaded"
        assert pool.snapshot("pinned").state == "loaded"
        # Now a comes back and b, idle, is the one evicted.
        assert (await pool.respond(ask("a"))).text == "a a a a"
        assert pool.snapshot("b").state == "unloaded"


async def test_the_victims_door_closes_before_the_eviction_first_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An eviction of a model that can sleep reads the host's free RAM in a thread first.
    The victim's door is closed before that wait, so a request for it that arrives
    meanwhile waits for it to load again rather than joining a model about to unload."""
    reading, go_on = threading.Event(), threading.Event()

    def slow_read() -> HostRam:
        reading.set()
        go_on.wait(30)
        return HostRam(available_mib=0, total_mib=1024)  # too short: it unloads

    monkeypatch.setattr(Residence, "sleep_ram_mib", lambda self: 100)
    monkeypatch.setattr(_residency, "read_host_ram", slow_read)
    settings = stub_settings(
        {"a": {"on_demand": True, "keep_alive": -1}, "b": {"on_demand": True, "keep_alive": -1}},
        max_loaded_models=1,
        min_resident_s=0,
    )
    async with open_pool(settings) as pool:
        await pool.respond(ask("a"))
        b = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_request, pool, ask("b", "bee"), b)
            await trio.to_thread.run_sync(reading.wait, 30)
            door_closed = pool.parts_for_tests().residency.door_closed(pool.model("a"))
            go_on.set()
        assert door_closed
        assert b.text == "bee"
        assert pool.snapshot("a").unload_reason == "evicted"


async def test_eviction_prefers_low_priority_then_least_recent(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = stub_settings(
        {
            "old": {"on_demand": True, "keep_alive": -1, "priority": 5},
            "low": {"on_demand": True, "keep_alive": -1, "priority": 0},
            "new": {"on_demand": True, "keep_alive": -1, "priority": 5},
            "next": {"on_demand": True, "keep_alive": -1, "priority": 5},
        },
        max_loaded_models=3,
        queue_timeout_s=60,
    )
    async with open_pool(settings) as pool:
        for name in ("old", "low", "new"):
            await pool.respond(ask(name))
            await trio.sleep(1)
        await pool.respond(ask("next"))
        assert pool.snapshot("low").state == "unloaded"
        # Among equal priorities the least recently used would go, but `low` may evict
        # none of them (spec: only models of lower priority than the incoming one go):
        # it waits, here until its queue timeout.
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("low"))
        assert info.value.code == "queue_timeout"
        states = {r.name: r.state for r in pool.snapshots()}
        assert states == {"old": "loaded", "low": "unloaded", "new": "loaded", "next": "loaded"}
