"""A request that waits for VRAM or a load reports the wait (``Queued``, ``Loading``),
and a queue timeout says what it waited for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from pool import Delta, Failed, Finished, PoolError, open_pool
from pool.actors import Loading, Queued, Waiting

from .helpers import ask, stub_settings


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(tmp_path))
    return tmp_path


def on_demand(**fields: Any) -> dict[str, Any]:
    return {"on_demand": True, "keep_alive": -1, "stub_reply": "a b c", **fields}


def assert_progress_climbs(waits: list[Waiting]) -> None:
    """The stub reports each quarter of its load; the last may land as it finishes."""
    progress = [w.progress for w in waits if isinstance(w, Loading)]
    assert len(progress) == len(waits) and progress[:3] == [0.25, 0.5, 0.75]
    assert progress == sorted(progress)


async def test_a_request_waiting_for_a_load_sees_queued_then_loading_then_deltas(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = stub_settings({"m": on_demand(stub_load_seconds=2)})
    async with (
        open_pool(settings) as pool,
        pool.admit(ask("m"), report_waits=True) as admission,
    ):
        assert admission.waiting
        waits = [w async for w in admission.waits()]
        events = [e async for e in admission.events()]
    assert waits[:2] == [Queued(1, "load"), Loading(None)]
    assert_progress_climbs(waits[2:])
    assert [e.text for e in events if isinstance(e, Delta)] == ["a", " b", " c"]
    assert isinstance(events[-1], Finished)


async def test_a_request_that_does_not_wait_reports_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = stub_settings({"m": {"enabled": True, "stub_reply": "x"}})
    async with (
        open_pool(settings) as pool,
        pool.admit(ask("m"), report_waits=True) as admission,
    ):
        assert not admission.waiting
        assert [w async for w in admission.waits()] == []
        assert (await admission.collect()).text == "x"


async def test_a_request_waiting_for_room_on_the_gpu_says_vram_then_load(
    autojump_clock: trio.abc.Clock,
) -> None:
    # "big" (more important) holds 6000 of 10000: "other" (6000) waits for VRAM until
    # an admin unload frees it, then for its load.
    settings = stub_settings(
        {
            "big": on_demand(stub_vram_mib=6000, priority=5),
            "other": on_demand(stub_vram_mib=6000, stub_load_seconds=1),
        },
        gpu_budget_mib=[10_000],
        queue_timeout_s=60,
    )
    async with open_pool(settings) as pool:
        await pool.load("big")
        seen: list[Waiting] = []
        async with trio.open_nursery() as nursery:

            async def unload_later() -> None:
                await trio.sleep(3)
                await pool.unload("big")

            nursery.start_soon(unload_later)
            async with pool.admit(ask("other"), report_waits=True) as admission:
                async for waiting in admission.waits():
                    seen.append(waiting)
                reply = await admission.collect()
        assert reply.text == "a b c"
    assert seen[:3] == [Queued(1, "vram"), Queued(1, "load"), Loading(None)], seen
    assert_progress_climbs(seen[3:])


async def test_a_second_waiting_request_stands_second(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"m": on_demand(stub_load_seconds=1)})
    async with open_pool(settings) as pool:
        # By arrival: both waits end with the same load, in either order.
        firsts: dict[int, list[Waiting]] = {}

        async def one(arrival: int) -> None:
            async with pool.admit(ask("m"), report_waits=True) as admission:
                firsts[arrival] = [w async for w in admission.waits()]
                await admission.collect()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            await trio.sleep(0.1)
            nursery.start_soon(one, 1)
    assert firsts[0][0] == Queued(1, "load")
    assert firsts[1][0] == Queued(2, "load")


@pytest.mark.parametrize("report_waits", [True, False])
async def test_a_timeout_names_what_it_waited_for(
    autojump_clock: trio.abc.Clock, report_waits: bool
) -> None:
    settings = stub_settings(
        {
            "big": on_demand(stub_vram_mib=6000, priority=5),
            "other": on_demand(stub_vram_mib=6000, queue_timeout_s=2),
            "slow": on_demand(stub_load_seconds=30, queue_timeout_s=2),
        },
        gpu_budget_mib=[10_000],
    )
    async with open_pool(settings) as pool:
        await pool.load("big")
        for model, reason in (("other", "vram"), ("slow", "load")):
            if report_waits:
                async with pool.admit(ask(model), report_waits=True) as admission:
                    events = [e async for e in admission.events()]
                assert isinstance(events[-1], Failed)
                error = events[-1].error
            else:
                with pytest.raises(PoolError) as caught:
                    await pool.respond(ask(model))
                error = caught.value
            assert error.code == "queue_timeout"
            assert error.details["waiting_for"] == reason, error.message
